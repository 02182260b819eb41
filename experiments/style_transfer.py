"""The Style Transformer (Dai et al. 2019) on two styles that exist here, scored as the paper scores it (issue 48
item 6; the result is docs/results/style_transfer.{json,md}).

    python experiments/style_transfer.py --data "style:SHAKESPEARE/input.txt,PTB/ptb.train.txt?names=shakespeare,ptb&max_len=15&vocab_size=5000" --minutes 25

An experiment, not part of the installed package: it trains with the public command line (`txl train --preset
style-transfer --data SPEC`, one thread) unless the run directory already holds a finished run, then loads the
checkpoint through txl's API and scores it with `txl.eval.style.score_style_transfer` (what `txl eval RUN`
prints for such a run): every test sentence of each style (up to --max-test) transferred greedily into the
other style, and the paper's three measures (its §4.3) with small stand-ins for its tools (that module's
docstring says which).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
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
    from txl.eval.style import score_style_transfer
    from txl.models.checkpoint import load_checkpoint

    torch.set_num_threads(args.threads)
    command, run = train(args)
    load = cpu_load()
    ckpt = load_checkpoint(run / "last")
    model, config = ckpt.model.eval(), ckpt.model.config
    corpus = open_style_corpus(args.data, vocab=ckpt.vocab)
    names = corpus.styles
    scores = score_style_transfer(model, ckpt.vocab, corpus, "test", max_sentences=args.max_test, seed=args.seed)
    rows, real, samples = scores["rows"], scores["real"], scores["samples"]
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
    from txl.eval.style import real_table, rows_table

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
        "assigns to the target style; **self-BLEU** = corpus BLEU-4 (sacrebleu, no smoothing) of the transfers against their inputs "
        "(content preservation); **target LM ppl** = perplexity under an interpolated Kneser-Ney trigram of the "
        "target style's training sentences (fluency; the paper: a 5-gram KenLM). The *copy* rows score the "
        "inputs themselves: the floor of style accuracy and the ceiling of self-BLEU. Greedy decoding.",
        "",
    ]
    lines += rows_table({"rows": r["rows"]}).splitlines()
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
              *real_table({"real": r["real_test"]}).splitlines()]
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
