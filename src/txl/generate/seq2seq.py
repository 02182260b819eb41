"""Decoding an `EncoderDecoder`: greedy, beam search and sampling; batched, with the decoder cache.

Every function takes padded sources (b, s) with their `attention_mask`, encodes them once and returns,
per source, the generated target ids *without* the start symbol and without the end symbol, plus the
model score of each: the sum of the log-probabilities of its tokens, the end symbol included when it was
produced. `use_cache=False` re-runs the decoder over the whole prefix at each step (the reference the
cached path is tested against).

Beam search (Sutskever et al. 2014; length penalty of Wu et al. 2016, GNMT: lp(n) = ((5 + n) / 6)^α,
α = 0 ranks by the summed log-probability) keeps `beam_size` hypotheses per source. It also counts the
greedy hypothesis among its finished ones, so it never returns a lower (length-penalised) score than
greedy decoding, and it stops early only when no live hypothesis can still beat the best finished one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from txl.errors import UsageError
from txl.generate.limits import MAX_BEAM, MAX_LENGTH_PENALTY
from txl.nn.sampling import pick_tokens


class EncoderDecoder(Protocol):
    """What decoding reads of an encoder-decoder (`txl.models.seq2seq.EncoderDecoder`): decoding sits
    below the models and knows this contract, never the class."""

    config: Any  # .n_layer, .vocab_size
    training: bool

    def encode(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor: ...
    def decode(self, decoder_input_ids: Tensor, encoded: Tensor, *, attention_mask: Tensor | None = None,
               cache: Any = None) -> Tensor: ...
    def output_logits(self, hidden: Tensor) -> Tensor: ...
    def new_cache(self) -> Any: ...  # an empty cache with reorder(index)
    def eval(self) -> Any: ...
    def train(self, mode: bool = True) -> Any: ...


@dataclass
class Decoded:
    """tokens: per source, the generated ids (no start, no end symbol); scores: their summed
    log-probabilities (float, the end symbol included when produced); finished: whether each ended with
    the end symbol (else it hit `max_len`)."""

    tokens: list[list[int]]
    scores: list[float]
    finished: list[bool]


def length_penalty(length: int, alpha: float) -> float:
    """GNMT's lp(n) = ((5 + n) / 6)^α (Wu et al. 2016, eq. 14); 1 for α = 0."""
    return ((5.0 + length) / 6.0) ** alpha


def _check(model: EncoderDecoder, source: Tensor, max_len: int, bos: int, eos: int) -> None:
    if source.dim() != 2:
        raise UsageError(f"source must be (batch, length), got shape {tuple(source.shape)}")
    if max_len < 1:
        raise UsageError(f"max_len must be >= 1, got {max_len}")
    vocab = model.config.vocab_size
    for name, value in (("bos", bos), ("eos", eos)):
        if not 0 <= value < vocab:
            raise UsageError(f"{name}={value} is outside the target vocabulary of {vocab} ids")


def new_cache(model: EncoderDecoder):
    """An empty decoder cache for `model`, from its `new_cache()` (the contract): decoding sits below
    the models and imports none of them (the dependency rule)."""
    return model.new_cache()


class _Stepper:
    """One next-token distribution per step, with or without the cache."""

    def __init__(self, model: EncoderDecoder, encoded: Tensor, attention_mask: Tensor | None, use_cache: bool):
        self.model, self.encoded, self.mask = model, encoded, attention_mask
        self.cache = new_cache(model) if use_cache else None

    def log_probs(self, prefix: Tensor) -> Tensor:
        """prefix (n, t) -> (n, V) log-probabilities of the token after it."""
        ids = prefix if self.cache is None else prefix[:, self.cache.length:]
        hidden = self.model.decode(ids, self.encoded, attention_mask=self.mask, cache=self.cache)
        return self.model.output_logits(hidden[:, -1]).float().log_softmax(dim=-1)

    def keep(self, index: Tensor) -> None:
        self.encoded = self.encoded.index_select(0, index)
        if self.mask is not None:
            self.mask = self.mask.index_select(0, index)
        if self.cache is not None:
            self.cache.reorder(index)


