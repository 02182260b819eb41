"""`txl bench attention-scaling`: time and peak memory of ONE attention layer against sequence length
(512 … 32k) for every attention variant of the arena (docs/guide/models.md, "The arena").

The layer is `txl.nn.attention.Attention` (q/kv/output projections + the kernel) on one sequence of n
tokens with no memory (queries = keys = n), the same shape for every variant (default 4 heads × 64,
d_model 256, RoPE: the one positional encoding every variant supports). Two modes: forward without
gradients (evaluation) and forward + backward (training).

Fairness (the rules of `txl.bench.common`): at each length the variants alternate call by call in
this process and we report medians after a warm-up; peak memory is the extra peak RSS of one call
measured in a fresh process per (variant, length, mode) (`--no-rss` skips it). Full attention runs
only while its n×n score matrices fit the `--max-gb` budget (estimated before running); cells it
skips are marked. Linformer is bidirectional (no causal mask, it cannot be causal), so its row is a
different computation, listed for cost only. Compressive memory is not a kernel (its layer is full
attention over [compressed ; memory ; segment]), so it has no row here.

Writes `attention_scaling.json`, `attention_scaling.md` and `attention_scaling.png` to `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from txl.argtypes import integer, integer_list, real, threads
from txl.errors import UsageError
from txl.io import save_figure, write_text

LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
MAX_SCALING_LENGTH = 1_048_576  # tokens; full attention is skipped long before by --max-gb
VARIANTS = ("full-eager", "full-fast", "sliding", "sparse", "performer", "linformer", "linear", "bigbird", "lsh",
            "routing", "sinkhorn", "compressed", "synthesizer", "inducing", "sliding-bidirectional", "memory-tokens")
BIDIRECTIONAL_ONLY = ("linformer", "inducing", "sliding-bidirectional")
# Each second-wave kernel's stated cost at the bench settings, and the time(32k)/time(16k) it implies.
SECOND_WAVE_GROWTH = {
    "linear": "O(n·d²): target ≤ 2.3", "bigbird": "O(n·6·64): target ≤ 2.3", "lsh": "O(n·64·2): target ≤ 2.3",
    "routing": "O(n·64) with a fixed window (O(n^1.5) only if the window grows as √n): target ≤ 3.0",
    "sinkhorn": "O(n·B + (n/B)²·B·d): the sort mix is quadratic in n/B, so up to 4",
    "compressed": "O(n²/8): quadratic, up to 4", "synthesizer": "O(n·L): target ≤ 2.3",
    "inducing": "O(n·256), bidirectional: target ≤ 2.3", "linformer": "O(n·256), bidirectional",
    "sparse": "O(n·l + n²/l)", "sliding-bidirectional": "O(n·w), w/2 keys on each side: target ≤ 2.3",
    "memory-tokens": "O(n²) as full attention (+ n·64): quadratic, up to 4",
}  # cannot be causal: their rows are a different computation


def variant_config(name: str, n: int, args: argparse.Namespace) -> dict:
    """Config overrides of one variant at length n."""
    configs = {
        "full-eager": dict(attention="full", attention_impl="eager"),
        "full-fast": dict(attention="full", attention_impl="fast"),
        "sliding": dict(attention="sliding", attention_options={"window": args.window}),
        "sparse": dict(attention="sparse", attention_options={"stride": args.stride}),
        "performer": dict(attention="performer", attention_options={"features": args.features}),
        "linformer": dict(attention="linformer", causal=False, attention_options={"k": args.linformer_k, "max_len": n}),
        # second wave (issue 21): blocks / buckets / windows of 64 keys, k = 256 summaries, as above
        "linear": dict(attention="linear"),
        "bigbird": dict(attention="bigbird", attention_options={"block": 64, "window": 1, "global_blocks": 1,
                                                        "random_blocks": 2}),
        "lsh": dict(attention="lsh", attention_options={"buckets": 64, "hashes": 2, "bucket_window": 64}),
        "routing": dict(attention="routing", attention_options={"clusters": 64, "bucket_window": 64}),
        "sinkhorn": dict(attention="sinkhorn", attention_options={"block": 64}),
        "compressed": dict(attention="compressed", attention_options={"ratio": 8}),
        "synthesizer": dict(attention="synthesizer", attention_options={"max_len": args.window}),
        "inducing": dict(attention="inducing", causal=False, attention_options={"points": args.linformer_k}),
        # issue 21 (rest): the window on both sides (the masked-LM encoder); full attention + 64 memory tokens
        "sliding-bidirectional": dict(attention="sliding", causal=False, attention_options={"window": args.window // 2}),
        "memory-tokens": dict(attention="full", memory_tokens=64),
    }
    if name not in configs:
        raise UsageError(f"unknown attention variant {name!r}; choose from {', '.join(VARIANTS)}")
    return configs[name]


def estimated_gb(name: str, n: int, args: argparse.Namespace, backward: bool) -> float:
    """Rough extra memory of the full-attention variants (n×n float32 scores per head, a few live
    copies, plus the int64/bool masks the eager reference builds); 0 for the O(n) variants."""
    if not name.startswith("full") and name != "memory-tokens":
        return 0.0
    copies = 5 if backward else 2
    return n * n * (args.heads * args.batch * 4 * copies + 9) / 2**30


def build_layer(name: str, n: int, args: argparse.Namespace):
    """(step, describe) for one variant at length n: step() runs the layer once."""
    import torch

    from txl.models.transformer_xl.config import TransformerXLConfig
    from txl.nn.attention import Attention, AttentionMask
    from txl.nn.positional import build_positional

    torch.manual_seed(args.seed)
    overrides = variant_config(name, n, args)
    config = TransformerXLConfig(
        vocab_size=16, n_layer=1, d_model=args.heads * args.d_head, n_head=args.heads, d_head=args.d_head,
        d_inner=16, mem_len=0, dropout=0.0, dropatt=0.0, pos_encoding=args.pos, **overrides,
    )
    layer = Attention(config).train(args.backward_mode)
    encoding = build_positional(config)
    x = torch.randn(args.batch, n, config.d_model, requires_grad=args.backward_mode)
    mask = AttentionMask(causal=config.causal)

    def step() -> None:
        state = encoding.prepare(k_len=n, clamp_len=0, device=x.device, dtype=x.dtype)
        positions = encoding.layer(0, state)
        if args.backward_mode:
            layer(x, positions=positions, mask=mask)[0].sum().backward()
            x.grad = None
            layer.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                layer(x, positions=positions, mask=mask)

    return step


def unsupported(name: str, args: argparse.Namespace) -> str | None:
    """Why the variant cannot run with these settings (e.g. performer with --pos xl), or None."""
    from txl.errors import ConfigError
    from txl.models.transformer_xl.config import TransformerXLConfig
    from txl.nn.attention import KERNELS

    if name == "full-fast" and ("full", "fast") not in KERNELS:
        return "no ('full', 'fast') kernel registered"
    try:
        TransformerXLConfig(vocab_size=16, n_layer=1, d_model=args.heads * args.d_head, n_head=args.heads,
                            d_head=args.d_head, d_inner=16, mem_len=0, dropatt=0.0, pos_encoding=args.pos,
                            **variant_config(name, 1024, args))
    except ConfigError as err:
        return str(err)
    return None


# ---------------------------------------------------------------------------------------------
# Measurements


def time_length(names: list[str], n: int, args: argparse.Namespace, backward: bool) -> dict[str, list[float]]:
    """Seconds per call of each variant at length n (`--steps` samples), alternating call by call."""
    from txl.bench.common import interleaved_medians

    run_args = argparse.Namespace(**{**vars(args), "backward_mode": backward})
    steps = {name: build_layer(name, n, run_args) for name in names}
    result = interleaved_medians(steps, warmup=args.warmup, timed=args.steps)
    return {name: result[name]["times_s"] for name in names}


def measure_rss(name: str, n: int, args: argparse.Namespace, backward: bool) -> float | None:
    """Extra peak RSS (MiB) of one call, in a fresh process; None if the probe failed (e.g. killed)."""
    payload = {**{k: v for k, v in vars(args).items() if k in PROBE_KEYS}, "name": name, "n": n,
               "backward_mode": backward}
    cmd = [sys.executable, "-m", "txl.bench.attention_scaling", "--probe", json.dumps(payload)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.probe_timeout)
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])["work_rss_mb"]


PROBE_KEYS = ("heads", "d_head", "batch", "pos", "window", "stride", "features", "linformer_k", "seed", "threads")


def probe_main(payload: dict) -> int:
    import torch

    from txl.allocator import keep_freed_memory
    from txl.bench.common import peak_rss_mb, rss_mb

    keep_freed_memory()  # as every `txl` command does
    args = argparse.Namespace(**payload)
    if args.threads:
        torch.set_num_threads(args.threads)
    step = build_layer(payload["name"], payload["n"], args)
    base = rss_mb()
    step()
    peak = peak_rss_mb()
    print(json.dumps({"work_rss_mb": round(peak - base, 1), "base_rss_mb": round(base, 1)}))
    return 0


# ---------------------------------------------------------------------------------------------
# Output


def markdown(result: dict) -> str:
    from txl.bench.common import machine_markdown

    args = result["settings"]
    lines = [
        "# Attention scaling: one layer, time and peak memory against sequence length",
        "",
        "Written by `txl bench attention-scaling` (src/txl/bench/attention_scaling.py). One attention layer "
        f"(q/kv/output projections + kernel), batch {args['batch']}, {args['heads']} heads × {args['d_head']}, "
        f"pos_encoding `{args['pos']}`, no memory (queries = keys = n), float32, {args['threads'] or 'default'} "
        f"torch thread(s). Sliding window w = "
        f"{args['window']}; sparse stride l = {args['stride']}; Performer {args['features']} features; "
        f"Linformer k = {args['linformer_k']} (bidirectional: a different computation, cost only).",
        "",
        f"Time: median of {args['rounds'] * args['steps']} calls per cell: the whole sweep ran {args['rounds']} "
        f"times ({args['steps']} timed call(s) after {args['warmup']} warm-up per cell and round), variants "
        "alternating call by call in one process, so each cell's calls come from different minutes. Memory: "
        "extra peak RSS of one call in a fresh process (deterministic). The machine is shared (2 cores, "
        "other jobs running): timings are noisy, compare within a row and read ratios, not absolute values; "
        "every sample is in the JSON. `skip` = not run (full attention over the memory budget, or "
        "unsupported); `–` = not measured.",
        "",
        machine_markdown(result["machine"]),
        "",
    ]
    for mode, title in (("forward", "Forward (no gradients)"), ("backward", "Forward + backward")):
        rows = result["modes"].get(mode)
        if not rows:
            continue
        names = result["variants"]
        lines += [f"## {title}", "", "Time in ms / extra peak memory in MiB.", ""]
        lines.append("| n | " + " | ".join(names) + " |")
        lines.append("|---|" + "|".join("---" for _ in names) + "|")
        for n, cells in rows.items():
            row = []
            for name in names:
                cell = cells.get(name, {})
                if cell.get("skipped"):
                    row.append("skip")
                    continue
                t = cell.get("time_s")
                m = cell.get("rss_mb")
                row.append(f"{t * 1000:,.0f} / {m:,.0f}" if m is not None else f"{t * 1000:,.0f} / –")
            lines.append(f"| {int(n):,} | " + " | ".join(row) + " |")
        lines.append("")
    lines += ["## Targets (issue 8)", "",
              "Ratios of medians; in brackets the same ratio from each cell's fastest call (contention only "
              "adds time, so the minimum is the least-disturbed sample).", ""]
    lines += [f"- {line}" for line in result["targets"]] + [""]
    if result["notes"]:
        lines += ["## Notes", ""] + [f"- {note}" for note in result["notes"]] + [""]
    lines += ["Reproduce: `" + result["command"] + "`", ""]
    return "\n".join(lines)


def targets(result: dict) -> list[str]:
    """The issue's targets, from medians; in brackets the same ratio from each cell's fastest call
    (contention only ever adds time, so the minimum is the least-disturbed sample)."""
    out = []
    window = result["settings"]["window"]

    def cell(mode: str, n: int, name: str) -> dict:
        return result["modes"].get(mode, {}).get(str(n), {}).get(name, {})

    def ratio(a: dict, b: dict) -> str:
        text = f"{a['time_s'] / b['time_s']:.2f}"
        return text + (f" [{a['min_s'] / b['min_s']:.2f}]" if a.get("min_s") and b.get("min_s") else "")

    sliding = cell("forward", 16384, "sliding")
    for full_name, label in (("full-eager", "full attention (eager)"), ("full-fast", "full attention (fast kernel)")):
        full = cell("forward", 16384, full_name)
        if full.get("time_s") and sliding.get("time_s"):
            text = f"n = 16k, forward: sliding (w = {window}) is {ratio(full, sliding)}× faster than {label}"
            if full.get("rss_mb") and sliding.get("rss_mb"):
                text += f" and uses {sliding['rss_mb'] / full['rss_mb']:.3f}× its memory"
            out.append(text + (" (target: ≥ 10× faster, ≤ 0.1× memory)" if full_name == "full-eager" else ""))
    for mode, label in (("forward", "forward"), ("backward", "forward+backward")):
        p16, p32 = cell(mode, 16384, "performer"), cell(mode, 32768, "performer")
        if p16.get("time_s") and p32.get("time_s"):
            out.append(f"Performer {label} time(32k) / time(16k) = {ratio(p32, p16)}"
                       + (" (target ≤ 2.3)" if mode == "forward" else ""))
    # Issue 21: every sub-quadratic kernel against full attention at 16k, and its growth 16k -> 32k.
    full = cell("forward", 16384, "full-fast")
    for name in result["variants"]:
        if name in ("full-eager", "full-fast", "sliding", "performer") or name not in SECOND_WAVE_GROWTH:
            continue
        k16, k32 = cell("forward", 16384, name), cell("forward", 32768, name)
        parts = []
        if full.get("time_s") and k16.get("time_s"):
            parts.append(f"{ratio(full, k16)}× faster than full attention (fast kernel)")
            if full.get("rss_mb") and k16.get("rss_mb"):
                parts.append(f"{k16['rss_mb'] / full['rss_mb']:.3f}× its memory")
        if k16.get("time_s") and k32.get("time_s"):
            parts.append(f"time(32k) / time(16k) = {ratio(k32, k16)} ({SECOND_WAVE_GROWTH[name]})")
        if parts:
            out.append(f"{name}, forward, n = 16k: " + "; ".join(parts))
    return out or ["(the target lengths were not measured in this run)"]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in ("forward", "backward") if result["modes"].get(m)]
    fig, axes = plt.subplots(len(modes), 2, figsize=(11, 4.2 * len(modes)), squeeze=False)
    for row, mode in enumerate(modes):
        data = result["modes"][mode]
        for col, (key, label) in enumerate((("time_s", "time per call (s)"), ("rss_mb", "extra peak memory (MiB)"))):
            ax = axes[row][col]
            for name in result["variants"]:
                points = [(int(n), cells[name][key]) for n, cells in data.items()
                          if cells.get(name, {}).get(key) is not None]
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, marker="o", label=name, linestyle="--" if name in BIDIRECTIONAL_ONLY else "-")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length n")
            ax.set_ylabel(label)
            ax.set_title(f"{'forward' if mode == 'forward' else 'forward + backward'}: {label.split(' (')[0]}")
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    fig.suptitle("One attention layer against sequence length (txl bench attention-scaling)")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# CLI


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", type=integer_list(1, MAX_SCALING_LENGTH), default=LENGTHS,
                        help="comma-separated sequence lengths (default: 512 … 32768)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    parser.add_argument("--modes", default="forward,backward", help="forward and/or backward (= forward + backward)")
    parser.add_argument("--heads", type=integer(1, 1024), default=4, help="attention heads (default 4)")
    parser.add_argument("--d-head", type=integer(1, 4096), default=64, help="dimension per head (default 64)")
    parser.add_argument("--batch", type=integer(1, 4096), default=1, help="sequences per call (default 1)")
    parser.add_argument("--pos", default="rope", help="positional encoding (variants that cannot apply it are skipped)")
    parser.add_argument("--window", type=integer(1, MAX_SCALING_LENGTH), default=512, help="sliding window w")
    parser.add_argument("--stride", type=integer(1, MAX_SCALING_LENGTH), default=128, help="sparse stride l")
    parser.add_argument("--features", type=integer(1, 65_536), default=256, help="Performer random features")
    parser.add_argument("--linformer-k", type=integer(1, 65_536), default=256,
                        help="Linformer: rows the keys and values are projected to (default 256)")
    parser.add_argument("--max-gb", type=real(0, 1_000_000, low_open=True), default=12.0,
                        help="skip full attention when its estimated extra memory exceeds this (GiB)")
    parser.add_argument("--warmup", type=integer(0, 10_000), default=1, help="untimed calls first (default 1)")
    parser.add_argument("--steps", type=integer(1, 10_000), default=1,
                        help="timed calls per variant and length in each round")
    parser.add_argument("--rounds", type=integer(1, 1_000), default=3,
                        help="repeat the whole sweep; a cell's time is the median of rounds × steps calls")
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--probe-timeout", type=real(0, 7 * 24 * 3600, low_open=True), default=900,
                        help="seconds one measuring subprocess may take (default 900)")
    parser.add_argument("--threads", type=threads(), default=1,
                        help="torch threads (0 = torch's default). 1 by default: on a shared machine every small "
                        "op of a multi-threaded run waits for a descheduled worker whenever another job runs "
                        "(measured 40× on a 128×256 matmul), which swamps what is being compared")
    parser.add_argument("--seed", type=integer(0, 2**63 - 1), default=0,
                        help="random seed of inputs and weights (default 0)")
    parser.add_argument("--out", default="docs/results", help="directory for attention_scaling.{json,md,png}")


def reproduce_command(args: argparse.Namespace) -> str:
    flags = ["lengths", "variants", "modes", "heads", "d_head", "batch", "pos", "window", "stride", "features",
             "linformer_k", "max_gb", "warmup", "steps", "rounds", "threads"]  # not --out: a path of this machine
    parts = [f"--{flag.replace('_', '-')} {_flag_text(getattr(args, flag))}" for flag in flags]
    return "txl bench attention-scaling " + " ".join(parts) + (" --no-rss" if args.no_rss else "")


def _flag_text(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


def run(args: argparse.Namespace) -> int:
    import torch

    from txl.bench.common import machine, write_json

    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = list(args.lengths)
    names = [n for n in str(args.variants).split(",") if n]
    modes = [m for m in str(args.modes).split(",") if m]
    for mode in modes:
        if mode not in ("forward", "backward"):
            raise UsageError(f"--modes takes forward and/or backward, got {mode!r}")
    for name in names:
        variant_config(name, 1024, args)  # unknown names fail here, by name
    notes, runnable = [], []
    for name in names:
        reason = unsupported(name, args)
        if reason:
            notes.append(f"{name} skipped: {reason}")
        else:
            runnable.append(name)
    result = {"settings": {k: getattr(args, k.replace("-", "_")) for k in
                           ("batch", "heads", "d_head", "pos", "window", "stride", "features", "linformer_k",
                            "warmup", "steps", "rounds", "threads", "max_gb")},
              "machine": machine(), "variants": runnable, "modes": {}, "notes": notes,
              "command": reproduce_command(args)}
    started = time.perf_counter()

    def fitting(n: int, backward: bool) -> list[str]:
        return [name for name in runnable if estimated_gb(name, n, args, backward) <= args.max_gb]

    # Timing: the whole sweep `--rounds` times, so each cell's samples come from different minutes
    # of a shared machine (load bursts last minutes; alternating variants alone cannot cancel them).
    samples: dict[tuple[str, int, str], list[float]] = {}
    for round_index in range(args.rounds):
        for mode in modes:
            for n in lengths:
                names_here = fitting(n, mode == "backward")
                if not names_here:
                    continue
                for name, times in time_length(names_here, n, args, mode == "backward").items():
                    samples.setdefault((mode, n, name), []).extend(times)
                    print(f"round {round_index + 1}/{args.rounds} {mode:8s} n={n:6d} {name:11s} "
                          f"{statistics.median(times) * 1000:10.1f} ms", flush=True)
    # Memory: deterministic, one fresh process per cell.
    for mode in modes:
        backward = mode == "backward"
        table: dict[str, dict] = {}
        for n in lengths:
            names_here = fitting(n, backward)
            cells: dict[str, dict] = {}
            for name in runnable:
                if name not in names_here:
                    cells[name] = {"skipped": True}
                    gb = estimated_gb(name, n, args, backward)
                    notes.append(f"{mode}, n = {n}: {name} skipped (needs ≈ {gb:.0f} GiB > --max-gb {args.max_gb:g})")
                    continue
                times = samples[(mode, n, name)]
                rss = None if args.no_rss else measure_rss(name, n, args, backward)
                cells[name] = {"time_s": statistics.median(times), "min_s": min(times),
                               "times_s": [round(t, 6) for t in times], "rss_mb": rss}
                print(f"{mode:8s} n={n:6d} {name:11s} median {cells[name]['time_s'] * 1000:10.1f} ms  "
                      f"{'–' if rss is None else f'{rss:,.0f} MiB'}", flush=True)
            table[str(n)] = cells
        result["modes"][mode] = table
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    result["targets"] = targets(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "attention_scaling.json", result)
    write_text(out / "attention_scaling.md", markdown(result))
    plot(result, out / "attention_scaling.png")
    print("\n".join(result["targets"]))
    print(f"wrote {out / 'attention_scaling.md'}, .json, .png")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--probe"]:
        return probe_main(json.loads(argv[1]))
    parser = argparse.ArgumentParser(prog="txl bench attention-scaling", description=__doc__.split("\n\n")[0])
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
