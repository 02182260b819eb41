"""Linformer (Wang et al. 2020, "Linformer: Self-Attention with Linear Complexity", arXiv 2006.04768),
for the bidirectional encoder (`causal=False`): no causal mask, no memory. The plain bidirectional
attention it is measured against is `attention="full"` with `causal=False`.

Linformer projects the n keys and values *along the sequence axis* to k rows (`k`) with
learned matrices E, F (k × n), then attends over those k rows:

    head = softmax(q (E K)ᵀ / sqrt(d)) (F V)          O(n·k) instead of O(n²)

It cannot be causal: every projected row mixes all n positions, future ones included, and masking the
projection per query would bring back an n×n cost. The config therefore rejects
`attention="linformer"` with `causal=True` (one error naming the reason).

Parameter sharing (`sharing`, the paper's §4 "Additional Efficiency Techniques"):

- `"headwise"` (the default, and the only form before issue 48): E and F per layer, shared by the heads;
- `"key-value"`: one matrix per layer, E = F, for the keys and the values (and every head);
- `"layerwise"`: one matrix E for the keys and the values of every head of every layer of the stack: the
  first layer's kernel owns it and the others read it (`share_with`, called by the model once a stack is
  built: `txl.nn.attention.layer.share_kernels`), so a checkpoint holds it once, under the first layer.

The projections are built for `max_len` positions; a shorter input uses their first n
columns (the same as zero-padding the sequence), a longer one is an error. Initialised N(0, 1/n_max) so
a projected row starts at the scale of a single key. Positional encodings: `rope` (rotation applied
before the projection), `sinusoidal`, `learned`; score terms (xl, shaw, alibi) cannot survive the
projection and are rejected by the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.errors import ConfigError, UsageError
from txl.nn.attention.masks import AttentionMask
from txl.nn.attention.registry import refuse, register
from txl.nn.options import LayerConfig, Options
from txl.nn.positional import LayerPositions


@dataclass(frozen=True)
class LinformerOptions(Options):
    """`attention_options` of attention='linformer'."""

    k: int = 256  # rows the keys/values are projected to along the sequence
    max_len: int = 512  # longest input the projections cover (their number of columns)
    sharing: Literal["headwise", "key-value", "layerwise"] = "headwise"  # E, F per layer; E = F; one E for all layers

    def validate(self) -> None:
        self.at_least(1, "k", "max_len")


def check_linformer(config: LayerConfig) -> None:
    if config.causal:
        raise ConfigError(
            "config.attention='linformer' cannot be causal: projecting keys along the sequence mixes "
            "future positions into every projected row (Wang et al. 2020); set causal=false for the "
            "bidirectional encoder, or use sliding/sparse/performer for a causal LM"
        )


@register("linformer", "eager", causal=False, bidirectional=True, score_terms=False, check=check_linformer, options=LinformerOptions)
class LinformerAttention(nn.Module):
    """`attention="linformer"` (bidirectional only): keys/values projected to `k` rows."""

    def __init__(self, config: LayerConfig):
        super().__init__()
        options = config.attention_options
        rows, max_len, self.sharing = options.k, options.max_len, options.sharing
        self.key_projection = nn.Parameter(torch.randn(rows, max_len) * max_len**-0.5)  # E
        # F: its own matrix (headwise), else E serves the values too
        self.value_projection = nn.Parameter(torch.randn(rows, max_len) * max_len**-0.5) if self.sharing == "headwise" else None
        self._shared_with: list[LinformerAttention] = []  # layerwise: [the first layer's kernel] (not a submodule)

    def share_with(self, first: LinformerAttention) -> None:
        """Layer-wise sharing: read `first`'s E from now on and drop this layer's own (a no-op unless
        `sharing="layerwise"`). The first kernel stays a module of its own layer only, so the model's
        parameters and state_dict hold E once."""
        if self.sharing != "layerwise" or first is self:
            return
        del self.key_projection
        self.key_projection = None
        self._shared_with = [first]

    def projections(self) -> tuple[Tensor, Tensor]:
        """(E, F) this layer applies: F is E unless `sharing="headwise"`; E is the first layer's under layerwise."""
        owner = self._shared_with[0] if self._shared_with else self
        key = owner.key_projection
        return key, key if owner.value_projection is None else owner.value_projection

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        key_projection, value_projection = self.projections()
        n, max_len = k.shape[-2], key_projection.shape[1]
        if n > max_len:
            raise UsageError(
                f"attention='linformer' was built for {max_len} positions but the input has {n}; "
                "shorten the input or raise attention_options.max_len"
            )
        refuse("linformer", mask, need_weights=need_weights, weights="it attends over projected rows, not keys")
        q_content, k_content = positions.content(q, k)
        if mask.key_padding is not None:  # padding keys and values out of every projected row
            real = mask.key_padding[:, None, :, None].to(v.dtype)  # (b, 1, n, 1)
            k_content, v = k_content * real, v * real
        keys = torch.einsum("rj,bhjd->bhrd", key_projection[:, :n].to(k.dtype), k_content)  # (b, h, k, d)
        values = torch.einsum("rj,bhjd->bhrd", value_projection[:, :n].to(v.dtype), v)
        scores = torch.einsum("bhid,bhrd->bhir", q_content, keys) * q.shape[-1] ** -0.5
        probs = F.dropout(scores.float().softmax(dim=-1).to(v.dtype), p=dropatt, training=training)
        return torch.einsum("bhir,bhrd->bhid", probs, values), None

    def extra_repr(self) -> str:
        rows, max_len = self.projections()[0].shape
        shared = ", E of layer 0" if self._shared_with else ""
        return f"k={rows}, max_len={max_len}, sharing={self.sharing}{shared}"
