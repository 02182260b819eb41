"""`txl bench train`: training throughput, forward + backward + clip + Adam step, tokens/s.

Every contender trains the same shape on the same random tokens, starting from a full memory of
zeros (Hugging Face starts that way; we give ours the same, so every timed step has the same shapes),
with Adam (lr 2.5e-4) and gradient clipping at 0.25 as the reference scripts. Peak RSS comes from a
fresh process per contender (`txl.bench.probe train`). With `--activation-checkpointing` every txl
contender also runs with its blocks recomputed in the backward (`txl-<impl>+ckpt`,
`model.checkpoint_blocks`), side by side: the peak RSS saved and the time it costs.
"""

from __future__ import annotations

from collections.abc import Callable

from txl.bench.common import (
    BenchOptions,
    Shape,
    autocast,
    build_hf,
    build_ours,
    check_precision,
    contender_names,
    interleaved_medians,
    machine,
    markdown_table,
    options_dict,
    probe,
    setup_torch,
)

TITLE = "Training throughput (forward + backward + clip + Adam)"
CHECKPOINTED = "ckpt"  # the contender-name suffix of activation checkpointing


def make_step(name: str, shape: Shape, precision: str, *, seed: int = 0) -> Callable[[], float]:
    """A closure that runs one training step of contender `name` ("txl-<impl>", "txl-<impl>+ckpt" with
    activation checkpointing, or "hf")."""
    import torch

    from txl.nn.memory import Memory
    from txl.train.optim import build_optimizer

    generator = torch.Generator().manual_seed(seed)
    batch, tgt = shape.batch, shape.tgt_len
    stream = torch.randint(0, shape.vocab, (batch, 16 * tgt + 1), generator=generator)
    position = [0]

    def segment():
        start = position[0]
        position[0] = (start + tgt) % (15 * tgt)
        return stream[:, start : start + tgt], stream[:, start + 1 : start + tgt + 1]

    if name == "hf":
        model = build_hf(shape)
        params = list(model.parameters())
        optimizer = torch.optim.Adam(params, lr=2.5e-4)
        mems = [None]

        def step() -> float:
            inputs, _ = segment()
            with autocast(precision):
                # HF shifts labels inside (it scores tgt-1 tokens per row); same forward/backward work
                out = model(input_ids=inputs, mems=mems[0], labels=inputs)
            loss = out.losses.float().mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.25)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            mems[0] = out.mems
            return float(loss.detach())

        return step

    impl, _, checkpointing = name.removeprefix("txl-").partition("+")
    model = build_ours(shape, impl)
    model.checkpoint_blocks = checkpointing == CHECKPOINTED
    params = list(model.parameters())
    optimizer = build_optimizer("adam", params, lr=2.5e-4, weight_decay=0.0)  # what `txl train` runs
    state = [Memory.zeros(shape.n_layer, batch, shape.mem_len, shape.d_model)]

    def step() -> float:
        inputs, labels = segment()
        with autocast(precision):
            out = model(inputs, memory=state[0], labels=labels)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.25)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state[0] = out.memory
        return float(out.loss.detach())

    return step


def run(options: BenchOptions) -> dict:
    check_precision(options.precision)
    setup_torch(options)
    shape = options.shape
    names = contender_names(options)
    if options.extra.get("activation_checkpointing"):
        names = [f"{n}+{CHECKPOINTED}" if variant else n for n in names for variant in (False, True)
                 if not (variant and n == "hf")]
    steps = {name: make_step(name, shape, options.precision, seed=options.seed) for name in names}
    timing = interleaved_medians(steps, warmup=options.warmup, timed=options.steps)
    tokens = shape.batch * shape.tgt_len
    profiles = {name: profile_steps(step, options.extra["profile"]) for name, step in steps.items()} if (
        options.extra.get("profile")) else {}
    rows = []
    for name in names:
        row = {"contender": name, "tokens_per_s": tokens / timing[name]["median_s"],
               "step_ms": 1000 * timing[name]["median_s"]}
        if options.rss:
            answer = probe("train", {"name": name, "config": shape.name, "precision": options.precision,
                                     "steps": 2, "threads": options.threads})
            row["peak_rss_mb"] = answer["peak_rss_mb"]
        rows.append(row)
    for reference in ("hf", "txl-eager"):
        if reference in timing:
            for row in rows:
                row[f"x_{reference}"] = timing[reference]["median_s"] / timing[row["contender"]]["median_s"]
    return {
        "bench": "train",
        "title": TITLE,
        "config": shape.name,
        "shape": shape.describe() + f"; tgt_len {shape.tgt_len}, mem_len {shape.mem_len}, batch {shape.batch}",
        "precision": options.precision,
        "options": options_dict(options),
        "machine": machine(),
        "rows": rows,
        "timing": timing,
        "profiles": profiles,
    }


def profile_steps(step: Callable[[], float], n: int, *, top: int | None = 25) -> list[dict]:
    """Run `step` n more times under the torch profiler (CPU): the operators with the most self time,
    per step, with their share of the profiled time (where a training step's time goes); `top=None`:
    every operator."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) or 1.0
    return [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1000 / n, "calls_per_step": e.count / n,
             "percent": 100 * e.self_cpu_time_total / total} for e in events[:top]]


# Operator kinds of a profile (`op_kinds`): the matrix products (oneDNN's linear, BLAS), the copies,
# the random draws (dropout), and everything else (element-wise, reductions, softmax, optimiser ...).
MATMUL_OPS = frozenset({"mkldnn::_linear_pointwise", "aten::mm", "aten::bmm", "aten::baddbmm", "aten::baddbmm_",
                        "aten::addmm", "aten::addmm_", "aten::addbmm", "aten::matmul", "aten::linear"})
COPY_OPS = frozenset({"aten::copy_", "aten::_to_copy", "aten::cat", "aten::stack", "aten::contiguous", "aten::clone"})
RANDOM_OPS = frozenset({"aten::random_", "aten::bernoulli_", "aten::uniform_", "aten::rand", "aten::rand_like",
                        "aten::randint", "aten::normal_"})


def op_kinds(ops: list[dict]) -> dict[str, float]:
    """Milliseconds per step by operator kind, from `profile_steps(..., top=None)`: matmul, copy, random,
    other, and ops (their sum: the time the profiler saw inside operators)."""
    kinds = {"matmul": 0.0, "copy": 0.0, "random": 0.0, "other": 0.0}
    for op in ops:
        kind = ("matmul" if op["op"] in MATMUL_OPS else "copy" if op["op"] in COPY_OPS
                else "random" if op["op"] in RANDOM_OPS else "other")
        kinds[kind] += op["self_ms_per_step"]
    kinds["ops"] = sum(kinds.values())
    return kinds


def table(result: dict) -> str:
    columns = [("contender", "contender"), ("tokens_per_s", "tokens/s"), ("step_ms", "step ms")]
    keys = set().union(*(row.keys() for row in result["rows"]))
    columns += [(k, h) for k, h in (("x_hf", "× HF"), ("x_txl-eager", "× eager"), ("peak_rss_mb", "peak RSS MiB"))
                if k in keys]
    head = f"**{result['config']}, {result['precision']}** — {result['shape']}\n\n"
    text = head + markdown_table(result["rows"], columns)
    for name, ops in (result.get("profiles") or {}).items():
        text += (f"\n\n**profile of {name}** (self time per step, the {len(ops)} costliest operators)\n\n"
                 + markdown_table(ops, [("op", "operator"), ("self_ms_per_step", "ms/step"),
                                        ("calls_per_step", "calls/step"), ("percent", "% of time")]))
    return text
