"""`txl train`: arguments, the configuration of a new or resumed run, and the multi-process launch."""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from txl.cli.arguments import add_threads, integer, real
from txl.errors import UsageError
from txl.train.config import apply_sets, build_run_config, preset_names
from txl.train.distributed import env_int
from txl.train.finish import finish
from txl.train.loop import Trainer
from txl.train.optim import lr_at
from txl.train.rundir import LAST, open_run_dir
from txl.train.state import STATE_FILE, resume_config

MAX_NPROC = 1024  # processes; more than a machine txl trains on has cores (launch() also checks this one's)
MAX_MINUTES = 525_600  # a year of wall clock


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", help=f"one of: {', '.join(preset_names())} (default: tiny)")
    parser.add_argument("--config", metavar="FILE", help="a TOML file with [model] and [train] sections")
    parser.add_argument("--data", metavar="SPEC",
                        help="data spec, e.g. ptb-char:DIR or text:FILE?tokenizer=chars (see `txl data list`); "
                             "needed when the preset's corpus is not in its download location")
    parser.add_argument("--out", metavar="DIR", help="run directory (default: runs/PRESET-TIMESTAMP)")
    parser.add_argument("--max-steps", type=int, metavar="N",
                        help="optimiser steps (also the schedule's horizon; with --resume, a new total)")
    parser.add_argument("--max-minutes", type=real(0, MAX_MINUTES, meaning="0 = none"), metavar="M",
                        help="wall-clock budget in minutes (0 = none)")
    parser.add_argument("--seed", type=int, help="random seed of the model, data order and sample")
    parser.add_argument("--objective", choices=["lm", "mlm", "classify"],
                        help="lm: next-token LM with memory (default); mlm: masked LM (BERT 80/10/10) for the "
                             "bidirectional encoder (causal=false, no memory, no sample); classify: label long "
                             "documents (--data docs:DIR, one sub-folder per label), each read segment by segment "
                             "with the memory (--set model.classifier_segments=first: the first segment only)")
    parser.add_argument("--mask-prob", type=float, metavar="P", help="mlm: share of positions masked (default 0.15)")
    parser.add_argument("--resume", metavar="RUN_DIR",
                        help="continue a run exactly where its last checkpoint left it (with --data when the corpus "
                             "moved; --max-steps/--max-minutes may change)")
    parser.add_argument("--init-from", metavar="RUN_OR_CKPT",
                        help="fine-tune: start a new run from these trained weights (the model section comes from "
                             "the checkpoint; the vocabulary must match; new optimiser and schedule)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key: model.d_model=256, lr=1e-3, precision=bf16 ... "
                             "(all --set flags are applied together, then checked)")
    parser.add_argument("--nproc", type=integer(0, MAX_NPROC, meaning="0 = this process only"), default=0,
                        help="launch N processes on this machine (torchrun --nproc-per-node N; at most one per CPU)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where to train (default: auto, a GPU when there is one)")
    add_threads(parser)
    parser.add_argument("--quiet", action="store_true", help="no progress bar or log lines")
    parser.add_argument("--force", action="store_true",
                        help="train into an existing --out that holds files txl did not write (txl's own file "
                             "names in it are replaced)")


