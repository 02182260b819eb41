"""Sampled softmax for training (Jean et al. 2015; the reference code's `--sample_softmax`).

With `config.sample_softmax = n > 0`, a model in training mode scores each target against a set of
negatives shared by the whole batch instead of the whole vocabulary, as the reference's `sample_logits`:

- the candidates are 2·n draws with replacement from the log-uniform (Zipfian) distribution
  P(k) = (log(k + 2) - log(k + 1)) / log(V + 1), made distinct, so a step has at most 2·n negatives (the
  number varies from step to step, as in the reference); the distribution assumes ids sorted by falling
  frequency, which txl's word vocabularies are (docs/guide/data.md);
- every logit, the target's and the negatives', is corrected by the log of its expected inclusion,
  log Q(k) = log(1 - (1 - P(k))^(2n)) (TensorFlow's `log_uniform_candidate_sampler`, whose formula the
  reference uses), so the sampled loss estimates the full softmax's;
- a negative that is the row's own target (an "accidental hit") is removed from that row;
- the loss of a row is -log_softmax([target ; negatives])[target].

As n grows every id enters the sample and log Q → 0, so the sampled loss and its gradient become the full
softmax's (tests/test_sampled_softmax.py measures the gradient error falling with n). Evaluation, generation
and any model in eval mode use the full softmax; the training loss in the logs is the sampled one.

Candidates are drawn by inverting the log-uniform CDF, log(k + 2) / log(V + 1), with the global RNG (saved
in checkpoints, so a resumed run draws what the uninterrupted one would have).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def log_uniform_draws(vocab_size: int, shape: int | tuple[int, ...], *,
                      device: torch.device | str | None = None) -> Tensor:
    """Draws with replacement from P(k) = log((k+2)/(k+1)) / log(V+1), k in [0, V) (int64, `shape`).

    Inverse CDF: P(X <= k) = log(k + 2) / log(V + 1), so X = floor(exp(u · log(V + 1))) - 1 for u ~ U[0, 1)."""
    u = torch.rand(shape, dtype=torch.float64, device=device)
    ids = torch.floor(torch.exp(u * math.log(vocab_size + 1))).long() - 1
    return ids.clamp_(0, vocab_size - 1)  # float rounding at u -> 1


def log_uniform_candidates(vocab_size: int, num_tries: int, *, device: torch.device | str | None = None) -> Tensor:
    """The negatives of one step: `num_tries` log-uniform draws, distinct and sorted (int64)."""
    return log_uniform_draws(vocab_size, num_tries, device=device).unique()


def log_expected_count(ids: Tensor, vocab_size: int, num_tries: int) -> Tensor:
    """log Q(k) = log(1 - (1 - P(k))^num_tries), P the log-uniform distribution (float32, shape of ids).

    Written -expm1(num_tries · log1p(-P)) for accuracy where P is small (the rare ids)."""
    k = ids.to(torch.float64)
    p = torch.log1p(1.0 / (k + 1.0)) / math.log(vocab_size + 1)
    return torch.log(-torch.expm1(num_tries * torch.log1p(-p))).float()


def sampled_nll(hidden: Tensor, weight: Tensor, bias: Tensor, labels: Tensor, negatives: Tensor, *,
                vocab_size: int, num_tries: int, linear: Callable[..., Tensor] = F.linear) -> Tensor:
    """Per-row sampled-softmax NLL (n,) float32, 0 where the label is -100.

    hidden: (n, d) already in the output weight's space (after the output projection); weight: (V, d);
    bias: (V,); labels: (n,) target ids or -100; negatives: (s,) distinct candidate ids shared by the rows."""
    ignored = labels == -100
    target = labels.clamp(0, vocab_size - 1)
    true_logit = (hidden * weight[target]).sum(-1).float() + bias[target].float()  # (n,)
    true_logit = true_logit - log_expected_count(target, vocab_size, num_tries)
    sample_logit = linear(hidden, weight[negatives], bias[negatives]).float()  # (n, s)
    sample_logit = sample_logit - log_expected_count(negatives, vocab_size, num_tries)
    hit = target[:, None] == negatives[None, :]  # (n, s): the row's own target drawn as a negative
    sample_logit = sample_logit.masked_fill(hit, float("-inf"))
    logits = torch.cat([true_logit[:, None], sample_logit], dim=-1)  # (n, 1 + s), the target first
    nll = torch.logsumexp(logits, dim=-1) - true_logit
    return nll.masked_fill(ignored, 0.0)
