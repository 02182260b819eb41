"""Routing attention (Roy, Saffar, Vaswani & Grangier 2021, "Efficient Content-Based Sparse Attention
with Routing Transformers", TACL, arXiv 2003.05997).

Shared-QK attention within clusters found by online k-means: each position's unit key k/|k| is routed
to its nearest of `clusters` centroids µ (per layer and head, unit vectors), and attends
within its cluster (§4: "queries and keys are assigned to their nearest centroid ... attention is
restricted to the cluster"). The paper balances clusters by taking the top-w members of each; here
clusters are balanced the Reformer way instead: a query sees the `bucket_window` most recent keys of
its cluster (see `txl.nn.attention.buckets`, which also makes it strictly causal and exact with memory).
With √n clusters of √n tokens (the paper's choice) the cost is O(n^1.5); with a fixed window it is
O(n·bucket_window).

Centroids are updated in training by an exponential moving average of the unit keys assigned to
them (§4, decay `decay`), without gradient, and renormalised; evaluation never changes them.
They are a buffer saved with the model. `attention_impl="eager"` is the dense reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.nn.attention.buckets import bucketed_attention, bucketed_reference
from txl.nn.attention.masks import AttentionMask
from txl.nn.attention.registry import register
from txl.nn.options import LayerConfig, Options
from txl.nn.positional import LayerPositions


@dataclass(frozen=True)
class RoutingOptions(Options):
    """`attention_options` of attention='routing'."""

    bucket_window: int = 64  # keys per query within its cluster (the sorted chunk length)
    clusters: int = 16  # k-means centroids per layer
    decay: float = 0.999  # EMA decay of the centroids (updated in training)

    def validate(self) -> None:
        self.at_least(1, "bucket_window", "clusters")
        if not 0.0 <= self.decay < 1.0:
            self.fail("decay", f"must be in [0, 1), got {self.decay}")


def nearest_centroid(x: Tensor, centroids: Tensor) -> Tensor:
    """x (b, h, n, d), centroids (h, C, d) -> (b, h, 1, n) cluster ids (one round)."""
    unit = F.normalize(x.detach().float(), dim=-1)
    return torch.einsum("bhnd,hcd->bhnc", unit, centroids.float()).argmax(-1)[:, :, None]


@register("routing", "fast", bidirectional=True, score_terms=False, options=RoutingOptions)
class RoutingAttention(nn.Module):
    """`attention="routing"`: shared-QK attention within online k-means clusters."""

    unused_query_projection = True  # shared QK: the layer's q_proj gets no gradient (DDP must know)

    def __init__(self, config: LayerConfig):
        super().__init__()
        self.window, self.decay = config.attention_options.bucket_window, config.attention_options.decay
        centroids = F.normalize(torch.randn(config.n_head, config.attention_options.clusters, config.d_head), dim=-1)
        self.register_buffer("centroids", centroids)

    def buckets(self, k: Tensor, training: bool) -> Tensor:
        clusters = nearest_centroid(k, self.centroids)
        if training and self.decay < 1:
            self.update_centroids(k, clusters[:, :, 0])
        return clusters

    @torch.no_grad()
    def update_centroids(self, k: Tensor, clusters: Tensor) -> None:
        """µ_c <- decay·µ_c + (1 - decay)·mean of the unit keys in c (clusters with members only)."""
        h, n_clusters, d = self.centroids.shape
        unit = F.normalize(k.float(), dim=-1).transpose(0, 1).reshape(h, -1, d)  # (h, b·n, d)
        members = F.one_hot(clusters.transpose(0, 1).reshape(h, -1), n_clusters).float()  # (h, b·n, C)
        sums = members.transpose(1, 2) @ unit  # (h, C, d)
        counts = members.sum(1)[..., None]
        mean = sums / counts.clamp(min=1)
        moved = F.normalize(self.decay * self.centroids.float() + (1 - self.decay) * mean, dim=-1)
        self.centroids.copy_(torch.where(counts > 0, moved, self.centroids.float()).to(self.centroids.dtype))

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        if need_weights:
            return RoutingReference.forward(self, q, k, v, positions=positions, mask=mask, dropatt=dropatt,
                                            training=training, need_weights=True)
        out = bucketed_attention(k, v, self.buckets(k, training), q_len=q.shape[-2], window=self.window,
                                 positions=positions, mask=mask, dropatt=dropatt, training=training)
        return out, None

    def extra_repr(self) -> str:
        return f"clusters={self.centroids.shape[1]}, window={self.window}, decay={self.decay}"


@register("routing", "eager", bidirectional=True, score_terms=False, options=RoutingOptions)
class RoutingReference(RoutingAttention):
    """The cluster pattern as a dense mask: the ground truth for `RoutingAttention`."""

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        out, probs = bucketed_reference(k, v, self.buckets(k, training), q_len=q.shape[-2], window=self.window,
                                        positions=positions, mask=mask, dropatt=dropatt, training=training)
        return out, probs if need_weights else None
