"""`txl bench eval`: evaluation throughput and peak memory against the memory length.

Evaluation moves one segment at a time and reuses the memory (Dai et al. 2019, §3.2): tokens/s of
scoring `eval_tgt_len`-token segments (logits + per-token NLL) with `mem_len` states of memory per
layer, for mem_len from 128 to 3800 (the enwik8-large evaluation setting). Every contender starts
from a full memory of zeros so all timed steps have the same shapes. Peak RSS per attention
implementation comes from a fresh process each (`txl.bench.probe eval`); it includes the memory
itself (n_layer × batch × mem_len × d_model floats, held twice while the next one is built).
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

TITLE = "Evaluation throughput and peak memory against mem_len"


def make_eval_step(name: str, shape: Shape, precision: str, *, mem_len: int, seed: int = 0) -> Callable[[], None]:
    import torch

    from txl.eval.segments import forward_segment
    from txl.nn.memory import Memory

    generator = torch.Generator().manual_seed(seed)
    batch, tgt = shape.eval_batch, shape.eval_tgt_len
    stream = torch.randint(0, shape.vocab, (batch, 8 * tgt + 1), generator=generator)
    position = [0]

    def segment():
        start = position[0]
        position[0] = (start + tgt) % (7 * tgt)
        return stream[:, start : start + tgt], stream[:, start + 1 : start + tgt + 1]

    if name == "hf":
        model = build_hf(shape, mem_len=mem_len, tgt_len=tgt, train=False)
        mems = [[torch.zeros(mem_len, batch, shape.d_model) for _ in range(shape.n_layer)]]

        @torch.no_grad()
        def step() -> None:
            inputs, _ = segment()
            with autocast(precision):
                out = model(input_ids=inputs, mems=mems[0], labels=inputs)
            mems[0] = out.mems

        return step

    impl = name.removeprefix("txl-")
    model = build_ours(shape, impl, mem_len=mem_len, train=False)
    state = [Memory.zeros(shape.n_layer, batch, mem_len, shape.d_model)]
    in_place = impl == "fast"  # the fast evaluation path: row groups, memory overwritten in place

    @torch.no_grad()
    def step() -> None:
        inputs, labels = segment()
        with autocast(precision):
            if in_place:  # exactly what `txl eval` runs
                state[0] = forward_segment(model, inputs, labels, state[0], mem_len=mem_len)[1]
            else:
                state[0] = model(inputs, memory=state[0], labels=labels).memory

    return step


def run(options: BenchOptions) -> dict:
    check_precision(options.precision)
    setup_torch(options)
    shape = options.shape
    names = contender_names(options)
    mem_lens = options.mem_lens or shape.eval_mem_lens
    tokens = shape.eval_batch * shape.eval_tgt_len
    rows = []
    timings = {}
    for mem_len in mem_lens:
        steps = {name: make_eval_step(name, shape, options.precision, mem_len=mem_len, seed=options.seed)
                 for name in names}
        timing = interleaved_medians(steps, warmup=options.warmup, timed=options.steps)
        del steps
        timings[str(mem_len)] = timing
        for name in names:
            row = {"mem_len": mem_len, "contender": name, "tokens_per_s": tokens / timing[name]["median_s"]}
            if "hf" in timing:
                row["x_hf"] = timing["hf"]["median_s"] / timing[name]["median_s"]
            if options.rss and name != "hf":
                answer = probe("eval", {"name": name, "config": shape.name, "precision": options.precision,
                                        "mem_len": mem_len, "steps": 2, "threads": options.threads})
                row.update(peak_rss_mb=answer["peak_rss_mb"], work_rss_mb=answer["work_rss_mb"])
            rows.append(row)
    if options.rss and "txl-eager" in names:
        eager = {row["mem_len"]: row for row in rows if row["contender"] == "txl-eager"}
        for row in rows:
            if "peak_rss_mb" in row and row["mem_len"] in eager:
                row["rss_vs_eager"] = row["peak_rss_mb"] / eager[row["mem_len"]]["peak_rss_mb"]
    memory_mb = {m: 4 * shape.n_layer * shape.eval_batch * m * shape.d_model / 2**20 for m in mem_lens}
    return {
        "bench": "eval",
        "title": TITLE,
        "config": shape.name,
        "shape": shape.describe() + f"; tgt_len {shape.eval_tgt_len}, batch {shape.eval_batch}",
        "precision": options.precision,
        "options": options_dict(options),
        "machine": machine(),
        "memory_state_mb": memory_mb,
        "rows": rows,
        "timing": timings,
    }


def table(result: dict) -> str:
    keys = set().union(*(row.keys() for row in result["rows"]))
    columns = [("mem_len", "mem_len"), ("contender", "contender"), ("tokens_per_s", "tokens/s")]
    columns += [(k, h) for k, h in (("x_hf", "× HF"), ("peak_rss_mb", "peak RSS MiB"),
                                    ("work_rss_mb", "RSS above start MiB"), ("rss_vs_eager", "RSS / eager"))
                if k in keys]
    head = f"**{result['config']}, {result['precision']}** — {result['shape']}\n\n"
    return head + markdown_table(result["rows"], columns)
