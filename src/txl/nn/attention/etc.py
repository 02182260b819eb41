"""ETC's global-local attention (Ainslie et al. 2020, "ETC: Encoding Long and Structured Inputs in
Transformers", arXiv 2004.08483, §3.1-3.2), on one token stream.

ETC splits the input into a long input and a small global input and attends in four pieces: g2g
(global to global), g2l (global to long), l2g (long to global), l2l (long to long, within a radius r).
Its "fixed ratio" global input has one global token per `chunk` long tokens. A causal LM with memory
has a single stream, so here the global input is the stream's own summary tokens: the last position of
every chunk of `chunk` keys (positions count over [memory ; segment] from key 0, as BigBird's blocks) is
that chunk's global token, the rest are long tokens. Then

- a **long** query sees the long keys within distance r (l2l; causal: the r before it and itself;
  bidirectional: r on each side) and every global key (l2g; causal: the earlier ones);
- a **global** query sees every key (g2g and g2l; causal: every earlier key, memory included).

Relative positions (§3.2) are Shaw et al.'s key vectors a_ℓ (`rel_keys`, d_head wide, shared by the
heads as Shaw's): score = q·(k + a_ℓ) / sqrt(d_head), with the label ℓ of the pair by piece:

- l2l: the distance p - j (within ±r, so ETC's clipping at r never bites): 2r + 1 labels;
- g2g: the distance between the two global tokens' chunks, clipped to ±r: 2r + 1 labels;
- l2g and g2l: whether the long token is in the global token's chunk (ETC's "hierarchical" label of a
  global token and the long tokens of its segment) or not: 2 labels each.

The encoding's own score terms do not apply (`score_terms=False`; RoPE/xPos or an absolute encoding may
be added). A long query costs O(r + n/chunk) keys and a global one O(n), so a layer is
O(n·(r + n/chunk)). `attention_impl="eager"` builds the pattern and the labels as dense (i, n) matrices:
the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from txl.nn.attention.masks import NEG, AttentionMask
from txl.nn.attention.pattern import dense_masked_attention
from txl.nn.attention.registry import refuse, register
from txl.nn.options import LayerConfig, Options
from txl.nn.positional import LayerPositions


@dataclass(frozen=True)
class ETCOptions(Options):
    """`attention_options` of attention='etc'."""

    radius: int = 16  # r: the l2l radius, and the clip of g2g chunk distances
    chunk: int = 16  # long tokens per global token (ETC's fixed ratio); the chunk's last position is global

    def validate(self) -> None:
        self.at_least(0, "radius")
        self.at_least(2, "chunk")


def etc_labels(q_pos: Tensor, k_pos: Tensor, *, radius: int, chunk: int, causal: bool) -> tuple[Tensor, Tensor]:
    """For query positions (..., I) against key positions (..., N) (broadcast): the label of each pair
    (int64) and whether the pair is in ETC's pattern (before causality and padding)."""
    r = radius
    q_global, k_global = q_pos % chunk == chunk - 1, k_pos % chunk == chunk - 1
    dist = q_pos - k_pos
    other = (q_pos // chunk != k_pos // chunk).long()
    g2g = 2 * r + 1 + (q_pos // chunk - k_pos // chunk).clamp(-r, r) + r
    labels = torch.where(
        q_global,
        torch.where(k_global, g2g, 4 * r + 4 + other),  # g2g, g2l
        torch.where(k_global, 4 * r + 2 + other, dist.clamp(-r, r) + r),  # l2g, l2l
    )
    near = dist.abs() <= r
    pattern = q_global | k_global | near
    if causal:
        pattern = pattern & (dist >= 0)
    return labels, pattern


@register("etc", "fast", bidirectional=True, score_terms=False, cross_attention=False, options=ETCOptions)
class ETCAttention(nn.Module):
    """`attention="etc"`: l2l band + l2g columns for long queries, dense rows for global queries."""

    name = "etc"

    def __init__(self, config: LayerConfig):
        super().__init__()
        options = config.attention_options
        self.radius, self.chunk = options.radius, options.chunk
        self.rel_keys = nn.Parameter(torch.randn(4 * self.radius + 6, config.d_head) * getattr(config, "init_std", 0.02))

    def label_scores(self, q: Tensor) -> Tensor:
        """q·a_ℓ for every label: (b, h, i, labels)."""
        return torch.einsum("bhid,ld->bhil", q, self.rel_keys.to(q.dtype))

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        refuse(self.name, mask, same_length="")
        if need_weights:
            return ETCReference.forward(self, q, k, v, positions=positions, mask=mask, dropatt=dropatt,
                                        training=training, need_weights=True)
        q, k = positions.content(q, k)
        b, h, i, d = q.shape
        n, r, K, scale = k.shape[-2], self.radius, self.chunk, q.shape[-1] ** -0.5
        device = q.device
        qa = self.label_scores(q)  # (b, h, i, L)
        p = torch.arange(i, device=device) + n - i
        real = None if mask.key_padding is None else mask.key_padding.to(device)  # (b, n)
        # long queries: the band of long keys (l2l) ...
        dist = torch.arange(-(0 if mask.causal else r), r + 1, device=device)  # p - j per slot
        j = p[:, None] - dist  # (i, W)
        band = (j >= 0) & (j < n) & (j % K != K - 1)
        j = j.clamp(0, n - 1)
        band = band[None, None] if real is None else band[None, None] & real[:, j][:, None]
        kw, vw = k[:, :, j], v[:, :, j]  # (b, h, i, W, d)
        local = torch.einsum("bhid,bhiwd->bhiw", q, kw) + qa[..., dist.clamp(-r, r) + r]
        # ... and every global key (l2g)
        g = torch.arange(K - 1, max(n, K - 1), K, device=device)  # (G,) the global keys (none before a chunk ends)
        seen = torch.ones(i, len(g), dtype=torch.bool, device=device) if not mask.causal else g[None, :] <= p[:, None]
        seen = seen[None, None] if real is None else seen[None, None] & real[:, g][:, None, None, :]
        l2g = 4 * r + 2 + (p[:, None] // K != g[None, :] // K).long()  # (i, G)
        glob = q @ k[:, :, g].transpose(-1, -2) + qa.gather(-1, l2g.expand(b, h, i, len(g)))
        visible = torch.cat([band, seen], dim=-1)  # (b|1, 1, i, W + G)
        scores = (torch.cat([local, glob], dim=-1).float() * scale).masked_fill(~visible, NEG)
        probs = (scores.softmax(-1) * visible.any(-1, keepdim=True)).to(v.dtype)  # a row seeing nothing: 0
        probs = torch.nn.functional.dropout(probs, p=dropatt, training=training)
        W = dist.numel()
        out = torch.einsum("bhiw,bhiwd->bhid", probs[..., :W], vw) + probs[..., W:] @ v[:, :, g]
        # global queries: dense rows over every key (g2g, g2l)
        rows = torch.nonzero(p % K == K - 1).flatten()
        if rows.numel():
            labels, pattern = etc_labels(p[rows][:, None], torch.arange(n, device=device)[None, :], radius=r,
                                         chunk=K, causal=mask.causal)
            offset = qa[:, :, rows].gather(-1, labels.expand(b, h, -1, -1)).float() * scale
            sees = pattern[None, None] if real is None else pattern[None, None] & real[:, None, None, :]
            dense, _ = dense_masked_attention(q[:, :, rows], k, v, sees, dropatt=dropatt, training=training,
                                              score_offset=offset)
            out = out.index_copy(2, rows, dense)
        return out, None

    def extra_repr(self) -> str:
        return f"radius={self.radius}, chunk={self.chunk}"


@register("etc", "eager", bidirectional=True, score_terms=False, cross_attention=False, options=ETCOptions)
class ETCReference(ETCAttention):
    """The pattern and the labels as dense (i, n) matrices, O(n²): the ground truth for `ETCAttention`."""

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        refuse(self.name, mask, same_length="")
        q, k = positions.content(q, k)
        b, h, i, _ = q.shape
        n = k.shape[-2]
        p = torch.arange(i, device=q.device) + n - i
        labels, pattern = etc_labels(p[:, None], torch.arange(n, device=q.device)[None, :], radius=self.radius,
                                     chunk=self.chunk, causal=mask.causal)
        offset = self.label_scores(q).gather(-1, labels.expand(b, h, i, n)).float() * q.shape[-1] ** -0.5
        visible = mask.visible(i, n, q.device) & pattern
        out, probs = dense_masked_attention(q, k, v, visible, dropatt=dropatt, training=training, score_offset=offset)
        return out, probs if need_weights else None
