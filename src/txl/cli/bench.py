"""`txl bench NAME`: argument parsing and dispatch. Imports nothing heavy at module level, so
`txl --help` stays fast; the benchmark module is imported when it runs."""

from __future__ import annotations

import argparse
import importlib

from txl.bench.common import CONFIG_NAMES
from txl.bench.registry import BENCHES, available, has_own_cli, load
from txl.cli.arguments import integer, integer_list, threads

# Bounds of the shared flags: far above any useful benchmark, below a run that would never end or a
# shape that exhausts memory before the first timing (issue 50).
MAX_STEPS = 10_000
MAX_BENCH_LENGTH = 65_536  # --context and --mem-lens, in tokens
MAX_PROFILE_STEPS = 1_000

def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


# One line per benchmark for `txl bench --help` (the module docstrings hold the method).
SUMMARIES: dict[str, str] = {
    "train": "training throughput (forward, backward, clip, Adam step) in tokens/s, ours against Hugging Face",
    "eval": "evaluation throughput and peak memory as the memory length grows",
    "generate": "generation speed: memory reuse against re-running the whole context for every token",
    "mfu": "model FLOP utilisation of a training step against this machine's matmul peak",
    "kernel": "the attention kernel alone: eager reference against the fast path",
    "curve": "does bf16 autocast train like fp32? loss curves side by side",
    "eval-speedup": "Transformer-XL evaluation against the vanilla Transformer per scored token (paper Table 9)",
    "attention-scaling": "time and peak memory of one attention layer of each arena variant against length",
    "all": "train, eval, generate, mfu, kernel and curve in one go; writes benchmarks.md, benchmarks.json, plots",
}

# The shared flags and which benchmarks read them (a benchmark shows only its own).
_COMMON = ("json", "config", "precision", "steps", "warmup", "threads", "quick")
FLAGS_OF: dict[str, tuple[str, ...]] = {
    "train": (*_COMMON, "against", "impl", "no_rss", "profile", "activation_checkpointing"),
    "eval": (*_COMMON, "against", "impl", "mem_lens", "no_rss"),
    "generate": (*_COMMON, "impl", "context"),
    "mfu": (*_COMMON, "impl"),
    "kernel": (*_COMMON, "impl"),
    "curve": ("json", "config", "quick"),
}


