"""Segment-level recurrence state (Dai et al. 2019, §3.2): one declared interface, its kinds, and the
forward pass that reads and writes it.

Memory is explicit: a model takes a memory (or None) and returns the next one; nothing is hidden
inside a module. In the spirit of Hugging Face's cache layers (`Cache` / `DynamicLayer`), every
memory implements one interface, `MemoryState`, whatever it holds:

    length, batch_size        positions each attention layer attends to before the segment; rows
    context(layer, fresh)     what layer `layer` attends to: [memory ; fresh]
    update(contexts, mem_len) the next memory from each layer's [memory ; segment]: the latest
                              mem_len states, detached (the stop-gradient SG(·) of the paper)
    detach, select, cat, to, truncate, donate
    reset(rows)               the same memory with chosen rows emptied (a row's document or session ended)
    state_dict, from_state_dict   flat name -> tensor export and restore (safetensors)

The kinds: `Memory` (below: the plain Transformer-XL memory, and compressive memory's older states
in `compressed`, Rae et al. 2020, txl/models/transformer_xl/compressive.py), `RecurrentMemory` (LSTM
and SHA-RNN, txl/models/rnn/model.py), the fast backend's `ProjectionCache` (txl/fast/memory.py), and
the encoder–decoder's `DecoderCache` (txl/models/seq2seq/model.py). Each is a pytree (`torch.export`
takes and returns them as they are; `register_pytree`).

A forward pass reads and writes a memory through a `MemoryPass` (as Hugging Face's
`Cache.update(k, v, layer_idx)`): each attention layer asks it for the keys and values of
[memory ; segment] (`keys_values`) and never learns which kind it runs on. `MemoryUpdate` is the
reference pass over a `MemoryState`; compressive memory's pass (`CompressiveUpdate`) compresses what
leaves the window, and the fast backend's passes (txl/fast/memory.py) reuse projections or buffers.
A model's memory kind (`reference_memory` here, `txl.fast.memory.open_memory`) picks the pass.
"""

from __future__ import annotations

import copy
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree


class MemoryState(ABC):
    """What a model carries from one segment to the next (batch-first tensors)."""

    @property
    @abstractmethod
    def length(self) -> int:
        """Positions each attention layer attends to before the segment (0: none)."""

    @property
    @abstractmethod
    def batch_size(self) -> int: ...

    @abstractmethod
    def context(self, layer: int, fresh: Tensor) -> Tensor:
        """[memory ; fresh] for `layer`, in fresh's dtype: the states that layer attends to."""

    @abstractmethod
    def update(self, contexts: Sequence[Tensor], *, mem_len: int, detach: bool = True) -> MemoryState | None:
        """The next memory: each layer's latest mem_len states of `contexts[i]` ([memory ; segment]),
        detached (`detach=False`, for callers without autograd, keeps views). None at mem_len 0."""

    @abstractmethod
    def detach(self) -> MemoryState: ...

    @abstractmethod
    def select(self, index: Tensor | slice | int) -> MemoryState:
        """Rows of the batch (keep some streams, reorder beams)."""

    @classmethod
    @abstractmethod
    def cat(cls, parts: Sequence[MemoryState]) -> MemoryState:
        """The inverse of `select` over consecutive row groups: one memory with all their rows."""

    @abstractmethod
    def to(self, *args, **kwargs) -> MemoryState: ...

    @abstractmethod
    def truncate(self, mem_len: int) -> MemoryState | None:
        """Keep the latest mem_len positions (None at mem_len 0)."""

    @abstractmethod
    def state_dict(self, prefix: str = "memory") -> dict[str, Tensor]:
        """Flat name -> tensor mapping for safetensors (contiguous, detached copies)."""

    @classmethod
    @abstractmethod
    def from_state_dict(cls, tensors: dict[str, Tensor], prefix: str = "memory") -> MemoryState | None: ...

    def tensors(self) -> tuple[Tensor, ...]:
        """Every tensor this memory holds (e.g. to count its bytes)."""
        return tuple(self.state_dict().values())

    def donate(self) -> MemoryState:
        """This memory, handed over to the next forward pass, which may reuse its buffers. Kinds that
        cannot return themselves."""
        return self

    def reset(self, rows: Tensor | Sequence[int] | int) -> MemoryState:
        """The same memory with `rows` emptied: those rows continue as a fresh sequence would start
        (issue 47: a finished document, session or episode swapped for a new one in a running batch).
        `rows`: a (batch,) bool mask, or row indices. Kinds that cannot say so refuse in one line."""
        from txl.errors import UsageError

        raise UsageError(f"{type(self).__name__} cannot reset rows; start a new memory (memory=None) instead")


