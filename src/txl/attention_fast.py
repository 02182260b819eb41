"""The fast `("full", "fast")` attention kernel: same signature and results as `eager_attention`,
plus the fast path's dropout.

What makes it faster than the eager reference (each kept because it measured faster side by side on
a 2-core AVX-512 CPU; `txl bench kernel` and docs/benchmarks.md have the numbers):

- Transformer-XL positions (`pos_encoding="xl"`) get a hand-written autograd function. Forward: the
  position scores BD are computed once against the distance table (head-major in training: one
  product per head over all batch rows), rel-shifted as a *strided view* (no padded copy,
  `rel_shift_strided`), and one `baddbmm` adds the content scores AC and the scale; the mask is added
  and softmax runs in place. Backward uses the FlashAttention identity dS = P * (dP - rowsum(dO * O))
  (Dao et al. 2022, eq. in §3.1), which needs no mask pass (P is 0 where masked), and writes dS below
  a zero row so that a strided view of it *is* the un-shifted gradient of BD (`_unshift_grad`).
- Training runs the queries in 2 causal blocks (`_XLAttention`): a block attends to the keys up to
  its last query only, so part of the masked corner of the score matrix is never computed; keys and
  values are read from, and their gradient written to, the projection's own layout.
- Post-LN blocks project keys and values with `project_context`, whose backward skips the input
  gradient of the memory rows (detached states).
- The largest intermediates (BD before the shift, dS, the un-shifted gradient of BD) live in
  per-thread scratch buffers (`_workspace`), reused from call to call instead of freshly mapped.
- Other encodings take a composed autograd path: positional bias (Shaw, ALiBi) through the strided
  rel-shift (`rel_shift_fast`), scores by one `baddbmm`, an additive mask.
- Without gradients (evaluation, generation) one batch row (and a group of heads, for very long
  memories) is processed at a time, so the score block stays under `EVAL_CHUNK_ELEMENTS` elements.
- `CheapDropout`: the same dropout distribution from a cheaper CPU random source, and ReLU + dropout
  fused for the feed-forward layer (below).

Tried and dropped (slower here): SDPA with the position term as a float bias (the CPU flash kernel
refuses a bias that needs a gradient in torch 2.13, and the math fallback is slower than the batched
matmuls below), autograd through `as_strided` (its backward falls back to a slow overlapping-geometry
path), a gather-based rel-shift.

Dimension names: b batch, h heads, i queries, n keys (memory + segment), d head dim.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading

import torch
import torch.nn.functional as F
from torch import Tensor

from txl.linear_fast import input_grad, linear, weight_grad
from txl.positional import LayerPositions, XLRelative, rel_shift_strided

# Without gradients, one batch row at a time with as many heads as keep the (heads, i, n) score block
# under this many elements (32 Mi = 128 MiB in fp32); at least one head.
EVAL_CHUNK_ELEMENTS = 1 << 25

_workspaces = threading.local()


def _workspace(name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
    """A scratch tensor reused across calls (per thread, per name) for intermediates that never leave
    the function that asked for it. Fresh large CPU tensors are costly here: the allocator maps new
    pages for every block above its mmap threshold, and first-touch page faults made a 32 MiB buffer
    cost 35 ms against 1 ms to refill a reused one (measured in a KVM guest, torch 2.13)."""
    numel = math.prod(shape)
    cache = _workspaces.__dict__
    buffer = cache.get(name)
    if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype or buffer.device != like.device:
        buffer = like.new_empty(numel)
        cache[name] = buffer
    return buffer[:numel].view(shape)


@functools.lru_cache(maxsize=64)
def _mask_bias(q_len: int, k_len: int, window: int | None, device: torch.device, dtype: torch.dtype) -> Tensor:
    """[q_len, k_len] additive mask: 0 where query i may see key j (`causal_mask`), -inf elsewhere.

    Adding it costs a ninth of an in-place `masked_fill_` with a broadcast bool mask on CPU (measured,
    torch 2.13), and -inf + a finite score is -inf, so softmax sees exactly what eager's masking gives.
    """
    dist = torch.arange(q_len, device=device)[:, None] + (k_len - q_len) - torch.arange(k_len, device=device)
    mask = dist < 0
    if window is not None:
        mask |= dist >= window
    return torch.zeros(q_len, k_len, device=device, dtype=dtype).masked_fill_(mask, float("-inf"))


def _unshift_view(buffer: Tensor, q_len: int, k_len: int) -> Tensor:
    """The inverse of `rel_shift_strided` as a view, for gradients.

    `buffer` is (.., q, k_len + q - 1) with the shifted block in its last k_len columns and zeros in
    its first q-1. Read with row stride k_len + q (one more than the buffer's), row i, column c lands
    on shifted[i, c + i - (q-1)], i.e. the entry the forward view read from (i, c); entries that no
    valid (causal) score came from read the zeros.
    """
    *lead, q, width = buffer.shape
    lead_strides = buffer.stride()[:-2]
    return buffer.as_strided((*lead, q_len, k_len), (*lead_strides, width + 1, 1), buffer.storage_offset())


def _shift_grad_buffer(like: Tensor, q_len: int, k_len: int) -> tuple[Tensor, Tensor]:
    """An uninitialised (.., q, k_len+q-1) buffer with zeroed left columns, and its (.., q, k_len) tail."""
    buffer = like.new_empty((*like.shape[:-2], q_len, k_len + q_len - 1))
    buffer[..., : q_len - 1].zero_()
    return buffer, buffer[..., q_len - 1 :]


class _RelShift(torch.autograd.Function):
    """`rel_shift_strided` with a copy-light backward (autograd's own `as_strided` backward takes a slow
    path for overlapping views: measured 1.2x slower than the reference pad-and-copy)."""

    @staticmethod
    def forward(ctx, raw):
        return rel_shift_strided(raw)

    @staticmethod
    def backward(ctx, grad):
        q_len, k_len = grad.shape[-2:]
        buffer, tail = _shift_grad_buffer(grad, q_len, k_len)
        tail.copy_(grad)
        return _unshift_view(buffer, q_len, k_len).contiguous()


def rel_shift_fast(raw: Tensor) -> Tensor:
    return _RelShift.apply(raw)


def _xl_probs(qu: Tensor, qv: Tensor, k: Tensor, r: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """Attention probabilities (B, i, n) from qu (B, i, d), k (B, n, d) and qv (.., i, d), r (.., n, d)
    whose leading dims flatten to B (the matmul broadcasts r over the batch).

    Scores are (AC + shift(BD)) * scale with BD = qv @ r^T against distances n-1 … 0 (column c holds
    distance n-1-c), shifted as a strided view so that column j holds distance i + (n - q) - j.
    """
    B, i, _ = qu.shape
    n = k.shape[-2]
    lead = qv.shape[:-2]  # r's leading dims (heads) broadcast into qv's; torch.broadcast_shapes is Python-slow
    if i == 1:  # a generated token: its columns are distances n-1 … 0 already (no shift), and small
        raw = shifted = torch.matmul(qv, r.transpose(-1, -2))  # (a workspace `out=` costs it a copy)
    else:
        raw = torch.matmul(qv, r.transpose(-1, -2), out=_workspace("raw", (*lead, i, n), qu))  # against distances
        shifted = rel_shift_strided(raw)
    scores = torch.baddbmm(
        shifted.reshape(B, i, n), qu, k.transpose(-1, -2), beta=scale, alpha=scale
    )  # (B, i, n); the shifted view is read once, as baddbmm's input
    del raw, shifted
    if mask is not None:  # None: nothing masked (a single query sees every key)
        scores.add_(mask)
    # In place, in the scores' dtype (callers run with autocast off). For bf16 that is still an fp32
    # softmax: the kernel accumulates in fp32 and rounds once at the end, bit-equal to eager's
    # `.float().softmax().to(bf16)` and 11x faster than that round trip (measured).
    return torch.softmax(scores, dim=-1, out=scores)


def _xl_forward_chunked(qu, qv, k, v, r, mask, scale) -> Tensor:
    """No-grad forward, one batch row and a group of heads at a time, so that the score block stays
    under EVAL_CHUNK_ELEMENTS. qu, qv (b, h, i, d), k, v (b, h, n, d), r (h, n, d) -> (b, h, i, d)."""
    b, h, i, d = qu.shape
    n = k.shape[-2]
    heads = max(1, min(h, EVAL_CHUNK_ELEMENTS // (i * n)))
    out = qu.new_empty(b, h, i, d)
    for row in range(b):
        for h0 in range(0, h, heads):
            h1 = min(h0 + heads, h)
            probs = _xl_probs(qu[row, h0:h1], qv[row, h0:h1], k[row, h0:h1], r[h0:h1], mask, scale)
            torch.bmm(probs, v[row, h0:h1], out=out[row, h0:h1])
    return out


# Training splits the queries into this many blocks when a block keeps at least TRAIN_MIN_BLOCK
# queries: a block attends to the keys up to its last query only, so part of the causally masked
# corner of the score matrix is never computed (with tgt_len = mem_len, 2 blocks skip 12.5% of the
# score work). Measured side by side (1 thread, base shape): 2 blocks 10% faster per fp32 training
# step than 1 and 3% in bf16; 4 and 8 blocks were slower than 2 (smaller products, more calls).
TRAIN_QUERY_BLOCKS = 2
TRAIN_MIN_BLOCK = 64


def _block_edges(q_len: int, window: int | None) -> list[int]:
    blocks = max(1, min(TRAIN_QUERY_BLOCKS, q_len // TRAIN_MIN_BLOCK))
    if window is not None:  # same_length masks the left instead: nothing to skip cheaply
        blocks = 1
    return [round(c * q_len / blocks) for c in range(blocks + 1)]


class _XLAttention(torch.autograd.Function):
    """softmax(((q+u)·k + shift((q+v)·r)) * scale, masked) · v with the backward written out, for
    training: over causal query blocks, reading keys and values from the projection's own
    (b, n, 2·h·d) output and returning its gradient in that layout. Inputs qu, qv (b, h, i, d),
    kv (b, n, 2·h·d), r (h, n, d), all of one dtype.

    Block [a, e) of the i queries sees keys [0, n - i + e) and distances 0 … n - i + e - 1 (the last
    n - i + e rows of r): the same problem on a smaller key range, since the rel-shift and the causal
    mask depend only on each query's distance to its keys. Doing the blocks inside one function (key,
    value and position gradients accumulated in place) and taking `kv` whole avoids the slices,
    zero-filled partial gradients, concatenations and the gather of the key and value gradients back
    into the projection's layout that autograd would add.

    The position term runs head-major: (q+v)·r for all batch rows of a head is one product against
    that head's r, so r is never broadcast (copied) over the batch, and in the backward the position
    table's gradient sums over the batch inside the product instead of in a (b·h, d, n) accumulator.

    Backward: dS = P * (dP - rowsum(dO * O)) (Dao et al. 2022, §3.1), which needs no mask pass (P is
    0 where masked). dS is written below one zero row per (batch, head) matrix (`_unshift_grad`): that
    keeps every product operand in the plain layout oneDNN takes without copying (bf16), and lets the
    inverse rel-shift read the zeros it needs for the gradient of the un-shifted BD block, which is
    copied once, head-major, and read by both of its products.
    """

    @staticmethod
    def forward(ctx, qu, qv, kv, r, scale, edges, window):
        b, h, i, d = qu.shape
        n = kv.shape[1]
        halves = kv.view(b, n, 2, h, d)
        k3 = halves[:, :, 0].transpose(1, 2).reshape(b * h, n, d)  # one copy each, then views per block
        v3 = halves[:, :, 1].transpose(1, 2).reshape(b * h, n, d)
        qu3 = qu.reshape(b * h, i, d)
        out = qu3.new_empty(b * h, i, d)
        probs = []
        for a, e in zip(edges[:-1], edges[1:]):
            q, keys = e - a, n - i + e
            raw = torch.bmm(_head_major(qv[:, :, a:e]), r[:, n - keys :].transpose(1, 2),
                            out=_workspace("raw", (h, b * q, keys), qu))  # against distances
            scores = qu3.new_empty(b, h, q, keys)
            scores.copy_(rel_shift_strided(raw.view(h, b, q, keys)).transpose(0, 1))
            p = scores.view(b * h, q, keys)
            p.baddbmm_(qu3[:, a:e], k3[:, :keys].transpose(1, 2), beta=scale, alpha=scale)
            p.add_(_mask_bias(q, keys, window, qu.device, qu.dtype))
            torch.softmax(p, dim=-1, out=p)  # in place; bf16 accumulates in fp32 (see `_xl_probs`)
            _product_into(out[:, a:e], p, v3[:, :keys])
            probs.append(p)
        ctx.save_for_backward(qu3, qv, k3, v3, r, out, *probs)
        ctx.scale, ctx.edges = scale, edges
        return out.view(b, h, i, d)

    @staticmethod
    def backward(ctx, grad_out):
        qu3, qv, k3, v3, r, out, *probs = ctx.saved_tensors
        scale, edges = ctx.scale, ctx.edges
        b, h, i, d = qv.shape
        n = k3.shape[1]
        grad_out = grad_out.to(out.dtype).reshape(b * h, i, d)
        delta = (grad_out.float() * out.float()).sum(-1, keepdim=True).to(out.dtype)  # rowsum(dO * O)
        grad_qu = torch.empty_like(qu3)
        grad_qv = torch.empty_like(qv)
        # Key/value gradients accumulate in fp32 as (B, n, d), whose copy into the projection's layout
        # moves rows of d; in bf16/fp16 as (B, d, n), since there oneDNN first copies a transposed big
        # operand (the (keys, queries) view of P or dS), which costs more than the element-wise gather
        # of the final transposed copy (measured on the tiny and base shapes, 1 thread).
        low = out.dtype != torch.float32
        grad_k = k3.new_zeros(b * h, d, n) if low else torch.zeros_like(k3)
        grad_v = k3.new_zeros(b * h, d, n) if low else torch.zeros_like(v3)
        grad_rt = r.new_zeros(h, d, n) if ctx.needs_input_grad[3] else None
        for (a, e), p in zip(zip(edges[:-1], edges[1:]), probs):
            q, keys, g = e - a, n - i + e, grad_out[:, a:e]
            if low:
                _accumulate(grad_v[:, :, :keys], g.transpose(1, 2), p)
            else:
                _accumulate(grad_v[:, :keys], p.transpose(1, 2), g)
            padded = _workspace("grad_scores", (b * h, q + 1, keys), p)
            if low:
                padded[:, 0].zero_()
                torch.bmm(g, v3[:, :keys].transpose(1, 2), out=padded[:, 1:])  # dP
            else:  # the zero row from a zero row of dO: the product's output is then all of `padded`
                torch.bmm(_below_zero_row(g), v3[:, :keys].transpose(1, 2), out=padded)  # (see `_product_into`)
            grad_scores = padded[:, 1:]
            grad_scores.sub_(delta[:, a:e]).mul_(p)  # dS; masked entries have p = 0
            # The products read dS with its zero row (one extra output row, dropped), so that every
            # operand stays plain; the zero row meets a zero row of queries (finite, so 0 * it = 0).
            qu_padded = _below_zero_row(qu3[:, a:e])
            grad_qu[:, a:e] = torch.bmm(padded, k3[:, :keys])[:, 1:]
            if low:
                _accumulate(grad_k[:, :, :keys], qu_padded.transpose(1, 2), padded)
            else:
                _accumulate(grad_k[:, :keys], padded.transpose(1, 2), qu_padded)
            grad_raw = _workspace("grad_raw", (h, b, q, keys), p)
            grad_raw.copy_(_unshift_grad(padded, b, h).transpose(0, 1))  # (h, b, q, keys), plain
            grad_raw = grad_raw.view(h, b * q, keys)
            grad_qv[:, :, a:e] = torch.bmm(grad_raw, r[:, n - keys :]).view(h, b, q, d).transpose(0, 1)
            if grad_rt is not None:
                _accumulate(grad_rt[:, :, n - keys :], _head_major(qv[:, :, a:e]).transpose(1, 2), grad_raw)
        grad_kv = k3.new_empty(b, n, 2, h, d)
        for half, grad in enumerate((grad_k.mul_(scale), grad_v)):
            grad_kv[:, :, half] = grad.view(b, h, d, n).permute(0, 3, 1, 2) if low else grad.view(b, h, n, d).transpose(1, 2)
        grad_r = grad_rt.transpose(1, 2).mul(scale) if grad_rt is not None else None  # (h, n, d)
        return (grad_qu.mul_(scale).view(b, h, i, d), grad_qv.mul_(scale), grad_kv.view(b, n, 2 * h * d), grad_r,
                None, None, None)


def _head_major(x: Tensor) -> Tensor:
    """(b, h, q, d) -> (h, b·q, d), contiguous: the rows of one head across the batch."""
    b, h, q, d = x.shape
    return x.transpose(0, 1).reshape(h, b * q, d)


def _unshift_grad(padded: Tensor, b: int, h: int) -> Tensor:
    """The gradient of the un-shifted BD block, (b, h, q, keys), as a view of `padded`: (b·h, q+1, keys)
    holding dS of the shifted scores below a zero row.

    The forward read shifted[i, j] = raw[i, j - i + q - 1] (`rel_shift_strided`), so the gradient of
    raw[i, c] is dS[i, c + i - (q - 1)], read with row stride keys + 1 from q - 1 entries before dS's
    row i. Entries no valid score came from land on zeros: for row 0, the tail of the zero row above;
    for row i > 0, row i - 1's causally masked tail, where dS = 0 because P = 0 there.
    """
    _, rows, keys = padded.shape
    q = rows - 1
    size, (matrix, row, _) = (b, h, q, keys), padded.stride()
    return padded.as_strided(size, (h * matrix, matrix, row + 1, 1), padded.storage_offset() + row - (q - 1))


def _below_zero_row(x: Tensor) -> Tensor:
    """(B, q, d) -> a fresh (B, q+1, d): a zero row, then x."""
    padded = x.new_empty(x.shape[0], x.shape[1] + 1, x.shape[2])
    padded[:, 0].zero_()
    padded[:, 1:] = x
    return padded


def _product_into(out: Tensor, x: Tensor, y: Tensor) -> None:
    """out = x @ y (batched) for a slice `out`. Into a slice whose matrices are not evenly spaced, the CPU
    fp32 `bmm` runs one gemm per matrix: a product into a fresh tensor and a copy was 1.3-2x faster on
    the tiny shape's blocks (slower in bf16, where oneDNN takes the slice as it is). Measured, 2 threads."""
    if out.dtype == torch.float32 and out.device.type == "cpu" and not out.is_contiguous():
        out.copy_(torch.bmm(x, y))
    else:
        torch.bmm(x, y, out=out)


