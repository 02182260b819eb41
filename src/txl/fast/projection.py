"""The key/value projection of [constant memory ; segment] without the memory rows' input gradient.

Post-LN blocks project the context [SG(memory) ; h]; the memory rows are detached states, so
autograd's input gradient for them is computed and thrown away. `project_context` computes it for the
segment rows only (mem_len / (mem_len + tgt_len) of that product: 3% of a base training step's FLOPs;
docs/results/benchmarks.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from txl.fast.linear import input_grad, linear, weight_grad


class _ContextProjection(torch.autograd.Function):
    """`F.linear(context, weight)` for the key/value projection when the first rows of `context` (the
    memory) are constants and the last rows are `fresh` (the segment). Autograd through the plain
    linear computes an input gradient for every context row and then throws the memory's away; this
    backward computes it for the segment rows only (mem_len / (mem_len + tgt_len) of that product: 3%
    of a base training step's FLOPs). The weight gradient still comes from every row.

    Autocast is resolved here (one compute dtype, casts written out) because the backward runs
    outside it."""

    @staticmethod
    def forward(ctx, context, fresh, weight, dtype):
        context, weight_c = context.to(dtype), weight.to(dtype)
        ctx.save_for_backward(context, weight_c)
        ctx.fresh_len, ctx.dtypes = fresh.shape[1], (fresh.dtype, weight.dtype)
        # 2-d rows out (`project_context` views them back): a Function output that is a view of a
        # buffer made inside forward has a `_base` autograd does not know (see `txl.fast.linear.linear`)
        return linear(context.flatten(0, 1), weight_c)

    @staticmethod
    def backward(ctx, grad):
        context, weight = ctx.saved_tensors
        grad = grad.to(context.dtype).reshape(*context.shape[:2], -1)
        grad_fresh = grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_fresh = input_grad(grad[:, -ctx.fresh_len :], weight).to(ctx.dtypes[0])
        if ctx.needs_input_grad[2]:
            grad_weight = weight_grad(grad.flatten(0, 1), context.flatten(0, 1)).to(ctx.dtypes[1])
        return None, grad_fresh, grad_weight, None


def project_context(context: Tensor, fresh: Tensor, weight: Tensor) -> Tensor:
    """`F.linear(context, weight)` where `context` is [constant memory ; `fresh`] (post-LN blocks, whose
    memory rows are detached states): gradients reach `fresh` and `weight` only (`_ContextProjection`)."""
    device = context.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    with torch.autocast(device, enabled=False):
        rows = _ContextProjection.apply(context.detach(), fresh, weight, dtype)
    return rows.view(*context.shape[:2], weight.shape[0])