def _layers(tensors: dict[str, Tensor], prefix: str) -> tuple[Tensor, ...]:
    """`{prefix}.0`, `{prefix}.1`, ... of a flat mapping, in layer order."""
    found = sorted((int(name[len(prefix) + 1 :]), t) for name, t in tensors.items()
                   if name.startswith(prefix + ".") and name[len(prefix) + 1 :].isdigit())
    return tuple(t for _, t in found)


@dataclass(frozen=True)
class Memory(MemoryState):
    """Per layer the *input* hidden states of that layer for the latest mem_len positions, each
    (batch, length, d_model), batch-first, detached. It starts empty (Hugging Face starts with mem_len
    zero vectors, so its first segment attends to zeros).

    `key_padding` (batch, length) bool, True for a real position and False for padding (the
    `AttentionMask.key_padding` convention), or None when every position is real (the common case,
    which runs the padding-free code). It is set by a forward pass given an `attention_mask` and by
    `reset(rows)`; attention never sees a padded memory position (issue 47, docs/guide/data.md).

    `compressed` (compressive memory only, else empty) holds per layer the older, compressed states:
    attention runs over [compressed ; hidden ; segment].
    """

    hidden: tuple[Tensor, ...]
    compressed: tuple[Tensor, ...] = ()
    # True: the caller gives these buffers up; the next forward may write the next memory into them
    # (evaluation at long memory then holds one memory, not two). Never saved; every method below
    # that builds a new Memory drops it. See `donate`.
    donated: bool = False
    key_padding: Tensor | None = None

    @property
    def length(self) -> int:
        return self.hidden[0].shape[1] if self.hidden else 0

    @property
    def compressed_length(self) -> int:
        return self.compressed[0].shape[1] if self.compressed else 0

    @property
    def batch_size(self) -> int:
        return self.hidden[0].shape[0]

    def layer(self, i: int) -> list[Tensor]:
        """Layer i's cached states that are not empty, oldest first: [compressed ; hidden]."""
        parts = [self.compressed[i]] if self.compressed_length else []
        return parts + ([self.hidden[i]] if self.length else [])

    def context(self, layer: int, fresh: Tensor) -> Tensor:
        parts = self.layer(layer)
        if not parts:
            return fresh
        return torch.cat([*(m.to(fresh.dtype) for m in parts), fresh], dim=1)

    def update(self, contexts: Sequence[Tensor], *, mem_len: int, detach: bool = True) -> Memory | None:
        """Each layer's latest mem_len states (the compressed memory is not carried: compressive
        memory's pass, `CompressiveUpdate`, builds its own next memory). `contexts[i]` is layer i's
        key/value input, the concatenation it attended over, so the new memory is simply its tail.
        (The reference computes end = mlen + qlen - ext_len; with ext_len = 0, the only setting we
        support, that is the same tail.)"""
        return update_memory(contexts, mem_len, detach=detach)

    def donate(self) -> Memory:
        """This memory, handed over to the next forward pass, which may overwrite its buffers in place
        with the next memory and return it (the fast backend does when the memory is full and no
        gradient is recorded). Use it only for a memory you will not read again."""
        return dataclasses.replace(self, donated=True)

    def to(self, *args, **kwargs) -> Memory:
        hidden = tuple(h.to(*args, **kwargs) for h in self.hidden)
        padding = None if self.key_padding is None else self.key_padding.to(device=hidden[0].device)
        return Memory(hidden, tuple(c.to(*args, **kwargs) for c in self.compressed), key_padding=padding)

    def detach(self) -> Memory:
        return Memory(tuple(h.detach() for h in self.hidden), tuple(c.detach() for c in self.compressed),
                      key_padding=self.key_padding)

    def select(self, index: Tensor | slice | int) -> Memory:
        if isinstance(index, int):
            index = slice(index, index + 1)
        padding = None if self.key_padding is None else self.key_padding[index]
        return Memory(tuple(h[index] for h in self.hidden), tuple(c[index] for c in self.compressed),
                      key_padding=padding)

    @classmethod
    def cat(cls, parts: Sequence[Memory]) -> Memory:
        padding = None
        if any(p.key_padding is not None for p in parts):
            padding = torch.cat([p.real_positions() for p in parts])
        return cls(tuple(torch.cat(layer) for layer in zip(*(p.hidden for p in parts), strict=True)),
                   tuple(torch.cat(layer) for layer in zip(*(p.compressed for p in parts), strict=True)),
                   key_padding=padding)

    def truncate(self, mem_len: int) -> Memory | None:
        """Keep the latest mem_len states per layer (the compressed memory is kept as is)."""
        if mem_len <= 0:
            return None
        padding = None if self.key_padding is None else self.key_padding[:, -mem_len:]
        return Memory(tuple(h[:, -mem_len:] for h in self.hidden), self.compressed, key_padding=padding)

    def real_positions(self) -> Tensor:
        """(batch, length) bool, True for a real position: `key_padding`, or all True without one."""
        if self.key_padding is not None:
            return self.key_padding
        return torch.ones(self.batch_size, self.length, dtype=torch.bool, device=self.hidden[0].device)

    def with_padding(self, key_padding: Tensor | None) -> Memory:
        """This memory (its kind and buffers kept) with `key_padding` (batch, length) as its padding mask;
        an all-real mask is dropped (None), so a batch whose padding has left the memory runs the
        padding-free code again."""
        if key_padding is not None and bool(key_padding.all()):
            key_padding = None
        if key_padding is None and self.key_padding is None:
            return self
        return dataclasses.replace(self, key_padding=key_padding)

    def reset(self, rows: Tensor | Sequence[int] | int) -> Memory:
        """`rows` emptied: their states zeroed and marked padding, so the next segment of such a row
        sees no memory, as a fresh row (memory=None) would; the other rows are untouched. `rows`: a
        (batch,) bool mask or row indices. Compressive memory's compressed states carry no padding
        mask and refuse."""
        from txl.errors import UsageError

        if self.compressed_length:
            raise UsageError("compressive memory (cmem_len > 0) cannot reset rows; start a new memory instead")
        if not self.length:
            return self
        chosen = reset_rows(rows, self.batch_size, device=self.hidden[0].device)
        if not bool(chosen.any()):
            return self
        keep = ~chosen
        hidden = tuple(h * keep[:, None, None].to(h.dtype) for h in self.hidden)  # zeros in the emptied rows
        return Memory(hidden, self.compressed, key_padding=self.real_positions() & keep[:, None])

    def state_dict(self, prefix: str = "memory") -> dict[str, Tensor]:
        """The compressed memory goes under `{prefix}_compressed.{layer}`, the padding mask (if any)
        under `{prefix}_padding` (uint8, 1 = real)."""
        out = {f"{prefix}.{i}": h.detach().contiguous() for i, h in enumerate(self.hidden)}
        out.update({f"{prefix}_compressed.{i}": c.detach().contiguous() for i, c in enumerate(self.compressed)})
        if self.key_padding is not None:
            out[f"{prefix}_padding"] = self.key_padding.to(torch.uint8).contiguous()
        return out

    @classmethod
    def from_state_dict(cls, tensors: dict[str, Tensor], prefix: str = "memory") -> Memory | None:
        hidden = _layers(tensors, prefix)
        if not hidden:
            return None
        padding = tensors.get(f"{prefix}_padding")
        return cls(hidden, _layers(tensors, f"{prefix}_compressed"),
                   key_padding=None if padding is None else padding != 0)

    def tensors(self) -> tuple[Tensor, ...]:
        return (*self.hidden, *self.compressed, *(() if self.key_padding is None else (self.key_padding,)))

    @classmethod
    def zeros(cls, n_layer: int, batch_size: int, length: int, d_model: int, **tensor_kwargs) -> Memory:
        return cls(tuple(torch.zeros(batch_size, length, d_model, **tensor_kwargs) for _ in range(n_layer)))


