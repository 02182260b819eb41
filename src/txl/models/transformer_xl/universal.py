"""The Universal Transformer's depth (Dehghani et al. 2019, "Universal Transformers", ICLR, arXiv
1807.03819): one shared block applied step after step, with a per-position halting unit (adaptive
computation time, Graves 2016, arXiv 1603.08983), as tensor2tensor's `universal_transformer_act`.

`universal = true` replaces the n_layer blocks by one block applied for up to n_layer steps (the
maximum depth, `max_depth` = n_layer: every per-layer structure — memory, xl's position projection
W_kR — keeps one entry per step). The decoder LM (`TransformerXL`) and both stacks of the encoder-decoder
(`EncoderDecoderConfig.universal`) run their shared block through `UniversalDepth`.

Signals (`universal_signals`, t2t's `step_preprocess`):
- "every-step" (the default, as t2t): before every step t = 0 … n_layer-1 the state gets the timestep
  signal (the sinusoid of t over d_model, t2t's `add_step_timing_signal`, step 0 included) and the
  position signal (t2t's `add_position_timing_signal`): for an absolute encoding merged by addition
  (sinusoidal, learned with merge='add') its position rows are added again at every step t >= 1 (at step 0
  they are the embedding's); the relative encodings (xl, shaw, rope, t5, alibi, ...) give every step's
  attention its position terms, so there is nothing to add. An absolute encoding merged otherwise (mul,
  zero, concat) has no additive signal: refused in one line.
- "after-first" (txl before issue 48; what an older UT config loads as, txl.models.migration): the timestep
  signal from step 1 on, positions at the embedding only, so step 0 is exactly an ordinary layer.

Halting (per position, UT §2.2 / ACT): p_t = σ(w·s_t + b) from the step's input. A position halts
at the first step where its accumulated p would reach `act_threshold`; that step gets the remainder
R = 1 - Σ p so far, earlier steps their p, later steps 0; at the last step every position halts
(Graves' N(t) = min(max depth, ...)). With y_t the block's output at step t and w_t that step's weight,
the layer output combines the steps as t2t's `act_type`:
- "basic" (t2t's default, `universal_transformer_act_basic`): o_t = w_t·y_t + (1 - w_t)·o_{t-1}, o_{-1} = 0,
  an interpolation of the state by the halting weights; a halted position (w = 0) keeps its o. (t2t's code
  writes the second term `previous_state * 1 - update_weights`, which Python parses as o - w; the update
  the paper and its comment describe, implemented here, is (1 - w)·o.)
- "accumulated" (`universal_transformer_act_accumulated`, Graves' mean-field output): o = Σ_t w_t · y_t,
  the weights sum to 1.
The next step reads y_t itself (t2t's `transformed_state`), not o. Ponder cost ρ = N + R (steps taken plus
the remainder), and `ponder_cost` · mean ρ is added to the training loss (the LM: as `out.aux_loss`; the
encoder-decoder: inside `out.loss` in training mode); `ponder_depth` reports the mean ρ.

Every step is computed for every position (a halted position keeps being transformed but no longer
counts): the memory needs each step's input for all positions, and cached decoding then equals the full
pass. With memory: each step's input is cached as that step's (layer's) memory, so the next segment
attends at step t over the states the previous segment had at step t, as Transformer-XL layers do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from txl.errors import ConfigError
from txl.models.transformer_xl.config import TransformerXLConfig
from txl.nn.attention.masks import AttentionMask
from txl.nn.backend import REFERENCE, Backend
from txl.nn.checkpointing import checkpointed
from txl.nn.positional import LayerPositions, sinusoid_table

StepFn = Callable[[Tensor, int], tuple[Tensor, Tensor | None]]


def additive_positions(encoding) -> bool:
    """Whether `encoding` (a PositionalEncoding) adds absolute position rows to the input (so "every-step"
    re-adds them). Raises ConfigError for an absolute encoding merged by anything but addition."""
    if not getattr(encoding, "takes_position_ids", False) or not hasattr(encoding, "position_table"):
        return False  # relative: every step's attention reads its position terms
    merge = getattr(encoding, "merge", "add")
    if merge != "add":
        raise ConfigError(f"config.universal with universal_signals='every-step' adds the position signal before "
                          f"every step (tensor2tensor's step_preprocess), which needs position_options.merge='add' "
                          f"for pos_encoding={encoding.name!r}, got merge={merge!r}; use merge='add' or "
                          f"universal_signals='after-first'")
    return True


def position_signal(encoding, like: Tensor, *, offset: int = 0, position_ids: Tensor | None = None) -> Tensor | None:
    """(1 or b, t, d) the absolute position rows of positions offset … offset+t-1 (or `position_ids`) that
    `encoding` adds to the input, None for a relative encoding."""
    if not additive_positions(encoding):
        return None
    if position_ids is None and offset:
        prefix = like.new_zeros(1, offset + like.shape[1], like.shape[-1])
        return encoding.position_table(prefix, None)[:, offset:].to(like.dtype)
    return encoding.position_table(like, position_ids).to(like.dtype)


class UniversalDepth(nn.Module):
    """The halting unit and the step loop around one shared block."""

    def __init__(self, config: TransformerXLConfig, *, backend: Backend = REFERENCE):
        super().__init__()
        self.max_depth = config.n_layer
        self.threshold = config.act_threshold
        self.act_type = config.act_type
        self.signals = config.universal_signals
        self.halt = backend.Linear(config.d_model, 1)
        self.d_model = config.d_model

    def reset_parameters(self) -> None:
        """UT's init of the halting bias (1.0, t2t's act_halting_bias_init): early steps keep going until
        they have learnt to stop."""
        nn.init.constant_(self.halt.bias, 1.0)

    def step_signal(self, step: int, like: Tensor) -> Tensor:
        """The timestep signal added before `step` (zero at step 0 with universal_signals='after-first')."""
        if step == 0 and self.signals == "after-first":
            return torch.zeros((), dtype=like.dtype, device=like.device)
        return sinusoid_table(torch.tensor([step], device=like.device), self.d_model).to(like.dtype)[0]

    def signal(self, step: int, like: Tensor, positions: Tensor | None) -> Tensor:
        """Everything added to the state before `step`: the timestep signal, and with "every-step" the
        position rows (`positions`, None for a relative encoding) from step 1 on."""
        out = self.step_signal(step, like)
        if step and positions is not None and self.signals == "every-step":
            out = out + positions
        return out

    def loop(self, run_step: StepFn, h: Tensor, *, positions: Tensor | None = None,
             ) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor | None]]:
        """The ACT loop: `run_step(state, step)` -> (the block's output y_t, attention probabilities).
        Returns (output o (b, t, d), ponder ρ (b, t), each step's input, each step's probabilities)."""
        halting = h.new_zeros(h.shape[:2], dtype=torch.float32)  # Σ p of the running positions
        running = torch.ones(h.shape[:2], dtype=torch.bool, device=h.device)
        remainder = torch.zeros_like(halting)
        steps = torch.zeros_like(halting)
        output = torch.zeros_like(h)
        inputs, attentions = [], []
        state = h
        for step in range(self.max_depth):
            state = state + self.signal(step, state, positions)
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
            state, probs = run_step(state, step)
            attentions.append(probs)
            w = weight[..., None].to(state.dtype)
            if self.act_type == "basic":  # o_t = w·y_t + (1 - w)·o_{t-1}
                output = w * state + (1.0 - w) * output
            else:  # accumulated: o = Σ w_t·y_t
                output = output + w * state
        return output, steps + remainder, inputs, attentions

    def forward(
        self, block: nn.Module, h: Tensor, *, memory, positions: Callable[[int], LayerPositions], mask: AttentionMask,
        need_weights: bool = False, checkpoint: bool = False, position_rows: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor | None]]:
        """The decoder LM's stack: (output (b, t, d), ponder ρ (b, t), each step's input, each step's
        attention probabilities). `position_rows`: the absolute position rows re-added before each step
        (`position_signal`), None for a relative encoding. `checkpoint`: each step's block is recomputed in
        the backward (txl.nn.checkpointing), with its step's memory slot set again for the recompute."""

        def run_step(state: Tensor, step: int):
            step_positions = positions(step)

            def run(x, memory, step=step, step_positions=step_positions):
                block.attn.layer_idx = step  # this step's memory slot (set in a recompute too)
                try:
                    return block(x, memory=memory, positions=step_positions, mask=mask, need_weights=need_weights)
                finally:
                    block.attn.layer_idx = 0

            return checkpointed(run, state, memory) if checkpoint else run(state, memory)

        return self.loop(run_step, h, positions=position_rows)

    def extra_repr(self) -> str:
        return f"max_depth={self.max_depth}, threshold={self.threshold}, act_type={self.act_type}, signals={self.signals}"
