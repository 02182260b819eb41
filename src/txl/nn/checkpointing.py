"""Activation checkpointing of a block that reads and writes the memory (`train.activation_checkpointing =
"blocks"`, Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost", arXiv 1604.06174).

`checkpointed(run, h, memory)` runs `run(h, memory)` (one block: (out, probs)) under
`torch.utils.checkpoint` (non-reentrant, RNG state preserved, so the recompute draws the same dropout
masks): its activations are not kept for the backward, which runs the block again to rebuild them.

The block's forward has a side effect the recompute must not repeat: its attention hands the memory
pass this layer's context (`MemoryPass.keys_values`), which the pass keeps for the next memory. The
first run (the forward) gets the real pass; every later run of the same call (the recompute, in the
backward) gets `memory.replay()`: the same keys and values, whose writes go to a throwaway copy, so the
next memory (already built by then) is never written twice. Nothing else the recompute touches outlives
it: the fast kernel's scratch workspaces (txl.nn.attention.xl_fast) are used inside one autograd
function's forward or backward and never saved, so block k's recompute cannot clobber what block
k+1's backward still reads (tests/test_activation_checkpointing.py pins equal gradients).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def checkpointed(run: Callable[[Tensor, Any], Any], h: Tensor, memory: Any) -> Any:
    """`run(h, memory)`, its activations recomputed in the backward; the recompute sees
    `memory.replay()` (see the module's docstring). `memory` may be None (no memory)."""
    calls = 0

    def block(x: Tensor) -> Any:
        nonlocal calls
        calls += 1
        return run(x, memory if calls == 1 or memory is None else memory.replay())

    return checkpoint(block, h, use_reentrant=False, preserve_rng_state=True)


def wants_checkpoint(enabled: bool) -> bool:
    """Whether a forward pass checkpoints its blocks: asked for, and autograd recording (no backward, no
    activations to save)."""
    return enabled and torch.is_grad_enabled()


__all__ = ["checkpointed", "wants_checkpoint"]
