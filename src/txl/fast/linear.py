"""The fast path's fp32 linear layers: oneDNN's matmul on x86 CPUs instead of torch's default BLAS.

torch sends an fp32 `F.linear` / `mm` on CPU to MKL's sgemm. On the AMD EPYC (AVX-512) this
repository benchmarks on, MKL runs its AVX2 code (it picks kernels by CPU vendor), while oneDNN, the
library torch already uses for bf16 matmuls, picks kernels by instruction set and reaches about twice
MKL's GFLOP/s on the same fp32 shapes (docs/results/benchmarks.md, "Measurements behind the code").
Same fp32 arithmetic: the error against a float64 product is of the same size as MKL's; only the
summation order differs.

torch exposes oneDNN's fp32 linear as `torch.ops.mkldnn._linear_pointwise` (used by inductor's CPU
backend) without a derivative, so `_OneDNNLinear` writes the backward with the same op: the input
gradient reads the weight transposed in place, and the weight gradient is computed as
(x^T dy)^T or dy^T x, whichever makes the operand that oneDNN copies (its transposed first argument)
the smaller one.

It runs only where it was measured to pay: CPU, fp32 (autocast off: bf16 and fp16 already go to
oneDNN), x86-64, outside `torch.compile` (whose inductor backend fails to lower the op), and a
product of at least `MIN_MACS` multiply-adds or a weight of at least `MIN_WEIGHT` elements. Below both
the op's fixed cost loses to MKL (a tiny model's generated token); a large weight read once per token
streams faster through oneDNN (the base shape's generated token). The break-evens are measured
(docs/results/benchmarks.md).
Everything else is `F.linear`. The reference backend keeps plain `nn.Linear`.
"""

from __future__ import annotations

import platform

import torch
import torch.nn.functional as F
from torch import Tensor, nn

MIN_MACS = 1 << 21  # products (rows x in x out multiply-adds) from this size go to oneDNN ...
MIN_WEIGHT = 1 << 18  # ... and so do all products with a weight of this many elements (measured break-evens)


def _find_op():
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):  # a build without it
        return None


_ONEDNN = _find_op()


def _onednn(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight^T (+ bias) by oneDNN; weight may be a transposed view (read in place)."""
    return _ONEDNN(x, weight, bias, "none", [], "")


def _eligible(a: Tensor, b: Tensor) -> bool:
    return (
        _ONEDNN is not None
        and not torch.compiler.is_compiling()  # inductor cannot lower the op in a training graph: F.linear
        and a.device.type == "cpu"
        and a.dtype == torch.float32
        and b.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
    )


def applies(x: Tensor, weight: Tensor) -> bool:
    """Whether x @ weight^T goes to oneDNN (see the module docstring)."""
    big = x.numel() * weight.shape[0] >= MIN_MACS or weight.numel() >= MIN_WEIGHT  # first: the cheapest test
    return big and _eligible(x, weight)


def input_grad(grad: Tensor, weight: Tensor) -> Tensor:
    """grad @ weight: the input gradient of `linear(x, weight)`."""
    if applies(grad, weight.t()):
        return _onednn(grad, weight.t())
    return torch.matmul(grad, weight)


def weight_grad(grad: Tensor, x: Tensor) -> Tensor:
    """grad^T @ x for 2-d grad (rows, out) and x (rows, in): the weight gradient, (out, in)."""
    if x.numel() * grad.shape[1] < MIN_MACS or not _eligible(x, grad):  # (no weight is read here)
        return torch.mm(grad.t(), x)
    if x.shape[1] <= grad.shape[1]:  # oneDNN copies its first argument, transposed: the smaller one
        return _onednn(x.t(), grad.t()).t().contiguous()
    return _onednn(grad.t(), x.t())


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = input_grad(grad, weight)
        rows = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_w = weight_grad(rows, x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = rows.sum(0)
        return grad_x, grad_w, grad_b


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)`, through oneDNN where `applies` (forward and backward)."""
    if not applies(x, weight):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        # On 2-d rows, viewed back outside the Function: the op returns an (.., out) input's result as a
        # view of a 2-d buffer, and a Function output that is a view has that buffer, which autograd
        # never sees, as its `_base`; a kernel that rebuilds a tensor from its views' `_base`
        # (`xl_fast.packed_kv`) then read a gradient-less tensor and the weight got no gradient.
        out = _OneDNNLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias)
        return out.view(*x.shape[:-1], weight.shape[0])
    return _onednn(x, weight, bias)


class FastLinear(nn.Linear):
    """`nn.Linear` whose product goes through `linear` (same parameters, same state_dict)."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
