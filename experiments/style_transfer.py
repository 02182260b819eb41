"""The Style Transformer (Dai et al. 2019) on two styles that exist here, scored as the paper scores it (issue 48
item 6; the result is docs/results/style_transfer.{json,md}).

    python experiments/style_transfer.py --data "style:SHAKESPEARE/input.txt,PTB/ptb.train.txt?names=shakespeare,ptb&max_len=15&vocab_size=5000" --minutes 25

An experiment, not part of the installed package: it trains with the public command line (`txl train --preset
style-transfer --data SPEC`, one thread) unless the run directory already holds a finished run, then loads the
checkpoint through txl's API and transfers every test sentence of each style (up to --max-test) into the other
style, greedily. The three measures of the paper (its §4.3), each with our own small stand-in for its tool:

- style accuracy: the share of transfers that a classifier trained on the two corpora's training sentences
  assigns to the target style. The paper uses fastText; here a fastText-like linear model over the mean of
  hashed unigram and bigram embeddings (trained here, seeded; its accuracy on the untouched test sentences is
  reported beside it);
- content preservation: self-BLEU, corpus BLEU-4 (Papineni et al. 2002, brevity penalty, no smoothing) of the
  transfers against their own inputs (the paper's "self-BLEU"; it has no human references here);
- fluency: the perplexity of the transfers under a language model of the target style, trained on that style's
  training sentences. The paper uses a 5-gram KenLM model; here an interpolated Kneser-Ney trigram (discount
  0.75), with the perplexity of the target style's real test sentences beside it.

The texts are read as the model reads them: tokenised by txl.data.style and with the words outside the run's
vocabulary written <unk>, for the classifier and the LM too (so an <unk> is no cue of one corpus). The "copy"
row scores the inputs themselves as if they were transfers: the floor of style accuracy and the ceiling of
self-BLEU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.2f}/{five:.2f} (1/5 min) on {os.cpu_count()} cores"


def shown_spec(spec: str) -> str:
    """The spec with each file's directory written DIR (no page records a path of the machine)."""
    name, _, rest = spec.partition(":")
    body, q, query = rest.partition("?")
    return f"{name}:" + ",".join(f"DIR/{Path(p).name}" for p in body.split(",")) + q + query


# -- the style classifier (fastText-like) ------------------------------------------------------------
def features(words: list[str], buckets: int) -> list[int]:
    grams = words + [f"{a} {b}" for a, b in zip(words, words[1:])]
    return [hash_gram(g) % buckets for g in grams] or [0]


def hash_gram(gram: str) -> int:
    """A stable hash (Python's own is salted per process)."""
    h = 2166136261
    for byte in gram.encode("utf-8"):
        h = ((h ^ byte) * 16777619) & 0xFFFFFFFF
    return h


def train_classifier(sentences: list[list[str]], labels: list[int], n_classes: int, *, seed: int = 0,
                     buckets: int = 1 << 18, dim: int = 32, epochs: int = 3):
    import torch

    torch.manual_seed(seed)
    bag = torch.nn.EmbeddingBag(buckets, dim, mode="mean")
    head = torch.nn.Linear(dim, n_classes)
    optimizer = torch.optim.Adam(list(bag.parameters()) + list(head.parameters()), lr=5e-3)
    rows = [features(s, buckets) for s in sentences]
    order = list(range(len(rows)))
    rng = random.Random(seed)
    for _ in range(epochs):
        rng.shuffle(order)
        for start in range(0, len(order), 64):
            index = order[start: start + 64]
            flat = torch.tensor([f for i in index for f in rows[i]])
            offsets = torch.tensor([0] + [len(rows[i]) for i in index[:-1]]).cumsum(0)
            loss = torch.nn.functional.cross_entropy(head(bag(flat, offsets)), torch.tensor([labels[i] for i in index]))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    def predict(batch: list[list[str]]) -> list[int]:
        out = []
        with torch.no_grad():
            for start in range(0, len(batch), 256):
                feats = [features(s, buckets) for s in batch[start: start + 256]]
                flat = torch.tensor([f for row in feats for f in row])
                offsets = torch.tensor([0] + [len(r) for r in feats[:-1]]).cumsum(0)
                out += head(bag(flat, offsets)).argmax(-1).tolist()
        return out

    return predict


