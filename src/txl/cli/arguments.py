"""What the `txl` commands share beyond the number types of `txl.argtypes`: the checkpoint-reading
commands' flags (eval, generate, recl, serve), devices, and the decoders' limits."""

from __future__ import annotations

import argparse

from txl.argtypes import (  # noqa: F401 (re-exported: the number types every command module uses)
    MAX_COUNT,
    MAX_LENGTH,
    MAX_THREADS,
    SHOWN,
    integer,
    integer_list,
    real,
    shown,
    threads,
)
from txl.errors import UsageError
from txl.generate.limits import MAX_BEAM, MAX_LENGTH_PENALTY  # noqa: F401 (the decoders' ceilings, shared)

# ---------------------------------------------------------------------------------------------
# Shared by the commands that read a checkpoint (eval, generate, recl, serve)

PRECISIONS = ("fp32", "bf16", "fp16", "auto")
# Lengths (tokens) and counts a command takes are bounded where they are parsed: an int of 30 digits
# would otherwise overflow deep inside torch (OverflowError) instead of being named here.
MAX_SCORED = 1 << 62  # --max-tokens, --positions
BEAM_SIZE = integer(1, MAX_BEAM)
LENGTH_PENALTY = real(0, MAX_LENGTH_PENALTY)


def resolve_device(name: str) -> str:
    """--device auto|cpu|cuda as a torch device name (auto: a GPU when there is one)."""
    if name == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda but no CUDA device is available; use --device cpu")
    return name


def add_checkpoint(parser: argparse.ArgumentParser, nargs: str | None = None) -> None:
    parser.add_argument("checkpoint", nargs=nargs, metavar="CKPT",
                        help="a checkpoint directory (config.json + model.safetensors + vocab.json) or a "
                             "`txl train` run directory (uses RUN/best, else RUN/last)")


def shown_number(value: int) -> str:
    return f"{value:.3g}" if abs(value) >= 10**15 else str(value)


def check_nonnegative(args: argparse.Namespace, *names: str, limit: int = MAX_LENGTH) -> None:
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        if value is not None and value > limit:
            raise UsageError(f"--{name.replace('_', '-')} must be <= {limit:,}, got {shown_number(value)}")


def check_positive(args: argparse.Namespace, *names: str, limit: int = MAX_LENGTH) -> None:
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if value is not None and value > limit:
            raise UsageError(f"--{name.replace('_', '-')} must be <= {limit:,}, got {shown_number(value)}")
