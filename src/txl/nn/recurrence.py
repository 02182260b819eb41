"""ERNIE-Doc's enhanced recurrence (Ding et al. 2021, "ERNIE-Doc: A Retrospective Long-Document Modeling
Transformer", ACL, §3.2): `config.memory_source = "same-layer"`.

Transformer-XL's layer n attends over [SG(h^{n-1}_τ) ; h^{n-1}_{τ+1}]: the previous segment's states at
the layer's own input. ERNIE-Doc replaces the memory by the layer's *output* of the previous segment,
[SG(h^n_τ) ; h^{n-1}_{τ+1}], so information climbs one layer per segment and the top layer's memory
holds the top layer's own states: the effective context grows with segments × layers instead of
being capped by the depth. The price is segment invariance: one pass over [s1 ; s2] is no longer two
passes with memory (within a segment a position still sees its neighbours' layer n−1 states).

`SameLayerUpdate` is the memory pass for it (`txl.nn.memory.MemoryPass`): a layer's keys and values come
from [memory ; its input] as before, and its block hands the pass its output (`keep_output`), whose
latest mem_len states (after the memory's) become the layer's next memory. The memory object itself is
the plain `txl.nn.memory.Memory` (per layer (b, length, d_model)); only what it holds differs. Both
backends run this reference pass (the fast backend's projection cache and in-place memory re-project
the memory's states as they find them, which here are outputs, so they do not apply).

x-transformers' `shift_mem_down = 1` is the nearby design: it rotates the list of layer-input memories
down by one, so layer l gets layer l+1's input (= layer l's output) and the top layer gets the
embedding layer's states (a wrap-around); here the top layer keeps its own output, as ERNIE-Doc's
equation has it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from txl.nn.memory import MemoryState, MemoryUpdate, update_memory


class SameLayerUpdate(MemoryUpdate):
    """One forward pass whose next memory holds each layer's output."""

    def __init__(self, memory: MemoryState | None, *, mem_len: int):
        super().__init__(memory, mem_len=mem_len)
        self.outputs: dict[int, Tensor] = {}  # layer -> [memory ; output] (a recomputed block overwrites)

    def keys_values(self, layer: int, fresh: Tensor, project: Callable[[Tensor], Tensor]) -> Tensor:
        return project(self.context(layer, fresh))

    def keep_output(self, layer: int, output: Tensor) -> None:
        """Layer `layer`'s output (b, t, d_model): the next memory of that layer is the tail of [memory ; output]."""
        self.outputs[layer] = self.context(layer, output)

    def finish(self) -> tuple[MemoryState | None, Tensor | None]:
        contexts = [self.outputs[i] for i in sorted(self.outputs)]
        if self.state is None:
            return update_memory(contexts, self.mem_len), None
        return self.state.update(contexts, mem_len=self.mem_len), None


def same_layer_memory(model: torch.nn.Module, memory: MemoryState | None, *, mem_len: int,
                      q_len: int) -> SameLayerUpdate:
    """The memory kind of a model with `memory_source = "same-layer"` (both backends)."""
    return SameLayerUpdate(memory, mem_len=mem_len)


__all__ = ["SameLayerUpdate", "same_layer_memory"]