# -- the target-style language model: interpolated Kneser-Ney trigram ----------------------------------
class KneserNey:
    """Interpolated Kneser-Ney trigram: the highest order on counts, the lower orders on continuation counts
    (how many distinct words precede), absolute discount d, the unigram floor mixed with a uniform share."""

    def __init__(self, sentences: list[list[str]], discount: float = 0.75):
        self.d = discount
        self.tri, self.ctx2, self.types2 = Counter(), Counter(), Counter()  # c(u v w), c(u v .), N1+(u v .)
        for words in sentences:
            seq = ["<s>", "<s>"] + words + ["</s>"]
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
        self.total_bigram_types = len(self.mid)
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

    def perplexity(self, sentences: list[list[str]]) -> float:
        total, count = 0.0, 0
        for words in sentences:
            seq = ["<s>", "<s>"] + words + ["</s>"]
            for u, v, w in zip(seq, seq[1:], seq[2:]):
                total -= math.log(self.prob(u, v, w))
                count += 1
        return math.exp(total / max(count, 1))


# -- BLEU ----------------------------------------------------------------------------------------------
def corpus_bleu(hypotheses: list[list[str]], references: list[list[str]], n: int = 4) -> float:
    """Corpus BLEU-n (one reference each), in percent."""
    matches, totals = [0] * n, [0] * n
    hyp_len = ref_len = 0
    for hyp, ref in zip(hypotheses, references):
        hyp_len += len(hyp)
        ref_len += len(ref)
        for k in range(1, n + 1):
            h = Counter(tuple(hyp[i: i + k]) for i in range(len(hyp) - k + 1))
            r = Counter(tuple(ref[i: i + k]) for i in range(len(ref) - k + 1))
            matches[k - 1] += sum(min(c, r[g]) for g, c in h.items())
            totals[k - 1] += max(len(hyp) - k + 1, 0)
    if min(matches) == 0:
        return 0.0
    log_precision = sum(math.log(m / t) for m, t in zip(matches, totals)) / n
    brevity = 1.0 if hyp_len > ref_len else math.exp(1 - ref_len / max(hyp_len, 1))
    return 100 * brevity * math.exp(log_precision)


# -- the study -----------------------------------------------------------------------------------------
def train(args) -> tuple[list[str], float]:
    out = Path(args.runs) / "style"
    command = [sys.executable, "-m", "txl", "train", "--preset", "style-transfer", "--data", args.data, "--out",
               str(out), "--max-steps", "100000", "--max-minutes", str(args.minutes), "--set",
               f"model.pretrain_steps={args.pretrain_steps}", "--set", "eval_interval=100000", "--threads",
               str(args.threads), "--quiet"] + sum((["--set", s] for s in args.set), [])
    if not (out / "result.json").is_file():
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT / "src")}
        subprocess.run(command, check=True, env=env)
    return command, out


