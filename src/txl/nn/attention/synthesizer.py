"""Synthesizer attention (Tay, Bahri, Metzler, Juan, Zhao & Zheng 2021, "Synthesizer: Rethinking
Self-Attention for Transformer Models", ICML, arXiv 2005.00743): attention weights that are not
query-key dot products.

- **dense** (`mode="dense"`, §3.1): each query synthesises its own row of scores with a
  two-layer network, B_i = W_2 relu(W_1 x_i + b_1) + b_2 (x_i = the query's projection, per head;
  W shared by the heads);
- **random** (`mode="random"`, §3.2): one learned score row per head, R, the same for
  every query (input-independent);
- **factorized dense** (`mode="factorized-dense"`, §3.1 "Factorized Dense Synthesizer"): the query's row
  of width ℓ is the product of two short ones, A = F_A(x_i) of length a and B = F_B(x_i) of length b
  (a·b >= ℓ), tiled to ℓ: C = H_A(A) * H_B(B), where H_A repeats each entry of A b times and H_B tiles B a
  times, so C[t] = A[t // b]·B[t mod b] (A ⊗ B flattened, cut to ℓ). F_A, F_B share the hidden layer of
  the dense form: A = W_A relu(W_1 x_i + b_1) + b_A, likewise B; a·d + b·d output weights instead of ℓ·d;
- **factorized random** (`mode="factorized-random"`, §3.2 "Factorized Random Synthesizer"): R = R_1 R_2ᵀ
  of rank k (`rank`) per head. The paper's R is ℓ × ℓ over (query, key) positions of a fixed-length input;
  here, as for `random`, R is one row by distance, so it is that row laid out as an a × b grid (row t at
  [t // b, t mod b]) that is R_1 R_2ᵀ, R_1 (a × k), R_2 (b × k): k·(a + b) parameters per head instead of ℓ.

`factors` = a (0: ceil(sqrt(ℓ))); b = ceil(ℓ / a).

The paper's rows index absolute positions 0 … ℓ-1 of a fixed-length input. Here they index the
*distance* to the key (0 … L-1 for a causal LM, -(L-1) … L-1 bidirectionally, L =
`max_len`): the same parameter count, but a memory extends it (two segments with memory
equal one pass) and any length runs; keys further than L are not seen, so a layer costs O(n·L).
Output = softmax(B) V over the visible keys.

Fast: blocks of queries attend to the band of keys their distances reach (an `unfold` view) with
scores gathered from the synthesised rows; `attention_impl="eager"` is the dense (i, n) reference.
Positions: the distance columns are the positions; `rope`/`xpos` rotations are not used (no q·k),
absolute encodings enter through the input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.nn.attention.masks import AttentionMask, distances
from txl.nn.attention.pattern import dense_masked_attention, gathered_attention, pad_to
from txl.nn.attention.registry import register
from txl.nn.options import LayerConfig, Options
from txl.nn.positional import LayerPositions


@dataclass(frozen=True)
class SynthesizerOptions(Options):
    """`attention_options` of attention='synthesizer'."""

    # scores synthesised per query (dense) or learned by distance (random), each also factorized (§3.1, §3.2)
    mode: Literal["dense", "random", "factorized-dense", "factorized-random"] = "dense"
    max_len: int = 256  # distances a query can see (its window, itself included)
    factors: int = 0  # a, factorized modes: the row of width ℓ is an a × ceil(ℓ/a) grid (0: a = ceil(sqrt(ℓ)))
    rank: int = 8  # k, factorized-random: R_1 R_2ᵀ of rank k

    def validate(self) -> None:
        self.at_least(1, "max_len", "rank")
        self.at_least(0, "factors")


def grid_shape(width: int, factors: int) -> tuple[int, int]:
    """(a, b) of the factorized row: a·b >= width, a = `factors` (capped at width) or ceil(sqrt(width))."""
    a = min(factors, width) if factors else math.isqrt(width - 1) + 1
    return a, -(-width // a)


@register("synthesizer", "fast", bidirectional=True, score_terms=False, options=SynthesizerOptions)
class SynthesizerAttention(nn.Module):
    """`attention="synthesizer"`: dense (per-query MLP) or random (learned) scores by distance."""

    def __init__(self, config: LayerConfig):
        super().__init__()
        self.mode, self.max_len, self.causal = config.attention_options.mode, config.attention_options.max_len, config.causal
        width = self.max_len if config.causal else 2 * self.max_len - 1
        d = config.d_head
        self.width = width
        a, b = grid_shape(width, config.attention_options.factors)
        if self.mode == "dense":
            self.hidden = nn.Linear(d, d)
            self.scores = nn.Linear(d, width)
        elif self.mode == "factorized-dense":
            self.hidden = nn.Linear(d, d)
            self.factor_a, self.factor_b = nn.Linear(d, a), nn.Linear(d, b)  # F_A, F_B
        elif self.mode == "random":
            self.table = nn.Parameter(torch.randn(config.n_head, width) * config.init_std)
        else:  # factorized-random: R_1 (h, a, k), R_2 (h, b, k); scaled so R_1 R_2ᵀ starts near init_std
            k = config.attention_options.rank
            scale = (config.init_std / k**0.5) ** 0.5
            self.table_a = nn.Parameter(torch.randn(config.n_head, a, k) * scale)
            self.table_b = nn.Parameter(torch.randn(config.n_head, b, k) * scale)

    def rows(self, q: Tensor) -> Tensor:
        """(b, h, i, width) synthetic scores of each query by distance column."""
        if self.mode == "dense":
            return self.scores(F.relu(self.hidden(q))).float()
        if self.mode == "factorized-dense":
            hidden = F.relu(self.hidden(q))
            a, b = self.factor_a(hidden).float(), self.factor_b(hidden).float()  # (.., a), (.., b)
            return (a[..., :, None] * b[..., None, :]).flatten(-2)[..., : self.width]  # H_A(A) * H_B(B)
        if self.mode == "random":
            table = self.table.float()
        else:
            table = (self.table_a.float() @ self.table_b.float().transpose(-1, -2)).flatten(-2)[:, : self.width]
        return table[None, :, None, :].expand(q.shape[0], -1, q.shape[2], -1)

    def column(self, dist: Tensor) -> tuple[Tensor, Tensor]:
        """The row column of each distance, and whether it is within reach."""
        if self.causal:
            return dist.clamp(0, self.max_len - 1), (dist >= 0) & (dist < self.max_len)
        return (dist + self.max_len - 1).clamp(0, 2 * self.max_len - 2), dist.abs() < self.max_len

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        if need_weights:
            return SynthesizerReference.forward(self, q, k, v, positions=positions, mask=mask, dropatt=dropatt,
                                                training=training, need_weights=True)
        b, h, i, d = q.shape
        n, L = v.shape[-2], self.max_len
        rows = self.rows(q)
        block = max(16, min(256, L // 4))
        back, ahead = L - 1, (0 if self.causal else L - 1)
        span = block + back + ahead
        n_qb = -(-i // block)
        # Key positions padded so that query block t's band starts at t·block - (L-1) + (n - i).
        front = back - (n - i)  # keys before position 0 that a band reaches (negative: unused memory)
        start = max(0, -front)
        def band(x: Tensor) -> Tensor:  # (b, h, n, d) -> (b, h, nq, span, d)
            x = F.pad(x[:, :, start:], (0, 0, max(front, 0), 0))
            x = pad_to(F.pad(x, (0, 0, 0, ahead)), 2, block)
            need = (n_qb - 1) * block + span
            x = F.pad(x, (0, 0, 0, max(0, need - x.shape[2])))
            return x.unfold(2, span, block).transpose(-1, -2)
        values = band(v)
        query_pos = (n - i) + torch.arange(n_qb * block, device=q.device).view(n_qb, block)
        key_pos = (n - i) - back + torch.arange(n_qb, device=q.device)[:, None] * block + torch.arange(span, device=q.device)
        dist = query_pos[:, :, None] - key_pos[:, None, :]  # (nq, block, span)
        col, visible = self.column(dist)
        visible = visible & (key_pos >= 0)[:, None, :] & (key_pos < n)[:, None, :]
        if mask.causal and mask.window is not None:
            visible = visible & (dist < mask.window)
        visible = visible[None, None]
        if mask.key_padding is not None:
            real = mask.key_padding.to(q.device)
            real_k = real[:, key_pos.clamp(0, n - 1)]  # (b, nq, span)
            visible = visible & real_k[:, None, :, None, :]
        rows = pad_to(rows, 2, block).view(b, h, n_qb, block, -1)
        scores = rows.gather(-1, col[None, None].expand(b, h, -1, -1, -1))
        out, _ = gathered_attention(None, None, values, visible, dropatt=dropatt, training=training,
                                    score_offset=scores, need_lse=False)
        return out.reshape(b, h, -1, d)[:, :, :i], None

    def extra_repr(self) -> str:
        return f"mode={self.mode}, max_len={self.max_len}"


@register("synthesizer", "eager", bidirectional=True, score_terms=False, options=SynthesizerOptions)
class SynthesizerReference(SynthesizerAttention):
    """The synthetic scores over every key as a dense (i, n) matrix: the ground truth."""

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        b, h, i, _ = q.shape
        n = v.shape[-2]
        col, reach = self.column(distances(i, n, q.device))
        scores = self.rows(q).gather(-1, col[None, None].expand(b, h, -1, -1))
        visible = reach & mask.visible(i, n, q.device)
        out, probs = dense_masked_attention(None, None, v, visible, dropatt=dropatt, training=training,
                                            score_offset=scores)
        return out, probs if need_weights else None
