"""The CPU fast backend, applied to a built model from outside (`apply`).

What it swaps in, each computing what the reference computes (tests/test_fast_attention.py) and each
choosing by device at call time, so the same model runs anywhere:

    dropout.py     dropout from a cheaper CPU random source (the fast attention kernel draws its
                   attention dropout there too); ReLU + dropout fused in the feed-forward
    linear.py      fp32 linear layers through oneDNN on x86 CPUs (torch's MKL runs AVX2 code on AMD)
    projection.py  the key/value projection without the memory rows' input gradient (post-LN)
    memory.py      memory kinds: that projection, the token-level projection cache, in-place
                   evaluation memory
    positions.py   position tables memoised while nothing can change them

The model's own code never asks which backend it runs on: `TransformerXL` applies this when its
config says `backend = "auto"` (the default); `backend = "reference"` keeps plain PyTorch modules
throughout. Which attention kernel runs is a separate choice (`attention_impl`).
"""

from __future__ import annotations

from torch import nn

from txl.fast.dropout import CheapDropout, FusedReluDropout
from txl.fast.linear import FastLinear
from txl.fast.linear import linear as fast_linear  # (the name `linear` stays the submodule)
from txl.fast.memory import open_memory
from txl.fast.positions import memoise_tables
from txl.nn.positional import PositionalEncoding


def apply(model: nn.Module) -> nn.Module:
    """Swap the fast backend into `model` in place (parameters, buffers and state_dict unchanged) and
    return it. Applying it twice changes nothing."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if _is_relu_dropout(child):
                setattr(module, name, FusedReluDropout(child[1].p))
            elif type(child) is nn.Dropout:
                setattr(module, name, CheapDropout(child.p, child.inplace))
        if type(module) is nn.Linear:
            module.__class__ = FastLinear
        if hasattr(module, "linear_fn"):  # modules with functional projections (adaptive input/softmax)
            module.linear_fn = fast_linear
        if isinstance(module, PositionalEncoding):
            memoise_tables(module)
    if hasattr(model, "memory_kind"):
        model.memory_kind = open_memory
    return model


def _is_relu_dropout(module: nn.Module) -> bool:
    return (isinstance(module, nn.Sequential) and len(module) == 2 and type(module[0]) is nn.ReLU
            and type(module[1]) is nn.Dropout)


__all__ = ["apply"]
