"""`txl recl`: the relative effective context length of a group of checkpoints (Dai et al. 2019,
appendix C), computed by `txl.eval.recl`; this module parses and checks the command's arguments."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from txl.cli.arguments import (
    MAX_SCORED,
    PRECISIONS,
    add_checkpoint,
    add_threads,
    check_nonnegative,
    check_positive,
    resolve_device,
)
from txl.cli.arguments import shown as _shown
from txl.errors import OutputError, UsageError, describe_os_error
from txl.io import write_text as write_file

# Bounds of --contexts and --r: each context is a forward pass per scored position, so 1:1000000000:1
# meant a billion of them (and a list of a billion ints before the first); lengths past the longest a
# model txl builds can take (config.mem_len's bound) are refused here, not deep in torch.
MAX_CONTEXTS = 1_000
MAX_CONTEXT_LENGTH = 1 << 24
MAX_RATIOS = 100


def parse_contexts(text: str) -> list[int]:
    """"100,200,300" or "100:1000:100" (start:stop:step, stop included) -> increasing ints >= 1."""
    shown = _shown(text)
    try:
        if ":" in text:
            parts = [int(p) for p in text.split(":")]
            if len(parts) != 3 or parts[2] < 1:
                raise ValueError
            count = max(0, (parts[1] - parts[0]) // parts[2] + 1)  # before making the list
            if count > MAX_CONTEXTS:
                raise UsageError(f"--contexts {shown} gives {count:,} lengths; give at most {MAX_CONTEXTS:,} "
                                 "context lengths (a larger step)")
            values = list(range(parts[0], parts[1] + 1, parts[2]))
        else:
            values = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise UsageError(f"--contexts {shown}: give comma-separated lengths (100,200,300) or "
                         "start:stop:step (100:1000:100)") from None
    if len(values) > MAX_CONTEXTS:
        raise UsageError(f"--contexts gives {len(values):,} lengths; give at most {MAX_CONTEXTS:,} context lengths")
    if len(values) < 2 or values[0] < 1 or any(b <= a for a, b in zip(values, values[1:])):
        raise UsageError(f"--contexts {shown}: need at least two increasing lengths >= 1")
    if values[-1] > MAX_CONTEXT_LENGTH:
        raise UsageError(f"--contexts: lengths must be <= {MAX_CONTEXT_LENGTH:,}, got {values[-1]:,}")
    return values


def parse_rs(text: str) -> list[float]:
    shown = _shown(text)
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise UsageError(f"--r {shown}: give comma-separated ratios such as 0.1,0.5,1.0") from None
    if not values or len(values) > MAX_RATIOS or any(not 0.0 < r <= 1.0 for r in values):  # nan fails too
        raise UsageError(f"--r {shown}: give 1 to {MAX_RATIOS} ratios, every ratio in (0, 1]")
    return values


def configure(parser: argparse.ArgumentParser) -> None:
    add_checkpoint(parser, nargs="+")
    add_threads(parser)
    parser.add_argument("--data", help="data spec (default: the corpus the first checkpoint trained on)")
    parser.add_argument("--split", default="valid", help="valid or test (default: valid)")
    parser.add_argument("--contexts", required=True, metavar="C1,C2,... | START:STOP:STEP",
                        help="context lengths, increasing; consecutive pairs are the (c, c + Δ) steps")
    parser.add_argument("--r", default="0.1,0.5,1.0", help="top-r ratios of hard tokens (default 0.1,0.5,1.0)")
    parser.add_argument("--threshold", type=float, default=0.01, help="relative gain threshold (paper: 0.01)")
    parser.add_argument("--mode", choices=["window", "memory"], default="window",
                        help="how context length c is realised: window = a fresh forward over exactly the c "
                             "previous tokens (the definition; default); memory = mem_len c with same_length "
                             "(attention length c; reach up to n_layer × c)")
    parser.add_argument("--positions", type=int,
                        help="score this many positions, evenly spaced (0 = all; default 2000 in window mode, "
                             "all in memory mode)")
    parser.add_argument("--max-tokens", type=int, default=0, help="only use the first N tokens of the split")
    parser.add_argument("--tgt-len", type=int, default=128,
                        help="memory mode: segment length (default 128; with same_length every query still sees "
                             "exactly c keys)")
    parser.add_argument("--batch-size", type=int, default=0,
                        help="window mode: windows per forward (0 = automatic); memory mode: streams (0 = 1)")
    parser.add_argument("--names", help="comma-separated labels for the checkpoints (default: run names)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="fp32, or bf16/fp16 autocast, or auto = bf16 where the device has fast bf16 (default fp32)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where to run (default: auto, a GPU when there is one)")
    parser.add_argument("--cache", metavar="DIR",
                        help="store per-token losses here and reuse them (resumable; change r or the "
                             "threshold without recomputing)")
    parser.add_argument("--vanilla-context", choices=["train", "full"], default="train",
                        help="window mode, models with absolute positions and no memory (vanilla Transformers): "
                             "train = they read at most their training segment length, as the paper's vanilla "
                             "model (default); full = every window is fed whole")
    parser.add_argument("--out", metavar="PREFIX", help="write PREFIX.md, PREFIX.json and PREFIX.png")
    parser.add_argument("--json", action="store_true", help="print JSON")


def _label(path: Path) -> str:
    return path.parent.name if path.name in ("best", "last") else path.name


def run(args: argparse.Namespace) -> int:
    from txl.eval.recl import choose_positions

    contexts = parse_contexts(args.contexts)
    rs = parse_rs(args.r)
    check_nonnegative(args, "batch_size")
    check_nonnegative(args, "positions", "max_tokens", limit=MAX_SCORED)
    check_positive(args, "tgt_len")
    if not 0 < args.threshold < 1:
        raise UsageError(f"--threshold must be in (0, 1), got {args.threshold}")
    names = [n.strip() for n in args.names.split(",")] if args.names else None
    if names is not None and len(names) != len(args.checkpoint):
        raise UsageError(f"--names gives {len(names)} labels for {len(args.checkpoint)} checkpoints")

    from txl.eval.corpus import open_eval_corpus
    from txl.eval.recl import (
        compute_recl,
        context_losses,
        fixed_context,
        plot_recl,
        recl_markdown,
        weights_key,
    )
    from txl.eval.result import metric_value
    from txl.models.checkpoint import load_checkpoint

    device = resolve_device(args.device)
    ckpts = [load_checkpoint(path, device=device) for path in args.checkpoint]
    from txl.models.registry import not_a_language_model

    for ckpt in ckpts:  # RECL compares how language models use context (an encoder-decoder ended in a traceback)
        other = not_a_language_model(ckpt.model.config)
        if other is not None:
            raise UsageError(f"{ckpt.path} is {other[0]}: txl recl measures a language model's context; {other[1]}")
        if not ckpt.model.config.causal:
            raise UsageError(f"{ckpt.path} is a bidirectional (masked-LM) model: it sees both sides of every token, "
                             "so its gain from left context is not what txl recl measures; give causal language models")
    names = names or [_label(c.path) for c in ckpts]
    if len(set(names)) != len(names):
        raise UsageError(f"two checkpoints have the same label ({names}); give --names")
    data = args.data or ckpts[0].data_spec
    corpus = tokens = None
    read_as = set()
    for ckpt in ckpts:  # every model must read the same corpus with the same vocabulary
        corpus, tokens = open_eval_corpus(ckpt, data, args.split)
        read_as.add(corpus.fingerprint)
    if len(read_as) > 1:  # e.g. an imported model (its own fixed vocabulary) next to one trained on the corpus
        raise UsageError(f"the checkpoints read {data} with different vocabularies, so their token streams differ; "
                         "RECL compares models on the same tokens")
    positions_count = args.positions if args.positions is not None else (2000 if args.mode == "window" else 0)
    positions = choose_positions(len(tokens), contexts[-1], positions_count, max_tokens=args.max_tokens)

    def log(message: str) -> None:
        if not args.json:
            print(message, file=sys.stderr, flush=True)

    losses = {}
    capped = {}
    started = time.perf_counter()
    for name, ckpt in zip(names, ckpts):
        cap = fixed_context(ckpt.model.config, ckpt.train_setting("tgt_len")) if args.vanilla_context == "train" else None
        if cap is not None and args.mode == "window":
            capped[name] = cap
            log(f"{name}: absolute positions, no memory: reads at most its training length {cap} (--vanilla-context)")
        log(f"{name}: {args.mode} mode, {len(positions):,} positions, contexts {contexts}")
        key = f"{weights_key(ckpt.path)}|{corpus.fingerprint}|{args.split}|{ckpt.model.clamp_len}"
        losses[name] = context_losses(ckpt.model, tokens, positions, contexts, mode=args.mode, tgt_len=args.tgt_len,
                                      batch_size=args.batch_size, device=device, precision=args.precision,
                                      cache=Path(args.cache) if args.cache else None, cache_key=key,
                                      log=lambda m, n=name: log(f"{n}: {m}"), max_context=capped.get(name))
    result = compute_recl(losses, contexts, rs, threshold=args.threshold)
    result.info = {"data": data, "split": args.split, "mode": args.mode, "checkpoints": [str(c.path) for c in ckpts],
                   "metric": corpus.metric, "seconds": time.perf_counter() - started,
                   "tgt_len": args.tgt_len if args.mode == "memory" else None,
                   "first_position": int(positions[0]), "last_position": int(positions[-1]),
                   "fixed_context": capped}
    table = recl_markdown(result, metric=corpus.metric)
    if args.out:
        prefix = Path(args.out)
        png = plot_recl(result, prefix.with_suffix(".png"), metric=corpus.metric)
        header = (f"RECL ({args.mode} mode) on `{data}` {args.split}: {len(positions):,} positions "
                  f"(targets {positions[0]:,} … {positions[-1]:,}), contexts {contexts}, threshold "
                  f"{args.threshold:g}\n\n")
        try:
            write_file(prefix.with_suffix(".md"), header + table + f"\n![RECL]({png.name})\n")
            write_file(prefix.with_suffix(".json"), json.dumps(result.to_dict(), indent=2) + "\n")
        except OSError as err:
            raise OutputError(f"cannot write {prefix}.md/.json: {describe_os_error(err)}") from None
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(table)
        best = {n: metric_value(min(result.mean_loss[n]), corpus.metric) for n in names}
        print("best " + corpus.metric + ": " + ", ".join(f"{n} {v:.4f}" for n, v in best.items()))
        if args.out:
            print(f"wrote {Path(args.out).with_suffix('.md')}, .json, .png")
    return 0
