"""Dropout with a cheaper CPU random source (`cheap_dropout`).

On CPU, `torch.bernoulli_` (what F.dropout uses) draws one Mersenne-Twister number per element; here
one 64-bit draw feeds four elements as 16-bit uniforms, several times faster (docs/results/benchmarks.md). The
keep probability is 1 - round(p * 2^16) / 2^16 (within 2^-17 of 1 - p) and survivors are scaled by
its exact inverse, so the output is unbiased. Same generator (`torch.manual_seed`, checkpointed RNG
state), different stream than `nn.Dropout`.

It sits here, below the fast backend (txl/fast/dropout.py holds the modules built on it), because the
fast attention kernel (`txl.nn.attention.xl_fast`) draws its attention dropout from it too, and
kernels import nothing above `txl.nn`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def dropout_scale(x: Tensor, p: float) -> Tensor:
    """x's dropout multiplier: 0 with probability round(p * 2^16) / 2^16, else 1 / keep-probability."""
    cut = round(p * 65536)
    words = (x.numel() + 3) // 4
    bits = torch.empty(words, dtype=torch.int64, device=x.device).random_(-(2**63), None)
    uniform = bits.view(torch.int16)[: x.numel()].view(x.shape)  # integers uniform on [-2^15, 2^15)
    # Keep where uniform >= threshold, as a multiplier (0 or 1/keep-probability) built without bool
    # tensors: clamping the integers to [threshold-1, threshold] in place leaves exactly two values,
    # 0 and 1 after the subtraction, then one cast to x's dtype. Bool tensors were the slow part here
    # (`>=` plus a bool->float cast, torch.where, x * bool), and the integer steps before the cast save
    # an fp32 round trip in bf16, with bit-equal results (docs/results/benchmarks.md).
    threshold = cut - 32768
    keep = uniform.clamp_(threshold - 1, threshold).sub_(threshold - 1)
    return keep.to(x.dtype).mul_(65536 / (65536 - cut))


class _CheapDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, p: float) -> Tensor:
        scale = dropout_scale(x, p)
        ctx.save_for_backward(scale)
        return x * scale

    @staticmethod
    def backward(ctx, grad: Tensor):
        (scale,) = ctx.saved_tensors
        return grad * scale, None


def cheap_source(x: Tensor, p: float, training: bool) -> bool:
    """Whether dropout of x draws from the cheap source: training on CPU with 0 < p < 1 (accelerators
    have fast counter-based RNG already; p = 0 is the identity, p = 1 left to F.dropout), outside a
    traced graph (`torch.compile`, `torch.export`: the in-place draw over the full int64 range does not
    trace, and a compiled graph generates its own random numbers for F.dropout)."""
    return training and 0.0 < p < 1.0 and x.device.type == "cpu" and not torch.compiler.is_compiling()


def cheap_dropout(x: Tensor, p: float, training: bool) -> Tensor:
    if not training or p == 0.0:
        return x
    return _CheapDropout.apply(x, p) if cheap_source(x, p, training) else F.dropout(x, p, training)
