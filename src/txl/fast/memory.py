"""The fast backend's memory kinds (`txl.nn.memory.MemoryUpdate` subclasses, over the same
`txl.nn.memory.MemoryState` interface), chosen per forward pass by `open_memory`:

- training and any segment with autograd: post-LN blocks project [constant memory ; segment] without
  the memory rows' input gradient (`txl.fast.projection.project_context`);
- token-by-token inference (generation): a projection cache. The memory keeps the key/value
  projections of its states (`ProjectionCache`), so a generated token costs O(mem_len) attention
  instead of re-projecting mem_len states in every layer, and new rows are appended into spare rows
  after the memory (`append_rows`) instead of copying mem_len rows per layer per token;
- evaluation with a donated, full memory (`Memory.donate`): the next memory is written into the old
  one's buffers, so evaluation at long memory holds one memory, not two.

Every kind returns what the reference `MemoryUpdate` returns, to float rounding (tests/test_fast_attention.py).
A graph being traced (`torch.compile`, `torch.export`) takes the first kind only: the projection
cache and the in-place memory live on Python state (buffer identities, versions, spare rows) that a
graph cannot hold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from txl.fast.projection import project_context
from txl.nn.memory import CompressiveUpdate, Memory, MemoryState, MemoryUpdate, register_pytree, update_memory

# Inference with at most this many new tokens per call (generation) caches the memory's key/value
# projections; longer segments (evaluation) re-project, so memory stays at the hidden states' size
# and results stay bit-identical to a plain forward.
PROJECTION_CACHE_MAX_QUERIES = 1


def open_memory(model: nn.Module, memory: MemoryState | None, *, mem_len: int, q_len: int) -> MemoryUpdate:
    """The memory kind of one forward pass of `model` under the fast backend."""
    if model.compressor is not None:
        learn = model.training and torch.is_grad_enabled()  # the reconstruction loss trains f_c
        return _CompressiveUpdate(memory, mem_len=mem_len, compressor=model.compressor, q_len=q_len,
                                  blocks=model.blocks if learn else None)
    if not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        if not model.training and q_len <= PROJECTION_CACHE_MAX_QUERIES:
            return ProjectionCacheUpdate(memory, mem_len=mem_len, model=model)
        if memory is not None and memory.donated and memory.length == mem_len > 0:
            return InPlaceUpdate(memory, mem_len=mem_len)
    return ContextProjectionUpdate(memory, mem_len=mem_len)


class _SkipMemoryRowGradient:
    """Mixin: with autograd, a bias-free linear projection of [constant memory ; fresh] computes the
    input gradient of the fresh rows only (post-LN blocks; pre-LN ones normalise the memory rows,
    whose gradient then reaches the norm's weights)."""

    def keys_values(self, layer: int, fresh: Tensor, project: Callable[[Tensor], Tensor]) -> Tensor:
        context = self.context(layer, fresh)
        self.contexts.append(context)
        if (context is not fresh and isinstance(project, nn.Linear) and project.bias is None
                and torch.is_grad_enabled() and not any(m.requires_grad for m in self.memory.layer(layer))):
            return project_context(context, fresh, project.weight)
        return project(context)


class ContextProjectionUpdate(_SkipMemoryRowGradient, MemoryUpdate):
    """Plain memory, projected with the memory-row gradient skip."""


class _CompressiveUpdate(_SkipMemoryRowGradient, CompressiveUpdate):
    """Compressive memory, projected with the memory-row gradient skip."""


class InPlaceUpdate(MemoryUpdate):
    """No autograd, a donated memory of exactly mem_len states: each layer's next memory is written
    into the old memory's buffer as soon as its context (which holds its own copy) is built."""

    def keys_values(self, layer: int, fresh: Tensor, project: Callable[[Tensor], Tensor]) -> Tensor:
        context = self.context(layer, fresh)
        self.memory.hidden[layer].copy_(context[:, -self.mem_len :])
        return project(context)

    def finish(self) -> tuple[Memory | None, Tensor | None]:
        return self.memory, None


@dataclass(frozen=True)
class ProjectionCache(Memory):
    """A memory that also holds, per layer, the key/value projections of `hidden` (b, length,
    2·n_head·d_head) and the key of the weights and dtype they were made with (`projection_key`).
    Derived data: never saved, and every `Memory` method that builds a new memory drops it."""

    projected: tuple[Tensor, ...] = ()
    key: tuple = ()


register_pytree(ProjectionCache, ("hidden", "compressed", "key_padding", "projected"), ("donated", "key"))


class ProjectionCacheUpdate(MemoryUpdate):
    """Token-level inference: reuse the memory's projections when their key still matches, append the
    new rows' states and projections into spare rows, keep the projections in the next memory."""

    def __init__(self, memory: Memory | None, *, mem_len: int, model: nn.Module):
        super().__init__(memory, mem_len=mem_len)
        self.model = model
        self.key: tuple | None = None
        self.projected: list[Tensor] = []

    def keys_values(self, layer: int, fresh: Tensor, project: Callable[[Tensor], Tensor]) -> Tensor:
        if self.key is None:
            self.key = projection_key(self.model, fresh.dtype)
        if self.memory is None:
            context = fresh
            kv = project(fresh)
        else:  # append, do not copy the memory
            context = append_rows(self.memory.hidden[layer].to(fresh.dtype), fresh)
            cache = self.memory
            if isinstance(cache, ProjectionCache) and cache.key == self.key:
                fresh_kv = project(fresh)
                kv = append_rows(cache.projected[layer].to(fresh_kv.dtype), fresh_kv)  # O(new rows)
            else:
                kv = project(context)
        self.contexts.append(context)
        self.projected.append(kv)
        return kv

    def finish(self) -> tuple[Memory | None, Tensor | None]:
        # no autograd to cut: keep views, so the next append stays cheap
        memory = update_memory(self.contexts, self.mem_len, detach=False)
        if memory is None:
            return None, None
        tails = tuple(kv[:, -memory.length :] for kv in self.projected)
        return ProjectionCache(memory.hidden, projected=tails, key=self.key), None


def projection_key(model: nn.Module, dtype: torch.dtype) -> tuple:
    """Everything the cached projections depend on: dtype, autocast, and the identity and version of
    the weights (an optimizer step or load_state_dict bumps the version), so stale projections are
    never used."""
    device = model.head.bias.device.type
    autocast = torch.is_autocast_enabled(device)
    params = [block.attn.kv_proj.weight for block in model.blocks]  # bias-free; read per call, never cached
    params += [block.attn.global_kv_proj.weight for block in model.blocks  # Longformer's K_g, V_g (sliding)
               if getattr(block.attn, "global_kv_proj", None) is not None]
    if model.config.pre_lnorm:
        params += [p for block in model.blocks for p in block.attn_norm.parameters()]  # LayerNorm or RMSNorm
    return (dtype, autocast, torch.get_autocast_dtype(device) if autocast else None,
            *((p.data_ptr(), p._version) for p in params))


def append_rows(past: Tensor, new: Tensor) -> Tensor:
    """`torch.cat([past, new], dim=1)` for (b, n, d) tensors without gradients, in amortised
    O(len(new)) instead of O(n): token-by-token generation appends one row per layer per token to a
    memory of mem_len rows, and copying the whole memory every time was a third of a token's time
    (docs/results/benchmarks.md).

    The result is a view of a buffer with spare rows after it. When `past` is such a view ending
    exactly where its buffer was last filled, `new` is written into the spare rows and a longer view is
    returned; otherwise (a plain tensor, a full buffer, or a second append from the same `past`, e.g.
    two continuations of one prompt) a new buffer is made. Rows a view already shows are never
    written again, so every earlier view keeps its values. How far a buffer is filled is kept on the
    buffer itself (`_txl_filled`)."""
    b, n, d = past.shape
    q = new.shape[1]
    base = past._base
    if (base is not None and not torch.is_grad_enabled() and base.dim() == 3 and base.is_contiguous()
            and base.shape[0] == b and base.shape[2] == d and past.stride() == base.stride()
            and new.dtype == past.dtype and new.device == past.device
            and (torch.is_inference_mode_enabled() or not base.is_inference())):  # inference tensors: no writes outside
        start = (past.storage_offset() - base.storage_offset()) // d
        end = start + n
        if getattr(base, "_txl_filled", None) == end and end + q <= base.shape[1]:
            base[:, end : end + q].copy_(new)
            base._txl_filled = end + q
            return base[:, start : end + q]
    if (torch.is_grad_enabled() and (past.requires_grad or new.requires_grad)) or new.dtype != past.dtype:
        return torch.cat([past, new], dim=1)  # autograd or type promotion: what cat does
    buffer = past.new_empty(b, 2 * (n + q) + 16, d)  # as many spare rows as the rows it holds
    buffer[:, :n].copy_(past)
    buffer[:, n : n + q].copy_(new)
    buffer._txl_filled = n + q
    return buffer[:, : n + q]