def study(args) -> dict:
    import torch

    from txl.data.style import open_style_corpus
    from txl.models.checkpoint import load_checkpoint

    torch.set_num_threads(args.threads)
    command, run = train(args)
    load = cpu_load()
    ckpt = load_checkpoint(run / "last")
    model, vocab, config = ckpt.model.eval(), ckpt.vocab, ckpt.model.config
    corpus = open_style_corpus(args.data, vocab=vocab)
    names = corpus.styles
    as_read = lambda ids: [vocab.symbols[i] for i in ids if i not in (config.pad_id, config.eos_id)]  # noqa: E731

    train_words = [[as_read(ids) for ids in corpus.sentences("train", s)] for s in range(len(names))]
    classify = train_classifier([w for style in train_words for w in style],
                                [s for s, style in enumerate(train_words) for _ in style], len(names))
    lms = [KneserNey(style) for style in train_words]

    rows, samples = [], []
    for source_style in range(len(names)):
        target = (source_style + 1) % len(names)
        sentences = corpus.sentences("test", source_style)[: args.max_test]
        outputs = []
        for start in range(0, len(sentences), 64):
            chunk = sentences[start: start + 64]
            width = max(len(s) for s in chunk)
            tokens = torch.full((len(chunk), width), config.pad_id, dtype=torch.long)
            for i, ids in enumerate(chunk):
                tokens[i, : len(ids)] = torch.tensor(ids)
            lengths = torch.tensor([len(s) for s in chunk])
            outputs += model.transfer(tokens, lengths, torch.full((len(chunk),), target, dtype=torch.long))
        inputs = [as_read(ids) for ids in sentences]
        transfers = [as_read(ids) for ids in outputs]
        for label, texts in (("style transformer", transfers), ("copy (the input)", inputs)):
            predicted = classify(texts)
            rows.append({"from": names[source_style], "to": names[target], "system": label, "sentences": len(texts),
                         "style_accuracy": sum(p == target for p in predicted) / len(texts),
                         "self_bleu": corpus_bleu(texts, inputs),
                         "target_lm_ppl": lms[target].perplexity(texts)})
        rng = random.Random(args.seed)
        for i in sorted(rng.sample(range(len(inputs)), min(10, len(inputs)))):
            samples.append({"from": names[source_style], "to": names[target], "source": " ".join(inputs[i]),
                            "transfer": " ".join(transfers[i])})
    real = {}
    for s in range(len(names)):
        test = [as_read(ids) for ids in corpus.sentences("test", s)[: args.max_test]]
        real[names[s]] = {"classifier_accuracy": sum(p == s for p in classify(test)) / len(test),
                          "lm_ppl": lms[s].perplexity(test), "sentences": len(test)}
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    result = json.loads((run / "result.json").read_text())
    training = {"steps": result.get("steps"), "minutes": (metrics[-1].get("elapsed") or 0) / 60 if metrics else None,
                "parameters": model.num_parameters(), "stopped_by": result.get("stopped_by"),
                "valid_self_reconstruction_ppl": (result.get("final", {}).get("valid") or {}).get("ppl")}
    shown = [shlex.quote(c) for c in command[3:]]
    shown[shown.index("--data") + 1] = shlex.quote(shown_spec(args.data))
    shown[shown.index("--out") + 1] = "RUN"
    return {"data": shown_spec(args.data), "styles": list(names),
            "train_sentences": {n: len(corpus.sentences("train", i)) for i, n in enumerate(names)},
            "command": "OMP_NUM_THREADS=1 txl " + " ".join(shown),
            "study_command": "python experiments/style_transfer.py " + " ".join(
                [f"--data {shlex.quote(shown_spec(args.data))}", f"--minutes {args.minutes:g}",
                 f"--pretrain-steps {args.pretrain_steps}", f"--max-test {args.max_test}", f"--seed {args.seed}"]
                + [f"--set {shlex.quote(s)}" for s in args.set]),
            "model": {k: v for k, v in config.to_dict().items() if k in (
                "n_layer", "n_encoder_layer", "n_discriminator_layer", "d_model", "n_head", "d_head", "d_inner",
                "discriminator", "self_factor", "cycle_factor", "adversarial_factor", "temperature",
                "pretrain_steps", "discriminator_steps", "generator_steps", "max_length", "vocab_size")},
            "training": training, "machine": f"shared CPU, 1 torch thread, load {load} when scored",
            "rows": rows, "real_test": real, "samples": samples,
            "date": time.strftime("%Y-%m-%d", time.gmtime())}


