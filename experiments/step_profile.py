"""Where a training step's time goes (issue 49, item 1): per operator, at several shapes and thread counts.

For each `txl bench` config and thread count: the median step time of txl's fast path (fp32 or bf16, the
step `txl bench train` times: forward, backward, clip, Adam), then N more steps under the torch profiler,
split into matrix products (oneDNN's linear, BLAS mm/bmm), copies, random draws (dropout) and the rest
(`txl.bench.train.op_kinds`), with the costliest operators. "outside ops" is the median step minus the
time the profiler saw inside operators: Python, autograd and dispatch. The process keeps freed memory as
every `txl` command does (`txl.allocator`).

    python experiments/step_profile.py --config tiny,ptb-char-hour,ptb-word-hour,base --threads 1,2 \\
        --out docs/results

Writes OUT/step_profile.json and OUT/step_profile.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def profile_shape(config: str, threads: int, *, precision: str, warmup: int, steps: int, profile: int,
                  top: int) -> dict:
    import torch

    from txl.bench.common import interleaved_medians, shape_named
    from txl.bench.train import make_step, op_kinds, profile_steps

    torch.set_num_threads(threads)
    shape = shape_named(config)
    step = make_step("txl-fast", shape, precision)
    median = interleaved_medians({"txl": step}, warmup=warmup, timed=steps)["txl"]["median_s"]
    ops = profile_steps(step, profile, top=None)
    kinds = op_kinds(ops)
    step_ms = 1000 * median
    row = {"config": config, "threads": threads, "precision": precision, "shape": shape.describe(),
           "tokens_per_step": shape.batch * shape.tgt_len, "step_ms": round(step_ms, 2),
           "tokens_per_s": round(shape.batch * shape.tgt_len / median, 1),
           "kinds_ms": {k: round(v, 2) for k, v in kinds.items()}, "outside_ops_ms": round(step_ms - kinds["ops"], 2),
           "top": [{**op, "self_ms_per_step": round(op["self_ms_per_step"], 3), "percent": round(op["percent"], 2)}
                   for op in ops[:top]]}
    print(f"{config} {threads} thread(s): {step_ms:.1f} ms/step, matmul {kinds['matmul']:.1f}, copy {kinds['copy']:.1f}, "
          f"random {kinds['random']:.1f}, other {kinds['other']:.1f}, outside ops {step_ms - kinds['ops']:.1f}", flush=True)
    return row


def markdown(result: dict) -> str:
    from txl.bench.common import machine_markdown

    lines = ["# Where a training step's time goes (txl fast path, per operator)", "",
             machine_markdown(result["machine"]), "",
             f"Median of {result['steps']} steps after {result['warmup']} (tokens/s), then {result['profile']} steps "
             "under the torch profiler: milliseconds per step by operator kind. matmul: oneDNN's linear and BLAS "
             "mm/bmm/baddbmm/addmm; copy: copy_, cat, stack, clone, dtype casts; random: dropout's draws; other: "
             "element-wise ops, reductions, softmax, layer norm, the optimiser; outside ops: the step minus all "
             "operator time (Python, autograd, dispatch). The profiler's own overhead lands in the kinds, so "
             "they can sum to more than the step.", "",
             "| config | threads | precision | step ms | tokens/s | matmul | copy | random | other | outside ops | matmul share |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        k = r["kinds_ms"]
        lines.append(f"| {r['config']} | {r['threads']} | {r['precision']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
                     f"{k['matmul']:.1f} | {k['copy']:.1f} | {k['random']:.1f} | {k['other']:.1f} | "
                     f"{r['outside_ops_ms']:.1f} | {100 * k['matmul'] / max(k['ops'], 1e-9):.0f}% |")
    for r in result["rows"]:
        lines += ["", f"## {r['config']}, {r['threads']} thread(s), {r['precision']}", "", r["shape"], "",
                  "| operator | ms/step | calls/step | % of operator time |", "|---|---|---|---|"]
        lines += [f"| `{op['op']}` | {op['self_ms_per_step']:.2f} | {op['calls_per_step']:.0f} | {op['percent']:.1f} |"
                  for op in r["top"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="tiny,ptb-char-hour,ptb-word-hour,base", help="txl bench configs, comma-separated")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--profile", type=int, default=3, help="profiled steps")
    parser.add_argument("--top", type=int, default=12, help="operators listed per shape")
    parser.add_argument("--out", type=Path, default=Path("step_profile"))
    args = parser.parse_args(argv)
    from txl.allocator import keep_freed_memory
    from txl.bench.common import machine

    keep_freed_memory()
    rows = [profile_shape(config, threads, precision=args.precision, warmup=args.warmup, steps=args.steps,
                          profile=args.profile, top=args.top)
            for config in args.config.split(",") for threads in map(int, args.threads.split(","))]
    result = {"machine": machine(), "warmup": args.warmup, "steps": args.steps, "profile": args.profile, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_profile.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "step_profile.md").write_text(markdown(result))
    print(f"wrote {args.out / 'step_profile.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