@torch.no_grad()
def greedy(model: EncoderDecoder, source: Tensor, attention_mask: Tensor | None = None, *, bos: int, eos: int,
           max_len: int, use_cache: bool = True) -> Decoded:
    """The most probable token at every step, for a batch of sources at once."""
    return _sample_or_greedy(model, source, attention_mask, bos=bos, eos=eos, max_len=max_len,
                             use_cache=use_cache, temperature=0.0)


@torch.no_grad()
def sample(model: EncoderDecoder, source: Tensor, attention_mask: Tensor | None = None, *, bos: int, eos: int,
           max_len: int, temperature: float = 1.0, top_k: int = 0, generator: torch.Generator | None = None,
           use_cache: bool = True) -> Decoded:
    """Ancestral sampling at `temperature` from the `top_k` most probable tokens (0 = all)."""
    if not temperature > 0:
        raise UsageError(f"temperature must be > 0 for sampling, got {temperature} (use greedy decoding)")
    if top_k < 0:
        raise UsageError(f"top_k must be >= 0, got {top_k}")
    return _sample_or_greedy(model, source, attention_mask, bos=bos, eos=eos, max_len=max_len,
                             use_cache=use_cache, temperature=temperature, top_k=top_k, generator=generator)


def _sample_or_greedy(model, source, attention_mask, *, bos, eos, max_len, use_cache, temperature,
                      top_k=0, generator=None) -> Decoded:
    _check(model, source, max_len, bos, eos)
    was_training = model.training
    model.eval()
    try:
        encoded = model.encode(source, attention_mask)
        stepper = _Stepper(model, encoded, attention_mask, use_cache)
        batch = source.shape[0]
        prefix = torch.full((batch, 1), bos, dtype=torch.long, device=source.device)
        scores = torch.zeros(batch, dtype=torch.float64, device=source.device)
        done = torch.zeros(batch, dtype=torch.bool, device=source.device)
        for _ in range(max_len):
            log_probs = stepper.log_probs(prefix)
            # the one token picker (txl.nn.sampling) over the log-probabilities, as this loop always drew
            token = pick_tokens(log_probs, temperature=temperature, top_k=top_k,
                                generator=generator).to(source.device)
            token = torch.where(done, torch.full_like(token, eos), token)
            scores += torch.where(done, 0.0, log_probs.gather(1, token[:, None]).squeeze(1).double())
            prefix = torch.cat([prefix, token[:, None]], dim=1)
            done |= token == eos
            if bool(done.all()):
                break
    finally:
        model.train(was_training)
    tokens, finished = [], []
    for row in prefix[:, 1:].tolist():
        ended = eos in row
        tokens.append(row[: row.index(eos)] if ended else row)
        finished.append(ended)
    return Decoded(tokens, scores.tolist(), finished)


@torch.no_grad()
def beam_search(model: EncoderDecoder, source: Tensor, attention_mask: Tensor | None = None, *, bos: int,
                eos: int, max_len: int, beam_size: int = 4, alpha: float = 0.0, use_cache: bool = True) -> Decoded:
    """The hypothesis with the best length-penalised score among `beam_size` kept per step (and the
    greedy one). `alpha`: the GNMT length penalty's exponent (0 = summed log-probability)."""
    _check(model, source, max_len, bos, eos)
    if beam_size < 1:
        raise UsageError(f"beam_size must be >= 1, got {beam_size}")
    if beam_size > MAX_BEAM:  # (batch × beam_size) decoder caches are held at once
        raise UsageError(f"beam_size must be <= {MAX_BEAM}, got {beam_size:,}")
    if not (math.isfinite(alpha) and 0 <= alpha <= MAX_LENGTH_PENALTY):  # NaN ranked every hypothesis alike
        raise UsageError(f"the length penalty alpha must be a finite number in [0, {MAX_LENGTH_PENALTY:g}], "
                         f"got {alpha}")
    baseline = greedy(model, source, attention_mask, bos=bos, eos=eos, max_len=max_len, use_cache=use_cache)
    if beam_size == 1:
        return baseline
    was_training = model.training
    model.eval()
    try:
        return _beam(model, source, attention_mask, baseline, bos=bos, eos=eos, max_len=max_len,
                     beam_size=beam_size, alpha=alpha, use_cache=use_cache)
    finally:
        model.train(was_training)