def markdown(r: dict) -> str:
    t = r["training"]
    lines = [
        "# Style Transformer: Tiny Shakespeare lines <-> Penn Treebank sentences",
        "",
        "Written by `experiments/style_transfer.py` (issue 48 item 6); do not edit by hand. The model: Dai et al. "
        "2019, *Style Transformer: Unpaired Text Style Transfer without Disentangled Latent Representation* "
        "(arXiv 1905.05621), `arch = \"style-transformer\"` (`txl.models.style`), trained by the reference "
        "implementation's schedule (`txl.train.style`).",
        "",
        f"- Data: `{r['data']}` (style = the file a sentence came from; lines of 5-15 tokens, split 90/5/5 by "
        f"hash; training sentences {', '.join(f'{k} {v:,}' for k, v in r['train_sentences'].items())}).",
        f"- Training: `{r['command']}` — {t['steps']:,} steps ({t['stopped_by']}) in {t['minutes']:.1f} minutes, "
        f"{t['parameters']:,} parameters (generator and discriminator); valid self-reconstruction perplexity "
        f"{t['valid_self_reconstruction_ppl'] or float('nan'):.2f}.",
        f"- Study: `{r['study_command']}`",
        f"- Machine: {r['machine']}; the minutes are wall-clock on a machine shared with other jobs.",
        "",
        "Measures (the paper's §4.3, with small stand-ins for its tools): **style accuracy** = share of transfers "
        "a fastText-like classifier (hashed unigrams and bigrams, trained on both corpora's training sentences) "
        "assigns to the target style; **self-BLEU** = corpus BLEU-4 of the transfers against their inputs "
        "(content preservation); **target LM ppl** = perplexity under an interpolated Kneser-Ney trigram of the "
        "target style's training sentences (fluency; the paper: a 5-gram KenLM). The *copy* rows score the "
        "inputs themselves: the floor of style accuracy and the ceiling of self-BLEU. Greedy decoding.",
        "",
        "| from -> to | system | sentences | style accuracy | self-BLEU | target LM ppl |",
        "|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        lines.append(f"| {row['from']} -> {row['to']} | {row['system']} | {row['sentences']:,} | "
                     f"{100 * row['style_accuracy']:.1f}% | {row['self_bleu']:.1f} | {row['target_lm_ppl']:.1f} |")
    rounds = max(0, (t["steps"] or 0) - r["model"]["pretrain_steps"]) / (
        r["model"]["discriminator_steps"] + r["model"]["generator_steps"])
    pairs = [(a, b) for a, b in zip(r["rows"][::2], r["rows"][1::2])]
    gain = ", ".join(f"{a['from']} -> {a['to']} {100 * (a['style_accuracy'] - b['style_accuracy']):+.1f} points"
                     for a, b in pairs)
    lines += ["", f"Reading: after {rounds:.0f} rounds of {r['model']['discriminator_steps']} discriminator and "
              f"{r['model']['generator_steps']} generator steps (and {r['model']['pretrain_steps']} steps of "
              f"self-reconstruction), the style accuracy of the transfers over copying the input is: {gain}; "
              "where that is near zero the model still rewrites each sentence as itself (self-BLEU near 100), i.e. "
              "this budget has not yet moved it off the reconstruction it learns first. The measures and the "
              "samples are what this run gives; they say nothing of the paper's numbers (Yelp and IMDb, a model "
              "four times wider, far more rounds on a GPU)."]
    lines += ["", "The tools on real test sentences of each style (their own style):", "",
              "| style | classifier accuracy | LM ppl (own style) | sentences |", "|---|---|---|---|"]
    for name, v in r["real_test"].items():
        lines.append(f"| {name} | {100 * v['classifier_accuracy']:.1f}% | {v['lm_ppl']:.1f} | {v['sentences']:,} |")
    for direction in dict.fromkeys((s["from"], s["to"]) for s in r["samples"]):
        lines += ["", f"## Ten samples, {direction[0]} -> {direction[1]} (test sentences, drawn with a fixed seed)", "",
                  "| input | transfer |", "|---|---|"]
        for s in r["samples"]:
            if (s["from"], s["to"]) == direction:
                cell = lambda text: text.replace("|", "\\|")  # noqa: E731
                lines.append(f"| {cell(s['source'])} | {cell(s['transfer'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a style: spec (one file per style)")
    parser.add_argument("--minutes", type=float, default=25.0, help="training budget (txl train --max-minutes)")
    parser.add_argument("--pretrain-steps", type=int, default=300, help="model.pretrain_steps")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more txl train --set")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-test", type=int, default=500, help="test sentences transferred per style")
    parser.add_argument("--seed", type=int, default=0, help="which samples are shown")
    parser.add_argument("--runs", default="/tmp/txl-style-transfer", help="the run directory's parent (reused)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results"), help="where the .json and .md go")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    r = study(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "style_transfer.json").write_text(json.dumps(r, indent=2, ensure_ascii=False) + "\n")
    (out / "style_transfer.md").write_text(markdown(r))
    print(markdown(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
