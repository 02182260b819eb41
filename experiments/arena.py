"""The arena: train every attention kernel and positional encoding on the same corpus, with the same
parameter count and the same CPU budget, and tabulate valid bpc, tokens/s and peak memory (issue 8;
docs/guide/models.md, "The arena"; the current result is docs/results/arena.md).

    python experiments/arena.py --minutes 5 --jobs 2 [--data ptb-char:DIR]

An experiment, not part of the installed package: it drives the public command line (`txl train`)
and reads the run directories it writes, so it runs from any directory of a checkout with txl
installed.

Each variant is one ordinary `txl train --preset arena-ptb-char --set ...` run in its own process
(so the row's command reproduces it exactly), limited to `--threads` torch threads and
`--minutes` of wall clock (validation excluded only in that it comes after the budget: one pass over
the whole valid split when the time is spent). `--jobs` runs go side by side; with jobs × threads =
cores every run sees the same machine. Parameter counts are equalised by choosing each variant's
d_inner so its count is the closest to the reference variant's (`xl`): the FFN width is the only
knob that does not change what the variant is.

Peak memory is the run process's maximum resident set (getrusage of the child), tokens/s the
trainer's own figure (training tokens over training wall time). A finished run already in `--runs`
with the same command is reused, so an interrupted arena continues where it stopped (the run that
was cut short starts again); `--fresh` retrains every run.

Noise: after the first pass the `--top` best causal rows are trained again with `--seeds` - 1 more
seeds (the preset's seed + 1, + 2, ...; the same command with `--seed S`), so the differences between
the leading variants come with their seed-to-seed spread (mean ± sample standard deviation).

Writes arena.json, arena.md and arena.png (train bpc against minutes) to `--out` (default
docs/results of this checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from campaign import RESULTS, planned_run, read_record, read_records, script_main, train_variants

from txl.argtypes import integer, real, threads
from txl.errors import TxlError, UsageError
from txl.io import read_json, save_figure, write_text

PRESET = "arena-ptb-char"


@dataclass(frozen=True)
class Variant:
    name: str
    sets: tuple[str, ...]  # model.* overrides (d_inner is added by the parameter matching)
    about: str
    train_sets: tuple[str, ...] = ()  # train.* overrides (the masked-LM rows: objective=mlm)
    # False: keep the preset's d_inner, for a variant whose fixed extra parameters outweigh any feed-forward
    # (GTrXL's gates: 6·d_model² each, two per layer, more than the whole FFN at d_model 128); its row says so
    match: bool = True

    @property
    def mlm(self) -> bool:
        return "objective=mlm" in self.train_sets


MLM = ("objective=mlm",)  # bidirectional encoder rows: masked LM, their own table (masked-token bpc)


VARIANTS: dict[str, Variant] = {v.name: v for v in [
    Variant("xl", (), "full attention, Transformer-XL relative positions (Dai et al. 2019)"),
    Variant("shaw", ("pos_encoding=shaw",), "full attention, learned relative embeddings (Shaw et al. 2018)"),
    Variant("sinusoidal", ("pos_encoding=sinusoidal",), "full attention, absolute sinusoids (Vaswani et al. 2017)"),
    Variant("learned", ("pos_encoding=learned",), "full attention, learned absolute positions (Al-Rfou et al. 2018)"),
    Variant("rope", ("pos_encoding=rope",), "full attention, rotary positions (Su et al. 2021)"),
    Variant("alibi", ("pos_encoding=alibi",), "full attention, linear distance biases (Press et al. 2022)"),
    Variant("sliding", ("attention=sliding", "sliding_window=64"), "sliding window w = 64, xl positions (Longformer)"),
    Variant("sparse", ("attention=sparse", "sparse_stride=16"),
            "strided sparse, l = 16 ≈ sqrt(mem + tgt), xl positions (Child et al. 2019)"),
    Variant("performer", ("pos_encoding=rope", "attention=performer", "performer_features=128"),
            "FAVOR+ with 128 features, rope (Choromanski et al. 2021)"),
    Variant("compressive", ("cmem_len=64", "cmem_ratio=4", "cmem_fn=conv"),
            "xl + 64 compressed states at 4:1, conv + reconstruction loss (Rae et al. 2020)"),
    Variant("xl-mem0", ("mem_len=0",), "xl without memory (the RECL baseline: differs from xl only in mem_len)"),
    Variant("sinusoidal-mem0", ("pos_encoding=sinusoidal", "mem_len=0"), "sinusoidal without memory: no temporal confusion"),
    Variant("learned-mem0", ("pos_encoding=learned", "mem_len=0"), "learned absolute without memory: no temporal confusion"),
    # second wave (issue 21): more positions, the rest of the efficient-attention survey, the Universal Transformer
    Variant("t5", ("pos_encoding=t5",), "full attention, T5 bucketed relative bias (Raffel et al. 2020)"),
    Variant("xpos", ("pos_encoding=xpos",), "full attention, rotary with exponential decay (Sun et al. 2023)"),
    Variant("linear", ("pos_encoding=rope", "attention=linear"), "elu+1 linear attention, rope (Katharopoulos et al. 2020)"),
    Variant("bigbird", ("pos_encoding=rope", "attention=bigbird", "bigbird_block=16", "bigbird_window=1",
                        "bigbird_global=1", "bigbird_random=2"),
            "window + global + random blocks of 16, rope (Zaheer et al. 2020)"),
    Variant("lsh", ("pos_encoding=rope", "attention=lsh", "lsh_buckets=8", "lsh_hashes=2", "bucket_window=32"),
            "shared-QK LSH, 8 buckets × 2 rounds, 32 keys per bucket, rope (Kitaev et al. 2020)"),
    Variant("routing", ("pos_encoding=rope", "attention=routing", "routing_clusters=8", "bucket_window=32"),
            "shared-QK online k-means, 8 clusters, 32 keys per cluster, rope (Roy et al. 2021)"),
    Variant("sinkhorn", ("pos_encoding=rope", "attention=sinkhorn", "sinkhorn_block=16"),
            "own block + soft-sorted earlier blocks of 16, rope (Tay et al. 2020)"),
    Variant("compressed", ("pos_encoding=rope", "attention=compressed", "compress_ratio=4"),
            "keys/values conv-compressed 4:1 + own block, rope (Liu et al. 2018)"),
    Variant("synthesizer", ("pos_encoding=rope", "attention=synthesizer", "synthesizer_max_len=256"),
            "dense synthesizer over 256 distances (Tay et al. 2021)"),
    Variant("universal", ("universal=true",), "Universal Transformer: one shared block, ≤ 4 ACT steps (Dehghani et al. 2019)"),
    Variant("memory-tokens", ("memory_tokens=16",),
            "xl + 16 learned memory tokens per layer that every query sees (Sukhbaatar et al. 2019)"),
    Variant("sliding-global", ("attention=sliding", "sliding_window=64", "global_tokens=4"),
            "sliding window w = 64 + the first 4 tokens of each segment global, xl positions (Longformer)"),
    # masked LM (bidirectional encoder), scored on masked tokens: a separate table
    Variant("mlm-full", ("attention=full",), "full bidirectional attention, rope", MLM),
    Variant("mlm-linformer", ("attention=linformer", "linformer_k=64", "linformer_max_len=128"),
            "Linformer k = 64 (Wang et al. 2020)", MLM),
    Variant("mlm-inducing", ("attention=inducing", "inducing_points=32"), "32 inducing points (Lee et al. 2019)", MLM),
    Variant("mlm-bigbird", ("attention=bigbird", "bigbird_block=16"), "bidirectional BigBird blocks of 16", MLM),
    Variant("mlm-performer", ("attention=performer", "performer_features=128"), "FAVOR+ 128 features", MLM),
    Variant("mlm-sliding", ("attention=sliding", "sliding_window=32"),
            "bidirectional sliding window, 32 keys on each side (Longformer)", MLM),
    Variant("mlm-memory-tokens", ("attention=full", "memory_tokens=16"), "full bidirectional + 16 memory tokens", MLM),
    # block options and recurrence variants of the Transformer-XL family (issue 47), run with --section blocks
    Variant("xl-preln", ("pre_lnorm=true",), "xl with pre-LN blocks (the GTrXL row's baseline)"),
    Variant("ernie-doc", ("memory_source=same-layer",),
            "xl with same-layer recurrence: layer l attends to its own output of the previous segment (ERNIE-Doc, "
            "Ding et al. 2021)"),
    Variant("gtrxl", ("pre_lnorm=true", "residual=gru-gate"),
            "pre-LN xl with GRU-gated residuals, identity-map reordering (GTrXL, Parisotto et al. 2020); not "
            "parameter-matched: its gates (6·d² each, 2 per layer) outweigh any d_inner", match=False),
    Variant("rmsnorm", ("norm=rmsnorm",), "xl with RMSNorm in place of LayerNorm (Zhang & Sennrich 2019)"),
    Variant("swiglu", ("ffn=swiglu",), "xl with a SwiGLU feed-forward (Shazeer 2020)"),
    Variant("geglu", ("ffn=geglu",), "xl with a GeGLU feed-forward (Shazeer 2020)"),
    Variant("gqa", ("n_kv_head=2",), "xl with grouped-query attention, 2 key/value heads for 4 (Ainslie et al. 2023)"),
    Variant("mqa", ("n_kv_head=1",), "xl with multi-query attention, 1 key/value head (Shazeer 2019)"),
    Variant("qk-norm", ("qk_norm=true",), "xl with RMS-normalised queries and keys per head (Henry et al. 2020)"),
    # the founding documents' remaining systems (issue 48), run with --section seeds
    Variant("axial", ("attention=axial", "attention_options.row=16"),
            "axial attention over rows of 16: masked row and masked column heads, xl positions (Ho et al. 2019)"),
    Variant("axial-outer", ("attention=axial", "attention_options.row=16",
                            'attention_options.axes=["row", "column", "previous-row"]'),
            "axial rows of 16 with the outer decoder's row-above heads too: every earlier position in two layers, "
            "xl positions"),
    Variant("etc", ("pos_encoding=rope", "attention=etc", "attention_options.radius=16", "attention_options.chunk=16"),
            "ETC global-local: l2l radius 16, each 16th position global (g2g, g2l, l2g), Shaw labels per piece, "
            "rope (Ainslie et al. 2020)"),
    Variant("mlm-etc", ("attention=etc", "attention_options.radius=16", "attention_options.chunk=16"),
            "bidirectional ETC global-local, radius 16, each 16th position global", MLM),
    Variant("sparse-fixed", ("attention=sparse", "attention_options.stride=16", "attention_options.pattern=fixed",
                             "attention_options.summary=2"),
            "Sparse Transformer's fixed pattern, blocks of 16 + the last 2 of every block, xl positions (Child et al. "
            "2019; read against sparse)"),
    Variant("image-local", ("attention=image-local", "attention_options.query_block=32", "attention_options.memory_block=64"),
            "Image Transformer 1-D local attention: query blocks of 32 over the 64 positions before + themselves, xl "
            "positions (Parmar et al. 2018)"),
    Variant("synthesizer-factorized", ("pos_encoding=rope", "attention=synthesizer", "attention_options.max_len=256",
                                       "attention_options.mode=factorized-dense"),
            "factorized dense synthesizer over 256 distances, a 16 × 16 grid (Tay et al. 2021; read against synthesizer)"),
    Variant("synthesizer-factorized-random", ("pos_encoding=rope", "attention=synthesizer", "attention_options.max_len=256",
                                              "attention_options.mode=factorized-random", "attention_options.rank=8"),
            "factorized random synthesizer, R = R1 R2^T of rank 8 over 256 distances (Tay et al. 2021)"),
    Variant("mlm-linformer-kv", ("attention=linformer", "attention_options.k=64", "attention_options.max_len=128",
                                 "attention_options.sharing=key-value"),
            "Linformer k = 64, one projection for keys and values per layer (Wang et al. 2020, key-value sharing)", MLM),
    Variant("mlm-linformer-layerwise", ("attention=linformer", "attention_options.k=64", "attention_options.max_len=128",
                                        "attention_options.sharing=layerwise"),
            "Linformer k = 64, one projection for keys and values of every layer (Wang et al. 2020, layerwise sharing)",
            MLM),
    Variant("reversible", ("pre_lnorm=true", "reversible=true"),
            "pre-LN xl with reversible blocks, activations rebuilt in the backward (Reformer; read against xl-preln)"),
]}
REFERENCE = "xl"
# `--section NAME`: these rows are trained on their own machine with the xl row again as their anchor and kept
# in arena.json beside the main table (a later run of the main table keeps them), titled here
SECTIONS = {"blocks": "Block options and recurrence variants of the Transformer-XL family (issue 47)",
            "seeds": "The founding documents' remaining systems (issue 48)"}


def _names(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # two jobs would train in one run directory
        raise argparse.ArgumentTypeError(f"variant(s) named twice: {', '.join(twice)}")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown arena variant(s) {', '.join(unknown)}; "
                                         f"known: {', '.join(VARIANTS)}")
    return names


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--variants", type=_names, default=tuple(VARIANTS), metavar="LIST",
                        help=f"variants to train (default all: {','.join(VARIANTS)})")
    parser.add_argument("--data", default=None, help="data spec, e.g. ptb-char:DIR (default: the preset's ptb-char from its download location)")
    parser.add_argument("--minutes", type=real(0, 7 * 24 * 60, low_open=True), default=5.0, help="training budget of each run (default 5)")
    parser.add_argument("--threads", type=threads(auto=False), default=1, help="torch threads per run (default 1)")
    parser.add_argument("--jobs", type=integer(1, 256), default=2, help="runs side by side (default 2: one per core)")
    parser.add_argument("--runs", default="runs/arena", help="directory of the run directories (default runs/arena)")
    parser.add_argument("--out", default=str(RESULTS), help="directory for arena.json/.md/.png (default: docs/results "
                        "of this checkout)")
    parser.add_argument("--seeds", type=integer(1, 100), default=3,
                        help="seeds for the --top best causal rows (default 3; 1 = one seed for every row)")
    parser.add_argument("--top", type=integer(0, 1000), default=5, help="causal rows trained with every seed (default 5)")
    parser.add_argument("--fresh", action="store_true", help="retrain runs that already finished")
    parser.add_argument("--section", choices=sorted(SECTIONS), default=None,
                        help="train --variants (plus xl, their anchor) as a section of their own, kept beside the main "
                             "table of an existing arena.json instead of replacing it")
    parser.add_argument("--render", action="store_true",
                        help="only rewrite arena.md and arena.png from --out/arena.json (no training)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="extra override for every run (e.g. train.batch_size=8)")


def parameter_count(sets: list[str], vocab_size: int) -> int:
    """Parameters of the preset with `sets` (model.* and train.* keys; masked LM adds the mask token)."""
    import torch

    from txl.models.transformer_xl.model import TransformerXL
    from txl.train.config import build_run_config

    run = build_run_config(preset=PRESET, sets=sets)
    with torch.device("meta"):
        model = TransformerXL(run.model_config(vocab_size=vocab_size))
    return model.num_parameters()


def match_d_inner(variant: Variant, target: int, vocab_size: int, base: int) -> tuple[int, int]:
    """The d_inner whose parameter count is closest to `target` (the count is affine in d_inner); the preset's
    for a variant that cannot be matched (`Variant.match`)."""
    sets = [f"model.{s}" for s in variant.sets] + [f"train.{s}" for s in variant.train_sets]
    if variant.mlm:
        sets.append("train.sample_tokens=0")
    low = parameter_count([*sets, f"model.d_inner={base}"], vocab_size)
    high = parameter_count([*sets, f"model.d_inner={base + 1}"], vocab_size)
    per_unit = high - low
    if not variant.match:
        return base, low
    d_inner = max(1, base + round((target - low) / per_unit))
    return d_inner, low + (d_inner - base) * per_unit


def command(variant: Variant, d_inner: int, args: argparse.Namespace, *, seed: int | None = None,
            name: str | None = None) -> list[str]:
    """The row's `txl train` command; `seed` adds `--seed` (the extra-seed runs, in `name`'s directory)."""
    argv = ["txl", "train", "--preset", PRESET]
    if args.data:
        argv += ["--data", args.data]
    argv += ["--max-minutes", f"{args.minutes:g}"]
    if variant.mlm:
        argv += ["--objective", "mlm"]
    for s in [*variant.sets, f"d_inner={d_inner}"]:
        argv += ["--set", f"model.{s}"]
    for s in args.sets:
        argv += ["--set", s]
    if seed is not None:
        argv += ["--seed", str(seed)]
    argv += ["--out", str(Path(args.runs) / (name or variant.name))]
    return argv


SEED_KEYS = ("valid", "steps", "tokens_per_second", "peak_rss_mb", "command")


def plan_item(variant: Variant, d_inner: int, args: argparse.Namespace, *, seed: int | None = None) -> dict:
    """One arena run (the first pass: the preset's seed; else `seed` in `<name>-seed<seed>`)."""
    run_name = variant.name if seed is None else f"{variant.name}-seed{seed}"
    argv = command(variant, d_inner, args, seed=seed, name=run_name)
    return planned_run(argv, Path(args.runs) / run_name, threads=args.threads, fresh=args.fresh,
                       name=variant.name, about=variant.about, d_inner=d_inner, mlm=variant.mlm, seed=seed)


def collect(item: dict) -> dict:
    run_dir = Path(item["run_dir"])
    result = read_record(run_dir / "result.json")
    records = read_records(run_dir / "metrics.jsonl")
    valid = [r for r in records if r.get("split") == "valid"]
    train = [r for r in records if r.get("split") == "train"]
    metric = result.get("metric", "bpc")
    return {
        **{k: item[k] for k in ("name", "about", "command", "d_inner", "peak_rss_mb")},
        "mlm": item.get("mlm", False),
        "accuracy": valid[-1].get("accuracy") if valid else None,
        "ponder_depth": train[-1].get("ponder_depth") if train else None,
        "parameters": result["parameters"],
        "metric": metric,
        "valid": valid[-1][metric] if valid else None,
        "valid_tokens": valid[-1]["tokens"] if valid else None,
        "steps": result["steps"],
        "tokens": result["tokens"],
        "train_minutes": result["elapsed"] / 60,
        "tokens_per_second": result["tokens_per_second"],
        # a window without a finite step records its loss as null (train/loop.py): no point on the curve
        "curve": [(r["elapsed"] / 60, r[metric]) for r in train if r.get(metric) is not None],
    }


def seed_spread(row: dict) -> tuple[float, float]:
    """Mean and sample standard deviation of a row's valid metric over its seeds."""
    values = [seed["valid"] for seed in row["seeds"]]
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def noise_section(rows: list[dict], metric: str) -> list[str]:
    """The rows trained with several seeds: each seed's result, and whether the gap between neighbours
    in the mean ranking is larger than their seed-to-seed spread."""
    seeded = sorted((r for r in rows if r.get("seeds")), key=lambda r: seed_spread(r)[0])
    if not seeded:
        return []
    count = len(seeded[0]["seeds"])
    lines = ["", f"## Noise: the {len(seeded)} best rows over {count} seeds", "",
             f"The {len(seeded)} best rows of the first pass, trained again with {count - 1} more seed(s): the same "
             "command plus `--seed S` (model initialisation, dropout and the masked/sampled data all change; the "
             "corpus order does not). Each seed's valid metric, then the mean and the sample standard deviation.",
             "", f"| variant | valid {metric} per seed | mean ± sd | steps per seed |", "|---|---|---|---|"]
    for r in seeded:
        mean, sd = seed_spread(r)
        per_seed = ", ".join(f"{seed['valid']:.4f} (seed {seed['seed']})" for seed in r["seeds"])
        steps = ", ".join(f"{seed['steps']:,}" for seed in r["seeds"])
        lines.append(f"| {r['name']} | {per_seed} | {mean:.4f} ± {sd:.4f} | {steps} |")
    lines += ["", "Neighbours in this ranking (gap of the means against the combined spread "
              "sqrt(sd_a² + sd_b²); with so few seeds only a gap of more than twice it is called a difference):", ""]
    for a, b in zip(seeded, seeded[1:], strict=False):
        (mean_a, sd_a), (mean_b, sd_b) = seed_spread(a), seed_spread(b)
        gap, spread = mean_b - mean_a, (sd_a ** 2 + sd_b ** 2) ** 0.5
        ratio = gap / spread if spread > 0 else (float("inf") if gap > 0 else 0.0)
        verdict = "a difference" if ratio > 2 else "within the noise"
        lines.append(f"- {a['name']} < {b['name']}: gap {gap:.4f} {metric}, {ratio:.1f}× the combined spread: "
                     f"{verdict}")
    return lines


def markdown(report: dict) -> str:
    from txl.bench.common import machine_markdown

    rows = [r for r in report["rows"] if not r.get("mlm")]
    mlm_rows = [r for r in report["rows"] if r.get("mlm")]
    metric = report["rows"][0]["metric"] if report["rows"] else "bpc"
    ref = next((r for r in rows if r["name"] == REFERENCE), None)
    cores = report["machine"].get("cores") or os.cpu_count() or 1
    share = ("jobs × threads ≤ its cores: no run waited for a core" if report["jobs"] * report["threads"] <= cores
             else f"jobs × threads > its {cores} cores: runs shared cores, tokens/s are lower than alone")
    lines = [
        "# The arena: every variant on PTB-char, same parameters, same CPU budget",
        "",
        f"Written by `python experiments/arena.py`. Every row is one `txl train` run of the "
        f"`{PRESET}` preset (4 layers, d_model 128, 4 heads × 32, tgt_len 128, mem_len 128, batch 16, "
        "Adam 1e-3 constant after 200 warm-up steps, dropout 0.1) that changes only the keys in its "
        "command; d_inner is chosen per variant so the parameter count is the closest to the xl row's. "
        f"Budget: {report['minutes']:g} minutes of training wall clock per run, {report['threads']} torch "
        f"thread(s), {report['jobs']} runs side by side on the machine below ({share}). Then one validation "
        "over the whole valid split "
        f"with the training memory. Lower {metric} is better; the budget is short (a fraction of an epoch "
        "to about one), so this ranks what each variant learns in equal CPU time on this corpus, not "
        "converged quality.",
        "",
        machine_markdown({**report["machine"], "threads": f"{report['threads']} (per run)"}),
        "",
        f"| variant | what | params | d_inner | valid {metric} | {metric} over seeds (mean ± sd) | steps | "
        "train tokens/s | peak RSS (MB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["valid"] is None, r["valid"] or 0)):
        spread = "—"
        if r.get("seeds"):
            mean, sd = seed_spread(r)
            spread = f"{mean:.4f} ± {sd:.4f} ({len(r['seeds'])} seeds)"
        lines.append(
            f"| {r['name']} | {r['about']} | {r['parameters']:,} | {r['d_inner']} | "
            f"{r['valid']:.4f} | {spread} | {r['steps']:,} | {r['tokens_per_second']:,.0f} | {r['peak_rss_mb']:,.0f} |"
        )
    lines += noise_section(rows, metric)
    if ref:
        lines += ["", f"Parameter counts lie within {report['max_param_gap']:.2%} of the xl row "
                  f"({ref['parameters']:,}), the rows marked not parameter-matched aside."]
    ponder = [r for r in rows if r.get("ponder_depth") is not None]
    for r in ponder:
        lines += ["", f"{r['name']}: average ponder depth (ACT steps + remainder) at the end of training "
                  f"{r['ponder_depth']:.2f} of at most {4 + 1}."]
    if mlm_rows:
        lines += [
            "", "## Bidirectional encoders (masked LM)", "",
            "The same preset trained with `--objective mlm` (BERT's 80/10/10 at mask_prob 0.15, no memory, the "
            "kernel sees the whole segment both ways), scored on the masked tokens of the valid split "
            f"(the same positions for every row): {metric} and accuracy of the masked tokens. Not comparable "
            "with the causal table (a different task).", "",
            f"| variant | what | params | d_inner | masked {metric} | masked accuracy | steps | train tokens/s | "
            "peak RSS (MB) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(mlm_rows, key=lambda r: (r["valid"] is None, r["valid"] or 0)):
            lines.append(
                f"| {r['name']} | {r['about']} | {r['parameters']:,} | {r['d_inner']} | {r['valid']:.4f} | "
                f"{r['accuracy']:.4f} | {r['steps']:,} | {r['tokens_per_second']:,.0f} | {r['peak_rss_mb']:,.0f} |")
    cheaper = [r["name"] for r in rows if ref and r is not ref and r["valid"] is not None and ref["valid"] is not None
               and r["steps"] > ref["steps"] and r["valid"] < ref["valid"]]
    lines += [
        "",
        "Reading the table: the budget is time, so a cheaper variant takes more steps (the steps column); "
        "at this short budget that can outweigh what it gives up. "
        + (f"Here {', '.join(cheaper)} took more steps than xl and reached a lower {metric}. " if cheaper else "")
        + "The absolute encodings (sinusoidal, learned) restart their positions in every segment, so "
        "with memory a key's position no longer tells which segment it came from: the temporal confusion "
        "Dai et al. (2019, §3.3) built relative positions to remove. The sinusoidal-mem0 and learned-mem0 rows "
        "train the same encodings without memory, where that confusion cannot arise.",
        "",
        "Linformer and inducing points cannot be causal (docs/guide/models.md, \"The arena\"): they appear only in the "
        "masked-LM table.",
        "",
        "![train bpc against minutes](arena.png)",
        *[line for section in report.get("sections", {}).values() for line in section_markdown(section)],
        "",
        "## Reproduce",
        "",
        "Each row alone (with PTB in its download location, `txl data download ptb`, or add `--data ptb-char:DIR`):",
        "",
        "```",
        *[f"{r['command']}" for r in report["rows"]],
        *[seed["command"] for r in report["rows"] for seed in r.get("seeds", [])[1:]],
        "```",
        "",
        f"All rows, side by side as above: `{report['reproduce']}`",
        "",
    ]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    colours = plt.get_cmap("tab20").colors
    causal = [r for r in report["rows"] if not r.get("mlm")]  # masked-LM curves are another task
    for index, r in enumerate(causal):
        if not r["curve"]:
            continue
        xs, ys = zip(*r["curve"], strict=True)
        k = 8  # running mean over 8 log records: the train bpc of one 25-step window is noisy
        smooth = [sum(ys[max(0, i - k + 1): i + 1]) / len(ys[max(0, i - k + 1): i + 1]) for i in range(len(ys))]
        ax.plot(xs, smooth, label=f"{r['name']} ({r['valid']:.3f})", color=colours[(2 * index) % 20 + index // 10],
                linestyle="-" if index < 10 else "--")
    ax.set_xlabel("training minutes")
    ax.set_ylabel(f"train {causal[0]['metric'] if causal else 'bpc'} (running mean)")
    ax.set_title("arena on PTB-char: same parameters, same CPU budget (final valid in the legend)")
    ends = [r["curve"][-1][1] for r in causal if r["curve"]]
    if ends:  # a run shorter than one log interval has no curve (a smoke run on a busy machine)
        ax.set_ylim(min(ends) - 0.1, max(ends) + 0.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from txl.bench.common import machine
    from txl.data import open_corpus
    from txl.train.config import build_run_config

    out = Path(args.out)
    if args.render:
        try:
            report = read_json(out / "arena.json", what="arena report", error=UsageError)
        except (OSError, ValueError, TxlError) as err:
            raise UsageError(f"--render needs a readable {out / 'arena.json'} ({err})") from None
        write_text(out / "arena.md", markdown(report))
        plot(report, out / "arena.png")
        print(f"wrote {out / 'arena.md'}, {out / 'arena.png'}")
        return 0
    if args.minutes <= 0 or args.threads < 1 or args.jobs < 1 or args.seeds < 1 or args.top < 0:
        raise UsageError("--minutes must be > 0, --threads, --jobs and --seeds >= 1, --top >= 0")
    data = args.data or build_run_config(preset=PRESET).train.data
    vocab_size = len(open_corpus(data).vocab)
    base = build_run_config(preset=PRESET, sets=list(args.sets)).model.get("d_inner", 512)
    target = parameter_count(list(args.sets), vocab_size)  # the reference variant (xl) changes no key
    if args.section and REFERENCE not in args.variants:
        args.variants = (REFERENCE, *args.variants)  # the anchor every row of a section is read against
    plan = []
    for name in args.variants:
        variant = VARIANTS[name]
        d_inner, _ = match_d_inner(variant, target, vocab_size, base) if name != REFERENCE else (base, target)
        plan.append(plan_item(variant, d_inner, args))
    started = time.time()
    train_variants(plan, args)
    rows = [collect(item) for item in plan]
    if args.seeds > 1 and args.top > 0:  # the leading causal rows again with more seeds: their noise
        first_seed = build_run_config(preset=PRESET, sets=list(args.sets)).train.seed
        causal = sorted((r for r in rows if not r["mlm"] and r["valid"] is not None), key=lambda r: r["valid"])
        extra = [plan_item(VARIANTS[r["name"]], r["d_inner"], args, seed=first_seed + k)
                 for r in causal[:args.top] for k in range(1, args.seeds)]
        train_variants(extra, args, desc="arena seeds")
        for r in causal[:args.top]:
            runs = [collect(item) for item in extra if item["name"] == r["name"]]
            r["seeds"] = [{"seed": first_seed, **{k: r[k] for k in SEED_KEYS}},
                          *({"seed": item["seed"], **{k: run[k] for k in SEED_KEYS}}
                            for item, run in zip((i for i in extra if i["name"] == r["name"]), runs, strict=True))]
    ref = next((r for r in rows if r["name"] == REFERENCE), rows[0])
    flags = ["python", "experiments/arena.py", "--variants", ",".join(args.variants), "--minutes", f"{args.minutes:g}",
             "--threads", str(args.threads), "--jobs", str(args.jobs), "--seeds", str(args.seeds),
             "--top", str(args.top)]
    if args.data:
        flags += ["--data", args.data]
    for s in args.sets:
        flags += ["--set", s]
    report = {
        "preset": PRESET, "minutes": args.minutes, "threads": args.threads, "jobs": args.jobs,
        "seeds": args.seeds, "top": args.top, "machine": machine(), "wall_minutes": (time.time() - started) / 60,
        "max_param_gap": max(abs(r["parameters"] - ref["parameters"]) / ref["parameters"] for r in rows
                             if VARIANTS[r["name"]].match),
        "reproduce": shlex.join(flags), "rows": rows,
    }
    if args.section:
        flags += ["--section", args.section]
        report["reproduce"] = shlex.join(flags)
    previous = _previous_report(out)
    if args.section:  # the main table stays as it was; this section is (re)placed
        if previous is None:
            raise UsageError(f"--section adds to an existing {out / 'arena.json'}; run the main table first")
        section = {**report, "name": args.section, "title": SECTIONS[args.section]}
        report = {**previous, "sections": {**previous.get("sections", {}), args.section: section}}
    elif previous is not None and previous.get("sections"):
        report["sections"] = previous["sections"]
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "arena.json", json.dumps(report, indent=2) + "\n")
    write_text(out / "arena.md", markdown(report))
    plot(report, out / "arena.png")
    print(markdown(report).split("## Reproduce")[0])
    print(f"wrote {out / 'arena.md'}, {out / 'arena.json'}, {out / 'arena.png'}")
    return 0


def _previous_report(out: Path) -> dict | None:
    path = out / "arena.json"
    if not path.exists():
        return None
    try:
        return read_json(path, what="arena report", error=UsageError)
    except (OSError, ValueError, TxlError) as err:
        raise UsageError(f"cannot read the existing {path} ({err}); move it away to start a new report") from None


def section_markdown(section: dict) -> list[str]:
    """A section's table: its rows against its own xl anchor, on its own machine."""
    from txl.bench.common import machine_markdown

    rows = sorted(section["rows"], key=lambda r: (r["valid"] is None, r["valid"] or 0))
    metric = rows[0]["metric"] if rows else "bpc"
    ref = next((r for r in rows if r["name"] == REFERENCE), None)
    lines = ["", f"## {section['title']}", "",
             f"The same preset, budget ({section['minutes']:g} minutes, {section['threads']} thread(s) per run, "
             f"{section['jobs']} runs side by side) and parameter matching as the main table, trained on the machine "
             "below with the xl row again as the anchor: compare these rows with this section's xl, not with the "
             "main table (another machine gives another number of steps in the same minutes).", "",
             machine_markdown({**section["machine"], "threads": f"{section['threads']} (per run)"}), "",
             f"| variant | what | params | d_inner | valid {metric} | vs xl | steps | train tokens/s | peak RSS (MB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        delta = "—" if ref is None or r is ref or r["valid"] is None else f"{r['valid'] - ref['valid']:+.4f}"
        lines.append(f"| {r['name']} | {r['about']} | {r['parameters']:,} | {r['d_inner']} | {r['valid']:.4f} | "
                     f"{delta} | {r['steps']:,} | {r['tokens_per_second']:,.0f} | {r['peak_rss_mb']:,.0f} |")
    if section.get("note"):  # what the numbers alone do not say (written into arena.json by hand)
        lines += ["", section["note"]]
    lines += ["", "One seed per row: the main table's noise section puts the seed-to-seed spread of a row at about "
              "0.002–0.016 bpc, so differences smaller than that are not differences.", "", "```",
              *[r["command"] for r in section["rows"]], "```", "", f"All rows: `{section['reproduce']}`"]
    return lines


def main(argv: list[str] | None = None) -> int:
    return script_main("arena", "train every attention kernel and positional encoding on PTB-char under one CPU "
                       "budget (docs/results/arena.md)", configure, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
