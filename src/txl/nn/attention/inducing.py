"""Inducing-point attention, the ISAB block of the Set Transformer (Lee et al. 2019, "Set Transformer:
A Framework for Attention-based Permutation-Invariant Neural Networks", ICML, arXiv 1810.00825, §3.2),
for the bidirectional encoder (`causal=False`).

m = `points` learned vectors I (per layer and head) first attend to the n keys, and the
queries then attend to what the inducing points gathered:

    A = softmax(I Kᵀ / sqrt(d))            (m × n; padding keys excluded)
    K' = A K,  V' = A V                    (m summary keys and values)
    out = softmax(Q K'ᵀ / sqrt(d)) V'      O(n·m) instead of O(n²)

(ISAB's two multi-head attention blocks share the layer's projections here, so the block adds only I.)
Every summary mixes all n positions, future ones included, so it cannot be causal (like Linformer);
the config says so. When A is a permutation (each inducing point picks one key) it is exactly full
bidirectional attention (tested). Positions: `rope` (applied to q and k before the summaries),
`sinusoidal`, `learned`; no score terms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.errors import ConfigError
from txl.nn.attention.masks import NEG, AttentionMask
from txl.nn.attention.registry import refuse, register
from txl.nn.options import LayerConfig, Options
from txl.nn.positional import LayerPositions


@dataclass(frozen=True)
class InducingOptions(Options):
    """`attention_options` of attention='inducing'."""

    points: int = 32  # m learned summaries the queries attend to

    def validate(self) -> None:
        self.at_least(1, "points")


def check_inducing(config: LayerConfig) -> None:
    if config.causal:
        raise ConfigError(
            "config.attention='inducing' cannot be causal: every inducing point summarises all positions, "
            "future ones included (Lee et al. 2019); set causal=false for the bidirectional encoder"
        )


@register("inducing", "eager", causal=False, bidirectional=True, score_terms=False, check=check_inducing, options=InducingOptions)
class InducingPointAttention(nn.Module):
    """`attention="inducing"`: queries attend to `points` learned summaries of the keys."""

    def __init__(self, config: LayerConfig):
        super().__init__()
        self.points = nn.Parameter(torch.randn(config.n_head, config.attention_options.points, config.d_head))

    def summary_weights(self, k: Tensor, key_padding: Tensor | None) -> Tensor:
        """A (b, h, m, n): how each inducing point spreads over the keys."""
        scores = torch.einsum("hmd,bhjd->bhmj", self.points.to(k.dtype), k).float() * k.shape[-1] ** -0.5
        if key_padding is not None:
            scores = scores.masked_fill(~key_padding[:, None, None, :].to(k.device), NEG)
        return scores.softmax(-1).to(k.dtype)

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        refuse("inducing", mask, need_weights=need_weights, weights="it attends over inducing-point summaries, not keys")
        q, k = positions.content(q, k)
        a = self.summary_weights(k, mask.key_padding)
        keys, values = a @ k, a @ v  # (b, h, m, d)
        scores = (q @ keys.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
        probs = F.dropout(scores.softmax(-1).to(v.dtype), p=dropatt, training=training)
        return probs @ values, None

    def extra_repr(self) -> str:
        return f"points={self.points.shape[1]}"
