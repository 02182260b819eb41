"""LSH attention (Kitaev, Kaiser & Levskaya 2020, "Reformer: The Efficient Transformer", arXiv 2001.04451).

Shared-QK attention over hash buckets: each position's unit key k/|k| is hashed by a random rotation
R (d × b/2) to h(x) = argmax([xR ; -xR]) (angular LSH, the paper's §2 "hashing attention"), in
`hashes` independent rounds of `buckets` buckets. A query sees the `bucket_window` most recent
keys of its bucket (itself only if nothing else), in each round, and the union over the rounds —
Reformer's "sorted chunks attending to their own and the previous chunk", made strictly causal and
exact (see `txl.nn.attention.buckets`). O(n·bucket_window·hashes) time and memory; causal with memory
(the memory's keys are hashed like the segment's), or bidirectional.

The rotations are a buffer drawn once per layer and saved with the model (the paper redraws them
every forward pass; a fixed hash keeps evaluation deterministic and a memory exact). The query
projection of the layer is unused (shared QK). `attention_impl="eager"` is the dense reference.
Positions: `rope`, `xpos` (rotations after hashing), `sinusoidal`, `learned`.
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
class LSHOptions(Options):
    """`attention_options` of attention='lsh'."""

    bucket_window: int = 64  # keys per query within its bucket (the sorted chunk length)
    buckets: int = 32  # hash buckets per round (even: random rotations ±)
    hashes: int = 2  # hash rounds: a query sees the union of its buckets over the rounds

    def validate(self) -> None:
        self.at_least(1, "bucket_window", "buckets", "hashes")
        if self.buckets % 2:
            self.fail("buckets", f"must be even (random rotations ±), got {self.buckets}")


def lsh_buckets(x: Tensor, rotations: Tensor) -> Tensor:
    """x (b, h, n, d), rotations (R, d, nb/2) -> (b, h, R, n) bucket ids: argmax([xR ; -xR])."""
    rotated = torch.einsum("bhnd,rdk->bhrnk", F.normalize(x.detach().float(), dim=-1), rotations)
    return torch.cat([rotated, -rotated], dim=-1).argmax(-1)


@register("lsh", "fast", bidirectional=True, score_terms=False, options=LSHOptions)
class LSHAttention(nn.Module):
    """`attention="lsh"`: shared-QK attention within angular-LSH buckets, n_hashes rounds."""

    unused_query_projection = True  # shared QK: the layer's q_proj gets no gradient (DDP must know)

    def __init__(self, config: LayerConfig):
        super().__init__()
        self.window = config.attention_options.bucket_window
        rotations = torch.randn(config.attention_options.hashes, config.d_head, config.attention_options.buckets // 2)
        self.register_buffer("rotations", rotations)

    def buckets(self, k: Tensor) -> Tensor:
        return lsh_buckets(k, self.rotations.float())

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        if need_weights:
            return LSHReference.forward(self, q, k, v, positions=positions, mask=mask, dropatt=dropatt,
                                        training=training, need_weights=True)
        out = bucketed_attention(k, v, self.buckets(k), q_len=q.shape[-2], window=self.window, positions=positions,
                                 mask=mask, dropatt=dropatt, training=training)
        return out, None

    def extra_repr(self) -> str:
        rounds, _, half = self.rotations.shape
        return f"buckets={2 * half}, hashes={rounds}, window={self.window}"


@register("lsh", "eager", bidirectional=True, score_terms=False, options=LSHOptions)
class LSHReference(LSHAttention):
    """The union of the rounds' bucket patterns as a dense mask: the ground truth for `LSHAttention`."""

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        out, probs = bucketed_reference(k, v, self.buckets(k), q_len=q.shape[-2], window=self.window,
                                        positions=positions, mask=mask, dropatt=dropatt, training=training)
        return out, probs if need_weights else None