def _beam(model, source, attention_mask, baseline: Decoded, *, bos, eos, max_len, beam_size, alpha, use_cache):
    batch, device = source.shape[0], source.device
    vocab = model.config.vocab_size
    encoded = model.encode(source, attention_mask)
    # (batch·beam) rows, beams of one source adjacent; at the start only beam 0 is live
    rows = torch.arange(batch, device=device).repeat_interleave(beam_size)
    stepper = _Stepper(model, encoded.index_select(0, rows), None if attention_mask is None
                       else attention_mask.index_select(0, rows), use_cache)
    prefix = torch.full((batch * beam_size, 1), bos, dtype=torch.long, device=device)
    scores = torch.full((batch, beam_size), float("-inf"), dtype=torch.float64, device=device)
    scores[:, 0] = 0.0

    def ranked(tokens: list[int], score: float, ended: bool) -> float:
        return score / length_penalty(len(tokens) + int(ended), alpha)

    # best finished hypothesis per source: (ranking score, tokens, raw score, ended) — greedy's first
    best = [(ranked(t, s, f), t, s, f) for t, s, f in zip(baseline.tokens, baseline.scores, baseline.finished)]
    open_ = [True] * batch
    for step in range(1, max_len + 1):
        log_probs = stepper.log_probs(prefix).double().view(batch, beam_size, vocab)
        total = (scores[:, :, None] + log_probs).view(batch, -1)  # (batch, beam·V)
        top_scores, top_index = total.topk(2 * beam_size, dim=1)  # enough to keep beam_size live ones
        beam_of, token_of = top_index // vocab, top_index % vocab
        new_scores = torch.full_like(scores, float("-inf"))
        chosen_rows = torch.zeros(batch, beam_size, dtype=torch.long, device=device)
        chosen_tokens = torch.full((batch, beam_size), eos, dtype=torch.long, device=device)
        top_scores_l, beam_l, token_l = top_scores.tolist(), beam_of.tolist(), token_of.tolist()
        for b in range(batch):
            kept = 0
            for score, beam, token in zip(top_scores_l[b], beam_l[b], token_l[b]):
                if score == float("-inf") or kept == beam_size:
                    break
                row = b * beam_size + beam
                if token == eos or step == max_len:
                    ended = token == eos
                    hyp = prefix[row, 1:].tolist() + ([] if ended else [token])
                    candidate = (ranked(hyp, score, ended), hyp, score, ended)
                    if open_[b] and candidate[0] > best[b][0]:
                        best[b] = candidate
                    continue
                new_scores[b, kept] = score
                chosen_rows[b, kept] = row
                chosen_tokens[b, kept] = token
                kept += 1
            # stop a source when no live hypothesis can beat its best: raw scores only fall, and
            # ((5 + n) / 6)^α grows with n, so max_len's penalty bounds a live one's ranking score
            live = new_scores[b].max().item()
            if live == float("-inf") or live / length_penalty(max_len, alpha) <= best[b][0]:
                open_[b] = False
                new_scores[b] = float("-inf")
        if not any(open_):
            break
        flat_rows = chosen_rows.view(-1)
        stepper.keep(flat_rows)
        prefix = torch.cat([prefix.index_select(0, flat_rows), chosen_tokens.view(-1, 1)], dim=1)
        scores = new_scores
    return Decoded([b[1] for b in best], [b[2] for b in best], [b[3] for b in best])
