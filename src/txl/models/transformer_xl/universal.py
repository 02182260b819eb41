"""The Universal Transformer's depth (Dehghani et al. 2019, "Universal Transformers", ICLR, arXiv
1807.03819): one shared block applied step after step, with a per-position halting unit (adaptive
computation time, Graves 2016, arXiv 1603.08983).

`universal = true` replaces the n_layer blocks by one block applied for up to n_layer steps (the
maximum depth, `max_depth` = n_layer: every per-layer structure — memory, xl's position projection
W_kR — keeps one entry per step). Before step t ≥ 1 the state gets a fixed step signal (the sinusoid
of t, UT's "timestep embedding"; none at step 0, so the first step is exactly an ordinary layer).

Halting (per position, UT §2.2 / ACT): p_t = σ(w·s_t + b) from the step's input. A position halts
at the first step where its accumulated p would reach `act_threshold`; that step gets the remainder
R = 1 - Σ p so far, earlier steps their p, later steps 0; at the last step every position halts.
The layer output is Σ_t w_t · block(s_t) (the weights sum to 1). Ponder cost ρ = N + R (steps taken
plus the remainder), and `ponder_cost` · mean ρ is added to the training loss (as `out.aux_loss`);
`out.ponder_depth` reports the mean ρ, the average depth that was used.

Every step is computed for every position (a halted position keeps being transformed but no longer
counts): the memory needs each step's input for all positions. With memory: each step's input is
cached as that step's (layer's) memory, so the next segment attends at step t over the states the
previous segment had at step t, as Transformer-XL layers do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from txl.models.transformer_xl.config import TransformerXLConfig
from txl.nn.attention.masks import AttentionMask
from txl.nn.backend import REFERENCE, Backend
from txl.nn.checkpointing import checkpointed
from txl.nn.positional import LayerPositions, sinusoid_table


class UniversalDepth(nn.Module):
    """The halting unit and the step loop around one shared block."""

    def __init__(self, config: TransformerXLConfig, *, backend: Backend = REFERENCE):
        super().__init__()
        self.max_depth = config.n_layer
        self.threshold = config.act_threshold
        self.halt = backend.Linear(config.d_model, 1)
        self.d_model = config.d_model

    def reset_parameters(self) -> None:
        """UT's init of the halting bias (1.0): early steps keep going until they have learnt to stop."""
        nn.init.constant_(self.halt.bias, 1.0)

    def step_signal(self, step: int, like: Tensor) -> Tensor:
        if step == 0:
            return torch.zeros((), dtype=like.dtype, device=like.device)
        return sinusoid_table(torch.tensor([step], device=like.device), self.d_model).to(like.dtype)[0]

    def forward(
        self, block: nn.Module, h: Tensor, *, memory, positions: Callable[[int], LayerPositions], mask: AttentionMask,
        need_weights: bool = False, checkpoint: bool = False,
    ) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor | None]]:
        """(output (b, t, d), ponder ρ (b, t), each step's input, each step's attention probabilities).
        `checkpoint`: each step's block is recomputed in the backward (txl.nn.checkpointing), with its
        step's memory slot set again for the recompute."""
        halting = h.new_zeros(h.shape[:2], dtype=torch.float32)  # Σ p of the running positions
        running = torch.ones(h.shape[:2], dtype=torch.bool, device=h.device)
        remainder = torch.zeros_like(halting)
        steps = torch.zeros_like(halting)
        output = torch.zeros_like(h)
        inputs, attentions = [], []
        state = h
        for step in range(self.max_depth):
            state = state + self.step_signal(step, state)
            p = torch.sigmoid(self.halt(state).squeeze(-1).float())
            last = step == self.max_depth - 1
            halts_now = running & ((halting + p >= self.threshold) | last)
            keeps_going = running & ~halts_now
            weight = torch.where(keeps_going, p, torch.zeros_like(p))
            weight = torch.where(halts_now, 1.0 - halting, weight)  # the remainder
            remainder = torch.where(halts_now, 1.0 - halting, remainder)
            halting = halting + torch.where(keeps_going, p, torch.zeros_like(p))
            steps = steps + running.float()
            running = keeps_going
            inputs.append(state)
            step_positions = positions(step)

            def run(x, memory, step=step, step_positions=step_positions):
                block.attn.layer_idx = step  # this step's memory slot (set in a recompute too)
                try:
                    return block(x, memory=memory, positions=step_positions, mask=mask, need_weights=need_weights)
                finally:
                    block.attn.layer_idx = 0

            state, probs = checkpointed(run, state, memory) if checkpoint else run(state, memory)
            attentions.append(probs)
            output = output + weight[..., None].to(state.dtype) * state
        return output, steps + remainder, inputs, attentions

    def extra_repr(self) -> str:
        return f"max_depth={self.max_depth}, threshold={self.threshold}"