def add_shared_flags(parser: argparse.ArgumentParser, names: tuple[str, ...] | None = None) -> None:
    """Declare the shared flags in `names` (all of them when None); the others get their defaults, so
    every benchmark's arguments have the same attributes."""
    flags = {
        "json": (("--json",), dict(metavar="FILE", help="also write the results as JSON")),
        "config": (("--config",), dict(choices=list(CONFIG_NAMES), default="tiny",
                                       help="tiny: 4×128, tgt=mem=128, batch 8; base: enwik8-base 12×512, "
                                            "tgt=mem=512, batch 2; a preset's name: the shape it trains "
                                            "(random tokens, its corpus's vocabulary size)")),
        "precision": (("--precision",), dict(choices=["fp32", "bf16"], default=None,
                                             help="fp32 or bf16 autocast (default fp32; mfu: both)")),
        "against": (("--against",), dict(choices=["hf"], action="append", default=[],
                                         help="also run Hugging Face TransfoXL (transformers==4.35.2, the bench "
                                              "extra)")),
        "impl": (("--impl",), dict(type=_names, default=("eager", "fast"), metavar="LIST",
                                   help="attention implementations of ours to run (default eager,fast)")),
        "steps": (("--steps",), dict(type=integer(1, MAX_STEPS), default=None,
                                     help="timed steps per contender (default 5)")),
        "warmup": (("--warmup",), dict(type=integer(0, MAX_STEPS), default=None,
                                       help="untimed steps first (default 2)")),
        "threads": (("--threads",), dict(type=threads(), default=0, help="torch threads (default 0: txl's choice, as every command)")),
        "mem_lens": (("--mem-lens",), dict(type=integer_list(1, MAX_BENCH_LENGTH), default=(), metavar="LIST",
                                           help="memory lengths to sweep (default: the benchmark's)")),
        "context": (("--context",), dict(type=integer(2, MAX_BENCH_LENGTH), default=1024,
                                         help="context length (default 1024)")),
        "no_rss": (("--no-rss",), dict(action="store_true", help="skip the peak-RSS subprocesses")),
        "profile": (("--profile",), dict(type=integer(0, MAX_PROFILE_STEPS), default=0, metavar="N",
                                         help="also profile N more steps of each contender and list the operators "
                                              "that take the most time (default 0: off)")),
        "activation_checkpointing": (("--activation-checkpointing",), dict(
            action="store_true", help="also run each txl contender with its blocks recomputed in the backward "
                                      "(train.activation_checkpointing=blocks), named txl-<impl>+ckpt")),
        "quick": (("--quick",), dict(action="store_true", help="few steps and small shapes: a smoke run")),
        "out": (("--out",), dict(default="docs/results",
                                 help="directory for benchmarks.md and the plots (default docs/results)")),
    }
    chosen = tuple(flags) if names is None else names
    defaults = {}
    for name, (option, kwargs) in flags.items():
        if name in chosen:
            parser.add_argument(*option, **kwargs)
        else:
            defaults[name] = False if kwargs.get("action") == "store_true" else kwargs.get("default")
    parser.set_defaults(**defaults)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = "speed and memory benchmarks, one per NAME; `txl bench NAME --help` shows its flags"
    sub = parser.add_subparsers(dest="name", metavar="NAME", required=True)
    for name, module_name in BENCHES.items():
        if not available(name):
            continue
        module = importlib.import_module(module_name)
        summary = SUMMARIES.get(name) or (module.__doc__ or name).strip().splitlines()[0]
        doc = {"attention-scaling": "docs/results/attention_scaling.md",
               "eval-speedup": "docs/guide/evaluation.md"}.get(name, "docs/results/benchmarks.md")
        p = sub.add_parser(name, help=summary, description=f"txl bench {name}: {summary}. Method and results: {doc}.")
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        if has_own_cli(module):
            module.configure(p)
        else:
            add_shared_flags(p, FLAGS_OF.get(name))
    p = sub.add_parser("all", help=SUMMARIES["all"], description=f"txl bench all: {SUMMARIES['all']}.")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    add_shared_flags(p)


def options_from(args: argparse.Namespace):
    from txl.bench.common import BenchOptions
    from txl.errors import UsageError
    from txl.models.transformer_xl.config import ATTENTION_IMPLS

    for impl in args.impl:
        if impl not in ATTENTION_IMPLS:
            raise UsageError(f"--impl {impl!r} is not an attention implementation ({', '.join(ATTENTION_IMPLS)})")
    quick = args.quick
    extra = {"context": args.context, "profile": args.profile,
             "activation_checkpointing": args.activation_checkpointing}
    if args.name == "mfu" and args.precision is None:
        extra["precisions"] = ["fp32", "bf16"]
    return BenchOptions(
        config=args.config,
        precision=args.precision or "fp32",
        against=tuple(args.against),
        impls=tuple(args.impl),
        warmup=args.warmup if args.warmup is not None else (1 if quick else 2),
        steps=args.steps if args.steps is not None else (2 if quick else 5),
        threads=args.threads,
        mem_lens=args.mem_lens,
        rss=not args.no_rss,
        quick=quick,
        extra=extra,
    )


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from txl.bench.common import write_json
    from txl.io import refuse_link

    if getattr(args, "json", None):
        refuse_link(Path(args.json))  # before minutes of measuring, not after (write_json refuses it too)
    if args.name != "all":
        module = load(args.name)
        if has_own_cli(module):
            return int(module.run(args) or 0)
    options = options_from(args)
    if args.name == "all":
        from txl.bench.report import run_all

        result = run_all(options, out_dir=args.out)
    else:
        module = load(args.name)
        result = module.run(options)
        print(f"## {module.TITLE}\n")
        print(module.table(result))
    if args.json:
        write_json(args.json, result)
    return 0
