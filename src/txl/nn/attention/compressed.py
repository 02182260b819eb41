"""Memory-compressed attention (Liu et al. 2018, "Generating Wikipedia by Summarizing Long Sequences",
ICLR, arXiv 1801.10198, §4.2.2 "memory-compressed attention").

Keys and values are compressed `ratio` (r) : 1 along the sequence by a strided convolution
(kernel r, stride r, learned, shared by the heads; initialised to mean pooling), and every query
attends over the compressed keys — O(n²/r) instead of O(n²). Causal "by blocks": positions are cut
into blocks of r from key position 0 of [memory ; segment]; the query at p sees

- the compressed blocks that end before its own block starts (no compressed row mixes a future key),
- the raw keys of its own block up to itself (so the newest r-1 tokens are not lost).

Bidirectional: every compressed block but its own, and its own block raw. The memory's blocks are
compressed like the segment's, so two segments with memory equal one pass. With r = 1 and the
convolution the identity, it is exactly full attention (tested).

`attention_impl="eager"` builds [compressed ; raw] keys with a dense mask: the reference; the fast
kernel computes the compressed columns as one (i, n/r) product and the own block as a block-diagonal
product, merged by their log-sum-exp. Positions: `rope`, `xpos` (keys rotated before compression),
`sinusoidal`, `learned`. No padding mask, no same_length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from txl.errors import ConfigError
from txl.nn.attention.masks import AttentionMask
from txl.nn.attention.pattern import dense_masked_attention, gathered_attention, merge_by_lse, pad_to
from txl.nn.attention.registry import refuse, register
from txl.nn.options import LayerConfig, Options
from txl.nn.positional import LayerPositions


@dataclass(frozen=True)
class CompressedOptions(Options):
    """`attention_options` of attention='compressed'."""

    ratio: int = 4  # keys/values compressed ratio:1 by a strided convolution

    def validate(self) -> None:
        self.at_least(1, "ratio")


def check_compressed(config: LayerConfig) -> None:
    if config.same_length:
        raise ConfigError("config.same_length is not available with attention='compressed' "
                          "(a compressed row spans several distances)")


@register("compressed", "fast", bidirectional=True, score_terms=False, check=check_compressed, options=CompressedOptions)
class CompressedAttention(nn.Module):
    """`attention="compressed"`: strided-convolution-compressed keys/values + the own block raw."""

    query_chunk = 2048  # queries per step over the compressed columns: memory O(chunk·n/r), not O(n²/r)

    def __init__(self, config: LayerConfig):
        super().__init__()
        r, d = config.attention_options.ratio, config.d_head
        self.ratio = r
        mean_pool = torch.eye(d).repeat(r, 1) / r  # (r·d, d): the convolution's weight, one d×d per offset
        self.key_conv = nn.Parameter(mean_pool.clone())
        self.value_conv = nn.Parameter(mean_pool.clone())

    def compress(self, x: Tensor, weight: Tensor) -> Tensor:
        """(b, h, n, d) -> (b, h, ceil(n/r), d): Σ_o x[t·r + o] W_o (zero rows pad the last block)."""
        b, h, _, d = x.shape
        blocks = pad_to(x, 2, self.ratio).reshape(b, h, -1, self.ratio * d)
        return blocks @ weight.to(x.dtype)

    def blocks_of(self, q_len: int, k_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
        query_pos = torch.arange(q_len, device=device) + k_len - q_len
        return query_pos // self.ratio, torch.arange(k_len, device=device) // self.ratio

    def compressed_visible(self, q_block: Tensor, n_blocks: int, causal: bool) -> Tensor:
        block = torch.arange(n_blocks, device=q_block.device)
        return block[None, :] < q_block[:, None] if causal else block[None, :] != q_block[:, None]

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        self._refuse(mask, need_weights)
        q, k = positions.content(q, k)
        b, h, i, d = q.shape
        n, r = k.shape[-2], self.ratio
        q_block, _ = self.blocks_of(i, n, q.device)
        keys, values = self.compress(k, self.key_conv), self.compress(v, self.value_conv)
        # The compressed columns, in chunks of queries: the (chunk, n/r) scores bound the memory.
        outs, lses = [], []
        for start in range(0, i, self.query_chunk):
            rows = slice(start, start + self.query_chunk)
            seen = self.compressed_visible(q_block[rows], keys.shape[2], mask.causal)  # (chunk, nc)
            out_c, lse_c = gathered_attention(q[:, :, rows], keys, values, seen, dropatt=dropatt, training=training)
            outs.append(out_c)
            lses.append(lse_c)
        out_c, lse_c = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        # Own block, raw: queries padded on the left to align with the key blocks.
        lead = (n - i) % r
        q_pad = pad_to(torch.nn.functional.pad(q, (0, 0, lead, 0)), 2, r)
        n_qb = q_pad.shape[2] // r
        first = (n - i) // r  # the first query block
        k_own = pad_to(k, 2, r)[:, :, first * r:].reshape(b, h, -1, r, d)[:, :, :n_qb]
        v_own = pad_to(v, 2, r)[:, :, first * r:].reshape(b, h, -1, r, d)[:, :, :n_qb]
        key_pos = (first + torch.arange(n_qb, device=q.device))[:, None] * r + torch.arange(r, device=q.device)
        visible = (key_pos < n)[:, None, :]  # (nq, 1, r)
        if mask.causal:
            visible = visible & (key_pos[:, :, None] >= key_pos[:, None, :])  # query slot ≥ key slot
        out_l, lse_l = gathered_attention(q_pad.view(b, h, n_qb, r, d), k_own, v_own, visible, dropatt=dropatt,
                                          training=training)
        out_l = out_l.reshape(b, h, -1, d)[:, :, lead:lead + i]
        lse_l = lse_l.reshape(b, h, -1)[:, :, lead:lead + i]
        return merge_by_lse([out_c, out_l], [lse_c, lse_l]), None

    def _refuse(self, mask: AttentionMask, need_weights: bool) -> None:
        refuse("compressed", mask, need_weights=need_weights, padding=True, same_length="",
               weights="it attends over compressed rows, not keys")

    def extra_repr(self) -> str:
        return f"ratio={self.ratio}"


@register("compressed", "eager", bidirectional=True, score_terms=False, check=check_compressed, options=CompressedOptions)
class CompressedReference(CompressedAttention):
    """[compressed ; raw] keys under one dense mask, O(n²/r + n²): the ground truth."""

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        self._refuse(mask, need_weights)
        q, k = positions.content(q, k)
        i, n = q.shape[-2], k.shape[-2]
        q_block, k_block = self.blocks_of(i, n, q.device)
        keys = torch.cat([self.compress(k, self.key_conv), k], dim=2)
        values = torch.cat([self.compress(v, self.value_conv), v], dim=2)
        own = q_block[:, None] == k_block[None, :]
        if mask.causal:
            own = own & mask.visible(i, n, q.device)[0, 0]
        seen = self.compressed_visible(q_block, keys.shape[2] - n, mask.causal)
        out, _ = dense_masked_attention(q, keys, values, torch.cat([seen, own], dim=1), dropatt=dropatt,
                                        training=training)
        return out, None
