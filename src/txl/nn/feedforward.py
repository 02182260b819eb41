"""The feed-forward activations a config chooses by name (`config.ffn`), each followed by dropout.

- relu (the paper's): Linear(d_model, d_inner) -> ReLU -> Dropout -> Linear(d_inner, d_model);
- gelu (Hendrycks & Gimpel 2016, the exact erf form): the same with GELU;
- swiglu, geglu (Shazeer 2020, "GLU Variants Improve Transformer", arXiv 2002.05202): a gated linear unit,
  FFN(x) = (act(x W + b) ⊙ (x V + c)) W2 + b2 with act = Swish (SiLU) or GELU. fc1 makes both halves at
  once, 2·d_inner wide: the first d_inner features are the value x V + c, the last d_inner the gate
  x W + b. `d_inner` is the gated width, the input width of fc2 (Shazeer's d_ff, Llama's
  intermediate_size), so the layer has 3·d_model·d_inner weights where the ReLU layer has 2·: for the
  same parameter count take 2/3 of the ReLU width, as Shazeer does (d_ff 3072 -> 2048). Biases are kept,
  as the paper's feed-forward has them (Shazeer's variants drop them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

GATED = {"swiglu": F.silu, "geglu": F.gelu}


class GatedActivation(nn.Module):
    """(b, t, 2·d_inner) [value ; gate] -> dropout(value ⊙ act(gate)) (b, t, d_inner)."""

    def __init__(self, act: Callable[[Tensor], Tensor], dropout: nn.Module):
        super().__init__()
        self.act, self.drop = act, dropout

    def forward(self, x: Tensor) -> Tensor:
        value, gate = x.chunk(2, dim=-1)
        return self.drop(value * self.act(gate))

    def extra_repr(self) -> str:
        return f"act={self.act.__name__}"


def activation(kind: str, dropout: float, *, dropout_cls: type[nn.Module],
               relu_dropout: Callable[[float], nn.Module]) -> nn.Module:
    """The activation + dropout of feed-forward `kind`, built from a backend's parts (`dropout_cls`, and
    `relu_dropout` for the paper's ReLU, which the fast backend fuses)."""
    if kind == "relu":
        return relu_dropout(dropout)
    if kind == "gelu":
        return nn.Sequential(nn.GELU(), dropout_cls(dropout))
    return GatedActivation(GATED[kind], dropout_cls(dropout))


def fc1_width(kind: str, d_inner: int) -> int:
    """fc1's output width: 2·d_inner for a gated unit (value and gate), else d_inner."""
    return 2 * d_inner if kind in GATED else d_inner


__all__ = ["GATED", "GatedActivation", "activation", "fc1_width"]
