"""The Transformer-XL paper's three claims at CPU scale (issue 19; the current result is docs/results/claims.md).

    python experiments/claims.py --corpus shakespeare=text:input.txt?tokenizer=chars --steps 1000

An experiment, not part of the installed package: it trains with `txl train` and measures RECL with
`txl recl` in their own processes and scores with txl's evaluation API, so it runs from any directory
of a checkout with txl installed.

1. RECL (appendix C): relative effective context length of Transformer-XL, an LSTM, SHA-RNN and a
   vanilla Transformer, r = 0.1, 0.5, 1.0, in window mode (`txl recl`: a fresh forward over exactly c
   previous tokens per scored position), one model group per seed.
2. The ablation (Table 6): xl + recurrence > shaw + recurrence > xl without recurrence (trained with
   mem 0, evaluated with memory) > vanilla (absolute positions, mem 0, the sliding-window evaluator).
3. Longer memory at evaluation: models trained with mem_len 32, 64, 128 evaluated over a range of
   memory lengths; the paired per-token difference against the training memory, with its standard
   error from batch means over contiguous blocks of targets (per-token losses are correlated).

Every model is one ordinary `txl train --preset claims-char` run in its own process (its command is in
the report), trained for the same number of steps on the same tokens, with one size chosen so the
parameter count is the closest to the Transformer-XL row's (d_inner: the Transformers' feed-forward
width, the lstm's hidden size; the sha-rnn's width d_model with its Boom at 4 × d_model). The budget is in steps, so runs side by side on a loaded machine give the same models. Finished
runs and evaluations are reused when their command is unchanged (an interrupted run continues).

Writes claims.json, claims_tables.md and claims_<corpus>.png to `--out` (default docs/results of this
checkout).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from campaign import RESULTS, log_tail, planned_run, read_record, script_main, train_variants

from txl.argtypes import MAX_COUNT, MAX_LENGTH, integer, integer_list, threads
from txl.errors import TxlError, UsageError
from txl.io import create_log, read_json
from txl.io.rundir import save_array, write_text

PRESET = "claims-char"
LN2 = math.log(2.0)


@dataclass(frozen=True)
class Variant:
    name: str
    sets: tuple[str, ...]  # model.* overrides; the size (knob) is added by the parameter matching
    about: str
    role: str  # "ablation", "sweep" or "rnn"
    knob: str = "d_inner"  # what the parameter matching scales: "d_inner", or "width" = d_model k, d_inner 4k

    def size_sets(self, k: int) -> list[str]:
        return [f"model.d_inner={k}"] if self.knob == "d_inner" else [f"model.d_model={k}", f"model.d_inner={4 * k}"]


VARIANTS: dict[str, Variant] = {v.name: v for v in [
    Variant("xl", (), "Transformer-XL: relative positions (Dai et al.), recurrence, mem 64", "ablation"),
    Variant("shaw", ("pos_encoding=shaw",), "Shaw et al. relative positions + recurrence, mem 64", "ablation"),
    Variant("xl-mem0", ("mem_len=0",), "Transformer-XL positions, trained without recurrence (mem 0)", "ablation"),
    Variant("vanilla", ("pos_encoding=sinusoidal", "mem_len=0"),
            "vanilla: absolute sinusoidal positions, mem 0 (Al-Rfou et al. 2018 style)", "ablation"),
    Variant("xl-m32", ("mem_len=32",), "Transformer-XL trained with mem 32", "sweep"),
    Variant("xl-m128", ("mem_len=128",), "Transformer-XL trained with mem 128", "sweep"),
    Variant("lstm", ("arch=lstm", "n_layer=3", "dropout=0.1", "dropout_input=0.1", "dropout_hidden=0.1",
                     "dropout_embed=0.0", "weight_drop=0.1"),
            "AWD-LSTM (Merity et al. 2018): 3 layers, weight drop, tied embeddings, state carried", "rnn"),
    Variant("sha-rnn", ("arch=sha-rnn", "n_layer=4", "mem_len=64", "dropout=0.1", "dropout_input=0.1",
                        "dropout_hidden=0.1", "dropout_embed=0.0", "weight_drop=0.1"),
            "SHA-RNN (Merity 2019): 4 LSTM blocks, single-head attention over 64 past states, Boom ×4", "rnn",
            knob="width"),
]}
REFERENCE = "xl"
RECL_GROUP = ("xl", "lstm", "sha-rnn", "vanilla")
ABLATION = ("xl", "shaw", "xl-mem0", "vanilla")


def _corpus(text: str) -> tuple[str, str]:
    name, sep, spec = text.partition("=")
    if not sep or not name.strip() or not spec.strip():
        raise argparse.ArgumentTypeError(f"--corpus takes NAME=SPEC (e.g. shakespeare=text:input.txt?tokenizer=chars), got {text!r}")
    return name.strip(), spec.strip()


def _names(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown claims variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    return names


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--corpus", dest="corpora", type=_corpus, action="append", default=[], metavar="NAME=SPEC",
                        help="a corpus to run the claims on (repeat; e.g. shakespeare=text:input.txt?tokenizer=chars)")
    parser.add_argument("--variants", type=_names, default=tuple(VARIANTS), metavar="LIST",
                        help=f"models to train (default all: {','.join(VARIANTS)})")
    parser.add_argument("--seeds", type=integer_list(0, 2**63 - 1, at_most=100), default=(1, 2, 3), metavar="S1,S2,...", help="training seeds (default 1,2,3)")
    parser.add_argument("--sweep-seeds", type=integer(1, 100), default=1,
                        help="seeds of the sweep-only variants xl-m32 and xl-m128 (default 1: the first seed)")
    parser.add_argument("--steps", type=integer(1, 100_000_000), default=1000, help="training steps of every run (default 1000)")
    parser.add_argument("--eval-tokens", type=integer(0, MAX_COUNT), default=100000,
                        help="valid targets scored per evaluation, the same for every model (default 100000; 0 = all)")
    parser.add_argument("--eval-mems", type=integer_list(0, MAX_LENGTH), default=(0, 16, 32, 64, 128, 256, 512), metavar="M1,M2,...",
                        help="evaluation memory lengths of the sweep (default 0,16,32,64,128,256,512)")
    parser.add_argument("--contexts", default="16,32,64,128,256,512", help="RECL context lengths (default 16,...,512)")
    parser.add_argument("--recl-positions", type=integer(0, MAX_COUNT), default=1000, help="RECL positions scored per context (default 1000)")
    parser.add_argument("--blocks", type=integer(2, 1_000_000), default=50,
                        help="contiguous blocks for the batch-means standard error of paired differences (default 50)")
    parser.add_argument("--threads", type=threads(auto=False), default=1, help="torch threads per process (default 1)")
    parser.add_argument("--jobs", type=integer(1, 256), default=2, help="processes side by side (default 2)")
    parser.add_argument("--runs", default="runs/claims", help="directory of the run directories (default runs/claims)")
    parser.add_argument("--out", default=str(RESULTS), help="directory for claims.json, claims_tables.md, PNGs "
                        "(default: docs/results of this checkout)")
    parser.add_argument("--phase", choices=("all", "train", "eval", "report"), default="all",
                        help="stop after training, after evaluation, or only rewrite the report from claims.json")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="extra override for every run (e.g. train.batch_size=8)")


# ---------------------------------------------------------------------------------------------
# Parameter matching and the training plan


def parameter_count(sets: list[str], vocab_size: int) -> int:
    import torch

    from txl.models.registry import build_model
    from txl.train.config import build_run_config

    run = build_run_config(preset=PRESET, sets=sets)
    with torch.device("meta"):
        model = build_model(run.model_config(vocab_size=vocab_size))
    return sum(p.numel() for p in model.parameters())


def trained_mem(sets: list[str], vocab_size: int) -> int:
    from txl.train.config import build_run_config

    return build_run_config(preset=PRESET, sets=sets).model_config(vocab_size=vocab_size).mem_len


def match_size(variant: Variant, sets: list[str], target: int, vocab_size: int) -> tuple[int, int]:
    """The size (the variant's knob) whose parameter count is closest to `target`; counts grow with it."""
    def count(k):
        return parameter_count([*sets, *variant.size_sets(k)], vocab_size)

    low, high = 1, 8
    while count(high) < target:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if count(mid) < target else (low, mid)
    best = min((low, high), key=lambda k: abs(count(k) - target))
    return best, count(best)


def plan_runs(args: argparse.Namespace) -> list[dict]:
    from txl.data import open_corpus

    plan = []
    for corpus, spec in args.corpora:
        vocab_size = len(open_corpus(spec).vocab)
        base_sets = list(args.sets) + [f"train.max_steps={args.steps}"]
        target = parameter_count(base_sets, vocab_size)
        for name in args.variants:
            variant = VARIANTS[name]
            sets = base_sets + [f"model.{s}" for s in variant.sets]
            size, params = match_size(variant, sets, target, vocab_size)
            seeds = args.seeds[: args.sweep_seeds] if variant.role == "sweep" else args.seeds
            for seed in seeds:
                run_dir = Path(args.runs) / corpus / f"{name}-s{seed}"
                argv = ["txl", "train", "--preset", PRESET, "--data", spec, "--quiet"]
                for s in [*sets, *variant.size_sets(size), f"train.seed={seed}"]:
                    argv += ["--set", s]
                argv += ["--out", str(run_dir)]
                plan.append(planned_run(
                    argv, run_dir, threads=args.threads, fresh=False, name=f"{corpus}/{name}-s{seed}", corpus=corpus,
                    spec=spec, variant=name, seed=seed, about=variant.about, size=f"{variant.knob} {size}",
                    parameters=params, trained_mem=trained_mem([*sets, *variant.size_sets(size)], vocab_size),
                    target_parameters=target))
        mine = [i for i in plan if i["corpus"] == corpus]
        memory = [i["trained_mem"] for i in mine if i["variant"] == REFERENCE] or [max(i["trained_mem"] for i in mine)]
        for i in mine:  # the ablation evaluates every row with the reference's training memory
            i["ablation_mem"] = memory[0]
    return plan


# ---------------------------------------------------------------------------------------------
# Evaluation: per-token losses at each memory length (cached in the run directory)


def _eval_key(item: dict, args: argparse.Namespace, mode: str, mem: int | None) -> str:
    return json.dumps({"command": item["command"], "mode": mode, "mem": mem, "tokens": args.eval_tokens})


def evaluate_run(item: dict, args: argparse.Namespace) -> dict:
    """{"mems": {m: bpc}, "window": bpc or None}; per-token NLL arrays saved beside the run."""
    from txl.eval.api import evaluate_checkpoint
    from txl.models.checkpoint import load_checkpoint

    run_dir = Path(item["run_dir"])
    cache_path = run_dir / "claims_eval.json"
    try:
        cache = read_record(cache_path)
    except (OSError, ValueError, TxlError):
        cache = {}
    ckpt = None
    variant = item["variant"]
    if variant == "lstm":  # any mem_len > 0 carries the LSTM state, 0 starts each segment afresh
        todo: list[tuple[str, int | None]] = [("mem", 0), ("mem", item["trained_mem"])]
    else:  # the sweep, the run's own training memory, and the ablation's evaluation memory
        mems = sorted({*args.eval_mems, item["trained_mem"], item["ablation_mem"]})
        todo = [("mem", m) for m in mems]
    if variant == "vanilla":
        todo.append(("window", None))
    for mode, mem in todo:
        key = _eval_key(item, args, mode, mem)
        npy = run_dir / f"claims_nll_{mode}{'' if mem is None else mem}.npy"
        if key in cache and npy.is_file():
            continue
        if ckpt is None:
            ckpt = load_checkpoint(run_dir, device="cpu")
        common = {"data": item["spec"], "split": "valid", "max_tokens": args.eval_tokens, "per_token": True}
        if mode == "window":
            tgt = ckpt.train_setting("tgt_len") or 64
            result, nll = evaluate_checkpoint(ckpt, vanilla=True, attn_len=tgt, stride=max(1, tgt // 4), **common)
        else:
            result, nll = evaluate_checkpoint(ckpt, mem_len=mem, **common)
        save_array(npy, nll)  # never through a link planted in the run directory
        cache[key] = {"mode": mode, "mem": mem, "bpc": result.loss / LN2, "tokens": result.tokens,
                      "file": npy.name}
        write_text(cache_path, json.dumps(cache, indent=2) + "\n")
    out = {"mems": {}, "window": None}
    for mode, mem in todo:
        entry = cache[_eval_key(item, args, mode, mem)]
        if mode == "mem":
            out["mems"][str(mem)] = entry["bpc"]
        else:
            out[mode] = entry["bpc"]
    return out


def per_token(item: dict, mode: str, mem: int | None = None) -> np.ndarray:
    return np.load(Path(item["run_dir"]) / f"claims_nll_{mode}{'' if mem is None else mem}.npy", allow_pickle=False)


def paired(a: np.ndarray, b: np.ndarray, blocks: int) -> tuple[float, float]:
    """Mean of a - b in bits per token and its standard error by batch means over `blocks` contiguous
    blocks (neighbouring tokens' losses are correlated, so the i.i.d. formula would be too small)."""
    d = (a.astype(np.float64) - b.astype(np.float64)) / LN2
    n = len(d) // blocks * blocks
    means = d[:n].reshape(blocks, -1).mean(axis=1)
    return float(d.mean()), float(means.std(ddof=1) / math.sqrt(blocks))


def run_recl(args: argparse.Namespace, plan: list[dict]) -> dict:
    """One `txl recl --mode window` per corpus and seed over the group present; results cached."""
    results = {}
    procs = []
    for corpus, spec in args.corpora:
        for seed in args.seeds:
            members = [next((i for i in plan if i["corpus"] == corpus and i["variant"] == v and i["seed"] == seed), None)
                       for v in RECL_GROUP]
            members = [m for m in members if m is not None]
            if len(members) < 2:
                continue
            prefix = Path(args.runs) / corpus / f"recl-s{seed}"
            argv = [sys.executable, "-m", "txl", "recl", *[m["run_dir"] for m in members],
                    "--names", ",".join(m["variant"] for m in members), "--data", spec, "--mode", "window",
                    "--contexts", args.contexts, "--positions", str(args.recl_positions),
                    "--cache", str(Path(args.runs) / corpus / "recl-cache"), "--out", str(prefix)]
            procs.append(((corpus, seed), prefix, argv))
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    running = []
    for key, prefix, argv in procs:
        if len(running) >= args.jobs:
            _wait_one(running)
        print("recl:", shlex.join(argv[2:]), flush=True)
        log = create_log(prefix.with_suffix(".log"))
        running.append((key, subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    while running:
        _wait_one(running)
    for key, prefix, argv in procs:
        data = read_record(prefix.with_suffix(".json"))
        results[f"{key[0]}/s{key[1]}"] = {"corpus": key[0], "seed": key[1], "command": shlex.join(["txl", *argv[3:]]),
                                          **data}
    return results


def _wait_one(running: list) -> None:
    key, proc, log = running.pop(0)
    code = proc.wait()
    log.close()
    if code != 0:
        raise UsageError(f"recl of {key} failed (exit {code}): {log_tail(log.name)}; log {log.name}")


# ---------------------------------------------------------------------------------------------
# The report


def _mean_sd(values: list[float]) -> tuple[float, float]:
    arr = np.asarray(values, dtype=np.float64)
    return float(arr.mean()), float(arr.std(ddof=1)) if len(arr) > 1 else 0.0


def build_report(args: argparse.Namespace, plan: list[dict], evals: dict[str, dict], recl: dict) -> dict:
    report: dict = {"corpora": dict(args.corpora), "steps": args.steps, "seeds": list(args.seeds),
                    "eval_tokens": args.eval_tokens, "eval_mems": list(args.eval_mems), "blocks": args.blocks,
                    "runs": [], "ablation": {}, "sweep": {}, "recl": recl}
    for item in plan:
        result = read_record(Path(item["run_dir"]) / "result.json")
        report["runs"].append({k: item[k] for k in ("name", "corpus", "variant", "seed", "size", "parameters",
                                                    "command", "peak_rss_mb", "trained_mem", "ablation_mem")}
                              | {"tokens": result["tokens"], "steps": result["steps"],
                                 "tokens_per_second": result["tokens_per_second"], "eval": evals[item["name"]]})
    for corpus, _ in args.corpora:
        runs = [r for r in report["runs"] if r["corpus"] == corpus]
        # the ablation: each row's score in the setting the paper gives it
        rows = []
        for name in ABLATION:
            mine = [r for r in runs if r["variant"] == name]
            if not mine:
                continue
            if name == "vanilla":
                setting, scores = "sliding window", [r["eval"]["window"] for r in mine]
            else:
                setting = f"mem {mine[0]['ablation_mem']}"
                scores = [r["eval"]["mems"][str(r["ablation_mem"])] for r in mine]
            mean, sd = _mean_sd(scores)
            rows.append({"variant": name, "setting": setting, "bpc": scores, "mean": mean, "sd": sd,
                         "parameters": mine[0]["parameters"], "seeds": [r["seed"] for r in mine]})
        ranks = []
        for i in range(len(args.seeds)):
            order = sorted((row for row in rows if i < len(row["bpc"])), key=lambda row: row["bpc"][i])
            ranks.append([row["variant"] for row in order])
        report["ablation"][corpus] = {"rows": rows, "rank_per_seed": ranks}
        # the sweep: paired differences against the training memory
        sweep = []
        for name in ("xl-mem0", "xl-m32", "xl", "xl-m128", "sha-rnn", "lstm"):
            for r in (r for r in runs if r["variant"] == name):
                item = next(i for i in plan if i["name"] == r["name"])
                train_mem = r["trained_mem"]
                ref = per_token(item, "mem", train_mem) if str(train_mem) in r["eval"]["mems"] else None
                cells = []
                for mem in sorted(int(m) for m in r["eval"]["mems"]):
                    if str(mem) not in r["eval"]["mems"]:
                        continue
                    cell = {"mem": mem, "bpc": r["eval"]["mems"][str(mem)]}
                    if ref is not None and mem != train_mem:
                        diff, se = paired(per_token(item, "mem", mem), ref, args.blocks)
                        cell |= {"diff": diff, "se": se, "z": diff / se if se > 0 else 0.0}
                    cells.append(cell)
                sweep.append({"variant": name, "seed": r["seed"], "trained_mem": train_mem, "cells": cells})
        report["sweep"][corpus] = sweep
    report["eval_mems"] = sorted({c["mem"] for rows in report["sweep"].values() for row in rows for c in row["cells"]})
    return report


def _fmt(value: float | None, digits: int = 4) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown(report: dict) -> str:
    from txl.bench.common import machine_markdown

    lines = ["# The paper's claims at CPU scale: measured tables", "",
             f"Generated by `python experiments/claims.py` ({report['steps']} steps per run, seeds {report['seeds']}, "
             f"{report['eval_tokens'] or 'all'} valid targets per evaluation, standard errors by batch means over "
             f"{report['blocks']} contiguous blocks). docs/results/claims.md discusses them.", ""]
    if report.get("machine"):
        lines += [machine_markdown(report["machine"]), ""]
    for corpus, spec in report["corpora"].items():
        lines += [f"## {corpus} (`{spec}`)", "", "### Ablation (Table 6's rows)", "",
                  "| model | evaluated | parameters | valid bpc per seed | mean ± sd |", "|---|---|---:|---|---|"]
        ab = report["ablation"][corpus]
        for row in ab["rows"]:
            per_seed = ", ".join(f"{v:.4f}" for v in row["bpc"])
            lines.append(f"| {row['variant']} | {row['setting']} | {row['parameters']:,} | {per_seed} | "
                         f"{row['mean']:.4f} ± {row['sd']:.4f} |")
        lines += ["", "Order per seed (best first): " + "; ".join(" < ".join(r) for r in ab["rank_per_seed"]), ""]
        lines += ["### Evaluation memory (paired difference against the training memory, bits/char)", "",
                  "| model | seed | trained mem | " + " | ".join(f"eval mem {m}" for m in report["eval_mems"]) + " |",
                  "|---|---:|---:|" + "---|" * len(report["eval_mems"])]
        for row in report["sweep"][corpus]:
            by_mem = {c["mem"]: c for c in row["cells"]}
            cells = []
            for m in report["eval_mems"]:
                c = by_mem.get(m)
                if c is None:
                    cells.append("–")
                elif "diff" in c:
                    cells.append(f"{c['bpc']:.4f} ({c['diff']:+.4f} ± {c['se']:.4f})")
                else:
                    cells.append(f"**{c['bpc']:.4f}**")
            lines.append(f"| {row['variant']} | {row['seed']} | {row['trained_mem']} | " + " | ".join(cells) + " |")
        lines += ["", "### RECL (window mode; one group per seed)", ""]
        recl_rows = [v for v in report["recl"].values() if v["corpus"] == corpus]
        if recl_rows:
            rs = [float(r) for r in recl_rows[0]["r"]]
            names = recl_rows[0]["names"]
            lines += ["| model | " + " | ".join(f"r = {r:g}" for r in rs) + " |", "|---|" + "---|" * len(rs)]
            for name in names:
                cells = []
                for r in rs:
                    vals = []
                    for v in recl_rows:
                        key = _rkey(v["recl"][name], r)
                        vals.append(("≥ " if v["censored"][name][key] else "") + str(v["recl"][name][key]))
                    cells.append(", ".join(vals))
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
            lines += ["", "Each cell: RECL of each seed's group (contexts "
                      f"{recl_rows[0]['contexts']}; \"≥ c\": still gaining at the longest context).", ""]
        lines += ["### Runs", "", "| run | parameters | size | tokens | tokens/s | command |", "|---|---:|---:|---:|---:|---|"]
        for r in (r for r in report["runs"] if r["corpus"] == corpus):
            lines.append(f"| {r['name']} | {r['parameters']:,} | {r['size']} | {r['tokens']:,} | "
                         f"{r['tokens_per_second']:,.0f} | `{r['command']}` |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _rkey(recl: dict, r: float) -> str:
    return next(k for k in recl if abs(float(k) - r) < 1e-9)


def plot(report: dict, corpus: str, path: Path) -> None:
    """Left: valid bpc against evaluation memory, each model the mean over its seeds. Right: the paired
    difference against the model's training memory (mean over seeds, ± the combined standard error),
    memories >= 16 only, where the differences are small enough to see."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from txl.io.rundir import save_figure

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    by_variant: dict[str, list[dict]] = {}
    for row in report["sweep"][corpus]:
        if len(row["cells"]) > 2:  # the lstm has two points (state or none): it is in the table
            by_variant.setdefault(row["variant"], []).append(row)
    for i, (name, rows) in enumerate(by_variant.items()):
        color = f"C{i}"
        mems = [c["mem"] for c in rows[0]["cells"]]
        bpc = [np.mean([r["cells"][j]["bpc"] for r in rows]) for j in range(len(mems))]
        trained = rows[0]["trained_mem"]
        label = f"{name} (trained mem {trained}, {len(rows)} seed{'s' if len(rows) > 1 else ''})"
        left.plot([max(m, 8) for m in mems], bpc, marker="o", color=color, label=label)
        keep = [j for j, m in enumerate(mems) if m >= 16 and m != trained]
        diff = [np.mean([r["cells"][j]["diff"] for r in rows]) for j in keep]
        se = [math.sqrt(sum(r["cells"][j]["se"] ** 2 for r in rows)) / len(rows) for j in keep]
        right.errorbar([mems[j] for j in keep], diff, yerr=se, marker="o", color=color, capsize=3, label=name)
        if trained >= 16:
            right.plot([trained], [0.0], marker="*", markersize=12, color=color)
    left.set_xscale("log", base=2)
    left.set_xlabel("evaluation memory length (0 drawn at 8)")
    left.set_ylabel("valid bpc (mean over seeds)")
    left.set_title(f"{corpus}: bpc against evaluation memory")
    left.legend(fontsize=7)
    right.axhline(0.0, color="grey", linewidth=0.8)
    right.set_xscale("log", base=2)
    right.set_xlabel("evaluation memory length (star: the training memory)")
    right.set_ylabel("bpc − bpc at the training memory (± s.e.)")
    right.set_title("paired difference against the training memory")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from txl.bench.common import machine

    out = Path(args.out)
    if args.phase == "report":
        try:
            report = read_json(out / "claims.json", what="claims report", error=UsageError)
        except (OSError, ValueError, TxlError) as err:
            raise UsageError(f"--phase report needs a readable {out / 'claims.json'} ({err})") from None
        _write(report, out)
        return 0
    if not args.corpora:
        raise UsageError("python experiments/claims.py needs at least one --corpus NAME=SPEC (e.g. --corpus "
                         "shakespeare=text:input.txt?tokenizer=chars)")
    if args.steps < 1 or args.threads < 1 or args.jobs < 1 or args.blocks < 2:
        raise UsageError("--steps, --threads and --jobs must be >= 1 and --blocks >= 2")
    started = time.time()
    plan = plan_runs(args)
    for item in plan:
        print(f"{item['name']}: {item['size']}, {item['parameters']:,} parameters "
              f"(target {item['target_parameters']:,})", flush=True)
    train_variants(plan, args, desc="claims")
    if args.phase == "train":
        return 0
    import torch

    torch.set_num_threads(args.threads * args.jobs)
    evals = {}
    from tqdm.auto import tqdm

    for item in tqdm(plan, desc="claims eval", unit="run", dynamic_ncols=True):
        evals[item["name"]] = evaluate_run(item, args)
    recl = run_recl(args, plan)
    report = build_report(args, plan, evals, recl)
    report["machine"] = machine()
    report["wall_minutes"] = (time.time() - started) / 60
    report["max_param_gap"] = max(abs(i["parameters"] - i["target_parameters"]) / i["target_parameters"] for i in plan)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "claims.json", json.dumps(report, indent=2) + "\n")
    _write(report, out)
    return 0


def _write(report: dict, out: Path) -> None:
    write_text(out / "claims_tables.md", markdown(report))
    for corpus in report["corpora"]:
        plot(report, corpus, out / f"claims_{corpus}.png")
    print(markdown(report))
    print(f"wrote {out / 'claims_tables.md'}, {out / 'claims.json'} and the plots")


def main(argv: list[str] | None = None) -> int:
    return script_main("claims", "the paper's claims at CPU scale: RECL against LSTM/SHA-RNN/vanilla, the ablation, "
                       "longer evaluation memory (docs/results/claims.md)", configure, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
