"""Sparse Sinkhorn attention (Tay, Bahri, Yang, Metzler & Juan 2020, "Sparse Sinkhorn Attention", ICML,
arXiv 2002.11296).

Positions are cut into blocks of B (`block`) from key position 0 of [memory ; segment]. A
meta sorting network scores every (query block t, key block s) pair from block summaries (the mean
key of a block): logits[t, s] = (σ_t W) · σ_s / sqrt(d) / τ (`temperature`), with W a learned
d×d matrix per layer. Sinkhorn normalisation (`iters` alternating row/column steps in log
space, §3.2) turns the logits into a soft permutation P, and block t's "sorted" keys and values are
Σ_s P[t, s] K_s, Σ_s P[t, s] V_s. Each query attends to its own block (local) and its sorted block:
O(n·B + (n/B)²·B·d) instead of O(n²).

Causal variant (§3.4): the sorted block of t mixes only blocks s < t, and block t's summary is the
previous block's (σ_{t-1}: every query of block t has seen it); column steps would let later blocks
change an earlier row of P, so the causal variant normalises rows only (a softmax over s < t). No
future key reaches a query, and a memory extends the pattern exactly. Block 0 has no sorted block.

With a hard permutation (rows of P one-hot) the sorted block is a real block, and the kernel equals
dense attention over own block ∪ block π(t) (tested). `attention_impl="eager"` is the reference: all
sorted blocks as extra keys beside the raw keys, under one dense mask. No padding mask, no
same_length. Positions: `rope`, `xpos`, `sinusoidal`, `learned`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from txl.errors import ConfigError
from txl.nn.attention.masks import NEG, AttentionMask
from txl.nn.attention.pattern import dense_masked_attention, gathered_attention, pad_to
from txl.nn.attention.registry import refuse, register
from txl.nn.options import LayerConfig, Options
from txl.nn.positional import LayerPositions


@dataclass(frozen=True)
class SinkhornOptions(Options):
    """`attention_options` of attention='sinkhorn'."""

    block: int = 64  # tokens per block
    iters: int = 8  # Sinkhorn balancing steps (bidirectional; causal normalises rows only)
    temperature: float = 0.75

    def validate(self) -> None:
        self.at_least(1, "block", "iters")
        if not 0.0 < self.temperature < math.inf:
            self.fail("temperature", f"must be > 0, got {self.temperature}")


def check_sinkhorn(config: LayerConfig) -> None:
    if config.same_length:
        raise ConfigError("config.same_length is not available with attention='sinkhorn' (a sorted block "
                          "mixes keys at many distances)")


def sinkhorn(logits: Tensor, allowed: Tensor, iters: int) -> Tensor:
    """Log-space Sinkhorn balancing of (.., t, s) logits over the `allowed` (t, s) entries: `iters`
    column-then-row steps, so rows end normalised; 0 outside `allowed` and in rows with no entry."""
    log_p = logits.float().masked_fill(~allowed, NEG)
    for _ in range(iters):
        log_p = log_p - log_p.logsumexp(-2, keepdim=True)
        log_p = log_p.masked_fill(~allowed, NEG)
        log_p = log_p - log_p.logsumexp(-1, keepdim=True)
        log_p = log_p.masked_fill(~allowed, NEG)
    if iters == 0:
        log_p = log_p - log_p.logsumexp(-1, keepdim=True)
    return log_p.exp() * allowed


@register("sinkhorn", "fast", bidirectional=True, score_terms=False, check=check_sinkhorn, options=SinkhornOptions)
class SinkhornAttention(nn.Module):
    """`attention="sinkhorn"`: own block + a learned soft-sorted block per query block."""

    def __init__(self, config: LayerConfig):
        super().__init__()
        options = config.attention_options
        self.block, self.iters, self.temperature = options.block, options.iters, options.temperature
        self.sort_weight = nn.Parameter(torch.eye(config.d_head))  # W of the sorting network

    def sort_matrix(self, k_blocks: Tensor, n: int, causal: bool) -> Tensor:
        """(b, h, nb, nb) soft permutation P from the keys in blocks (b, h, nb, B, d)."""
        b, h, nb, B, d = k_blocks.shape
        real = (torch.arange(nb * B, device=k_blocks.device) < n).view(nb, B, 1).to(k_blocks.dtype)
        summary = (k_blocks * real).sum(3) / real.sum(1).clamp(min=1)  # (b, h, nb, d): mean key per block
        block = torch.arange(nb, device=k_blocks.device)
        if causal:  # block t is sorted from the previous block's summary, among blocks s < t
            summary_q = torch.nn.functional.pad(summary[:, :, :-1], (0, 0, 1, 0))
            allowed = block[None, :] < block[:, None]
        else:
            summary_q = summary
            allowed = block[None, :] != block[:, None]
        logits = (summary_q @ self.sort_weight.to(summary.dtype)) @ summary.transpose(-1, -2)
        logits = logits * d**-0.5 / self.temperature
        return sinkhorn(logits, allowed, 0 if causal else self.iters).to(k_blocks.dtype)

    def sorted_blocks(self, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
        """Keys and values in blocks (b, h, nb, B, d), and the sorted ones, with P."""
        b, h, n, d = k.shape
        k_blocks = pad_to(k, 2, self.block).view(b, h, -1, self.block, d)
        v_blocks = pad_to(v, 2, self.block).view(b, h, -1, self.block, d)
        p = self.sort_matrix(k_blocks, n, causal)
        return (torch.einsum("bhts,bhsjd->bhtjd", p, k_blocks), torch.einsum("bhts,bhsjd->bhtjd", p, v_blocks),
                p)

    def _refuse(self, mask: AttentionMask, need_weights: bool) -> None:
        refuse("sinkhorn", mask, need_weights=need_weights, padding=True, same_length="",
               weights="it attends over sorted (mixed) blocks, not keys")

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        self._refuse(mask, need_weights)
        q, k = positions.content(q, k)
        b, h, i, d = q.shape
        n, B = k.shape[-2], self.block
        sorted_k, sorted_v, p = self.sorted_blocks(k, v, mask.causal)
        lead = (n - i) % B
        q_pad = pad_to(torch.nn.functional.pad(q, (0, 0, lead, 0)), 2, B)
        n_qb, first = q_pad.shape[2] // B, (n - i) // B
        own_k = pad_to(k, 2, B).view(b, h, -1, B, d)[:, :, first:first + n_qb]
        own_v = pad_to(v, 2, B).view(b, h, -1, B, d)[:, :, first:first + n_qb]
        keys = torch.cat([sorted_k[:, :, first:first + n_qb], own_k], dim=3)  # (b, h, nq, 2B, d)
        values = torch.cat([sorted_v[:, :, first:first + n_qb], own_v], dim=3)
        slot = torch.arange(B, device=q.device)
        key_pos = (first + torch.arange(n_qb, device=q.device))[:, None] * B + slot  # (nq, B)
        own = (key_pos < n)[:, None, :]
        if mask.causal:
            own = own & (slot[:, None] >= slot[None, :])
        has_sorted = p[:, :, first:first + n_qb].sum(-1) > 0  # (b, h, nq)
        visible = torch.cat([has_sorted[..., None, None].expand(b, h, n_qb, B, B),
                             own.expand(n_qb, B, B).expand(b, h, n_qb, B, B)], dim=-1)
        out, _ = gathered_attention(q_pad.view(b, h, n_qb, B, d), keys, values, visible, dropatt=dropatt,
                                    training=training, need_lse=False)
        return out.reshape(b, h, -1, d)[:, :, lead:lead + i], None

    def extra_repr(self) -> str:
        return f"block={self.block}, iters={self.iters}, temperature={self.temperature}"


@register("sinkhorn", "eager", bidirectional=True, score_terms=False, check=check_sinkhorn, options=SinkhornOptions)
class SinkhornReference(SinkhornAttention):
    """[every sorted block ; raw keys] under one dense mask: the ground truth for `SinkhornAttention`."""

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        self._refuse(mask, need_weights)
        q, k = positions.content(q, k)
        b, h, i, d = q.shape
        n, B = k.shape[-2], self.block
        sorted_k, sorted_v, p = self.sorted_blocks(k, v, mask.causal)
        nb = sorted_k.shape[2]
        q_block = (torch.arange(i, device=q.device) + n - i) // B
        k_block = torch.arange(n, device=q.device) // B
        own = q_block[:, None] == k_block[None, :]
        if mask.causal:
            own = own & mask.visible(i, n, q.device)[0, 0]
        sorted_block = torch.arange(nb * B, device=q.device) // B
        has_sorted = p.sum(-1) > 0  # (b, h, nb)
        sees_sorted = (q_block[:, None] == sorted_block[None, :]) & has_sorted[:, :, q_block, None]
        visible = torch.cat([sees_sorted, own.expand(b, h, i, n)], dim=-1)
        keys = torch.cat([sorted_k.reshape(b, h, nb * B, d), k], dim=2)
        values = torch.cat([sorted_v.reshape(b, h, nb * B, d), v], dim=2)
        out, _ = dense_masked_attention(q, keys, values, visible, dropatt=dropatt, training=training)
        return out, None
