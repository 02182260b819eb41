"""Scoring an `EncoderDecoder` on a pair corpus: teacher-forced loss and token accuracy, and decoded
targets against references (exact match, ROUGE) with a table of samples."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from txl.data.seq2seq import PairCorpus, eval_batches
from txl.eval.precision import autocast
from txl.eval.result import EvalResult
from txl.eval.seq2seq_metrics import exact_match, rouge
from txl.generate.seq2seq import beam_search, greedy


@dataclass
class Seq2SeqResult(EvalResult):
    """EvalResult of teacher-forced scoring, plus token accuracy (argmax = label, over scored tokens)."""

    token_accuracy: float | None = None
    pairs: int = 0


@torch.no_grad()
def teacher_forced(model, corpus: PairCorpus, split: str, *, batch_size: int, device, precision: str = "fp32",
                   max_pairs: int = 0) -> Seq2SeqResult:
    """Mean NLL per target token (end symbol included) and token accuracy over `split`."""
    was_training = model.training
    model.eval()
    pairs = corpus.pairs(split)
    pairs = pairs[:max_pairs] if max_pairs else pairs
    start = time.perf_counter()
    nll_sum, correct, count = 0.0, 0, 0
    try:
        for _, batch in eval_batches(pairs, corpus.vocab, batch_size=batch_size):
            labels = batch.labels.to(device)
            with autocast(torch.device(device), precision):
                out = model(batch.source.to(device), batch.attention_mask.to(device), batch.decoder_input.to(device),
                            labels)
            scored = labels != -100
            nll_sum += float(out.nll.double().sum())
            correct += int(((out.logits.argmax(-1) == labels) & scored).sum())
            count += int(scored.sum())
    finally:
        model.train(was_training)
    return Seq2SeqResult(loss=nll_sum / max(count, 1), tokens=count, seconds=time.perf_counter() - start,
                         metric="ppl", mem_len=0, tgt_len=0, batch_size=batch_size, warm_memory=False,
                         mode="seq2seq", split=split, token_accuracy=correct / max(count, 1), pairs=len(pairs))


@dataclass
class DecodeResult:
    """Decoded targets of one split against their references."""

    split: str
    method: str  # "greedy" or "beam4" etc.
    pairs: int
    exact_match: float
    rouge: dict[str, float] | None
    seconds: float
    samples: list[dict] = field(default_factory=list)  # source, reference, output (the first n)
    outputs: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        out = {"split": self.split, "method": self.method, "pairs": self.pairs, "exact_match": self.exact_match,
               "seconds": self.seconds, "samples": self.samples}
        if self.rouge is not None:
            out.update(self.rouge)
        return out


@torch.no_grad()
def decode_split(model, corpus: PairCorpus, split: str, *, beam_size: int = 1, alpha: float = 0.0,
                 batch_size: int = 64, device="cpu", max_pairs: int = 0, max_len: int = 0,
                 n_samples: int = 10) -> DecodeResult:
    """Decode every source of `split` (greedy for beam_size 1) and score the texts against the references."""
    pairs = corpus.pairs(split)
    texts = corpus.references(split)
    if max_pairs:
        pairs, texts = pairs[:max_pairs], texts[:max_pairs]
    vocab = corpus.vocab.target
    longest = max(len(t) for _, t in corpus.pairs("train")) + 1
    max_len = max_len or 2 * longest
    outputs: list[str | None] = [None] * len(pairs)
    start = time.perf_counter()
    for index, batch in eval_batches(pairs, corpus.vocab, batch_size=batch_size):
        src, mask = batch.source.to(device), batch.attention_mask.to(device)
        if beam_size == 1:
            decoded = greedy(model, src, mask, bos=vocab.bos_id, eos=vocab.eos_id, max_len=max_len)
        else:
            decoded = beam_search(model, src, mask, bos=vocab.bos_id, eos=vocab.eos_id, max_len=max_len,
                                  beam_size=beam_size, alpha=alpha)
        for i, tokens in zip(index, decoded.tokens):
            outputs[i] = vocab.decode(tokens)
    references = [t for _, t in texts]
    done = [o or "" for o in outputs]
    samples = [{"source": s, "reference": r, "output": o} for (s, r), o in zip(texts[:n_samples], done)]
    return DecodeResult(split=split, method="greedy" if beam_size == 1 else f"beam{beam_size}", pairs=len(pairs),
                        exact_match=exact_match(done, references), rouge=rouge(done, references),
                        seconds=time.perf_counter() - start, samples=samples, outputs=done)
