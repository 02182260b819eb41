"""`txl bench kernel`: the attention kernel alone, eager reference against the fast path.

One layer's relative attention core (`pos_encoding="xl"`: content and position scores, rel-shift,
causal mask, softmax, probabilities · values) on the shapes of the `tiny` and `base` training steps
and of `base` evaluation at mem_len 3800, forward + backward (training) and forward without
gradients (evaluation). Projections, dropout and the rest of the block are left out, so the ratio
isolates what `src/txl/nn/attention/xl_fast.py` changes. The two kernels alternate call by call.
"""

from __future__ import annotations

from txl.bench.common import (
    BenchOptions,
    autocast,
    check_precision,
    interleaved_medians,
    machine,
    markdown_table,
    options_dict,
    setup_torch,
)

TITLE = "Attention kernel alone: eager reference against the fast path"


def cases(options: BenchOptions) -> list[tuple[str, int, int, int, str]]:
    """(label, batch, q_len, mem_len, mode) for the chosen shape."""
    shape = options.shape
    train = (f"{shape.name} training", shape.batch, shape.tgt_len, shape.mem_len, "forward+backward")
    evaluation = (f"{shape.name} eval", shape.eval_batch, shape.eval_tgt_len, max(shape.eval_mem_lens), "forward")
    if options.quick:
        evaluation = (f"{shape.name} eval", shape.eval_batch, shape.eval_tgt_len, min(shape.eval_mem_lens), "forward")
    return [train, evaluation]


def make_call(impl: str, shape, batch: int, q_len: int, mem_len: int, mode: str, precision: str):
    import torch

    from txl.nn.attention import KERNELS
    from txl.nn.attention.layer import split_kv
    from txl.nn.attention.masks import CAUSAL
    from txl.nn.positional import XLRelative

    kernel = KERNELS[("full", impl)]
    config = shape.model_config(dropout=0.0)
    torch.manual_seed(0)
    encoding = XLRelative(config).train(mode != "forward")
    n = q_len + mem_len
    h, d = shape.n_head, shape.d_head
    grad = mode != "forward"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32  # as the projections give them
    q = torch.randn(batch, h, q_len, d).to(dtype).requires_grad_(grad)
    kv = torch.randn(batch, n, 2 * h * d).to(dtype).requires_grad_(grad)  # the key/value projection's layout

    def call() -> None:
        with autocast(precision), torch.set_grad_enabled(grad):
            state = encoding.prepare(k_len=n, clamp_len=0, device=q.device, dtype=q.dtype)
            out, _ = kernel(q, *split_kv(kv, h), positions=encoding.layer(0, state), mask=CAUSAL, dropatt=0.0,
                            training=grad)
            if grad:
                out.float().sum().backward()

    return call


def run(options: BenchOptions) -> dict:
    check_precision(options.precision)
    setup_torch(options)
    shape = options.shape
    impls = [i for i in options.impls if i in ("eager", "fast")] or ["eager", "fast"]
    rows, timings = [], {}
    for label, batch, q_len, mem_len, mode in cases(options):
        calls = {impl: make_call(impl, shape, batch, q_len, mem_len, mode, options.precision) for impl in impls}
        timing = interleaved_medians(calls, warmup=options.warmup, timed=options.steps)
        timings[label] = timing
        row = {"case": label, "mode": mode, "batch": batch, "q_len": q_len, "keys": q_len + mem_len}
        for impl in impls:
            row[f"{impl}_ms"] = 1000 * timing[impl]["median_s"]
        if "eager" in timing and "fast" in timing:
            row["speedup"] = timing["eager"]["median_s"] / timing["fast"]["median_s"]
        rows.append(row)
        del calls
    return {
        "bench": "kernel",
        "title": TITLE,
        "config": shape.name,
        "shape": f"{shape.n_head} heads × {shape.d_head}, xl relative positions",
        "precision": options.precision,
        "options": options_dict(options),
        "machine": machine(),
        "rows": rows,
        "timing": timings,
    }


def table(result: dict) -> str:
    keys = set().union(*(row.keys() for row in result["rows"]))
    columns = [("case", "case"), ("mode", "mode"), ("batch", "batch"), ("q_len", "queries"), ("keys", "keys")]
    columns += [(k, h) for k, h in (("eager_ms", "eager ms"), ("fast_ms", "fast ms"), ("speedup", "fast × eager"))
                if k in keys]
    head = f"**{result['config']}, {result['precision']}** — {result['shape']}\n\n"
    return head + markdown_table(result["rows"], columns)