def reset_rows(rows: Tensor | Sequence[int] | int, batch_size: int, *, device: torch.device | str) -> Tensor:
    """(batch,) bool of the rows `reset(rows)` empties: a bool mask of the batch, or row indices."""
    from txl.errors import UsageError

    if isinstance(rows, int):
        rows = [rows]
    rows = torch.as_tensor(rows, device=device)
    if rows.numel() == 0:
        return torch.zeros(batch_size, dtype=torch.bool, device=device)
    if rows.dtype == torch.bool:
        if rows.shape != (batch_size,):
            raise UsageError(f"reset takes a (batch,) = ({batch_size},) bool mask, got shape {tuple(rows.shape)}")
        return rows
    if rows.dim() != 1 or rows.is_floating_point():
        raise UsageError("reset takes row indices (ints) or a (batch,) bool mask")
    if rows.numel() and (int(rows.min()) < -batch_size or int(rows.max()) >= batch_size):
        raise UsageError(f"reset: a row index is outside the batch of {batch_size}")
    chosen = torch.zeros(batch_size, dtype=torch.bool, device=device)
    chosen[rows.long()] = True
    return chosen


def update_memory(contexts: Sequence[Tensor], mem_len: int, *, detach: bool = True) -> Memory | None:
    """A plain `Memory` of the latest `mem_len` positions of each layer's [memory ; input]
    (`Memory.update`); `detach=False` keeps the tails as views of `contexts`, which
    `txl.fast.memory.append_rows` can extend in place."""
    if mem_len <= 0:
        return None
    return Memory(tuple(c[:, -mem_len:].detach() if detach else c[:, -mem_len:] for c in contexts))