def _accumulate(acc: Tensor, x: Tensor, y: Tensor) -> None:
    """acc += x @ y (batched). Into a slice whose matrices are not evenly spaced, the CPU fp32 `baddbmm_`
    falls back to one `addmm_` per batch entry; a product into a fresh tensor and an add is faster."""
    if acc.dtype == torch.float32 and acc.device.type == "cpu" and not acc.is_contiguous():
        acc.add_(torch.bmm(x, y))
    else:
        acc.baddbmm_(x, y)


def fast_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    positions: LayerPositions,
    window: int | None,
    dropatt: float,
    training: bool,
    kv: Tensor | None = None,
) -> Tensor:
    """Drop-in replacement for `eager_attention` (same arguments, same result to float rounding).
    `kv`: the (b, n, 2·h·d) projection k and v are the halves of (`Attention` passes it); training
    reads it directly (`_XLAttention`)."""
    q_len, k_len, d_head = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = d_head**-0.5
    encoding = positions.encoding
    use_dropatt = training and dropatt > 0
    if isinstance(encoding, XLRelative) and not use_dropatt:
        # One compute dtype for every input (autocast's, if on), and autocast off inside: the backward
        # runs outside autocast, so both passes must agree on dtypes by construction.
        device = q.device.type
        autocast_on = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast_on else q.dtype
        qu = encoding.content(positions.layer, positions.state, q, k)[0].to(dtype)
        qv = (q + encoding._bias(encoding.v, positions.layer)).to(dtype)
        r = encoding.inference_table(positions.layer, positions.state, k_len).to(dtype)  # (h, n, d)
        k, v = k.to(dtype), v.to(dtype)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (qu, qv, k, v, r))
        # (entering a disabled autocast costs a generated token 3% of its time: only when it is on)
        with torch.autocast(device, enabled=False) if autocast_on else contextlib.nullcontext():
            if not grad:  # one query without a window (a generated token) sees every key: no mask
                mask = None if q_len == 1 and window is None else _mask_bias(q_len, k_len, window, q.device, dtype)
                return _xl_forward_chunked(qu, qv, k, v, r, mask, scale)
            if kv is None:  # a direct call with k and v apart: the projection's layout, built once
                kv = torch.stack([k.transpose(1, 2), v.transpose(1, 2)], dim=2).flatten(2)
            return _XLAttention.apply(qu, qv, kv.to(dtype), r, scale, _block_edges(q_len, window), window)
    mask = _mask_bias(q_len, k_len, window, q.device, q.dtype)
    return _composed_attention(q, k, v, positions=positions, mask=mask, scale=scale,
                               dropatt=dropatt, training=training)


