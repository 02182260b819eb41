"""Reversible blocks (Gomez et al. 2017, "The Reversible Residual Network", arXiv 1707.04585; Kitaev et
al. 2020, Reformer, §3): `config.reversible = true`.

The residual stream is a pair (x1, x2), both the embedding at the start (Reformer duplicates its
input). Block l with attention sublayer F_l and feed-forward sublayer G_l maps it to

    y1 = x1 + F_l(x2)        y2 = x2 + G_l(y1)

and the last pair is averaged, (y1 + y2) / 2, into the final norm and the softmax. F_l(x) =
attention(norm(x)) over [memory ; x] (pre-LN: the memory rows are normalised too) and G_l(x) =
ffn(norm(x)); the memory keeps x2, the attention sublayer's input. The block is invertible:

    x2 = y2 - G_l(y1)        x1 = y1 - F_l(x2)

so the backward (`ReversibleStack`, one autograd function over all the blocks) keeps only the last
pair and rebuilds each block's input from its output as it goes down, recomputing F_l and G_l once
more to take their gradients: activation memory independent of depth (one block's worth), for about
one more forward's compute. Gradients equal ordinary backpropagation through the same coupling up to
rounding (tests/test_reversible.py: 1e-5), since the rebuilt inputs differ from the forward's by
float rounding only. Dropout masks are redrawn identically (each sublayer's RNG state is kept and
restored for its recompute), and autocast is re-entered as the forward had it.

What the blocks read from outside (the positional encoding's per-forward tensors, `pos_state`) enters
the function as inputs, so their gradients go back through the caller's graph; parameters of the blocks
(and anything else they read directly) get theirs accumulated by the inner backward, as Reformer does.
Call the model's backward with `loss.backward()` (`torch.autograd.grad` of a parameter does not see the
accumulated gradients). The recompute reads the memory through `MemoryPass.replay()`, so the next
memory is written once (as activation checkpointing, txl.nn.checkpointing).

The blocks are duck-typed (`attn`, `attn_norm`, `ff`, `ff_norm`: txl.models.transformer_xl.model.Block),
so this module imports nothing above txl.nn.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from txl.nn.attention.masks import AttentionMask
from txl.nn.memory import MemoryPass
from txl.nn.positional import LayerPositions

PositionsFor = Callable[[int, dict], LayerPositions]  # (layer index, pos_state) -> that layer's positions


def attention_half(block: nn.Module, x: Tensor, *, memory: MemoryPass | None, positions: LayerPositions,
                   mask: AttentionMask, need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
    """F(x) = attention(norm(x)) over [memory ; x], the memory rows normalised too (pre-LN), and the
    probabilities with `need_weights`."""
    return block.attn(block.attn_norm(x), x, positions=positions, mask=mask, memory=memory,
                      source_norm=block.attn_norm, need_weights=need_weights)


def feedforward_half(block: nn.Module, x: Tensor) -> Tensor:
    """G(x) = ffn(norm(x))."""
    return block.ff(block.ff_norm(x))


def reversible_blocks(
    blocks: Sequence[nn.Module], h: Tensor, *, memory: MemoryPass | None, positions: PositionsFor, pos_state: dict,
    mask: AttentionMask, recompute: bool = True, need_weights: bool = False,
) -> tuple[Tensor, list[Tensor], list[Tensor | None]]:
    """The reversible stack over h (b, t, d_model): the output (y1 + y2) / 2 of the last block, every
    block's input as (x1 + x2) / 2 (for `output_hidden_states`; without autograd history under
    `recompute`), and each block's attention probabilities (with `need_weights`, else None).
    `recompute=False`: plain autograd through the same coupling (every activation kept), the
    reference the reversible backward is tested against; it is also what runs without autograd and
    when the probabilities are asked for."""
    if not (recompute and torch.is_grad_enabled() and h.requires_grad) or need_weights:
        x1 = x2 = h
        inputs, attentions = [], []
        for i, block in enumerate(blocks):
            inputs.append((x1 + x2) / 2)
            attended, probs = attention_half(block, x2, memory=memory, positions=positions(i, pos_state), mask=mask,
                                             need_weights=need_weights)
            x1 = x1 + attended
            x2 = x2 + feedforward_half(block, x1)
            attentions.append(probs)
        return (x1 + x2) / 2, inputs, attentions
    names = [k for k, v in pos_state.items() if isinstance(v, Tensor) and v.requires_grad]
    run = _Run(blocks, memory, positions, pos_state, names, mask)
    y1, y2 = ReversibleStack.apply(h, run, *(pos_state[k] for k in names))
    # a copy: the caller appends the final output (whose graph holds the autograd node, which holds `run`)
    # to the list it gets; appended to run.inputs, that was a cycle through the C++ graph, which Python's
    # collector cannot free, and every training step leaked its activations (about 20 MB a step at d 128)
    return (y1 + y2) / 2, list(run.inputs), [None] * len(run.blocks)


class _Run:
    """What the autograd function needs besides tensors: the blocks, the memory pass, the positions,
    the mask, and each sublayer's RNG state (filled by the forward, read by the backward)."""

    def __init__(self, blocks, memory, positions: PositionsFor, pos_state: dict, names: list[str], mask: AttentionMask):
        self.blocks, self.memory, self.positions, self.mask = list(blocks), memory, positions, mask
        self.pos_state, self.names = pos_state, names
        self.states: list[tuple[Any, Any]] = []  # per block: (F's RNG state, G's RNG state)
        self.inputs: list[Tensor] = []
        self.autocast: tuple[str, bool, torch.dtype] | None = None


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _restored(state: tuple[Tensor, Tensor | None], device: torch.device):
    """Run with the RNG as it was at `state`, and leave the RNG as it was before."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


class ReversibleStack(torch.autograd.Function):
    """(h, run, *position tensors) -> (y1, y2) of the last block; the backward rebuilds the activations."""

    @staticmethod
    def forward(ctx, h: Tensor, run: _Run, *position_tensors: Tensor):
        device = h.device
        run.autocast = (device.type, torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))
        x1 = x2 = h
        with torch.no_grad():
            for i, block in enumerate(run.blocks):
                run.inputs.append((x1 + x2) / 2)
                f_state = _rng_state(device)
                x1 = x1 + attention_half(block, x2, memory=run.memory, positions=run.positions(i, run.pos_state),
                                         mask=run.mask)[0]
                g_state = _rng_state(device)
                x2 = x2 + feedforward_half(block, x1)
                run.states.append((f_state, g_state))
        ctx.run = run
        ctx.save_for_backward(x1, x2)
        return x1, x2

    @staticmethod
    def backward(ctx, dy1: Tensor, dy2: Tensor):
        run: _Run = ctx.run
        y1, y2 = ctx.saved_tensors
        device = y1.device
        device_type, autocast_on, autocast_dtype = run.autocast
        # the position tensors as leaves of the recompute: their gradients are summed over the blocks
        leaves = {k: run.pos_state[k].detach().requires_grad_() for k in run.names}
        state = {**run.pos_state, **leaves}
        memory = None if run.memory is None else run.memory.replay()
        for i in reversed(range(len(run.blocks))):
            block = run.blocks[i]
            f_state, g_state = run.states[i]
            with torch.enable_grad(), torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
                y1_ = y1.detach().requires_grad_()
                with _restored(g_state, device):
                    g = feedforward_half(block, y1_)
                torch.autograd.backward(g, dy2)
            with torch.no_grad():
                x2 = y2 - g
                dy1 = dy1 + y1_.grad
            with torch.enable_grad(), torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on):
                x2_ = x2.detach().requires_grad_()
                with _restored(f_state, device):
                    f = attention_half(block, x2_, memory=memory, positions=run.positions(i, state), mask=run.mask)[0]
                torch.autograd.backward(f, dy1)
            with torch.no_grad():
                x1 = y1 - f
                dy2 = dy2 + x2_.grad
            y1, y2 = x1, x2
        return (dy1 + dy2, None, *(leaves[k].grad for k in run.names))
