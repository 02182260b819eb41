"""Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs: Fast Autoregressive
Transformers with Linear Attention", arXiv 2006.16236), and the Performer's generalised ReLU kernel
(Choromanski et al. 2021, §2.3 "generalized attention").

softmax(q·k) is replaced by a feature-map kernel φ(q)·φ(k), deterministic here (no random features):

    out_i = Σ_j φ(q_i)·φ(k_j) v_j / Σ_j φ(q_i)·φ(k_j)
    φ(x) = elu(x) + 1      (`feature="elu"`, Katharopoulos et al. eq. 7)
    φ(x) = relu(x) + ε     (`feature="relu"`, the Performer's generalised kernel f = ReLU)

Causal (the LM, with memory): the prefix sums S = Σ_{j≤i} φ(k_j) v_jᵀ, z = Σ_{j≤i} φ(k_j) of the
Performer's chunked code (`txl.nn.attention.performer.causal_linear_attention`, shared, with every key's
stabiliser 0: these features cannot overflow). O(n·(c + d)·d) time, never an n×n matrix; memory keys
start the prefix, so two segments with memory equal one pass. Bidirectional: S and z over all keys.

A small ε (`FEATURE_EPS`) keeps every denominator positive (ReLU features can all be 0). Positions:
`rope` (rotation before the feature map), `sinusoidal`, `learned`, `xpos`; no score terms, no
dropatt (no probabilities are formed), no same_length window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.nn.attention.masks import AttentionMask
from txl.nn.attention.performer import (
    FEATURE_EPS,
    bidirectional_linear_attention,
    causal_linear_attention,
    quadratic_linear_attention,
)
from txl.nn.attention.registry import check_no_probabilities, refuse, register
from txl.nn.options import LayerConfig, Options
from txl.nn.positional import LayerPositions


@dataclass(frozen=True)
class LinearOptions(Options):
    """`attention_options` of attention='linear'."""

    feature: Literal["elu", "relu"] = "elu"  # elu = elu+1 (Katharopoulos); relu = Performer's generalised kernel


def feature_map(x: Tensor, kind: str) -> Tensor:
    """φ(x) ≥ ε elementwise: elu + 1 or relu (+ ε)."""
    # One fresh (.., n, d) buffer, shifted in place: `F.elu(x) + 1 + eps` made three, and at 32k tokens
    # (32 MB per tensor, above glibc's largest mmap threshold) every fresh buffer is new pages that the
    # kernel must fault in and zero, which made time(32k)/time(16k) 2.4 for a linear-time kernel.
    # (elu's and clamp_min's backward read their input, never this output: the shift is safe.)
    if kind == "elu":
        return F.elu(x).add_(1.0 + FEATURE_EPS)
    return x.clamp_min(0.0).add_(FEATURE_EPS)  # relu (its backward would read the shifted output)


@register("linear", "fast", bidirectional=True, score_terms=False, check=check_no_probabilities, options=LinearOptions)
class LinearAttention(nn.Module):
    """`attention="linear"`: φ(q)·φ(k) attention by chunked prefix sums (causal) or global sums."""

    chunk_size = 128  # queries per causal step (as the Performer's)

    def __init__(self, config: LayerConfig):
        super().__init__()
        self.feature = config.attention_options.feature

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        refuse("linear", mask, need_weights=need_weights, same_length="no window over prefix sums",
               weights="it never forms the attention probabilities")
        q, k = positions.content(q, k)
        with torch.autocast(device_type=q.device.type, enabled=False):  # float32 sums, as the Performer's
            phi_q, phi_k = feature_map(q.float(), self.feature), feature_map(k.float(), self.feature)
            if mask.key_padding is not None:  # padding keys out of every sum
                phi_k = phi_k * mask.key_padding[:, None, :, None].to(phi_k.dtype)
            scale = phi_k.new_zeros(phi_k.shape[:-1])  # no stabiliser needed: features are bounded by |x| + 1
            out = self.linear_attention(phi_q, phi_k, scale, v.float(), causal=mask.causal)
            if mask.key_padding is not None:
                out = out.nan_to_num(0.0)
        return out.to(v.dtype), None

    def linear_attention(self, phi_q: Tensor, phi_k: Tensor, scale: Tensor, v: Tensor, *, causal: bool) -> Tensor:
        if not causal:
            return bidirectional_linear_attention(phi_q, phi_k, scale, v)
        return causal_linear_attention(phi_q, phi_k, scale, v, chunk_size=self.chunk_size)

    def extra_repr(self) -> str:
        return f"feature={self.feature}"


@register("linear", "eager", bidirectional=True, score_terms=False, check=check_no_probabilities, options=LinearOptions)
class LinearReference(LinearAttention):
    """The same kernel as a masked (i, n) matrix of φ(q)·φ(k): the ground truth for the prefix sums."""

    def linear_attention(self, phi_q, phi_k, scale, v, *, causal):
        return quadratic_linear_attention(phi_q, phi_k, scale, v, causal=causal)
