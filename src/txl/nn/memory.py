"""Segment-level recurrence state (Dai et al. 2019, §3.2).

Memory is explicit: the model takes a `Memory` (or None) and returns the next one; nothing is hidden
inside a module. For each layer it holds the *input* hidden states of that layer for the latest
`mem_len` positions, detached from the graph (the stop-gradient SG(·) of the paper). It starts empty
(Hugging Face starts with mem_len zero vectors, so its first segment attends to zeros).

A forward pass reads and writes the memory through a `MemoryUpdate` (in the spirit of Hugging Face's
`Cache.update(k, v, layer_idx)`): each layer asks it for the keys and values of [memory ; segment],
and it keeps what the next segment needs, with the stop-gradient and the truncation to mem_len. Its
kind decides how the memory grows and truncates and whether projections are reused: this file holds
the plain Transformer-XL memory; compressive memory is `txl/models/transformer_xl/compressive.py`; the fast backend's
projection cache and in-place evaluation memory are `txl/fast/memory.py`.

`Memory.compressed` holds compressive memory's older states (Rae et al. 2020; `txl/models/transformer_xl/compressive.py`):
attention then runs over [compressed ; memory ; segment].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Memory:
    """Per-layer cached hidden states, each (batch, length, d_model), batch-first.

    `compressed` (compressive memory only, else empty) holds per layer the older, compressed states:
    attention runs over [compressed ; hidden ; segment].
    """

    hidden: tuple[Tensor, ...]
    compressed: tuple[Tensor, ...] = ()
    # True: the caller gives these buffers up; the next forward may write the next memory into them
    # (evaluation at long memory then holds one memory, not two). Never saved; every method below
    # that builds a new Memory drops it. See `donate`.
    donated: bool = False

    @property
    def length(self) -> int:
        return self.hidden[0].shape[1] if self.hidden else 0

    @property
    def compressed_length(self) -> int:
        return self.compressed[0].shape[1] if self.compressed else 0

    def layer(self, i: int) -> list[Tensor]:
        """Layer i's cached states that are not empty, oldest first: [compressed ; hidden]."""
        parts = [self.compressed[i]] if self.compressed_length else []
        return parts + ([self.hidden[i]] if self.length else [])

    @property
    def batch_size(self) -> int:
        return self.hidden[0].shape[0]

    def donate(self) -> Memory:
        """This memory, handed over to the next forward pass, which may overwrite its buffers in place
        with the next memory and return it (the fast backend does when the memory is full and no
        gradient is recorded). Use it only for a memory you will not read again."""
        return dataclasses.replace(self, donated=True)

    def to(self, *args, **kwargs) -> Memory:
        return Memory(tuple(h.to(*args, **kwargs) for h in self.hidden),
                      tuple(c.to(*args, **kwargs) for c in self.compressed))

    def detach(self) -> Memory:
        return Memory(tuple(h.detach() for h in self.hidden), tuple(c.detach() for c in self.compressed))

    def select(self, index: Tensor | slice | int) -> Memory:
        """Rows of the batch (e.g. to keep some streams and drop others)."""
        if isinstance(index, int):
            index = slice(index, index + 1)
        return Memory(tuple(h[index] for h in self.hidden), tuple(c[index] for c in self.compressed))

    @classmethod
    def cat(cls, parts: Sequence[Memory]) -> Memory:
        """The inverse of `select` over consecutive row groups: one memory with all their rows."""
        return cls(tuple(torch.cat(layer) for layer in zip(*(p.hidden for p in parts), strict=True)),
                   tuple(torch.cat(layer) for layer in zip(*(p.compressed for p in parts), strict=True)))

    def truncate(self, mem_len: int) -> Memory | None:
        """Keep the latest mem_len states per layer (the compressed memory is kept as is)."""
        if mem_len <= 0:
            return None
        return Memory(tuple(h[:, -mem_len:] for h in self.hidden), self.compressed)

    def state_dict(self, prefix: str = "memory") -> dict[str, Tensor]:
        """Flat name -> tensor mapping for safetensors (contiguous copies); the compressed memory
        goes under `{prefix}_compressed.{layer}`."""
        out = {f"{prefix}.{i}": h.detach().contiguous() for i, h in enumerate(self.hidden)}
        out.update({f"{prefix}_compressed.{i}": c.detach().contiguous() for i, c in enumerate(self.compressed)})
        return out

    @classmethod
    def from_state_dict(cls, tensors: dict[str, Tensor], prefix: str = "memory") -> Memory | None:
        def layers(name_prefix: str) -> tuple[Tensor, ...]:
            found = sorted(
                (int(name[len(name_prefix) + 1 :]), t)
                for name, t in tensors.items()
                if name.startswith(name_prefix + ".") and name[len(name_prefix) + 1 :].isdigit()
            )
            return tuple(t for _, t in found)

        hidden = layers(prefix)
        if not hidden:
            return None
        return cls(hidden, layers(f"{prefix}_compressed"))

    @classmethod
    def zeros(cls, n_layer: int, batch_size: int, length: int, d_model: int, **tensor_kwargs) -> Memory:
        return cls(tuple(torch.zeros(batch_size, length, d_model, **tensor_kwargs) for _ in range(n_layer)))


def update_memory(contexts: Sequence[Tensor], mem_len: int, *, detach: bool = True) -> Memory | None:
    """Keep the latest `mem_len` positions of each layer's [memory ; input], without gradient.

    `contexts[i]` is layer i's key/value input, i.e. the concatenation the layer attended over, so the
    new memory is simply its tail. (The reference computes end = mlen + qlen - ext_len; with
    ext_len = 0, the only setting we support, that is the same tail.) `detach=False` (callers without
    autograd) keeps the tails as views of `contexts`, which `append_rows` can extend in place.
    """
    if mem_len <= 0:
        return None
    return Memory(tuple(c[:, -mem_len:].detach() if detach else c[:, -mem_len:] for c in contexts))


class MemoryUpdate:
    """One forward pass over a memory, the reference kind: plain Transformer-XL memory.

    Layer i calls `keys_values(i, fresh, project)` with its input `fresh` (b, t, d_model) and a
    row-wise projection to keys and values; it gets the projection of [memory ; fresh] and the update
    keeps [memory ; fresh] for `finish`, which returns the next memory: the latest mem_len states per
    layer, detached (the stop-gradient SG(·) of the paper), and an auxiliary loss (None here).
    """

    def __init__(self, memory: Memory | None, *, mem_len: int):
        self.memory = memory if memory is not None and (memory.length or memory.compressed_length) else None
        self.mem_len = mem_len
        self.contexts: list[Tensor] = []  # per layer, [memory ; fresh]

    @property
    def past_length(self) -> int:
        """Keys before the segment's (the same for every layer)."""
        return 0 if self.memory is None else self.memory.compressed_length + self.memory.length

    def context(self, layer: int, fresh: Tensor) -> Tensor:
        """[memory ; fresh] for `layer`, in fresh's dtype (b, past_length + t, d_model)."""
        if self.memory is None:
            return fresh
        return torch.cat([*(m.to(fresh.dtype) for m in self.memory.layer(layer)), fresh], dim=1)

    def keys_values(self, layer: int, fresh: Tensor, project: Callable[[Tensor], Tensor]) -> Tensor:
        context = self.context(layer, fresh)
        self.contexts.append(context)
        return project(context)

    def finish(self) -> tuple[Memory | None, Tensor | None]:
        return update_memory(self.contexts, self.mem_len), None