# ---------------------------------------------------------------------------------------------
# A forward pass over a memory


class MemoryPass(ABC):
    """What an attention layer sees of the memory during one forward pass."""

    @abstractmethod
    def keys_values(self, layer: int, fresh: Tensor, project: Callable[[Tensor], Tensor]) -> Tensor:
        """The key/value projection of [memory ; fresh] for `layer` (`fresh`: the layer's input rows,
        `project`: a row-wise projection); the pass keeps what the next segment needs."""

    def replay(self) -> MemoryPass:
        """A pass for re-running a layer of this forward pass (activation checkpointing's recompute,
        `txl.nn.checkpointing`): the same keys and values, and nothing kept. Passes that keep nothing
        return themselves."""
        return self


class MemoryUpdate(MemoryPass):
    """One forward pass over a `MemoryState`, the reference kind.

    Layer i calls `keys_values(i, fresh, project)` with its input `fresh` (b, t, d_model) and a
    row-wise projection to keys and values; it gets the projection of `memory.context(i, fresh)`
    and the pass keeps that context for `finish`, which returns `memory.update(contexts)`: the next
    memory (the latest mem_len states per layer, detached), and an auxiliary loss (None here).
    """

    def __init__(self, memory: MemoryState | None, *, mem_len: int):
        self.state = memory
        # the memory a layer attends over; None when there is nothing to attend to
        self.memory = memory if memory is not None and (memory.length or _compressed_length(memory)) else None
        self.mem_len = mem_len
        self.contexts: list[Tensor] = []  # per layer, [memory ; fresh]

    @property
    def past_length(self) -> int:
        """Keys before the segment's (the same for every layer)."""
        return 0 if self.memory is None else _compressed_length(self.memory) + self.memory.length

    def context(self, layer: int, fresh: Tensor) -> Tensor:
        """[memory ; fresh] for `layer`, in fresh's dtype (b, past_length + t, d_model)."""
        return fresh if self.memory is None else self.memory.context(layer, fresh)

    def keys_values(self, layer: int, fresh: Tensor, project: Callable[[Tensor], Tensor]) -> Tensor:
        context = self.context(layer, fresh)
        self.contexts.append(context)
        return project(context)

    def replay(self) -> MemoryUpdate:
        """A copy whose contexts go to a list of its own: a recomputed layer reads the same memory and
        leaves this pass's contexts (the next memory, already built) alone. Subclasses keeping more than
        `contexts` override it (or, like txl.nn.recurrence's output dict, only ever overwrite an entry
        with an equal tensor)."""
        twin = copy.copy(self)
        twin.contexts = []
        return twin

    def finish(self) -> tuple[MemoryState | None, Tensor | None]:
        """The next memory, and an auxiliary loss (None here)."""
        if self.state is None:
            return update_memory(self.contexts, self.mem_len), None
        return self.state.update(self.contexts, mem_len=self.mem_len), None