def _composed_attention(q, k, v, *, positions, mask, scale, dropatt, training) -> Tensor:
    """Every other encoding (and xl with attention dropout): autograd through fused building blocks."""
    b, h, i, d = q.shape
    n = k.shape[-2]
    q_content, k_content = positions.content(q, k)
    bias = positions.score_bias(q, k_len=n, rel_shift=rel_shift_fast)
    if bias is None:
        scores = torch.bmm(q_content.reshape(b * h, i, d), k_content.reshape(b * h, n, d).transpose(1, 2))
        scores = scores.mul_(scale) if not scores.requires_grad else scores * scale
    else:
        bias = bias.to(q_content.dtype).expand(b, h, i, n).reshape(b * h, i, n)
        scores = torch.baddbmm(
            bias, q_content.reshape(b * h, i, d), k_content.reshape(b * h, n, d).transpose(1, 2),
            beta=scale, alpha=scale,
        )
    scores = scores.float() + mask.float()
    probs = scores.softmax(dim=-1).to(v.dtype)
    probs = F.dropout(probs, p=dropatt, training=training)
    out = torch.bmm(probs, v.reshape(b * h, n, d)).view(b, h, i, d)
    value_term = positions.value_term(probs.view(b, h, i, n))
    return out if value_term is None else out + value_term


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
        return linear(context, weight_c)

    @staticmethod
    def backward(ctx, grad):
        context, weight = ctx.saved_tensors
        grad = grad.to(context.dtype)
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
        return _ContextProjection.apply(context.detach(), fresh, weight, dtype)


