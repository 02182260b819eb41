"""The attention-based RNN encoder-decoder against the encoder-decoder Transformer on txl's two pair tasks
(issue 48 item 5; the result is docs/results/rnn_vs_transformer.{json,md}).

    python experiments/rnn_vs_transformer.py --seeds 1 2 3 --pydoc-steps 800 --ablation-seeds 1
    python experiments/rnn_vs_transformer.py --tasks reverse --seeds 1 --runs /tmp/x --out /tmp/docs   # a subset

An experiment, not part of the installed package: it drives the public command line (`txl train --preset
...`) of the checkout it lives in, one run at a time at `--threads` threads, and reads what the runs write
(result.json: parameters, training seconds, the test split's teacher-forced loss and token accuracy, and its
greedy and beam-4 decodings' exact match and ROUGE). A run whose result.json exists is reused, so an
interrupted study resumes where it stopped.

The pairs of presets have (within about 1%) the same parameter count and the same training section (optimizer,
schedule, learning rate, label smoothing, batch, steps): they differ only in the model.

    task     Transformer preset   RNN preset              budget
    reverse  seq2seq-reverse      seq2seq-reverse-rnn     the presets' 1,500 steps
    pydoc    seq2seq-pydoc        seq2seq-pydoc-rnn       --pydoc-steps (default 1,000 of the presets' 4,000 /
                                                          30 minutes: a shared 2-core machine), both alike

`--ablation-seeds` adds the RNN's alignment functions (dot, general, additive) × step orders (luong,
bahdanau) on reverse, the preset otherwise unchanged.

Minutes are wall-clock training seconds on whatever machine ran the study (the table records its load);
they compare the two models only when both ran on the same machine under the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = {  # task -> (metric shown first, {model: preset})
    "reverse": ("exact_match", {"transformer": "seq2seq-reverse", "rnn": "seq2seq-reverse-rnn"}),
    "pydoc": ("rougeL", {"transformer": "seq2seq-pydoc", "rnn": "seq2seq-pydoc-rnn"}),
}
MODELS = ("transformer", "rnn")
ABLATION = [(a, f) for f in ("luong", "bahdanau") for a in ("dot", "general", "additive")]
PRESET_CHOICE = ("general", "luong")  # the RNN presets' alignment and step order
LOAD_FILE = "study_load.json"  # written beside a run's result.json when this study trains it
NAMES = {"transformer": "Transformer encoder-decoder", "rnn": "RNN encoder-decoder + attention"}


def cpu_load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.2f}/{five:.2f} (1/5 min) on {os.cpu_count()} cores"


def train_command(task: str, model: str, seed: int, out: Path, args) -> list[str]:
    preset = TASKS[task][1][model]
    command = [sys.executable, "-m", "txl", "train", "--preset", preset, "--out", str(out), "--threads",
               str(args.threads), "--quiet", "--set", f"train.seed={seed}"]
    if task == "pydoc":
        command += ["--set", f"train.max_steps={args.pydoc_steps}", "--set", "train.max_minutes=0"]
    for extra in args.set:
        command += ["--set", extra]
    return command


def environment(threads: int) -> dict[str, str]:
    """This checkout's package first on the path (the study measures the code beside it)."""
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(threads)}


def read_run(out: Path) -> dict:
    """The scores a finished run wrote (result.json)."""
    result = json.loads((out / "result.json").read_text())
    test = result["final"]["test"]
    decoded = {d["method"]: d for d in test["decoded"]}
    row = {"parameters": result["parameters"], "steps": result["steps"], "train_seconds": result["elapsed"],
           "test_loss": test["loss"], "token_accuracy": test["token_accuracy"], "pairs": test["pairs"]}
    for method, scores in decoded.items():
        row[method] = {k: scores.get(k) for k in ("exact_match", "rouge1", "rouge2", "rougeL")}
        row[method]["decode_seconds"] = scores["seconds"]
        row[method]["samples"] = scores["samples"][:5]
    return row


def train_or_reuse(out: Path, command: list[str], args) -> dict:
    """Train `out` unless its result.json exists; its scores and the load readings taken when it trained."""
    if not (out / "result.json").is_file():
        if out.exists():  # an interrupted run: train it again from the start
            command.append("--force")
        load_before = cpu_load()
        subprocess.run(command, check=True, env=environment(args.threads))
        (out / LOAD_FILE).write_text(json.dumps({"load_before": load_before, "load_after": cpu_load(),
                                                 "trained": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}) + "\n")
    # the machine's load while the run trained (a reused run keeps its own readings)
    loads = json.loads((out / LOAD_FILE).read_text()) if (out / LOAD_FILE).is_file() else {
        "load_before": "not recorded", "load_after": "not recorded"}
    return {**read_run(out), **loads, "command": "txl " + shlex.join(command[3:])}


def show(row: dict) -> None:
    keys = ("task", "model", "alignment", "decoder_flow", "seed", "parameters", "train_seconds", "token_accuracy")
    print(json.dumps({k: row[k] for k in keys if k in row} | {"greedy": row["greedy"]["exact_match"]}), flush=True)