def _compressed_length(memory: MemoryState) -> int:
    return getattr(memory, "compressed_length", 0)


class CompressiveUpdate(MemoryUpdate):
    """Compressive memory's pass (Rae et al. 2020): [compressed ; memory ; segment] per layer, and
    `finish` hands the contexts to the model's compressor (`MemoryCompressor`,
    txl/models/transformer_xl/compressive.py), which compresses what leaves the memory and, in
    training, returns the attention-reconstruction loss."""

    def __init__(self, memory: MemoryState | None, *, mem_len: int, compressor: Callable[..., Any], q_len: int,
                 blocks: Sequence[torch.nn.Module] | None):
        super().__init__(memory, mem_len=mem_len)
        self.compressor, self.q_len, self.blocks = compressor, q_len, blocks

    def finish(self) -> tuple[MemoryState | None, Tensor | None]:
        compressed_len = 0 if self.memory is None else _compressed_length(self.memory)
        return self.compressor(self.contexts, compressed_len=compressed_len, mem_len=self.mem_len, q_len=self.q_len,
                               blocks=self.blocks)


def reference_memory(model: torch.nn.Module, memory: MemoryState | None, *, mem_len: int, q_len: int) -> MemoryUpdate:
    """The reference memory kind of one forward pass of `model`: plain, or compressive when the model
    has a compressor (`cmem_len`). The fast backend has its own kinds (txl/fast/memory.py)."""
    if model.compressor is None:
        return MemoryUpdate(memory, mem_len=mem_len)
    learn = model.training and torch.is_grad_enabled()  # the reconstruction loss trains f_c
    return CompressiveUpdate(memory, mem_len=mem_len, compressor=model.compressor, q_len=q_len,
                             blocks=model.blocks if learn else None)


# ---------------------------------------------------------------------------------------------
# Memories as pytrees: torch.export and torch.compile take and return them as they are


def register_pytree(cls: type, tensor_fields: Sequence[str], static_fields: Sequence[str] = ()) -> type:
    """Register a memory dataclass as a pytree node: `tensor_fields` (tensors or tuples of them) are
    its children, `static_fields` (hashable, compared by value) its context."""
    tensor_fields, static_fields = tuple(tensor_fields), tuple(static_fields)

    def flatten(memory):
        return [getattr(memory, f) for f in tensor_fields], tuple(getattr(memory, f) for f in static_fields)

    def flatten_with_keys(memory):
        return ([(pytree.GetAttrKey(f), getattr(memory, f)) for f in tensor_fields],
                tuple(getattr(memory, f) for f in static_fields))

    def unflatten(children, context):
        return cls(**dict(zip(tensor_fields, children)), **dict(zip(static_fields, context)))

    pytree.register_pytree_node(cls, flatten, unflatten, serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
                                flatten_with_keys_fn=flatten_with_keys)
    return cls


register_pytree(Memory, ("hidden", "compressed", "key_padding"), ("donated",))
