"""Linformer (Wang et al. 2020, "Linformer: Self-Attention with Linear Complexity", arXiv 2006.04768),
and the plain bidirectional attention it is measured against. Both are for the bidirectional
encoder (`causal=False`): no causal mask, no memory.

Linformer projects the n keys and values *along the sequence axis* to k rows (`linformer_k`) with
learned matrices E, F (k × n), then attends over those k rows:

    head = softmax(q (E K)ᵀ / sqrt(d)) (F V)          O(n·k) instead of O(n²)

It cannot be causal: every projected row mixes all n positions, future ones included, and masking the
projection per query would bring back an n×n cost. The config therefore rejects
`attention="linformer"` with `causal=True` (one error naming the reason).

E and F are per layer and shared by the heads (the paper's "headwise sharing"), one for keys and one
for values. They are built for `linformer_max_len` positions; a shorter input uses their first n
columns (the same as zero-padding the sequence), a longer one is an error. Initialised N(0, 1/n_max) so
a projected row starts at the scale of a single key. Positional encodings: `rope` (rotation applied
before the projection), `sinusoidal`, `learned`; score terms (xl, shaw, alibi) cannot survive the
projection and are rejected by the config.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.attention import KERNELS
from txl.config import TransformerXLConfig
from txl.errors import UsageError
from txl.positional import LayerPositions


def bidirectional_attention(
    q: Tensor, k: Tensor, v: Tensor, *, positions: LayerPositions, window: int | None, dropatt: float, training: bool
) -> Tensor:
    """Full softmax attention without a mask (BERT-style encoder): the baseline of the encoder arena."""
    q_content, k_content = positions.content(q, k)
    scores = torch.einsum("bhid,bhjd->bhij", q_content, k_content)
    bias = positions.score_bias(q, k_len=k.shape[-2])
    if bias is not None:
        scores = scores + bias
    probs = (scores * q.shape[-1] ** -0.5).float().softmax(dim=-1).to(v.dtype)
    probs = F.dropout(probs, p=dropatt, training=training)
    return torch.einsum("bhij,bhjd->bhid", probs, v)


class LinformerAttention(nn.Module):
    """`attention="linformer"` (bidirectional only): keys/values projected to `linformer_k` rows."""

    def __init__(self, config: TransformerXLConfig):
        super().__init__()
        rows, max_len = config.linformer_k, config.linformer_max_len
        self.key_projection = nn.Parameter(torch.randn(rows, max_len) * max_len**-0.5)  # E
        self.value_projection = nn.Parameter(torch.randn(rows, max_len) * max_len**-0.5)  # F

    def forward(self, q, k, v, *, positions: LayerPositions, window: int | None, dropatt: float, training: bool):
        n, max_len = k.shape[-2], self.key_projection.shape[1]
        if n > max_len:
            raise UsageError(
                f"attention='linformer' was built for {max_len} positions but the input has {n}; "
                "shorten the input or raise linformer_max_len"
            )
        q_content, k_content = positions.content(q, k)
        keys = torch.einsum("rj,bhjd->bhrd", self.key_projection[:, :n].to(k.dtype), k_content)  # (b, h, k, d)
        values = torch.einsum("rj,bhjd->bhrd", self.value_projection[:, :n].to(v.dtype), v)
        scores = torch.einsum("bhid,bhrd->bhir", q_content, keys) * q.shape[-1] ** -0.5
        probs = F.dropout(scores.float().softmax(dim=-1).to(v.dtype), p=dropatt, training=training)
        return torch.einsum("bhir,bhrd->bhid", probs, values)

    def extra_repr(self) -> str:
        rows, max_len = self.key_projection.shape
        return f"k={rows}, max_len={max_len}"


KERNELS[("full", "bidirectional")] = bidirectional_attention
KERNELS[("linformer", "bidirectional")] = LinformerAttention
