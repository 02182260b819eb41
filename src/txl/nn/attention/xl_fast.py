"""The fast `("full", "fast")` attention kernel: same signature and results as `eager_attention`.

What makes it faster than the eager reference (each kept because it measured faster side by side on
a 2-core AVX-512 CPU; `txl bench kernel` and docs/results/benchmarks.md have the numbers):

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
- The largest intermediates (BD before the shift, dS, the un-shifted gradient of BD) live in
  per-thread scratch buffers (`_workspace`), reused from call to call instead of freshly mapped.
- Other encodings take a composed autograd path: positional bias (Shaw, ALiBi) through the strided
  rel-shift (`rel_shift_fast`), scores by one `baddbmm`, an additive mask.
- Without gradients (evaluation, generation) one batch row (and a group of heads, for very long
  memories) is processed at a time, so the score block stays under `EVAL_CHUNK_ELEMENTS` elements.
- Attention dropout (training with `dropatt > 0`, composed path) draws its mask from the fast
  backend's cheaper CPU random source (`txl.nn.dropout.cheap_dropout`: one 64-bit draw per four
  elements instead of `bernoulli_`'s one per element; unbiased, same generator and seed). It was a measurable
  part of a bf16 training step at ptb-word-hour's shape (docs/results/cpu_hour.md). The eager reference keeps
  `F.dropout`; off the CPU both are `F.dropout`.
- Padding masks, non-causal masks (bidirectional encoder, cross-attention), memory tokens
  (`config.memory_tokens`: their content-only columns are joined to the scores) and requests for the
  probabilities take the composed path too, with the mask as an additive tensor.

Tried and dropped (slower here): SDPA with the position term as a float bias (the CPU flash kernel
refuses a bias that needs a gradient in torch 2.13, and the math fallback is slower than the batched
matmuls below), autograd through `as_strided` (its backward falls back to a slow overlapping-geometry
path), a gather-based rel-shift.

Dimension names: b batch, h heads, i queries, n keys (memory + segment), d head dim.
"""

from __future__ import annotations

import contextlib
import math
import threading

import torch
import torch.nn.functional as F
from torch import Tensor

from txl.nn.attention.masks import NEG, AttentionMask, causal_bias
from txl.nn.attention.registry import register
from txl.nn.dropout import cheap_dropout
from txl.nn.positional import LayerPositions, rel_shift_pad, rel_shift_strided

# Without gradients, one batch row at a time with as many heads as keep the (heads, i, n) score block
# under this many elements (32 Mi = 128 MiB in fp32); at least one head.
EVAL_CHUNK_ELEMENTS = 1 << 25

_workspaces = threading.local()


def _workspace(name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
    """A scratch tensor reused across calls (per thread, per name) for intermediates that never leave
    the function that asked for it. Fresh large CPU tensors are costly here: the allocator maps new
    pages for every block above its mmap threshold and each page faults on first touch (the
    measurement is in docs/results/benchmarks.md, "Measurements behind the code")."""
    numel = math.prod(shape)
    if torch.compiler.is_compiling():  # a traced graph (torch.compile, torch.export) allocates its own
        return like.new_empty(shape)
    cache = _workspaces.__dict__
    buffer = cache.get(name)
    if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype or buffer.device != like.device:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
            buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
        cache[name] = buffer
    return buffer[:numel].view(shape)


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
    path for overlapping views, slower than the reference pad-and-copy; docs/results/benchmarks.md)."""

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
    # `.float().softmax().to(bf16)` and much faster than that round trip (docs/results/benchmarks.md).
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
# score work). 2 blocks measured faster than 1, 4 and 8 (docs/results/benchmarks.md, "What the fast path does").
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
            p.add_(causal_bias(q, keys, window, qu.device, qu.dtype))
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
        # of the final transposed copy (docs/results/benchmarks.md).
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
    fp32 `bmm` runs one gemm per matrix: a product into a fresh tensor and a copy is faster on
    small blocks (slower in bf16, where oneDNN takes the slice as it is; docs/results/benchmarks.md)."""
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


