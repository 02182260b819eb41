"""The one token picker: next-token scores -> one token per row (greedy at temperature 0, else a draw
from the temperature-scaled distribution filtered to the top-k tokens and the top-p nucleus; Holtzman et
al. 2020). Every decoder calls it: the language-model decoder (`txl.generate.decoder`, behind
`model.generate`, `txl generate`, `sample_text` and `txl serve`) and the encoder-decoder's sampling
(`txl.generate.seq2seq`).

Draws are reproducible: with a `torch.Generator` the same seed gives the same tokens. The draw is made
on the generator's device (the CPU without one), so a CPU generator seeds the same tokens whichever
device the model runs on (torch's CUDA and CPU random streams differ).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from txl.errors import CheckpointError, UsageError

# Below these, logits / temperature overflows float32 and the nucleus test underflows: both would turn
# the probabilities into NaN. A temperature this small is greedy decoding in all but name.
MIN_TEMPERATURE = 1e-3
MIN_TOP_P = 1e-6
MAX_NEW_TOKENS = 1 << 24


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    """The sampling settings a user gives, checked: one line naming the setting and its range."""
    if max_new_tokens < 1:
        raise UsageError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if max_new_tokens > MAX_NEW_TOKENS:
        raise UsageError(f"max_new_tokens must be <= {MAX_NEW_TOKENS:,}, got {max_new_tokens:.3g}")
    if temperature < 0:
        raise UsageError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not (temperature == 0 or MIN_TEMPERATURE <= temperature < math.inf):  # also NaN
        raise UsageError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {temperature}")
    if top_k < 0:
        raise UsageError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0.0 < top_p <= 1.0:  # also rejects NaN
        raise UsageError(f"top_p must be in (0, 1], got {top_p}")
    if top_p < MIN_TOP_P:
        raise UsageError(f"top_p must be >= {MIN_TOP_P} (a smaller nucleus underflows; use --greedy), got {top_p}")


def check_seed(seed: int | None) -> None:
    if seed is not None and not 0 <= seed < 2**63:
        raise UsageError(f"seed must be in [0, 2**63), got {seed:.3g}" if seed >= 10**15 else
                         f"seed must be in [0, 2**63), got {seed}")


def filter_logits(logits: Tensor, *, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Mask all but the top-k tokens and the smallest nucleus with probability >= top_p."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens before it already reach top_p (the top token always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def check_finite_scores(logits: Tensor) -> None:
    """Sampling from NaN probabilities is a torch error deep inside multinomial; say what it means."""
    if not bool(torch.isfinite(logits).all()):
        raise CheckpointError("the model's scores for the next token are not finite (NaN or Inf): its weights are "
                              "damaged or were trained into overflow; use another checkpoint")


def pick_tokens(logits: Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> Tensor:
    """One token per row of `logits` (rows, vocab) -> (rows,) long on the CPU: the argmax at temperature
    0, else one draw per row from softmax(filter(logits / temperature)) with `generator`."""
    check_finite_scores(logits)
    if temperature == 0:
        return logits.argmax(-1).cpu()
    probs = filter_logits(logits / temperature, top_k=top_k, top_p=top_p).softmax(-1)
    probs = probs.to(generator.device if generator is not None else "cpu")
    return torch.multinomial(probs, 1, generator=generator)[:, 0].cpu()
