"""`txl bench generate`: greedy generation at a 1k-token context, memory reuse against a full re-run.

Memory reuse (`txl.generate.decoder.stream_tokens`, mem_len 1024): the prompt fills the memory once, then
every new token is one forward pass over that single token attending to the cached states. Full
re-run (`txl.generate.decoder.generate_rerun`): every new token re-runs the whole context, as a model
without recurrence must. Both use the same model; the two modes alternate round by round (128
consecutive reuse tokens, then one re-run).
"""

from __future__ import annotations

import statistics
import time

from txl.bench.common import (
    BenchOptions,
    build_ours,
    check_precision,
    machine,
    markdown_table,
    options_dict,
    setup_torch,
)

TITLE = "Generation: memory reuse against a full re-run (context 1k)"
CONTEXT = 1024


def run(options: BenchOptions) -> dict:
    import torch

    from txl.bench.common import autocast
    from txl.generate.decoder import generate_rerun, stream_tokens

    check_precision(options.precision)
    setup_torch(options)
    shape = options.shape
    context = int(options.extra.get("context", CONTEXT))
    # Reuse tokens timed per round (one re-run token per round). A re-run sweeps megabytes through the
    # caches and the next few memory-reuse tokens pay for it (a cold start of a few tokens' time); real
    # generation produces tokens back to back, so a round is long enough for that cold start to be a
    # small part of it, as 32 tokens were not.
    per_round = 128
    rows, timings = [], {}
    for impl in options.impls:
        model = build_ours(shape, impl, mem_len=context, train=False)
        prompt = torch.randint(0, shape.vocab, (context,), generator=torch.Generator().manual_seed(options.seed))
        rounds = options.warmup + options.steps
        with autocast(options.precision):
            stream = stream_tokens(model, prompt, max_new_tokens=rounds * per_round + 1, temperature=0.0,
                                   mem_len=context)
            next(stream)  # the prompt fills the memory
            reuse, rerun = [], []
            for r in range(rounds):
                start = time.perf_counter()
                for _ in range(per_round):
                    next(stream)
                reuse_s = (time.perf_counter() - start) / per_round
                start = time.perf_counter()
                generate_rerun(model, prompt, max_new_tokens=1)
                rerun_s = time.perf_counter() - start
                if r >= options.warmup:
                    reuse.append(reuse_s)
                    rerun.append(rerun_s)
            stream.close()
        med_reuse, med_rerun = statistics.median(reuse), statistics.median(rerun)
        timings[impl] = {"reuse_s": reuse, "rerun_s": rerun}
        rows.append({"contender": f"txl-{impl}", "mode": "memory reuse", "tokens_per_s": 1 / med_reuse,
                     "ms_per_token": 1000 * med_reuse, "speedup": med_rerun / med_reuse})
        rows.append({"contender": f"txl-{impl}", "mode": "full re-run", "tokens_per_s": 1 / med_rerun,
                     "ms_per_token": 1000 * med_rerun, "speedup": 1.0})
        del model
    return {
        "bench": "generate",
        "title": TITLE,
        "config": shape.name,
        "shape": shape.describe() + f"; context {context}, batch 1, greedy",
        "precision": options.precision,
        "options": options_dict(options),
        "machine": machine(),
        "rows": rows,
        "timing": timings,
    }


def table(result: dict) -> str:
    columns = [("contender", "contender"), ("mode", "mode"), ("tokens_per_s", "tokens/s"),
               ("ms_per_token", "ms/token"), ("speedup", "× re-run")]
    head = f"**{result['config']}, {result['precision']}** — {result['shape']}\n\n"
    return head + markdown_table(result["rows"], columns)
