"""Image Transformer 1-D local attention (Parmar et al. 2018, "Image Transformer", ICML, arXiv 1802.05751,
§3.2 "Local Self-Attention", the 1-D form), for a causal LM with Transformer-XL memory.

The sequence is cut into query blocks of l_q positions (`query_block`). Every query of a block attends to
the block's *memory block*: the l_m positions before the block (`memory_block`) and the block itself,
causally (the paper's decoder: a query sees the keys of its memory block up to itself). So the query at
position p of block B = floor(p / l_q) sees the keys

    j ∈ [B·l_q - l_m, p]

All the queries of a block share one span of l_m + l_q keys: the fast kernel attends block by block over
those spans (an `unfold` view, no (i, n) matrix), O(n·(l_m + l_q)); `attention_impl="eager"` is the dense
reference, the full kernel's scores masked to that set (O(n²)), which the fast kernel also runs when one
span is longer than the keys (short inputs: no cheaper) and for the probabilities.

Blocks count from key 0 of [memory ; segment] (as BigBird's blocks and the axial grid): with `tgt_len` and
`mem_len` multiples of l_q, and a memory that is full, the blocks are the stream's own; the memory is the
previous segment's layer inputs, so the first blocks of a segment reach back into it as the paper's
memory block reaches back into earlier pixels.

Positions: every encoding applies. Within a block's span the queries are the last l_q of the l_m + l_q keys,
so the encoding's score term (xl, shaw, alibi, t5) and Shaw's value term are computed per span with the
ordinary `score_bias(q, k_len=span)` / `value_term` calls; rotations (rope, xpos) are applied to q and k
first; absolute encodings enter with the input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.nn.attention.masks import NEG, AttentionMask
from txl.nn.attention.pattern import pad_to
from txl.nn.attention.registry import register
from txl.nn.attention.sparse import dense_pattern_attention
from txl.nn.options import LayerConfig, Options
from txl.nn.positional import LayerPositions, rel_shift_pad


@dataclass(frozen=True)
class ImageLocalOptions(Options):
    """`attention_options` of attention='image-local'."""

    query_block: int = 64  # l_q: queries per block (their keys are shared)
    memory_block: int = 128  # l_m: positions before the query block that its queries also see

    def validate(self) -> None:
        self.at_least(1, "query_block")
        self.at_least(0, "memory_block")


def image_local_pattern(q_len: int, k_len: int, query_block: int, memory_block: int, device: torch.device) -> Tensor:
    """(i, n) bool: key j is in the memory block of query i's block and not after the query."""
    p = torch.arange(q_len, device=device)[:, None] + k_len - q_len
    j = torch.arange(k_len, device=device)[None, :]
    return (j <= p) & (j >= (p // query_block) * query_block - memory_block)


@register("image-local", "fast", cross_attention=False, options=ImageLocalOptions)
class ImageLocalAttention(nn.Module):
    """`attention="image-local"`: query blocks of l_q over their memory block of l_m + themselves."""

    name = "image-local"

    def __init__(self, config: LayerConfig):
        super().__init__()
        options = config.attention_options
        self.query_block, self.memory_block = options.query_block, options.memory_block

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        n, lq, lm = k.shape[-2], self.query_block, self.memory_block
        if need_weights or lm + lq > n:  # the probabilities; or one span holds every key: the dense form is no dearer
            return ImageLocalReference.forward(self, q, k, v, positions=positions, mask=mask, dropatt=dropatt,
                                               training=training, need_weights=True)
        b, h, i, d = q.shape
        span = lm + lq
        q_content, k_content = positions.content(q, k)
        first = (n - i) // lq  # the first block holding a query (blocks count from key 0)
        lead = n - i - first * lq  # its positions before the segment: padded queries
        blocks = -(-(lead + i) // lq)
        q_blocks = pad_to(F.pad(q_content, (0, 0, lead, 0)), 2, lq).view(b, h, blocks, lq, d)
        start = first * lq - lm  # the key position where block 0's span starts (negative: before key 0)

        def spans(x: Tensor) -> Tensor:  # (b, h, n, d) -> (b, h, blocks, span, d): block t's keys
            x = F.pad(x[:, :, max(start, 0):], (0, 0, max(-start, 0), 0))
            x = F.pad(x, (0, 0, 0, max(0, (blocks - 1) * lq + span - x.shape[2])))
            return x.unfold(2, span, lq).transpose(-1, -2)

        k_spans, v_spans = spans(k_content), spans(v)
        t = torch.arange(blocks, device=q.device)[:, None]
        query_pos = (first + t) * lq + torch.arange(lq, device=q.device)  # (blocks, lq)
        key_pos = start + t * lq + torch.arange(span, device=q.device)  # (blocks, span)
        visible = (key_pos[:, None, :] <= query_pos[:, :, None]) & (key_pos >= 0)[:, None, :]  # (blocks, lq, span)
        if mask.window is not None:
            visible = visible & (query_pos[:, :, None] - key_pos[:, None, :] < mask.window)
        visible = visible[None, None]
        if mask.key_padding is not None:
            real = mask.key_padding.to(q.device)[:, key_pos.clamp(0, n - 1)]  # (b, blocks, span)
            visible = visible & real[:, None, :, None, :]
        scores = q_blocks @ k_spans.transpose(-1, -2)  # (b, h, blocks, lq, span)
        # within a span the block's queries are its last lq keys: the encoding's term per span, as for a segment
        flat = q.new_zeros(b, h, blocks * lq, d)
        flat[:, :, lead:lead + i] = q
        per_block = flat.view(b, h, blocks, lq, d).transpose(1, 2).reshape(b * blocks, h, lq, d)
        bias = positions.score_bias(per_block, k_len=span, rel_shift=rel_shift_pad)
        if bias is not None:
            scores = scores + bias.expand(b * blocks, -1, -1, -1).reshape(b, blocks, h, lq, span).transpose(1, 2)
        scores = (scores.float() * d**-0.5).masked_fill(~visible, NEG)
        probs = (scores.softmax(-1) * visible.any(-1, keepdim=True)).to(v.dtype)
        probs = F.dropout(probs, p=dropatt, training=training)
        out = probs @ v_spans  # (b, h, blocks, lq, d)
        value_term = positions.value_term(probs.transpose(1, 2).reshape(b * blocks, h, lq, span))
        if value_term is not None:
            out = out + value_term.view(b, blocks, h, lq, d).transpose(1, 2)
        return out.reshape(b, h, blocks * lq, d)[:, :, lead:lead + i], None

    def extra_repr(self) -> str:
        return f"query_block={self.query_block}, memory_block={self.memory_block}"


@register("image-local", "eager", cross_attention=False, options=ImageLocalOptions)
class ImageLocalReference(ImageLocalAttention):
    """The memory-block pattern as a dense (i, n) mask over the full kernel's scores: the ground truth."""

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        pattern = image_local_pattern(q.shape[-2], k.shape[-2], self.query_block, self.memory_block, q.device)
        out, probs = dense_pattern_attention(q, k, v, pattern[None], positions=positions, mask=mask, dropatt=dropatt,
                                             training=training)
        return out, probs if need_weights else None
