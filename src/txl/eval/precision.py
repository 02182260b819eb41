"""Numeric precision of a forward pass: `fp32`, `bf16`, `fp16` or `auto`. Training, evaluation and the
benchmarks share it.

`auto` by device (issue 46, item 4):
    CUDA, compute capability >= 8 (Ampere and later; ROCm)   bf16 autocast: bf16 tensor cores, fp32's range
    CUDA, older GPUs (Volta, Turing, Pascal)                 fp16 autocast; the trainer scales the loss
                                                             (its GradScaler is on whenever precision is fp16)
    CPU                                                      bf16 where it is a measured speed-up, else fp32
    anything else                                            fp32
Older GPUs run bf16 only emulated (`torch.cuda.is_bf16_supported()` says True there unless asked
`including_emulation=False`), slower than fp32; their fp16 tensor cores are the fast half precision."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import torch


def bf16_instructions(device: torch.device) -> bool:
    """Whether `device` has bfloat16 matrix instructions at all (CUDA compute capability 8 or later;
    an x86 CPU with AVX512-BF16 or AMX). Necessary for a bf16 speed-up, not sufficient on CPUs."""
    if device.type == "cuda":  # compute capability 8 (Ampere) and later; older GPUs only emulate bf16
        return torch.cuda.is_available() and torch.cuda.get_device_properties(device).major >= 8
    if device.type == "cpu":
        cpu = getattr(torch, "cpu", None)
        checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(getattr(cpu, name, lambda: False)() for name in checks)
    return False


BF16_MIN_SPEEDUP = 1.25  # a CPU must run the probe this much faster in bf16 for `auto` to choose it


def matmul_seconds(dtypes: Sequence[torch.dtype], *, size: int = 512, repeats: int = 7) -> list[float]:
    """The fastest of `repeats` single-threaded CPU products of two size x size matrices, per dtype,
    interleaved so a busy machine slows every dtype alike (one warm-up product each first)."""
    pairs = [(torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)) for dtype in dtypes]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # per-core speed: with several threads a busy core stalls the whole product
    try:
        for a, b in pairs:
            torch.mm(a, b)
        best = [float("inf")] * len(pairs)
        for _ in range(repeats):
            for i, (a, b) in enumerate(pairs):
                start = time.perf_counter()
                torch.mm(a, b)
                best[i] = min(best[i], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return best


_CPU_BF16_VERDICT: list[bool] = []  # the probe's answer, once per process


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 autocast is a speed-up on `device`. On CUDA: the instructions exist (compute
    capability >= 8). On a CPU the instructions are not enough: AVX512-BF16 without AMX can run bf16
    products slower than fp32 (an Emerald Rapids VM with AMX hidden: about 0.5x), so the first call
    also times a 512 x 512 product in both precisions on one thread (a few milliseconds, once per
    process) and says yes only when bf16 is at least BF16_MIN_SPEEDUP times faster."""
    if not bf16_instructions(device):
        return False
    if device.type != "cpu":
        return True
    if not _CPU_BF16_VERDICT:
        fp32, bf16 = matmul_seconds((torch.float32, torch.bfloat16))
        _CPU_BF16_VERDICT.append(fp32 >= BF16_MIN_SPEEDUP * bf16)
    return _CPU_BF16_VERDICT[0]


def cuda_half(device: torch.device) -> str:
    """The half precision of a CUDA device: "bf16" on compute capability >= 8 (and on ROCm), what
    `torch.cuda.is_bf16_supported(including_emulation=False)` checks, but for `device` rather than the
    current one; "fp16" on older GPUs."""
    if torch.version.hip:
        return "bf16"
    return "bf16" if torch.cuda.get_device_properties(device).major >= 8 else "fp16"


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto` = the device's half precision on CUDA (cuda_half: bf16, or fp16 on GPUs older than compute
    capability 8), bf16 on a CPU where it is a speed-up (fast_bf16), else fp32; others as given."""
    if precision != "auto":
        return precision
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return cuda_half(device)
    return "bf16" if fast_bf16(device) else "fp32"


def autocast(device: torch.device, precision: str):
    precision = resolve_precision(precision, device)
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return torch.autocast(device_type=device.type, dtype=dtype)

