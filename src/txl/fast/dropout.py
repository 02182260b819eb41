"""Dropout with a cheaper random source, and ReLU + dropout fused for the feed-forward layer.

On CPU, `torch.bernoulli_` (what F.dropout uses) draws one
Mersenne-Twister number per element; here one 64-bit draw feeds four elements as 16-bit uniforms,
several times faster (docs/benchmarks.md). The keep
probability is 1 - round(p * 2^16) / 2^16 (within 2^-17 of 1 - p) and survivors are scaled by its
exact inverse, so the output is unbiased. Same generator (`torch.manual_seed`, checkpointed RNG
state), different stream than `nn.Dropout`: the reference backend keeps `nn.Dropout`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _dropout_scale(x: Tensor, p: float) -> Tensor:
    """x's dropout multiplier: 0 with probability round(p * 2^16) / 2^16, else 1 / keep-probability."""
    cut = round(p * 65536)
    words = (x.numel() + 3) // 4
    bits = torch.empty(words, dtype=torch.int64, device=x.device).random_(-(2**63), None)
    uniform = bits.view(torch.int16)[: x.numel()].view(x.shape)  # integers uniform on [-2^15, 2^15)
    # Keep where uniform >= threshold, as a multiplier (0 or 1/keep-probability) built without bool
    # tensors: clamping the integers to [threshold-1, threshold] in place leaves exactly two values,
    # 0 and 1 after the subtraction, then one cast to x's dtype. Bool tensors were the slow part here
    # (`>=` plus a bool->float cast, torch.where, x * bool), and the integer steps before the cast save
    # an fp32 round trip in bf16, with bit-equal results (docs/benchmarks.md).
    threshold = cut - 32768
    keep = uniform.clamp_(threshold - 1, threshold).sub_(threshold - 1)
    return keep.to(x.dtype).mul_(65536 / (65536 - cut))


class _CheapDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, p: float) -> Tensor:
        scale = _dropout_scale(x, p)
        ctx.save_for_backward(scale)
        return x * scale

    @staticmethod
    def backward(ctx, grad: Tensor):
        (scale,) = ctx.saved_tensors
        return grad * scale, None


class _ReluDropout(torch.autograd.Function):
    """dropout(relu(x)) for the feed-forward hidden layer, as relu(x * scale) (equal, since scale >= 0)
    computed in place in the freshly drawn multiplier. The backward needs only the output: where it
    is positive the multiplier was 1/keep, elsewhere the gradient is 0. Two fresh hidden-sized
    tensors instead of three and one saved instead of three (docs/benchmarks.md). x itself is left alone: it is a view of the
    linear layer's output, and an in-place write there costs autograd a copy-and-scatter."""

    @staticmethod
    def forward(ctx, x: Tensor, p: float) -> Tensor:
        out = _dropout_scale(x, p).mul_(x).clamp_min_(0)  # in the multiplier's fresh buffer
        ctx.save_for_backward(out)
        # the forward's multiplier as stored in x's dtype (rounded in bf16), so the gradient is dropout's
        ctx.inverse_keep = float(torch.tensor(65536 / (65536 - round(p * 65536)), dtype=x.dtype))
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (out,) = ctx.saved_tensors
        return torch.ops.aten.threshold_backward(grad, out, 0).mul_(ctx.inverse_keep), None


def _cheap_source(x: Tensor, p: float, training: bool) -> bool:
    """Whether dropout of x draws from the cheap source: training on CPU with 0 < p < 1 (accelerators
    have fast counter-based RNG already; p = 0 is the identity, p = 1 left to F.dropout)."""
    return training and 0.0 < p < 1.0 and x.device.type == "cpu"


def cheap_dropout(x: Tensor, p: float, training: bool) -> Tensor:
    if not training or p == 0.0:
        return x
    return _CheapDropout.apply(x, p) if _cheap_source(x, p, training) else F.dropout(x, p, training)


class CheapDropout(torch.nn.Dropout):
    """`nn.Dropout` with the cheaper CPU random source above (same p, no state, same state_dict)."""

    def forward(self, x: Tensor) -> Tensor:
        return cheap_dropout(x, self.p, self.training)

    def after_relu(self, x: Tensor) -> Tensor:
        """self(relu(x)), fused (`_ReluDropout`) in training on CPU."""
        if _cheap_source(x, self.p, self.training):
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
