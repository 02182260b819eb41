"""The parts a model is built from, chosen once, when it is built (`Backend`).

A model's constructor takes its config's backend (`txl.fast.backend_for(config.backend)`) and builds
its layers from it: `backend.Linear(...)` where the reference code reads `nn.Linear(...)`. `REFERENCE`
(below) is plain PyTorch; the CPU fast backend (`txl.fast.FAST`, the default through
`backend = "auto"`) gives subclasses that compute the same thing faster, with the same parameters and
state_dict keys. So a built model is an ordinary module: nothing is swapped in afterwards, and the
layers never ask which backend they run on (torchtitan's "build a pure model, then choose how it
runs", moved to build time so that `torch.export` sees the model as it runs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.nn.functional as F
from torch import nn

from txl.nn.memory import reference_memory
from txl.nn.positional import build_positional

if TYPE_CHECKING:
    from txl.nn.positional import PositionalEncoding


def relu_then_dropout(p: float) -> nn.Module:
    """The feed-forward layer's activation: ReLU, then dropout (as the reference)."""
    return nn.Sequential(nn.ReLU(), nn.Dropout(p))


def as_built(module: nn.Module) -> nn.Module:
    """The reference's `adopt`: a module stays as its own code built it."""
    return module


@dataclass(frozen=True)
class Backend:
    """Module classes and functions a model is made of."""

    name: str
    Linear: type[nn.Linear] = nn.Linear  # noqa: N815 (a class, named as the class it stands for)
    Dropout: type[nn.Dropout] = nn.Dropout  # noqa: N815
    relu_dropout: Callable[[float], nn.Module] = relu_then_dropout  # ReLU + dropout (the FFN's activation)
    linear: Callable[..., Any] = F.linear  # functional projections (adaptive input and softmax)
    positional: Callable[[Any], PositionalEncoding] = build_positional  # config -> the positional encoding
    memory_kind: Callable[..., Any] = reference_memory  # (model, memory, *, mem_len, q_len) -> a MemoryUpdate
    # A module built by code that takes no backend (a kernel with parameters, an encoding's own
    # projections), made this backend's as it is built: its plain Linear and Dropout children become
    # this backend's (parameters unchanged). The reference leaves it as it is.
    adopt: Callable[[nn.Module], nn.Module] = as_built


REFERENCE = Backend("reference")
