"""The fast backend's dropout modules: `nn.Dropout` from the cheaper CPU random source
(`txl.nn.dropout.cheap_dropout`), and ReLU + dropout fused for the feed-forward layer.

A model built with the fast backend makes these in place of `nn.Dropout` and
`Sequential(ReLU, Dropout)` (same p, no parameters, same state_dict). Same generator
(`torch.manual_seed`, checkpointed RNG state), different stream than `nn.Dropout`: the reference
backend keeps `nn.Dropout`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from txl.nn.dropout import cheap_dropout, cheap_source, dropout_scale


class _ReluDropout(torch.autograd.Function):
    """dropout(relu(x)) for the feed-forward hidden layer, as relu(x * scale) (equal, since scale >= 0)
    computed in place in the freshly drawn multiplier. The backward needs only the output: where it
    is positive the multiplier was 1/keep, elsewhere the gradient is 0. Two fresh hidden-sized
    tensors instead of three and one saved instead of three (docs/results/benchmarks.md). x itself is left alone: it is a view of the
    linear layer's output, and an in-place write there costs autograd a copy-and-scatter."""

    @staticmethod
    def forward(ctx, x: Tensor, p: float) -> Tensor:
        out = dropout_scale(x, p).mul_(x).clamp_min_(0)  # in the multiplier's fresh buffer
        ctx.save_for_backward(out)
        # the forward's multiplier as stored in x's dtype (rounded in bf16), so the gradient is dropout's
        ctx.inverse_keep = float(torch.tensor(65536 / (65536 - round(p * 65536)), dtype=x.dtype))
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (out,) = ctx.saved_tensors
        return torch.ops.aten.threshold_backward(grad, out, 0).mul_(ctx.inverse_keep), None


class CheapDropout(torch.nn.Dropout):
    """`nn.Dropout` with the cheaper CPU random source (same p, no state, same state_dict)."""

    def forward(self, x: Tensor) -> Tensor:
        return cheap_dropout(x, self.p, self.training)

    def after_relu(self, x: Tensor) -> Tensor:
        """self(relu(x)), fused (`_ReluDropout`) in training on CPU."""
        if cheap_source(x, self.p, self.training):
            return _ReluDropout.apply(x, self.p)
        return self(F.relu(x))


class FusedReluDropout(torch.nn.Module):
    """dropout(relu(x)) in one step (`_ReluDropout`) in training on CPU: what the fast backend puts in
    place of the feed-forward layer's `Sequential(ReLU, Dropout)` (same result, same random numbers)."""

    def __init__(self, p: float):
        super().__init__()
        self.drop = CheapDropout(p)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop.after_relu(x)


__all__ = ["CheapDropout", "FusedReluDropout", "cheap_dropout"]
