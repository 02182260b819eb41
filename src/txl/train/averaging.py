"""An exponential moving average of the weights (`train.ema`), validated next to the live weights.

Averaging the iterates is an old regulariser of language models: Polyak–Ruppert averaging, AWD-LSTM's
averaged SGD, the Transformer-XL paper's "weight average" on Penn Treebank. The trainer keeps the average
in fp32 beside the model, updates it after every optimiser step, and at each validation scores it too;
`best` holds whichever weights scored better on valid, so the final test score is chosen on valid alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from txl.errors import CheckpointError

PREFIX = "ema."  # names of the average's tensors in a checkpoint's trainer.safetensors


class WeightAverage:
    """EMA of a model's parameters with decay `decay` per update.

    The first updates use the smaller decay (1 + n) / (10 + n) after n updates, so the average is not
    held near the initial weights for thousands of steps (TensorFlow's ExponentialMovingAverage with
    num_updates).
    Buffers are not averaged: the model's own buffers serve both sets of weights.
    """

    def __init__(self, model: torch.nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"the average's decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.updates = 0
        self.names = [name for name, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in model.named_parameters() if p.requires_grad]
        self.shadow = [p.detach().float().clone() for p in self.params]

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self) -> None:
        weight = 1.0 - self.current_decay()  # n = the updates before this one
        self.updates += 1
        live = [p.detach().float() for p in self.params]  # a no-op view for fp32 weights
        torch._foreach_lerp_(self.shadow, live, weight)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The model holds the average inside the block and its own weights again after it."""
        with torch.no_grad():
            saved = [p.detach().clone() for p in self.params]
            for p, s in zip(self.params, self.shadow):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, saved):
                    p.copy_(s)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {PREFIX + name: s for name, s in zip(self.names, self.shadow)}

    def load(self, tensors: dict[str, torch.Tensor], updates, where: str) -> None:
        """Restore `tensors()` and the update count from a checkpoint; any mismatch is a CheckpointError."""
        if not isinstance(updates, int) or isinstance(updates, bool) or updates < 0:
            raise CheckpointError(f"{where}: the weight average's update count is missing or damaged "
                                  f"({updates!r})")
        for name, s in zip(self.names, self.shadow):
            saved = tensors.get(PREFIX + name)
            if saved is None or saved.shape != s.shape or not saved.dtype.is_floating_point:
                raise CheckpointError(f"{where}: the weight average of {name} is missing or does not fit this "
                                      "model; the checkpoint is damaged or from another run")
            s.copy_(saved)
        self.updates = updates
