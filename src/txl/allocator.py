"""Keep freed memory in the process instead of handing it back to the OS (glibc on Linux).

glibc serves an allocation above its mmap threshold with fresh pages from `mmap` and unmaps them
again on free. The threshold adapts upwards as such blocks are freed, but never beyond 32 MB on
64-bit systems; and memory freed at the top of the heap is trimmed back to the OS. So a tensor of
more than 32 MB made and freed in every step (one layer's keys at 32k tokens: 1 x 4 heads x 32,768 x
64 x 4 bytes = 33.5 MB) costs a page fault and a page zeroing per 4 KB, every step: an elementwise
op on it took 24 ms instead of 14 ms here, and a linear-time attention kernel measured
time(32k)/time(16k) = 2.4 where 16k (16 MB tensors, reused from the heap) paid nothing
(docs/results/attention_scaling.md). This is what jemalloc/tcmalloc are recommended for on CPU; here it is
two `mallopt` calls: no mmap below 1 GB, no trimming below 2 GB.

The cost: memory a process has freed stays mapped to it (its resident size does not shrink after a
peak; the peak itself is unchanged). Every `txl` command sets it at start (`txl.cli.main.main`);
`TXL_SYSTEM_MALLOC=1` leaves the C library's defaults alone. Elsewhere (macOS, Windows, musl) nothing
is changed.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # bytes: allocations below this come from the heap ...
TRIM_THRESHOLD = (1 << 31) - 1  # ... and free memory at the heap top below this is kept

_STATE: dict[str, bool] = {}


def keep_freed_memory() -> bool:
    """Set the thresholds once per process; whether they are in effect (see the module docstring)."""
    if "kept" not in _STATE:
        _STATE["kept"] = _set_thresholds()
    return _STATE["kept"]


def freed_memory_kept() -> bool:
    """Whether this process keeps freed memory (for the benchmarks' machine description)."""
    return _STATE.get("kept", False)


def _set_thresholds() -> bool:
    if platform.system() != "Linux" or os.environ.get("TXL_SYSTEM_MALLOC", "") not in ("", "0"):
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
