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


# ---------------------------------------------------------------------------------------------
# Torch threads (every command that computes: `--threads N`, applied once by txl.cli.main)


def add_threads(parser: argparse.ArgumentParser) -> None:
    """`--threads N`: torch's intra-op threads (0 = txl's choice, `default_threads`)."""
    parser.add_argument("--threads", type=integer(0, MAX_THREADS, meaning="0 = txl's choice"), default=0, metavar="N",
                        help="torch threads (default 0: one per physical core this process may use, minus the cores "
                             "other processes keep busy; OMP_NUM_THREADS, when set, decides instead)")


def apply_threads(n: int) -> int:
    """Set torch's threads to `n` (0: `default_threads()`); returns the count in use. The inter-op pool is
    sized alike where torch still allows it (only before its first parallel work)."""
    import contextlib

    import torch

    if n == 0:
        n = default_threads()
        if n == 0:  # OMP_NUM_THREADS / MKL_NUM_THREADS: the user's choice, which torch has read already
            return torch.get_num_threads()
    torch.set_num_threads(n)
    with contextlib.suppress(RuntimeError):  # already started (a second command in one process)
        torch.set_num_interop_threads(n)
    return torch.get_num_threads()


def default_threads(*, sample_seconds: float = 0.15) -> int:
    """txl's thread count: the physical cores this process may use, less those other processes keep busy
    now, at least 1 (0 when OMP_NUM_THREADS or MKL_NUM_THREADS is set: the environment decides).

    Why fewer on a busy machine: torch's threads wait for one another at every operation, so one thread
    that shares its core with another process stalls them all. Measured on 2 cores (AMD EPYC, the demo's
    4-layer model, docs/guide/training.md): beside one busy process, 2 threads trained at 1,521 and 921
    tokens/s where 1 thread trained at 3,041 and 4,982 (issue 45); on a quiet machine 2 threads are faster."""
    import os

    if os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS"):
        return 0
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = physical_cores(cpus)
    if cores <= 1:
        return 1
    return max(1, cores - busy_cores(cpus, sample_seconds))


def physical_cores(cpus: list[int]) -> int:
    """Physical cores among these logical CPUs (hyper-threads of one core count once); Linux's topology files,
    else one per CPU."""
    from pathlib import Path

    seen = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            seen.add(_sys_text(topology / "core_cpus_list").strip())
        except Exception:  # noqa: BLE001 - no topology (another OS, a container without /sys): one core per CPU
            seen.add(str(cpu))
    return max(len(seen), 1)


def busy_cores(cpus: list[int], seconds: float) -> int:
    """How many of these CPUs other processes keep busy, from /proc/stat over `seconds` (this process sleeps
    meanwhile): a CPU counts when it is at least 40% busy (a half-busy core already stalls a thread team).
    0 where /proc/stat cannot be read."""
    import time

    first = _cpu_times(cpus)
    if not first:
        return 0
    time.sleep(seconds)
    second = _cpu_times(cpus)
    busy = 0.0
    for cpu, (idle, total) in second.items():
        if cpu in first and total > first[cpu][1]:
            busy += 1 - (idle - first[cpu][0]) / (total - first[cpu][1])
    return int(busy + 0.6)


def _cpu_times(cpus: list[int]) -> dict[int, tuple[int, int]]:
    """cpu -> (idle + iowait jiffies, all jiffies) from /proc/stat; {} when it cannot be read."""
    from txl.io import read_proc

    try:
        text = read_proc("/proc/stat")
    except OSError:  # not Linux
        return {}
    wanted, times = {f"cpu{c}": c for c in cpus}, {}
    for line in text.splitlines():
        name, *fields = line.split()
        if name in wanted and len(fields) >= 5:
            values = [int(v) for v in fields[:8]]
            times[wanted[name]] = (values[3] + values[4], sum(values))
    return times


def _sys_text(path) -> str:
    """A /sys file's text (its size reads as a page whatever it holds, so it is read up to a cap)."""
    from txl.io import open_regular

    with open_regular(path, what="kernel file", limit=1 << 20, follow_links=True) as f:
        return f.read(1 << 20).decode("ascii", "replace")