def run(args: argparse.Namespace) -> int:
    if args.nproc and env_int("WORLD_SIZE", 1) == 1:
        return launch(args.nproc)
    flags = {"data": args.data, "max_steps": args.max_steps, "max_minutes": args.max_minutes, "seed": args.seed,
             "objective": args.objective, "mask_prob": args.mask_prob}
    if args.objective == "mlm":
        flags["sample_tokens"] = 0  # an encoder generates no text (a --set sample_tokens=N is still an error)
    main = env_int("RANK", 0) == 0
    lock = None
    try:
        if args.resume:
            if (args.preset or args.config or args.set or args.seed is not None or args.init_from
                    or args.force or args.objective or args.mask_prob is not None):
                raise UsageError("--resume continues the saved configuration; only --max-steps, --max-minutes and "
                                 "--data (the same corpus, moved) may change; to start a new run from its weights "
                                 "use --init-from RUN --out NEW")
            if args.out:
                raise UsageError(f"--resume continues the run in its own directory {args.resume}; drop --out (to "
                                 f"start a new run from its weights, use --init-from {args.resume} --out {args.out})")
            out = Path(args.resume)
            if main:  # one writer: locked before crash recovery reads or moves anything in the run
                lock = open_run_dir(out, resume=True)
            before = resume_config(out)
            run = resume_config(out, max_steps=args.max_steps, max_minutes=args.max_minutes)
            if args.data:
                run.train.data = args.data  # the fingerprints are compared when the checkpoint is restored
            state = saved_state(out)
            step, elapsed = int(state["step"]), float(state.get("elapsed") or 0.0)
            note = schedule_note(before.train, run.train, step, elapsed)  # (refuses a budget already passed)
            done = finished_line(out, run.train, step, elapsed)
            if done:  # nothing to train: say so instead of scoring the same weights again (every rank stops)
                if main:
                    print(f"txl train: {done}", file=sys.stderr)
                if lock is not None:
                    lock.release()
                return 0
            if note:
                print(f"note: {note}", file=sys.stderr)
        else:
            preset = args.preset or (None if args.config else "tiny")
            run = build_run_config(preset=preset, config_file=args.config, flags=flags)
            if args.init_from:
                run.model = init_model_section(args.init_from)
                if args.preset or args.config:
                    print(f"note: --init-from: the model section is {args.init_from}'s; the [model] of "
                          f"{args.preset or args.config} is not used (--set model.KEY=VALUE still applies)",
                          file=sys.stderr)
            apply_sets(run, args.set)
            name = preset or Path(args.config).stem
            if args.init_from:
                name += "-finetune"
            out = Path(args.out) if args.out else Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
            if main:
                lock = open_run_dir(out, resume=False, force=args.force)
        trainer = Trainer(run, out, device=args.device, resume=bool(args.resume), quiet=args.quiet,
                          init_from=args.init_from, force=args.force, lock=lock)  # one lock per run
    except BaseException:
        if lock is not None:
            lock.abandon()  # a failed start leaves the directory as it was
        raise
    try:
        return _train(trainer, run, out)
    finally:
        trainer.close()
        if lock is not None:
            lock.release()


def _train(trainer: Trainer, run, out: Path) -> int:
    if trainer.dist.main:
        start = f", weights from {trainer.init_from}" if trainer.init_from else ""
        print(f"txl train: {trainer.model.num_parameters():,} parameters, data {run.train.data} "
              f"({len(trainer.corpus.vocab):,} tokens in the vocabulary, metric {trainer.metric}), "
              f"out {out}, world size {trainer.dist.world}, {torch.get_num_threads()} torch thread"
              f"{'s' if torch.get_num_threads() > 1 else ''}{start}", file=sys.stderr)
    summary = trainer.fit()
    if summary["stopped_by"] != "signal":
        finish(trainer, summary)
    elif trainer.dist.main:
        print(f"txl train: stopped by signal at step {summary['steps']}; resume with --resume {out}", file=sys.stderr)
    if dist.is_initialized():
        if summary["stopped_by"] != "signal":
            dist.barrier()  # every rank leaves together: a rank tearing down gloo while rank 0 still wrote its
            # results could abort ("terminate called without an active exception", about 1 run in 8 under load)
        dist.destroy_process_group()
    return 0


def init_model_section(source: str) -> dict:
    """`--init-from`: the model section is the checkpoint's (its vocabulary size comes from the data)."""
    from txl.errors import CheckpointError
    from txl.models.checkpoint import no_checkpoint_yet
    from txl.models.pretrained import resolve_checkpoint
    from txl.models.registry import load_config

    if line := no_checkpoint_yet(source):  # a run before its first save: when that comes, not "not a run"
        raise CheckpointError(line)
    config = load_config(resolve_checkpoint(source)).to_dict()
    config.pop("vocab_size", None)
    return config


def saved_step(run_dir: Path) -> int:
    return int(saved_state(run_dir)["step"])


def saved_state(run_dir: Path) -> dict:
    from txl.models.pretrained import read_json

    return read_json(run_dir / LAST / STATE_FILE, "training state")