def run(args) -> int:
    runs = Path(args.runs)
    rows, ablation = [], []
    for task in args.tasks:
        for seed in args.seeds:
            for model in MODELS:
                out = runs / f"{task}-{model}-seed{seed}"
                row = {"task": task, "model": model, "seed": seed,
                       **train_or_reuse(out, train_command(task, model, seed, out, args), args)}
                show(row)
                rows.append(row)
    for seed in args.ablation_seeds if args.rnn_pydoc_lr else []:  # the RNN on pydoc at its own learning rate
        out = runs / f"pydoc-rnn-lr{args.rnn_pydoc_lr:g}-seed{seed}"
        command = train_command("pydoc", "rnn", seed, out, args) + ["--set", f"train.lr={args.rnn_pydoc_lr:g}"]
        row = {"task": "pydoc", "model": "rnn-lr", "seed": seed, **train_or_reuse(out, command, args)}
        show(row)
        rows.append(row)
    for seed in args.ablation_seeds:  # the RNN's alignment functions and step orders on reverse
        for alignment, flow in ABLATION:
            name = "" if (alignment, flow) == PRESET_CHOICE else f"-{alignment}-{flow}"
            out = runs / f"reverse-rnn{name}-seed{seed}"
            command = train_command("reverse", "rnn", seed, out, args)
            if name:
                command += ["--set", f"model.alignment={alignment}", "--set", f"model.decoder_flow={flow}"]
            row = {"task": "reverse", "model": "rnn", "alignment": alignment, "decoder_flow": flow, "seed": seed,
                   **train_or_reuse(out, command, args)}
            show(row)
            ablation.append(row)
    write_results(args, rows, ablation)
    return 0


