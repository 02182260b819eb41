"""`txl bench mfu`: model FLOP utilisation of a training step against this machine's matmul peak.

Achieved FLOP/s = (analytic matmul FLOPs of one training step) / (median step time). The peak is
the FLOP/s of a large square matmul (`PEAK_N`³, same dtype) measured in the same run, alternating
with the training steps so both see the same machine, by the faster of torch's own `mm` and the
fast path's `txl.fast.linear.linear` (in fp32 on an x86 CPU that is oneDNN instead of MKL: about 2x
on the AMD benchmark machine, so the peak is the machine's, not one library's). MFU = achieved / peak.

FLOPs of one training step (`train_step_flops`), with t = batch·tgt_len tokens, n = tgt_len + mem_len
keys per query row, HD = n_head·d_head, counting a multiply-add as 2 FLOPs:

    per layer, forward:  q 2·t·d·HD + kv 2·(batch·n)·d·2HD + out 2·t·HD·d + FFN 2·t·d·d_inner·2
                         + positions (xl) 2·n·d·HD + scores (a)+(c), (b)+(d) and probs·v 3·2·batch·n_head·tgt·n·d_head
    head, forward:       2·t·d·vocab
    step = 3 × forward   (backward = gradients of inputs and of weights, 2× the forward)

Score matrices count in full and every input gradient counts; elementwise work (softmax, LayerNorm,
dropout, Adam) is not, as in the usual MFU definition (PaLM, app. B): these are the model's FLOPs, the
same for every implementation. The fast path executes fewer (its training step skips part of the
causally masked score corner and the input gradient of the detached memory rows: about 7% fewer
on the base shape), so its MFU is model-FLOP utilisation, not hardware utilisation.
"""

from __future__ import annotations

import statistics
import time

from txl.bench.common import (
    BenchOptions,
    Shape,
    machine,
    markdown_table,
    options_dict,
    setup_torch,
)
from txl.errors import UsageError

TITLE = "Model FLOP utilisation of a training step"
PEAK_N = 2048


def forward_flops(shape: Shape, *, tgt_len: int | None = None, mem_len: int | None = None, batch: int | None = None) -> int:
    tgt = shape.tgt_len if tgt_len is None else tgt_len
    mem = shape.mem_len if mem_len is None else mem_len
    b = shape.batch if batch is None else batch
    t, n, d, hd = b * tgt, tgt + mem, shape.d_model, shape.n_head * shape.d_head
    per_layer = (
        2 * t * d * hd  # q
        + 2 * (b * n) * d * 2 * hd  # k, v over memory + segment
        + 2 * t * hd * d  # output projection
        + 2 * t * d * shape.d_inner * 2  # FFN
        + 2 * n * d * hd  # W_kR R (xl positions), once per layer
        + 3 * 2 * b * shape.n_head * tgt * n * shape.d_head  # AC, BD, probs @ v
    )
    return shape.n_layer * per_layer + 2 * t * d * shape.vocab


def train_step_flops(shape: Shape) -> int:
    return 3 * forward_flops(shape)


def run(options: BenchOptions) -> dict:
    import torch

    from txl.bench.train import make_step
    from txl.fast.linear import linear

    setup_torch(options)
    shape = options.shape
    if dict(shape.extra).get("cutoffs"):
        raise UsageError(f"MFU counts the FLOPs of a full softmax; {shape.name} has an adaptive softmax "
                         "(cutoffs): time it with `txl bench train` instead")
    precisions = options.extra.get("precisions") or [options.precision]
    flops = train_step_flops(shape)
    tokens = shape.batch * shape.tgt_len
    rows, timings = [], {}
    for precision in precisions:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        left, right = torch.randn(PEAK_N, PEAK_N).to(dtype), torch.randn(PEAK_N, PEAK_N).to(dtype)
        right_t = right.t().contiguous()
        matmuls = {"torch.mm": lambda a=left, b=right: a @ b, "txl linear": lambda a=left, b=right_t: linear(a, b)}

        steps = {f"txl-{impl}": make_step(f"txl-{impl}", shape, precision, seed=options.seed) for impl in options.impls}
        for _ in range(options.warmup):
            for matmul in matmuls.values():
                matmul()
            for step in steps.values():
                step()
        peak_times, step_times = {name: [] for name in matmuls}, {name: [] for name in steps}
        for _ in range(options.steps):
            for name, step in steps.items():
                start = time.perf_counter()
                step()
                step_times[name].append(time.perf_counter() - start)
                for _ in range(3):
                    for library, matmul in matmuls.items():
                        start = time.perf_counter()
                        with torch.no_grad():
                            matmul()
                        peak_times[library].append(time.perf_counter() - start)
        peak_by = min(peak_times, key=lambda library: statistics.median(peak_times[library]))
        peak = 2 * PEAK_N**3 / statistics.median(peak_times[peak_by])
        timings[precision] = {"matmul_s": peak_times, "step_s": step_times}
        for name, times in step_times.items():
            achieved = flops / statistics.median(times)
            rows.append({"contender": name, "precision": precision, "tokens_per_s": tokens / statistics.median(times),
                         "achieved_gflops": achieved / 1e9, "peak_gflops": peak / 1e9, "peak_by": peak_by,
                         "mfu": achieved / peak})
        del steps, left, right, right_t, matmuls
    return {
        "bench": "mfu",
        "title": TITLE,
        "config": shape.name,
        "shape": shape.describe() + f"; tgt_len {shape.tgt_len}, mem_len {shape.mem_len}, batch {shape.batch}",
        "precision": ",".join(precisions),
        "flops_per_step": flops,
        "peak_matmul": f"{PEAK_N}x{PEAK_N} @ {PEAK_N}x{PEAK_N}",
        "options": options_dict(options),
        "machine": machine(),
        "rows": rows,
        "timing": timings,
    }


def table(result: dict) -> str:
    columns = [("contender", "contender"), ("precision", "precision"), ("tokens_per_s", "tokens/s"),
               ("achieved_gflops", "achieved GFLOP/s"), ("peak_gflops", "matmul peak GFLOP/s"), ("peak_by", "peak by"), ("mfu", "MFU")]
    rows = [dict(row, mfu=f"{100 * row['mfu']:.1f}%") for row in result["rows"]]
    head = (f"**{result['config']}** — {result['shape']}; {result['flops_per_step'] / 1e9:.1f} GFLOP per "
            f"training step (formula in `txl.bench.mfu`)\n\n")
    return head + markdown_table(rows, columns)