def finished_line(out: Path, cfg, step: int, elapsed: float) -> str:
    """One line when a resumed run has nothing left to do: its budget (the saved one, or the one given now) is
    reached and its result.json was written. "" otherwise (a run stopped after its last checkpoint but before
    its result still gets its final scores)."""
    from txl.errors import TxlError
    from txl.models.pretrained import read_json

    by_steps = step >= cfg.max_steps
    by_minutes = cfg.max_minutes > 0 and elapsed >= cfg.max_minutes * 60
    if not (by_steps or by_minutes) or not (out / "result.json").is_file():
        return ""
    try:
        result = read_json(out / "result.json", "run result", follow_links=False)
    except TxlError:
        result = {}
    metric = result.get("metric") if isinstance(result, dict) else None
    final = result.get("final", {}).get("valid", {}) if isinstance(result, dict) and isinstance(
        result.get("final"), dict) else {}
    value = final.get(metric) if isinstance(final, dict) and isinstance(metric, str) else None
    if not isinstance(value, int | float):
        value = result.get(f"best_valid_{metric}") if isinstance(result, dict) and isinstance(metric, str) else None
    score = f", valid {metric} {value:.4f}" if isinstance(value, int | float) else ""
    run = shlex.quote(str(out))
    if by_steps:
        budget, more = f"max_steps {cfg.max_steps}", f"--max-steps {max(2 * cfg.max_steps, step + 1)}"
    else:
        budget, more = (f"max_minutes {cfg.max_minutes:g} ({elapsed / 60:.1f} minutes trained)",
                        f"--max-minutes {math.ceil(2 * max(cfg.max_minutes, elapsed / 60))}")
    return (f"{out} is finished: step {step}, {budget}{score} ({out / 'result.json'}); nothing was trained or "
            f"scored; to train longer give a larger budget: txl train --resume {run} {more}")


def schedule_note(before, after, step: int, elapsed: float = 0.0) -> str:
    """What a new step or time budget does to a resumed run's learning-rate schedule, in one line
    (`elapsed`: the run's training seconds so far). A budget already spent is an error."""
    steps_changed = after.max_steps != before.max_steps
    minutes_changed = after.max_minutes != before.max_minutes
    if not (steps_changed or minutes_changed):
        return ""
    if steps_changed and after.max_steps <= step:
        raise UsageError(f"--max-steps {after.max_steps} is not beyond the run's step {step}; give a larger total")
    if minutes_changed and 0 < after.max_minutes * 60 <= elapsed:
        raise UsageError(f"--max-minutes {after.max_minutes:g} is not beyond the run's {elapsed / 60:.1f} minutes of "
                         "training; give a larger total")
    change = " and ".join(
        [f"max_steps {before.max_steps} -> {after.max_steps}"] * steps_changed
        + [f"max_minutes {before.max_minutes:g} -> {after.max_minutes:g}"] * minutes_changed)
    by_clock = after.schedule_clock == "minutes" and after.max_minutes > 0  # without minutes: the steps alone
    if after.schedule == "constant" or (after.schedule == "inv_sqrt" and step >= after.warmup_steps) or (
            not steps_changed and not by_clock):
        return f"{change}; the {after.schedule} schedule does not depend on it"

    def lr(cfg, at):
        spent = elapsed / (60 * cfg.max_minutes) if cfg.schedule_clock == "minutes" and cfg.max_minutes > 0 else 0.0
        return lr_at(at, schedule=cfg.schedule, lr=cfg.lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps,
                     eta_min=cfg.eta_min, time_fraction=spent)

    horizon = "whichever of max_steps and max_minutes is further along" if by_clock else f"step {after.max_steps}"
    now, was = lr(after, step), lr(before, step)
    trend = "the same rate" if abs(now - was) <= 1e-12 * max(abs(was), 1e-30) else (
        "it decays more slowly from here" if now > was else "it decays faster from here")
    return (f"{change}: the {after.schedule} schedule now ends at {horizon}, so the learning rate at step {step} "
            f"is {now:.3g} instead of {was:.3g}; {trend}")


def launch(nproc: int) -> int:
    """`txl train --nproc N ...`: N ranks of `txl train ...` (same arguments) on this machine, started as
    `torchrun --standalone --nproc-per-node N` starts them (txl.train.distributed.launch_local)."""
    import os

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if nproc > cpus:  # each process is a whole trainer (~150 MB before its model); past the cores they only queue
        raise UsageError(f"--nproc {nproc} is more than the {cpus} CPUs this process may use; use --nproc {cpus} "
                         "or fewer (one process per core)")
    argv = [a for a in sys.argv[1:]]
    cleaned, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        cleaned.append(a)
    from txl.train.distributed import launch_local

    return launch_local(nproc, cleaned, cpus=cpus)  # cleaned: sys.argv past the program, "train" first