@register("full", "fast", bidirectional=True, global_mask=True, memory_tokens=True)
def fast_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    positions: LayerPositions,
    mask: AttentionMask,
    dropatt: float,
    training: bool,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Drop-in replacement for `eager_attention` (same arguments, same result to float rounding)."""
    q_len, k_len, d_head = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = d_head**-0.5
    if torch.compiler.is_compiling():  # a traced graph: the composed path (see `_composed_attention`)
        return _composed_attention(q, k, v, positions=positions, mask=mask, scale=scale, dropatt=dropatt,
                                   training=training, need_weights=need_weights, rel_shift=rel_shift_pad)
    plain = mask.causal and mask.key_padding is None and not need_weights and not mask.memory_tokens
    terms = positions.xl_terms(q, k_len=k_len) if plain and not (training and dropatt > 0) else None
    if terms is not None:
        # One compute dtype for every input (autocast's, if on), and autocast off inside: the backward
        # runs outside autocast, so both passes must agree on dtypes by construction.
        device = q.device.type
        autocast_on = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast_on else q.dtype
        qu, qv, r = (t.to(dtype) for t in terms)  # (b, h, i, d), (b, h, i, d), (h, n, d)
        window = mask.window
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (qu, qv, k, v, r))
        # (entering a disabled autocast costs a generated token 3% of its time: only when it is on)
        with torch.autocast(device, enabled=False) if autocast_on else contextlib.nullcontext():
            if not grad:  # one query without a window (a generated token) sees every key: no mask
                bias = None if q_len == 1 and window is None else causal_bias(q_len, k_len, window, q.device, dtype)
                return _xl_forward_chunked(qu, qv, k.to(dtype), v.to(dtype), r, bias, scale), None
            kv = packed_kv(k, v).to(dtype)
            return _XLAttention.apply(qu, qv, kv, r, scale, _block_edges(q_len, window), window), None
    return _composed_attention(q, k, v, positions=positions, mask=mask, scale=scale, dropatt=dropatt,
                               training=training, need_weights=need_weights)


def packed_kv(k: Tensor, v: Tensor) -> Tensor:
    """The (b, n, 2·h·d) key/value projection that k and v (b, h, n, d) are the two halves of, when
    they are views of one such tensor (what `Attention` passes), else built once. The training kernel
    reads keys and values from, and writes their gradient to, this layout. (The tensor itself, not an
    `as_strided` view of k: autograd would then give v's half of the gradient to nobody.)"""
    b, h, n, d = k.shape
    if torch.compiler.is_compiling():  # storage offsets are not traced: a graph rebuilds the layout (one copy)
        return torch.stack([k.transpose(1, 2), v.transpose(1, 2)], dim=2).flatten(2)
    base = k._base
    # A view's `_base` is the tensor autograd tracks only if it requires grad whenever the views do: a
    # view returned by an autograd.Function has a gradient-less buffer as its `_base`, and reading
    # that would cut the projection out of the graph (the weight then gets no gradient at all).
    if (base is not None and v._base is base and (base.requires_grad or not (k.requires_grad or v.requires_grad))
            and base.is_contiguous() and base.numel() == b * n * 2 * h * d
            and k.stride() == (n * 2 * h * d, d, 2 * h * d, 1) and v.stride() == k.stride()
            and k.storage_offset() == base.storage_offset() and v.storage_offset() == base.storage_offset() + h * d):
        return base.view(b, n, 2 * h * d)
    return torch.stack([k.transpose(1, 2), v.transpose(1, 2)], dim=2).flatten(2)


attention_dropout = cheap_dropout  # (probs, p, training) -> probs; tests swap in F.dropout for parity


def _composed_attention(q, k, v, *, positions, mask, scale, dropatt, training, need_weights, rel_shift=rel_shift_fast):
    """Every other encoding (and xl with attention dropout, a padding or non-causal mask, or asked for
    the probabilities): autograd through fused building blocks.

    A graph being traced (`torch.compile`, `torch.export`) takes this path for every encoding, with
    the reference rel-shift (`rel_shift_pad`): the hand-written kernel's strided views are built from
    storage offsets, which a graph does not trace, and its scratch buffers and written-out backward
    are what a compiler generates for itself. Same results (the parity tests)."""
    b, h, i, d = q.shape
    tokens = mask.memory_tokens  # learned keys before [memory ; segment], content score only
    n = k.shape[-2] - tokens
    q_content, k_content = positions.content(q, k[:, :, tokens:] if tokens else k)
    bias = positions.score_bias(q, k_len=n, rel_shift=rel_shift)
    if bias is None:
        scores = torch.bmm(q_content.reshape(b * h, i, d), k_content.reshape(b * h, n, d).transpose(1, 2))
        scores = scores.mul_(scale) if not scores.requires_grad else scores * scale
    else:
        bias = bias.to(q_content.dtype).expand(b, h, i, n).reshape(b * h, i, n)
        scores = torch.baddbmm(
            bias, q_content.reshape(b * h, i, d), k_content.reshape(b * h, n, d).transpose(1, 2),
            beta=scale, alpha=scale,
        )
    if tokens:
        token_scores = torch.bmm(q.reshape(b * h, i, d), k[:, :, :tokens].reshape(b * h, tokens, d).transpose(1, 2))
        scores = torch.cat([token_scores * scale, scores], dim=-1)
    scores = scores.float()
    if mask.causal and mask.key_padding is None:
        causal = causal_bias(i, n, mask.window, q.device, torch.float32)
        probs = (scores + (F.pad(causal, (tokens, 0)) if tokens else causal)).softmax(dim=-1)
    else:  # a padded query may see no key at all: a finite fill, and its row set to 0
        visible = mask.visible(i, tokens + n, q.device)  # (b or 1, 1, i, m + n)
        fill = torch.zeros(visible.shape, device=q.device).masked_fill_(~visible, NEG)
        probs = (scores.view(b, h, i, tokens + n) + fill).softmax(dim=-1)
        if mask.key_padding is not None:
            probs = probs * visible.any(-1, keepdim=True)
        probs = probs.view(b * h, i, tokens + n)
    probs = probs.to(v.dtype)
    weights = probs.view(b, h, i, tokens + n) if need_weights else None
    probs = attention_dropout(probs, dropatt, training)
    out = torch.bmm(probs, v.reshape(b * h, tokens + n, d)).view(b, h, i, d)
    probs = probs.view(b, h, i, tokens + n)
    value_term = positions.value_term(probs[..., tokens:] if tokens else probs)
    return (out if value_term is None else out + value_term), weights
