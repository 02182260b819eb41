"""The CPU fast backend (`FAST`): the parts a model is built from when its config says
`backend = "auto"` (the default); `backend = "reference"` builds plain PyTorch modules throughout.

Each part computes what the reference computes (tests/test_fast_attention.py) and chooses by device
at call time, so the same model runs anywhere:

    dropout.py     dropout from a cheaper CPU random source (`txl.nn.dropout`; the fast attention
                   kernel draws its attention dropout there too); ReLU + dropout fused in the
                   feed-forward layer
    linear.py      fp32 linear layers through oneDNN on x86 CPUs (torch's MKL runs AVX2 code on AMD)
    projection.py  the key/value projection without the memory rows' input gradient (post-LN)
    memory.py      memory kinds: that projection, the token-level projection cache, in-place
                   evaluation memory
    positions.py   position tables memoised while nothing can change them

A model's constructor asks `backend_for(config.backend)` once and builds its layers from what it gets
(`txl.nn.backend.Backend`): a built model is an ordinary module, nothing is swapped in afterwards, and
its state_dict is the reference's, key for key. Which attention kernel runs is a separate choice
(`attention_impl`).
"""

from __future__ import annotations

from torch import nn

from txl.fast.dropout import CheapDropout, FusedReluDropout
from txl.fast.linear import FastLinear
from txl.fast.linear import linear as fast_linear  # (the name `linear` stays the submodule)
from txl.fast.memory import open_memory
from txl.fast.positions import build_memoised_positional
from txl.nn.backend import REFERENCE, Backend


def adopt(module: nn.Module) -> nn.Module:
    """Make the plain `nn.Linear` and `nn.Dropout` (and the feed-forward's `Sequential(ReLU, Dropout)`)
    inside a module built by code that takes no backend the fast backend's, in place, as the module is
    built (parameters and state_dict unchanged). Used for attention kernels with parameters and the
    positional encodings' own projections, which build their layers themselves."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if _is_relu_dropout(child):
                setattr(parent, name, FusedReluDropout(child[1].p))
            elif type(child) is nn.Dropout:
                setattr(parent, name, CheapDropout(child.p, child.inplace))
        if type(parent) is nn.Linear:
            parent.__class__ = FastLinear
    return module


def _is_relu_dropout(module: nn.Module) -> bool:
    return (isinstance(module, nn.Sequential) and len(module) == 2 and type(module[0]) is nn.ReLU
            and type(module[1]) is nn.Dropout)


def _positional(config) -> nn.Module:
    return adopt(build_memoised_positional(config))


FAST = Backend("fast", Linear=FastLinear, Dropout=CheapDropout, relu_dropout=FusedReluDropout, linear=fast_linear,
               positional=_positional, memory_kind=open_memory, adopt=adopt)


def backend_for(name: str) -> Backend:
    """The backend a config's `backend` names: "auto" -> the fast backend, "reference" -> plain PyTorch."""
    return FAST if name == "auto" else REFERENCE


__all__ = ["FAST", "REFERENCE", "Backend", "adopt", "backend_for"]
