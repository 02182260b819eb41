"""Fixed sparse attention, the "strided" and the "fixed" patterns of Child et al. 2019 (Sparse
Transformers, arXiv 1904.10509, §4.2), as two kinds of heads (their "interleaved" variant: each head one
pattern). `SparseOptions.pattern` picks one: "strided" (the default) or "fixed".

**strided** (`pattern="strided"`):

With stride l (`SparseOptions.stride`), the query at position p sees, in

- a **local** head (the first ceil(h/2) heads): A¹ = {p-l, …, p}, the l+1 most recent keys (both ends
  included, as the paper's t = max(0, i-l) … i);
- a **strided** head (the other heads): A² = {j ≤ p : (p - j) mod l = 0}, every l-th key back to the
  start of the memory.

Two layers of such heads connect any pair of positions. With l ≈ sqrt(n) (the paper's choice) a head
costs O(n·sqrt(n)); here l is fixed by the config, so the local heads cost O(n·l) and the strided
heads O(n²/l). Positions count over [memory ; segment], so the memory extends both patterns.

Both patterns are the sliding-window kernel's machinery with one `(window, dilation)` pair per head:
local = (l+1, 1), strided = (unbounded, l). Every positional encoding applies (the strided heads use
its terms at distances that are multiples of l). `attention_impl="eager"` is the dense-mask reference.

**fixed** (`pattern="fixed"`, for data without a periodic structure such as text, §4.2): positions are cut
into blocks of l, and the query at p sees, in

- a **block** head (the first ceil(h/2) heads): A¹ = {j ≤ p : floor(j/l) = floor(p/l)}, the earlier
  positions of its own block;
- a **summary** head (the other heads): A² = {j ≤ p : j mod l ∈ {l-c, …, l-1}}, the last c positions
  (`summary` = c) of every block so far, which carry what their block holds to every later position.

Block positions count from key 0 of [memory ; segment] (as BigBird's and the axial grid's): with `tgt_len`
and `mem_len` multiples of l, and a memory that is full, the blocks are the stream's own. A block head
costs O(l) keys per query, a summary head O(n·c/l). The fast kernel attends within the blocks and over
the gathered summary keys (no (i, n) matrix) when the encoding adds no score term (rope, xpos, absolute
encodings); with a score-term encoding (xl, shaw, alibi, t5), or for the probabilities, it runs the
reference: the dense (i, n) scores with the pattern as a mask (the ground truth, O(n²)). The fused
GPU impls (sdpa, flex) cover the strided bands only and run the fixed pattern's fast kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.errors import ConfigError
from txl.nn.attention.masks import NEG, AttentionMask
from txl.nn.attention.pattern import gathered_attention, pad_to
from txl.nn.attention.registry import register
from txl.nn.attention.sliding import UNBOUNDED, SlidingWindowAttention, SlidingWindowReference, shaw_values
from txl.nn.options import LayerConfig, Options
from txl.nn.positional import LayerPositions, rel_shift_pad


@dataclass(frozen=True)
class SparseOptions(Options):
    """`attention_options` of attention='sparse'."""

    stride: int = 128  # l: local window and stride (strided), block length (fixed); the paper picks l ≈ sqrt(context)
    pattern: Literal["strided", "fixed"] = "strided"  # Child et al.'s two factorisations
    summary: int = 1  # c, fixed only: the last c positions of each block are the summary every later query sees

    def validate(self) -> None:
        self.at_least(1, "stride", "summary")
        if self.summary > self.stride:
            self.fail("summary", f"must be <= stride (c of the l = {self.stride} positions of a block), got {self.summary}")


def sparse_head_windows(config: LayerConfig) -> list[tuple[int, int]]:
    """(window, dilation) per head: local heads first, then strided heads."""
    local = (config.n_head + 1) // 2
    stride = config.attention_options.stride
    return [(stride + 1, 1)] * local + [(UNBOUNDED, stride)] * (config.n_head - local)


def check_sparse(config: LayerConfig) -> None:
    if config.n_head < 2:
        raise ConfigError("config.attention='sparse' needs n_head >= 2 (half local, half strided heads)")
    if shaw_values(config):
        raise ConfigError(
            "config.position_options.values (shaw) needs every head on one attention pattern; it is not "
            "available with attention='sparse' or mixed sliding dilation"
        )


@register("sparse", "fast", check=check_sparse, options=SparseOptions)
class SparseStridedAttention(SlidingWindowAttention):
    """`attention="sparse"`: local + strided heads (Child et al. 2019), block-banded, no n×n matrix."""

    name = "sparse"

    def __new__(cls, config: LayerConfig | None = None, *args, **kwargs):
        # pattern="fixed": the fixed kernels below (the fused subclasses too: their bands are the strided ones)
        if config is not None and config.attention_options.pattern == "fixed":
            fixed = SparseFixedReference if issubclass(cls, SparseStridedReference) else SparseFixedAttention
            return fixed(config)
        return super().__new__(cls)

    def __init__(self, config: LayerConfig):
        nn.Module.__init__(self)
        self.head_windows = sparse_head_windows(config)
        self.global_tokens = 0


@register("sparse", "eager", check=check_sparse, options=SparseOptions)
class SparseStridedReference(SparseStridedAttention, SlidingWindowReference):
    """The same pattern as a dense mask (O(n²)): the ground truth for `SparseStridedAttention`."""


# ---------------------------------------------------------------------------------------------
# the fixed pattern


def dense_pattern_attention(q: Tensor, k: Tensor, v: Tensor, pattern: Tensor, *, positions: LayerPositions,
                            mask: AttentionMask, dropatt: float, training: bool) -> tuple[Tensor, Tensor]:
    """The full kernel's attention (content, the encoding's score and value terms) restricted to `pattern`
    ((h|1, i, n) bool) and the mask: softmax over the visible keys, a row that sees none gets 0. Returns
    out and the probabilities (b, h, i, n)."""
    i, n, d = q.shape[-2], k.shape[-2], q.shape[-1]
    q_content, k_content = positions.content(q, k)
    scores = torch.einsum("bhid,bhjd->bhij", q_content, k_content)
    bias = positions.score_bias(q, k_len=n, rel_shift=rel_shift_pad)
    if bias is not None:
        scores = scores + bias
    visible = mask.visible(i, n, q.device) & pattern[None]
    probs = (scores.float() * d**-0.5).masked_fill(~visible, NEG).softmax(dim=-1) * visible.any(-1, keepdim=True)
    probs = probs.to(v.dtype)
    dropped = F.dropout(probs, p=dropatt, training=training)
    out = torch.einsum("bhij,bhjd->bhid", dropped, v)
    value_term = positions.value_term(dropped)
    return (out if value_term is None else out + value_term), probs


def fixed_pattern(n_head: int, q_len: int, k_len: int, stride: int, summary: int, device: torch.device) -> Tensor:
    """(h, i, n) bool: the keys each head's set holds for each query, causality included: block heads
    (the first ceil(h/2)) their own block, summary heads the last `summary` positions of every block."""
    p = torch.arange(q_len, device=device)[:, None] + k_len - q_len
    j = torch.arange(k_len, device=device)[None, :]
    earlier = j <= p
    block = earlier & (j // stride == p // stride)
    summarised = earlier & (j % stride >= stride - summary)
    local = (n_head + 1) // 2
    return torch.stack([block] * local + [summarised] * (n_head - local))


class SparseFixedReference(nn.Module):
    """`attention="sparse"` with `pattern="fixed"`, dense: the full kernel's scores (content and the
    encoding's score term) over every key, masked to each head's set (O(n²)): the ground truth."""

    name = "sparse"

    def __init__(self, config: LayerConfig):
        super().__init__()
        options = config.attention_options
        self.n_head, self.stride, self.summary = config.n_head, options.stride, options.summary

    def pattern(self, q_len: int, k_len: int, device: torch.device) -> Tensor:
        return fixed_pattern(self.n_head, q_len, k_len, self.stride, self.summary, device)

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        out, probs = dense_pattern_attention(q, k, v, self.pattern(q.shape[-2], k.shape[-2], q.device),
                                             positions=positions, mask=mask, dropatt=dropatt, training=training)
        return out, probs if need_weights else None

    def extra_repr(self) -> str:
        return f"pattern=fixed, stride={self.stride}, summary={self.summary}"


class SparseFixedAttention(SparseFixedReference):
    """The fixed pattern without an (i, n) matrix: block heads attend within their block of l keys, summary
    heads over the gathered summary keys (c of every l). Score-term encodings and the probabilities take
    the reference (see the module docstring)."""

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        if need_weights or positions.encoding.score_terms:
            return super().forward(q, k, v, positions=positions, mask=mask, dropatt=dropatt, training=training,
                                   need_weights=need_weights)
        q, k = positions.content(q, k)
        b, h, i, d = q.shape
        n, l = k.shape[-2], self.stride
        local = (h + 1) // 2
        out = q.new_empty(b, h, i, d)
        real = torch.ones(1, n, dtype=torch.bool, device=q.device) if mask.key_padding is None \
            else mask.key_padding.to(q.device)  # (b|1, n)
        # block heads: the keys as rows of l (from key 0), each query row against its own key row
        rows, first = -(-n // l), (n - i) // l  # key rows; the first row holding a query
        lead = n - i - first * l  # queries padded on the left onto the grid
        q_rows = rows - first
        grid = lambda x: pad_to(x, 2, l).view(x.shape[0], x.shape[1], rows, l, d)[:, :, first:]  # noqa: E731
        q_grid = pad_to(F.pad(q[:, :local], (0, 0, lead, 0)), 2, l).view(b, local, q_rows, l, d)
        pos = first * l + torch.arange(q_rows * l, device=q.device).view(q_rows, l)  # key positions on the grid
        visible = (pos[:, None, :] <= pos[:, :, None])  # (q_rows, l query, l key)
        if mask.window is not None:
            visible = visible & (pos[:, :, None] - pos[:, None, :] < mask.window)
        seen = pad_to(real, 1, l).view(-1, rows, l)[:, first:]  # (b|1, q_rows, l)
        visible = visible[None, None] & seen[:, None, :, None, :]
        o, _ = gathered_attention(q_grid, grid(k[:, :local]), grid(v[:, :local]), visible, dropatt=dropatt,
                                  training=training, need_lse=False)
        out[:, :local] = o.reshape(b, local, q_rows * l, d)[:, :, lead:lead + i]
        if local < h:  # summary heads: the last `summary` keys of every block, gathered
            j = torch.arange(n, device=q.device)
            keys = j[j % l >= l - self.summary]  # (m,)
            p = torch.arange(i, device=q.device)[:, None] + n - i
            visible = keys[None, :] <= p
            if mask.window is not None:
                visible = visible & (p - keys[None, :] < mask.window)
            visible = visible[None, None] & real[:, keys][:, None, None, :]
            out[:, local:], _ = gathered_attention(q[:, local:], k[:, local:, keys], v[:, local:, keys], visible,
                                                   dropatt=dropatt, training=training, need_lse=False)
        return out, None
