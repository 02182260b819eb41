"""Scores of a Style Transformer run (Dai et al. 2019, arXiv 1905.05621, §4.3): `txl eval RUN` of a run with
arch = "style-transformer", and experiments/style_transfer.py (docs/results/style_transfer.md).

Every sentence of a split is transferred greedily into each other style, and the transfers are scored by the
paper's three measures, each with a small stand-in for the paper's tool:

- style accuracy: the share of transfers that a classifier trained on the corpus's training sentences assigns
  to the target style. The paper uses fastText; here a fastText-like linear model over the mean of hashed
  unigram and bigram embeddings (`train_classifier`, seeded; its accuracy on the split's own sentences is
  reported beside it);
- content preservation: self-BLEU, corpus BLEU-4 of the transfers against their own inputs (sacrebleu, no
  tokenisation and no smoothing, as the texts are already tokens; the optional package `sacrebleu`:
  `pip install 'txl[style]'`, else this column is left out);
- fluency: the perplexity of the transfers under a language model of the target style trained on that
  style's training sentences. The paper uses a 5-gram KenLM; here an interpolated Kneser-Ney trigram
  (`KneserNey`, discount 0.75), with the perplexity of the target style's real sentences beside it.

The texts are read as the model reads them: tokenised by txl.data.style, with the words outside the run's
vocabulary written <unk>, for the classifier and the LM too (so an <unk> is no cue of one corpus). The "copy"
rows score the inputs themselves as if they were transfers: the floor of style accuracy, the ceiling of
self-BLEU.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence

import torch

COPY = "copy (the input)"
MODEL = "style transformer"


# -- style accuracy: a fastText-like classifier ----------------------------------------------------------
def hash_gram(gram: str) -> int:
    """FNV-1a of the UTF-8 bytes: a hash stable across processes (Python's own is salted per process)."""
    h = 2166136261
    for byte in gram.encode("utf-8"):
        h = ((h ^ byte) * 16777619) & 0xFFFFFFFF
    return h


def features(words: Sequence[str], buckets: int) -> list[int]:
    """Hashed unigrams and bigrams of one sentence."""
    grams = list(words) + [f"{a} {b}" for a, b in zip(words, words[1:])]
    return [hash_gram(g) % buckets for g in grams] or [0]


def train_classifier(sentences: Sequence[Sequence[str]], labels: Sequence[int], n_classes: int, *, seed: int = 0,
                     buckets: int = 1 << 18, dim: int = 32, epochs: int = 3,
                     progress: bool = False) -> Callable[[Sequence[Sequence[str]]], list[int]]:
    """Train on (sentence, label) pairs with Adam, batches of 64 in a seeded order; returns `predict(sentences)`."""
    from tqdm.auto import tqdm

    with torch.random.fork_rng(devices=[]):  # seeded weights; the caller's random state is left as it was
        torch.manual_seed(seed)
        bag = torch.nn.EmbeddingBag(buckets, dim, mode="mean", sparse=True)
        head = torch.nn.Linear(dim, n_classes)
    # lazy Adam on the table (only the rows a batch touches move, as fastText's sparse updates): a dense Adam
    # step over its 8 M weights took 60 times longer than the rest of the step
    optimizers = [torch.optim.SparseAdam(bag.parameters(), lr=5e-3), torch.optim.Adam(head.parameters(), lr=5e-3)]
    rows = [features(s, buckets) for s in sentences]
    order = list(range(len(rows)))
    rng = random.Random(seed)
    batches = range(0, len(order), 64)
    with tqdm(total=epochs * len(batches), desc="style classifier", unit="batch", disable=not progress,
              leave=False) as bar:
        for _ in range(epochs):
            rng.shuffle(order)
            for start in batches:
                index = order[start: start + 64]
                flat = torch.tensor([f for i in index for f in rows[i]])
                offsets = torch.tensor([0] + [len(rows[i]) for i in index[:-1]]).cumsum(0)
                target = torch.tensor([labels[i] for i in index])
                loss = torch.nn.functional.cross_entropy(head(bag(flat, offsets)), target)
                for optimizer in optimizers:
                    optimizer.zero_grad()
                loss.backward()
                for optimizer in optimizers:
                    optimizer.step()
                bar.update(1)

    def predict(batch: Sequence[Sequence[str]]) -> list[int]:
        out = []
        with torch.no_grad():
            for start in range(0, len(batch), 256):
                feats = [features(s, buckets) for s in batch[start: start + 256]]
                flat = torch.tensor([f for row in feats for f in row])
                offsets = torch.tensor([0] + [len(r) for r in feats[:-1]]).cumsum(0)
                out += head(bag(flat, offsets)).argmax(-1).tolist()
        return out

    return predict


# -- fluency: an interpolated Kneser-Ney trigram -----------------------------------------------------------
class KneserNey:
    """Interpolated Kneser-Ney trigram: the highest order on counts, the lower orders on continuation counts
    (how many distinct words precede), absolute discount d, the unigram floor mixed with a uniform share."""

    def __init__(self, sentences: Sequence[Sequence[str]], discount: float = 0.75):
        self.d = discount
        self.tri, self.ctx2, self.types2 = Counter(), Counter(), Counter()  # c(u v w), c(u v .), N1+(u v .)
        for words in sentences:
            seq = ["<s>", "<s>", *words, "</s>"]
            for u, v, w in zip(seq, seq[1:], seq[2:]):
                if self.tri[(u, v, w)] == 0:
                    self.types2[(u, v)] += 1
                self.tri[(u, v, w)] += 1
                self.ctx2[(u, v)] += 1
        self.mid = Counter((v, w) for (_, v, w) in self.tri)  # N1+(. v w)
        self.mid_ctx, self.mid_types = Counter(), Counter()  # sum_w N1+(. v w), N1+(v .) among them
        for (v, _), c in self.mid.items():
            self.mid_ctx[v] += c
            self.mid_types[v] += 1
        self.continuation = Counter(w for (_, w) in self.mid)  # N1+(. w)
        self.total_bigram_types = max(len(self.mid), 1)
        self.vocab = set(self.continuation) | {"</s>"}

    def prob(self, u: str, v: str, w: str) -> float:
        uniform = 1.0 / (len(self.vocab) + 1)
        p1 = 0.9 * self.continuation[w] / self.total_bigram_types + 0.1 * uniform
        c1 = self.mid_ctx[v]
        p2 = p1 if c1 == 0 else (max(self.mid[(v, w)] - self.d, 0) + self.d * self.mid_types[v] * p1) / c1
        c2 = self.ctx2[(u, v)]
        if c2 == 0:
            return p2
        return (max(self.tri[(u, v, w)] - self.d, 0) + self.d * self.types2[(u, v)] * p2) / c2

    def perplexity(self, sentences: Sequence[Sequence[str]]) -> float:
        total, count = 0.0, 0
        for words in sentences:
            seq = ["<s>", "<s>", *words, "</s>"]
            for u, v, w in zip(seq, seq[1:], seq[2:]):
                total -= math.log(self.prob(u, v, w))
                count += 1
        return math.exp(total / max(count, 1))


# -- content preservation: self-BLEU -------------------------------------------------------------------------
def bleu_available() -> bool:
    try:
        import sacrebleu  # noqa: F401
    except ImportError:
        return False
    return True


def self_bleu(hypotheses: Sequence[Sequence[str]], references: Sequence[Sequence[str]]) -> float | None:
    """Corpus BLEU-4 (one reference each, brevity penalty, no smoothing) in percent; None without sacrebleu."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    if not bleu_available():
        return None
    from sacrebleu.metrics import BLEU

    bleu = BLEU(tokenize="none", smooth_method="none", force=True)
    score = bleu.corpus_score([" ".join(h) for h in hypotheses], [[" ".join(r) for r in references]]).score
    return round(score, 9)  # its product in log space leaves 100.00000000000004 for identical texts


# -- the whole score ---------------------------------------------------------------------------------------------
def transfer_sentences(model, sentences: Sequence[Sequence[int]], style: int, *, device=None,
                       max_length: int | None = None, batch_size: int = 64, progress: bool = False,
                       desc: str = "transfer") -> list[list[int]]:
    """Greedy transfers (ids, without <eos>) of sentences given as ids ending in <eos>, batched by
    `txl.data.style.collate` (also `txl generate --style`'s)."""
    from tqdm.auto import tqdm

    from txl.data.style import collate

    device = device if device is not None else next(model.parameters()).device
    out: list[list[int]] = []
    for start in tqdm(range(0, len(sentences), batch_size), desc=desc, unit="batch", disable=not progress,
                      leave=False):
        chunk = list(sentences[start: start + batch_size])
        batch = collate(chunk, [style] * len(chunk))
        out += model.transfer(batch.tokens.to(device), batch.lengths.to(device), batch.styles.to(device),
                              max_length=max_length)
    return out


def score_style_transfer(model, vocab, corpus, split: str, *, max_sentences: int = 0, n_samples: int = 10,
                         seed: int = 0, device=None, progress: bool = False) -> dict:
    """Transfer the first `max_sentences` (0 = all) sentences of `split` of each style into every other style
    and score them; the classifier and the LMs learn from the corpus's train split.

    Returns {"split", "styles", "rows": one per (from, to, system), "real": the tools on the split's own
    sentences per style, "samples": `n_samples` (source, transfer) per direction, drawn with `seed`}."""
    config, names = model.config, list(corpus.styles)
    special = (config.pad_id, config.eos_id)

    def as_read(ids: Sequence[int]) -> list[str]:
        return [vocab.symbols[i] for i in ids if i not in special]

    train = [[as_read(ids) for ids in corpus.sentences("train", s)] for s in range(len(names))]
    classify = train_classifier([w for style in train for w in style],
                                [s for s, style in enumerate(train) for _ in style], len(names), progress=progress)
    lms = [KneserNey(style) for style in train]
    held = [corpus.sentences(split, s)[: max_sentences or None] for s in range(len(names))]
    rows, samples = [], []
    was_training = model.training
    model.eval()
    try:
        for source, sentences in enumerate(held):
            inputs = [as_read(ids) for ids in sentences]
            for target in range(len(names)):
                if target == source:
                    continue
                transfers = [as_read(ids) for ids in transfer_sentences(
                    model, sentences, target, device=device, progress=progress,
                    desc=f"{names[source]} -> {names[target]}")]
                for system, texts in ((MODEL, transfers), (COPY, inputs)):
                    predicted = classify(texts)
                    rows.append({"from": names[source], "to": names[target], "system": system,
                                 "sentences": len(texts),
                                 "style_accuracy": sum(p == target for p in predicted) / max(len(texts), 1),
                                 "self_bleu": self_bleu(texts, inputs),
                                 "target_lm_ppl": lms[target].perplexity(texts)})
                rng = random.Random(seed)
                for i in sorted(rng.sample(range(len(inputs)), min(n_samples, len(inputs)))):
                    samples.append({"from": names[source], "to": names[target], "source": " ".join(inputs[i]),
                                    "transfer": " ".join(transfers[i])})
    finally:
        model.train(was_training)
    real = {}
    for s, sentences in enumerate(held):
        texts = [as_read(ids) for ids in sentences]
        real[names[s]] = {"classifier_accuracy": sum(p == s for p in classify(texts)) / max(len(texts), 1),
                          "lm_ppl": lms[s].perplexity(texts), "sentences": len(texts)}
    return {"split": split, "styles": names, "rows": rows, "real": real, "samples": samples}


def rows_table(scores: dict) -> str:
    """The rows as a markdown table (self-BLEU "-" without sacrebleu)."""
    lines = ["| from -> to | system | sentences | style accuracy | self-BLEU | target LM ppl |",
             "|---|---|---|---|---|---|"]
    for row in scores["rows"]:
        bleu = "-" if row["self_bleu"] is None else f"{row['self_bleu']:.1f}"
        lines.append(f"| {row['from']} -> {row['to']} | {row['system']} | {row['sentences']:,} | "
                     f"{100 * row['style_accuracy']:.1f}% | {bleu} | {row['target_lm_ppl']:.1f} |")
    return "\n".join(lines)


def real_table(scores: dict) -> str:
    lines = ["| style | classifier accuracy | LM ppl (own style) | sentences |", "|---|---|---|---|"]
    for name, v in scores["real"].items():
        lines.append(f"| {name} | {100 * v['classifier_accuracy']:.1f}% | {v['lm_ppl']:.1f} | {v['sentences']:,} |")
    return "\n".join(lines)
