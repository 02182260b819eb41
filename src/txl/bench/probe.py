"""Measure one workload's peak memory in a fresh process: `python -m txl.bench.probe KIND JSON`.

Peak RSS (`ru_maxrss`) is a high-water mark of the whole process, so each contender gets its own
process. Prints one JSON line: peak_rss_mb (the process peak), base_rss_mb (after the model, data and
starting memory are built, before the first step) and their difference, work_rss_mb.
"""

from __future__ import annotations

import json
import sys

from txl.bench.common import peak_rss_mb, rss_mb, shape_named


def main(argv: list[str]) -> int:
    kind, payload = argv[0], json.loads(argv[1])
    import torch

    from txl.allocator import keep_freed_memory

    keep_freed_memory()  # as every `txl` command does

    if payload.get("threads"):
        torch.set_num_threads(payload["threads"])
    shape = shape_named(payload["config"])
    if kind == "train":
        from txl.bench.train import make_step

        step = make_step(payload["name"], shape, payload["precision"])
    elif kind == "eval":
        from txl.bench.evaluation import make_eval_step

        step = make_eval_step(payload["name"], shape, payload["precision"], mem_len=payload["mem_len"])
    else:
        raise SystemExit(f"unknown probe kind {kind!r}")
    base = rss_mb()
    for _ in range(payload.get("steps", 2)):
        step()
    peak = peak_rss_mb()
    print(json.dumps({"peak_rss_mb": round(peak, 1), "base_rss_mb": round(base, 1),
                      "work_rss_mb": round(peak - base, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
