"""The masked-LM objective for the bidirectional encoder (`causal=False`), BERT's recipe (Devlin et
al. 2019, §3.1): pick `rate` of the positions; of those, 80% become the mask token, 10% a random token,
10% stay; the model predicts the original token at exactly the picked positions.

The encoder reuses the LM's blocks and softmax head unchanged: `model(inputs, labels=labels)` scores
`labels[b, t]` from position t (no shift), and -100 marks positions that are not scored, so `out.loss`
is the masked-LM loss and `out.nll` its per-token terms. The mask token needs its own id: give the
model one more vocabulary entry than the corpus (e.g. `vocab_size = len(vocab) + 1`, `mask_id =
len(vocab)`), so no real token is ever confused with it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from txl.errors import UsageError


def mask_tokens(
    input_ids: Tensor, *, mask_id: int, vocab_size: int, rate: float = 0.15, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """(inputs, labels) for one masked-LM step: labels hold the original ids where picked, else -100.

    At least one position per sequence is picked, so every row contributes to the loss. Random
    replacement tokens are drawn from [0, vocab_size) excluding `mask_id`.
    """
    if not 0.0 < rate < 1.0:
        raise UsageError(f"masked-LM rate must be in (0, 1), got {rate}")
    if not 0 <= mask_id < vocab_size:
        raise UsageError(f"mask_id={mask_id} is outside the vocabulary [0, {vocab_size})")
    device = input_ids.device

    def uniform(shape) -> Tensor:
        return torch.rand(shape, generator=generator, device=generator.device if generator else device).to(device)

    draw = uniform(input_ids.shape)
    picked = draw < rate
    # Guarantee one scored position per row: the position with the smallest draw.
    picked.scatter_(1, draw.argmin(dim=1, keepdim=True), True)
    labels = torch.where(picked, input_ids, torch.full_like(input_ids, -100))
    action = uniform(input_ids.shape)
    to_mask = picked & (action < 0.8)
    to_random = picked & (action >= 0.8) & (action < 0.9)
    # Random tokens in [0, vocab_size - 1), shifted past mask_id so the mask token is never drawn.
    random_ids = (uniform(input_ids.shape) * (vocab_size - 1)).long()
    random_ids = random_ids + (random_ids >= mask_id).long()
    inputs = torch.where(to_mask, torch.full_like(input_ids, mask_id), input_ids)
    inputs = torch.where(to_random, random_ids, inputs)
    return inputs, labels
