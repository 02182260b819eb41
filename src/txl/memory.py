"""Segment-level recurrence state (Dai et al. 2019, §3.2).

Memory is explicit: the model takes a `Memory` (or None) and returns the next one; nothing is hidden
inside a module. For each layer it holds the *input* hidden states of that layer for the latest
`mem_len` positions, detached from the graph (the stop-gradient SG(·) of the paper). It starts empty
(Hugging Face starts with mem_len zero vectors, so its first segment attends to zeros).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Memory:
    """Per-layer cached hidden states, each (batch, length, d_model), batch-first."""

    hidden: tuple[Tensor, ...]

    @property
    def length(self) -> int:
        return self.hidden[0].shape[1] if self.hidden else 0

    @property
    def batch_size(self) -> int:
        return self.hidden[0].shape[0]

    def to(self, *args, **kwargs) -> Memory:
        return Memory(tuple(h.to(*args, **kwargs) for h in self.hidden))

    def detach(self) -> Memory:
        return Memory(tuple(h.detach() for h in self.hidden))

    def select(self, index: Tensor | slice | int) -> Memory:
        """Rows of the batch (e.g. to keep some streams and drop others)."""
        if isinstance(index, int):
            index = slice(index, index + 1)
        return Memory(tuple(h[index] for h in self.hidden))

    def truncate(self, mem_len: int) -> Memory | None:
        if mem_len <= 0:
            return None
        return Memory(tuple(h[:, -mem_len:] for h in self.hidden))

    def state_dict(self, prefix: str = "memory") -> dict[str, Tensor]:
        """Flat name -> tensor mapping for safetensors (contiguous copies)."""
        return {f"{prefix}.{i}": h.detach().contiguous() for i, h in enumerate(self.hidden)}

    @classmethod
    def from_state_dict(cls, tensors: dict[str, Tensor], prefix: str = "memory") -> Memory | None:
        layers = sorted(
            (int(name[len(prefix) + 1 :]), t)
            for name, t in tensors.items()
            if name.startswith(prefix + ".") and name[len(prefix) + 1 :].isdigit()
        )
        if not layers:
            return None
        return cls(tuple(t for _, t in layers))

    @classmethod
    def zeros(cls, n_layer: int, batch_size: int, length: int, d_model: int, **tensor_kwargs) -> Memory:
        return cls(tuple(torch.zeros(batch_size, length, d_model, **tensor_kwargs) for _ in range(n_layer)))


def update_memory(contexts: Sequence[Tensor], mem_len: int) -> Memory | None:
    """Keep the latest `mem_len` positions of each layer's [memory ; input], without gradient.

    `contexts[i]` is layer i's key/value input, i.e. the concatenation the layer attended over, so the
    new memory is simply its tail. (The reference computes end = mlen + qlen - ext_len; with
    ext_len = 0, the only setting we support, that is the same tail.)
    """
    if mem_len <= 0:
        return None
    return Memory(tuple(c[:, -mem_len:].detach() for c in contexts))