# ---------------------------------------------------------------------------------------------
# Dropout with a cheaper random source. On CPU, `torch.bernoulli_` (what F.dropout uses) draws one
# Mersenne-Twister number per element; here one 64-bit draw feeds four elements as 16-bit uniforms,
# 7x faster measured on this repository's benchmark machine (docs/benchmarks.md). The keep
# probability is 1 - round(p * 2^16) / 2^16 (within 2^-17 of 1 - p) and survivors are scaled by its
# exact inverse, so the output is unbiased. Same generator (`torch.manual_seed`, checkpointed RNG
# state), different stream than `nn.Dropout`: the eager path keeps `nn.Dropout`.


def _dropout_scale(x: Tensor, p: float) -> Tensor:
    """x's dropout multiplier: 0 with probability round(p * 2^16) / 2^16, else 1 / keep-probability."""
    cut = round(p * 65536)
    words = (x.numel() + 3) // 4
    bits = torch.empty(words, dtype=torch.int64, device=x.device).random_(-(2**63), None)
    uniform = bits.view(torch.int16)[: x.numel()].view(x.shape)  # integers uniform on [-2^15, 2^15)
    # Keep where uniform >= threshold, as a multiplier (0 or 1/keep-probability) built without bool
    # tensors: clamping the integers to [threshold-1, threshold] in place leaves exactly two values,
    # 0 and 1 after the subtraction, then one cast to x's dtype. Bool tensors were the slow part here:
    # `>=` plus a bool->float cast took 4x longer, and torch.where / x * bool 10-50x longer than a
    # float product (this CPU, torch 2.13); the integer steps before the cast save an fp32 round trip
    # in bf16 (measured 7% on a (2, 512, 2048) multiplier, bit-equal results).
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
    tensors instead of three and one saved instead of three (measured: 1 ms less per call on the tiny
    benchmark's (8, 128, 512) hidden layer, this CPU). x itself is left alone: it is a view of the
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


def use_cheap_dropout(module: torch.nn.Module) -> None:
    """Swap every plain `nn.Dropout` inside `module` for `CheapDropout` (the fast path's dropout)."""
    for child in module.modules():
        for name, sub in child.named_children():
            if type(sub) is torch.nn.Dropout:
                setattr(child, name, CheapDropout(sub.p, sub.inplace))
