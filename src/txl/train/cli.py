"""`txl train`: arguments, the configuration of a new or resumed run, and the multi-process launch."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch.distributed as dist

from txl.errors import UsageError
from txl.run_config import build_run_config, preset_names
from txl.train.distributed import env_int
from txl.train.finish import finish
from txl.train.loop import Trainer
from txl.train.state import open_run_dir, resume_config


def configure_cli(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", help=f"one of: {', '.join(preset_names())} (default: tiny)")
    parser.add_argument("--config", help="a TOML file with [model] and [train] sections")
    parser.add_argument("--data", help="data spec, e.g. ptb-char:../shared/data/ptb (see `txl data list`)")
    parser.add_argument("--out", help="run directory (default: runs/PRESET-TIMESTAMP)")
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--max-minutes", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue a run exactly where its last checkpoint left it")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key: model.d_model=256, lr=1e-3, precision=bf16 ...")
    parser.add_argument("--nproc", type=int, default=0,
                        help="launch N processes on this machine (torchrun --nproc-per-node N)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--force", action="store_true",
                        help="train into an existing --out that holds files txl did not write (txl's own file "
                             "names in it are replaced)")


def run_cli(args: argparse.Namespace) -> int:
    if args.nproc < 0:
        raise UsageError(f"--nproc must be >= 0 (0 = this process only), got {args.nproc}")
    if args.nproc and env_int("WORLD_SIZE", 1) == 1:
        return launch(args.nproc)
    flags = {"data": args.data, "max_steps": args.max_steps, "max_minutes": args.max_minutes, "seed": args.seed}
    main = env_int("RANK", 0) == 0
    lock = None
    try:
        if args.resume:
            if args.preset or args.config or args.set or args.data or args.seed is not None or args.force:
                raise UsageError("--resume continues the saved configuration; only --max-steps and --max-minutes "
                                 "may change")
            out = Path(args.resume)
            if main:  # locked before crash recovery reads or moves anything in the run
                lock = open_run_dir(out, resume=True)
            run = resume_config(out, max_steps=args.max_steps, max_minutes=args.max_minutes)
        else:
            preset = args.preset or (None if args.config else "tiny")
            run = build_run_config(preset=preset, config_file=args.config, sets=args.set, flags=flags)
            out = Path(args.out) if args.out else Path("runs") / f"{preset or Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
            if main:
                lock = open_run_dir(out, resume=False, force=args.force)
        return _train(args, run, out)
    finally:
        if lock is not None:
            lock.release()


def _train(args: argparse.Namespace, run, out: Path) -> int:
    trainer = Trainer(run, out, device=args.device, resume=bool(args.resume), quiet=args.quiet, force=args.force)
    if trainer.dist.main:
        print(f"txl train: {trainer.model.num_parameters():,} parameters, data {run.train.data} "
              f"({len(trainer.corpus.vocab):,} tokens in the vocabulary, metric {trainer.metric}), "
              f"out {out}, world size {trainer.dist.world}", file=sys.stderr)
    summary = trainer.fit()
    if summary["stopped_by"] != "signal":
        finish(trainer, summary)
    elif trainer.dist.main:
        print(f"txl train: stopped by signal at step {summary['steps']}; resume with --resume {out}", file=sys.stderr)
    trainer.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def launch(nproc: int) -> int:
    """`txl train --nproc N ...` = `torchrun --nproc-per-node N -m txl train ...` (same arguments)."""
    import subprocess

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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "txl", *cleaned]
    return subprocess.call(cmd)
