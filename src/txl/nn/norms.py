"""The block norms a config chooses by name (`config.norm`): LayerNorm (the paper's) or RMSNorm.

RMSNorm (Zhang & Sennrich 2019, arXiv 1910.07467): y = x / sqrt(mean(x²) + eps) · g, a learned gain g and
no bias and no centring; `torch.nn.RMSNorm` computes it. Both take the config's `layer_norm_eps`.
"""

from __future__ import annotations

from torch import nn

NORMS = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm}


def build_norm(kind: str, width: int, *, eps: float) -> nn.Module:
    """The norm `kind` ("layernorm" | "rmsnorm") over the last dimension of size `width`."""
    return NORMS[kind](width, eps=eps)


__all__ = ["NORMS", "build_norm"]
