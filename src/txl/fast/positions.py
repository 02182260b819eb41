"""Position tables memoised while nothing can change them (the fast backend).

Generation calls the positional encoding once per token: building the float64 sinusoid table and
projecting it through every layer's W_kR cost more than the token's attention at a 1k context
(docs/results/benchmarks.md). Neither depends on the input, so without autograd and outside training the last
table is kept. The memo key holds everything a result depends on (length, clamp, dtype, device,
autocast, inference mode, and for the projected table the weight's identity and version, which any
in-place update such as an optimizer step bumps), so a stale table is never returned. A graph being
traced (`torch.compile`, `torch.export`) computes the tables: a memo is Python state a graph cannot hold.
"""

from __future__ import annotations

import torch
from torch import Tensor

from txl.nn.positional import POSITIONAL_ENCODINGS, PositionalEncoding


class _MemoisedPrepare:
    """Mixin for any encoding: the per-forward state of the last call, in evaluation mode."""

    def prepare(self, *, k_len, clamp_len, device, dtype):
        if self.training or torch.compiler.is_compiling():  # dropout on the table (xl): never the same twice;
            # a traced graph (torch.compile, torch.export) computes the table, keeps no Python state
            return super().prepare(k_len=k_len, clamp_len=clamp_len, device=device, dtype=dtype)
        key = (k_len, clamp_len, device, dtype, torch.is_inference_mode_enabled())  # inference tensors stay there
        hit = self.__dict__.get("_prepare_memo")
        if hit is not None and hit[0] == key:
            return hit[1]
        state = super().prepare(k_len=k_len, clamp_len=clamp_len, device=device, dtype=dtype)
        self.__dict__["_prepare_memo"] = (key, state)
        return state


class _MemoisedProjectedTable(_MemoisedPrepare):
    """Mixin for Transformer-XL's encoding: also W_kR R per layer, without autograd and dropout."""

    def projected_table(self, layer: int, state: dict, k_len: int, stride: int = 1) -> Tensor:
        if torch.is_grad_enabled() or self.training or torch.compiler.is_compiling():
            return super().projected_table(layer, state, k_len, stride)
        weight = self.r_proj[layer].weight
        table = state["R"]
        autocast = torch.is_autocast_enabled(table.device.type)
        key = (k_len, stride, state.get("clamp_len"), table.dtype, table.device, autocast,
               torch.get_autocast_dtype(table.device.type) if autocast else None, weight.data_ptr(), weight._version)
        memo = self.__dict__.setdefault("_table_memo", {})
        hit = memo.get(layer)
        if hit is not None and hit[0] == key:
            return hit[1]
        r = super().projected_table(layer, state, k_len, stride)
        memo[layer] = (key, r)
        return r


_CLASSES: dict[type, type] = {}


def memoised_class(cls: type[PositionalEncoding]) -> type[PositionalEncoding]:
    """`cls` with the memoised `prepare` and, where it has one, `projected_table` (same parameters,
    same state_dict): one subclass per encoding, made once."""
    if cls not in _CLASSES:
        mixin = _MemoisedProjectedTable if hasattr(cls, "projected_table") else _MemoisedPrepare
        _CLASSES[cls] = type(f"Memoised{cls.__name__}", (mixin, cls), {"__module__": cls.__module__})
    return _CLASSES[cls]


def build_memoised_positional(config) -> PositionalEncoding:
    """The config's positional encoding (`txl.nn.positional.build_positional`), built as its memoised
    subclass."""
    return memoised_class(POSITIONAL_ENCODINGS[config.pos_encoding])(config)