def summary(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    values = [v * scale for v in values]
    mean = statistics.mean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.{digits}f} ± {std:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def write_results(args, rows: list[dict], ablation: list[dict]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"seeds": args.seeds, "threads": args.threads, "pydoc_steps": args.pydoc_steps, "set": args.set,
                "machine": f"{os.cpu_count()} cores", "written": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (out / "rnn_vs_transformer.json").write_text(json.dumps({"settings": settings, "runs": rows,
                                                                    "alignment_ablation": ablation}, indent=2) + "\n")
    table = ["| task | model | parameters | seeds | exact match, greedy (%) | beam 4 (%) | ROUGE-L, greedy | beam 4 | "
             "ROUGE-1 / ROUGE-2, beam 4 | token accuracy (%) | test loss | training minutes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for task in args.tasks:
        for model in (*MODELS, "rnn-lr"):
            group = [r for r in rows if r["task"] == task and r["model"] == model]
            if not group:
                continue
            params = sorted({g["parameters"] for g in group})
            beam = [g.get("beam4", g["greedy"]) for g in group]
            table.append(
                f"| {task} | {name(model, args)} | {', '.join(f'{p:,}' for p in params)} | "
                f"{', '.join(str(g['seed']) for g in group)} | "
                f"{summary([g['greedy']['exact_match'] for g in group], 100)} | "
                f"{summary([b['exact_match'] for b in beam], 100)} | "
                f"{summary([100 * g['greedy']['rougeL'] for g in group], 1, 1)} | "
                f"{summary([100 * b['rougeL'] for b in beam], 1, 1)} | "
                f"{statistics.mean(100 * b['rouge1'] for b in beam):.1f} / {statistics.mean(100 * b['rouge2'] for b in beam):.1f} | "
                f"{summary([g['token_accuracy'] for g in group], 100)} | "
                f"{summary([g['test_loss'] for g in group], 1, 3)} | "
                f"{summary([g['train_seconds'] / 60 for g in group], 1, 1)} |")
    loads = sorted({r[k] for r in rows + ablation for k in ("load_before", "load_after")})
    samples = []
    for task in args.tasks:
        for model in (*MODELS, "rnn-lr"):
            first = next((r for r in rows if r["task"] == task and r["model"] == model), None)
            if first is None:
                continue
            samples += [f"**{task}, {name(model, args)}, seed {first['seed']}, beam 4** (source → output / reference):", ""]
            for s in first.get("beam4", first["greedy"])["samples"][:3]:
                samples.append(f"- `{cell(s['source'])}` → `{cell(s['output'])}` / `{cell(s['reference'])}`")
            samples.append("")
    commands = sorted({r["command"] for r in rows + ablation if r["seed"] == (args.seeds + args.ablation_seeds)[0]})
    lines = [
        "# The attention-based RNN encoder-decoder against the Transformer", "",
        "Issue 48 item 5. The RNN encoder-decoder with attention (`model.arch = \"rnn-seq2seq\"`: a bidirectional "
        "LSTM encoder, an LSTM decoder with input feeding and the `general` alignment of Luong et al. 2015; seed "
        "003's Attention_study) against the encoder-decoder Transformer (`model.arch = \"encoder-decoder\"`, "
        "Vaswani et al. 2017) on txl's two shipped pair tasks, at equal parameters (within about 1%) and with the "
        "same training section (Adam (0.9, 0.98, 1e-9), cosine schedule, label smoothing 0.1, the same batches "
        "and steps). Written by `experiments/rnn_vs_transformer.py`; test split; mean ± sample std (min-max) "
        f"over seeds {', '.join(map(str, args.seeds))}.", "",
        "## Result (test split)", "", *table, "",
        *notes(args),
        f"- Minutes: wall-clock training time (validation included, final decoding excluded) at "
        f"{args.threads} thread(s) on a **shared** machine ({os.cpu_count()} cores, other jobs running: load "
        f"{loads[0]} to {loads[-1]}); they compare the two models only roughly, on this machine under this load.",
        *ablation_table(ablation), "", "## Samples", "", *samples,
        "## Commands", "", "```bash", "python experiments/rnn_vs_transformer.py " + shlex.join(sys.argv[1:]),
        *commands, "```", "",
        "Seeds differ only in `--set train.seed=S`. Each run's scores, samples and load readings are in "
        "rnn_vs_transformer.json.", ""]
    (out / "rnn_vs_transformer.md").write_text("\n".join(lines))
    print(f"written: {out / 'rnn_vs_transformer.md'}, {out / 'rnn_vs_transformer.json'}")


def ablation_table(ablation: list[dict]) -> list[str]:
    """The RNN's alignment functions and step orders on reverse (the preset's training section)."""
    if not ablation:
        return []
    seeds = sorted({r["seed"] for r in ablation})
    lines = ["", "## The RNN's alignment functions and step orders (reverse)", "",
             f"`--set model.alignment=A --set model.decoder_flow=F` on `seq2seq-reverse-rnn`, seeds "
             f"{', '.join(map(str, seeds))}, everything else as the preset (general + luong is the preset's own "
             "run above).", "",
             "| alignment | step order | parameters | exact match, greedy (%) | beam 4 (%) | token accuracy (%) | "
             "test loss | training minutes |", "|---|---|---|---|---|---|---|---|"]
    for alignment, flow in ABLATION:
        group = [r for r in ablation if r["alignment"] == alignment and r["decoder_flow"] == flow]
        if group:
            lines.append(
                f"| {alignment} | {flow} | {group[0]['parameters']:,} | "
                f"{summary([g['greedy']['exact_match'] for g in group], 100)} | "
                f"{summary([g.get('beam4', g['greedy'])['exact_match'] for g in group], 100)} | "
                f"{summary([g['token_accuracy'] for g in group], 100)} | {summary([g['test_loss'] for g in group], 1, 3)} | "
                f"{summary([g['train_seconds'] / 60 for g in group], 1, 1)} |")
    return lines


def name(model: str, args) -> str:
    if model == "rnn-lr":
        return f"{NAMES['rnn']}, lr {args.rnn_pydoc_lr:g} (its own, not the Transformer's)"
    return NAMES[model]


def notes(args) -> list[str]:
    """One line per task of the table: what it is and its budget."""
    about = {
        "reverse": "- reverse: reverse a random lower-case string of 4-16 letters (`reverse`: 20,000 training pairs, "
                   "1,000 test pairs never seen in training), the presets' 1,500 steps of 64 pairs. Exact match is "
                   "the score; ROUGE reads a reversed string as one word.",
        "pydoc": "- pydoc: summarise a Python function of the standard library (its source, truncated to 64 BPE "
                 "tokens of one shared 4,000-token vocabulary) as the first line of its docstring "
                 f"(`pydoc-summaries`, split by module), {args.pydoc_steps:,} steps of 32 pairs for both models "
                 "(the presets train 4,000 steps or 30 minutes; cut for a shared CPU), scored with the weights of "
                 "the best valid loss. ROUGE-L F1 (x100) is the score; exact match is near 0 for both.",
    }
    lines = [about[task] for task in args.tasks]
    if args.rnn_pydoc_lr and "pydoc" in args.tasks and args.ablation_seeds:
        lines.append(f"- The RNN row at lr {args.rnn_pydoc_lr:g} changes only `train.lr` (the Transformer preset's "
                     "1e-3 leaves the RNN undertrained in this budget), seeds "
                     f"{', '.join(map(str, args.ablation_seeds))}.")
    return lines


def cell(text: str, width: int = 70) -> str:
    text = " ".join(text.split()).replace("`", "'")
    return text if len(text) <= width else text[: width - 1] + "…"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=["reverse", "pydoc"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--ablation-seeds", nargs="*", type=int, default=[],
                        help="also train the RNN on reverse with every alignment and step order, these seeds")
    parser.add_argument("--rnn-pydoc-lr", type=float, default=0.0,
                        help="also train the RNN on pydoc at this learning rate, --ablation-seeds seeds")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--pydoc-steps", type=int, default=1000)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to every run's txl train (a tiny budget for a test)")
    parser.add_argument("--runs", default="/tmp/txl-rnn-vs-transformer", help="run directories (reused)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results"))
    args = parser.parse_args(argv)
    if len(set(args.seeds)) != len(args.seeds) or len(set(args.ablation_seeds)) != len(args.ablation_seeds):
        print("error: a seed is named twice (two runs would share one directory)", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
