"""`txl bench eval-speedup`: Transformer-XL evaluation against the vanilla Transformer, per scored token.

The paper's Table 9 (Dai et al. 2019 §4.5): at the same attention length L, the vanilla model of
Al-Rfou et al. 2018 re-runs a window of L tokens for every prediction (Fig. 1b), while Transformer-XL
moves a segment of T tokens at a time and reuses the memory (Fig. 2b). Paper, one GPU: 363× at L = 800,
773× at 1,800, 1,409× at 2,800, 1,874× at 3,800.

What is timed, in one process, the two sides alternating (median of `steps` rounds after `warmup`):

- XL: one segment of T tokens (batch 1) with mem_len = L and same_length, so every query attends to
  exactly L keys (itself included) — the vanilla window's attention length. The memory is filled
  before timing, so every timed segment is the steady state. Time per token = segment time / T.
- vanilla: one forward over B windows of L tokens (mem_len 0), each scoring only its last token,
  exactly `txl.eval.vanilla.context_nll`. Time per token = forward time / B.

Both score real next-token NLL (labels given, logits not kept) on the same random token stream, with
the same model and attention kernel. Weights are random (timing does not depend on them) unless
`--ckpt` loads a checkpoint. The ratio is per token: vanilla time per token / XL time per token.

Command line: `txl bench eval-speedup --attn-len 800[,3800] [--json]` (this module declares its own
flags: `configure(parser)` and `run(args) -> int`), or the same flags with
`python -m txl.bench.eval_speedup`. Python: `benchmark(attn_lens, ...) -> dict`, `markdown(result)`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass

from txl.argtypes import integer, integer_list, threads
from txl.io import read_proc

TITLE = "Evaluation speed-up of Transformer-XL over the vanilla Transformer (per scored token)"
PAPER = {800: 363, 1800: 773, 2800: 1409, 3800: 1874}  # Dai et al. 2019, Table 9 (GPU)
DEFAULT_TGT_LEN = 1024  # XL segment length: min(attn_len, this); see docs/guide/evaluation.md
MAX_ATTN_LEN = 65_536  # tokens: 17x the paper's longest (3,800); the vanilla side is quadratic in it


@dataclass(frozen=True)
class Shape:
    n_layer: int
    d_model: int
    n_head: int
    d_head: int
    d_inner: int
    vocab: int = 256


SHAPES = {
    "base": Shape(12, 512, 8, 64, 2048),  # enwik8-base of Dai et al. 2019
    "tiny": Shape(4, 128, 4, 32, 512),
}


def _build_model(config: str, ckpt: str | None, impl: str):
    import torch

    from txl.models.transformer_xl.config import TransformerXLConfig
    from txl.models.transformer_xl.model import TransformerXL

    if ckpt:
        from txl.models.checkpoint import load_checkpoint

        model = load_checkpoint(ckpt).model
    else:
        if config not in SHAPES:
            from txl.errors import UsageError

            raise UsageError(f"unknown bench config {config!r}; choose one of {', '.join(SHAPES)}")
        s = SHAPES[config]
        torch.manual_seed(0)
        model = TransformerXL(TransformerXLConfig(vocab_size=s.vocab, n_layer=s.n_layer, d_model=s.d_model,
                                                  n_head=s.n_head, d_head=s.d_head, d_inner=s.d_inner, mem_len=0,
                                                  dropout=0.0, attention_impl=impl,
                                                  backend="reference" if impl == "eager" else "auto"))
    return model.eval()


def measure(model, attn_len: int, *, tgt_len: int, windows: int = 0, warmup: int = 1, steps: int = 5,
            seed: int = 0) -> dict:
    """Interleaved timing of one XL segment and one vanilla forward at attention length `attn_len`."""
    import numpy as np
    import torch

    from txl.eval.vanilla import _window_nll, default_window_batch

    device = next(model.parameters()).device
    windows = windows or default_window_batch(attn_len)
    rounds = warmup + steps
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    fill = math.ceil(attn_len / tgt_len)  # segments that fill the memory before timing
    size = max((fill + rounds) * tgt_len, attn_len + rounds * windows) + 1
    tokens = rng.integers(0, vocab, size=size, dtype=np.int64)
    stream = torch.from_numpy(tokens)
    state = {"memory": None, "pos": 0, "end": attn_len}

    @torch.no_grad()
    def xl_segment() -> None:
        start = state["pos"]
        inputs = stream[start : start + tgt_len][None].to(device)
        labels = stream[start + 1 : start + tgt_len + 1][None].to(device)
        # same_length: every XL query attends to exactly attn_len keys, like the vanilla window
        out = model(inputs, memory=state["memory"], labels=labels, mem_len=attn_len, same_length=True,
                    return_logits=False)
        state["memory"], state["pos"] = out.memory, start + tgt_len

    @torch.no_grad()
    def vanilla_windows() -> None:
        ends = state["end"] + np.arange(windows)  # last target of each window
        _window_nll(model, tokens, ends - attn_len, length=attn_len, scored=np.ones(windows, np.int64),
                    device=device, precision="fp32")
        state["end"] += windows

    for _ in range(fill):
        xl_segment()
    assert state["memory"].length == attn_len
    times = {"xl": [], "vanilla": []}
    for r in range(rounds):
        for name, step in (("xl", xl_segment), ("vanilla", vanilla_windows)):
            start = time.perf_counter()
            step()
            if r >= warmup:
                times[name].append(time.perf_counter() - start)
    xl = statistics.median(times["xl"]) / tgt_len
    vanilla = statistics.median(times["vanilla"]) / windows
    per_round = [(v / windows) / (x / tgt_len) for x, v in zip(times["xl"], times["vanilla"])]
    return {
        "attn_len": attn_len,
        "tgt_len": tgt_len,
        "windows_per_forward": windows,
        "xl_ms_per_token": 1e3 * xl,
        "vanilla_ms_per_token": 1e3 * vanilla,
        "speedup": vanilla / xl,
        "speedup_rounds_min": min(per_round),
        "speedup_rounds_max": max(per_round),
        "paper": PAPER.get(attn_len),
        "xl_times_s": [round(t, 6) for t in times["xl"]],
        "vanilla_times_s": [round(t, 6) for t in times["vanilla"]],
    }


def machine() -> dict:
    import torch

    info = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "torch": torch.__version__}
    with contextlib.suppress(OSError, StopIteration):
        info["cpu"] = next(ln.split(":", 1)[1].strip() for ln in read_proc("/proc/cpuinfo").splitlines()
                           if ln.startswith("model name"))
    with contextlib.suppress(OSError):
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return info


def benchmark(attn_lens, *, config: str = "base", ckpt: str | None = None, tgt_len: int = 0, windows: int = 0,
              warmup: int = 1, steps: int = 5, threads: int = 0, impl: str = "auto", seed: int = 0) -> dict:
    import torch

    from txl.errors import UsageError

    if not attn_lens or any(a < 1 for a in attn_lens):
        raise UsageError(f"attention lengths must be >= 1, got {list(attn_lens)}")
    if tgt_len < 0 or windows < 0 or steps < 1 or warmup < 0:
        raise UsageError("--tgt-len and --windows must be >= 0 (0 = default), --steps >= 1, --warmup >= 0")
    if threads:
        torch.set_num_threads(threads)
    model = _build_model(config, ckpt, impl)
    c = model.config
    rows = [measure(model, a, tgt_len=tgt_len or min(a, DEFAULT_TGT_LEN), windows=windows, warmup=warmup,
                    steps=steps, seed=seed) for a in attn_lens]
    from txl.nn.attention import resolve_kernel

    kernel = resolve_kernel(c.attention, c.attention_impl).__name__
    return {
        "bench": "eval-speedup",
        "title": TITLE,
        "model": f"{'checkpoint ' + ckpt if ckpt else config + ' (random weights)'}: {c.n_layer} layers, d_model "
                 f"{c.d_model}, {c.n_head}×{c.d_head} heads, d_inner {c.d_inner}, vocab {c.vocab_size}",
        "attention_kernel": kernel,
        "machine": machine(),
        "warmup": warmup,
        "steps": steps,
        "rows": rows,
    }


def _times(ratio: float) -> str:
    return f"{ratio:,.0f}×" if ratio >= 10 else f"{ratio:.2f}×"


def markdown(result: dict) -> str:
    lines = [f"{result['model']}; attention kernel `{result['attention_kernel']}`; median of {result['steps']} "
             f"interleaved rounds after {result['warmup']} warm-up", "",
             "| attention length | XL tgt_len | XL ms/token | vanilla ms/token | speed-up | (min–max over rounds) "
             "| paper (GPU) |", "|---:|---:|---:|---:|---:|---|---:|"]
    for r in result["rows"]:
        paper = f"{r['paper']:,}×" if r.get("paper") else "–"
        lines.append(f"| {r['attn_len']:,} | {r['tgt_len']} | {r['xl_ms_per_token']:.3f} | "
                     f"{r['vanilla_ms_per_token']:.1f} | **{_times(r['speedup'])}** | "
                     f"{_times(r['speedup_rounds_min'])}–{_times(r['speedup_rounds_max'])} | {paper} |")
    m = result["machine"]
    lines += ["", f"machine: {m.get('cpu')}, {m.get('cores')} logical cores, {m.get('threads')} torch threads, "
                  f"torch {m.get('torch')}, load average at the end {m.get('load_average')}"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line: `txl bench eval-speedup ...` (the bench registry calls configure/run) or
# `python -m txl.bench.eval_speedup ...`


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--attn-len", type=integer_list(1, MAX_ATTN_LEN), default=(800,),
                        help="attention length(s), comma-separated (paper: 800,1800,2800,3800)")
    parser.add_argument("--config", choices=sorted(SHAPES), default="base",
                        help="model shape with random weights (default base: 12 layers, d_model 512)")
    parser.add_argument("--ckpt", help="time this checkpoint instead of a random model")
    parser.add_argument("--tgt-len", type=integer(0, MAX_ATTN_LEN), default=0,
                        help=f"XL segment length (default min(attn_len, {DEFAULT_TGT_LEN}))")
    parser.add_argument("--windows", type=integer(0, 4096), default=0,
                        help="vanilla windows per forward (0 = ~4096 tokens)")
    parser.add_argument("--steps", type=integer(1, 10_000), default=5, help="timed rounds (default 5)")
    parser.add_argument("--warmup", type=integer(0, 10_000), default=1, help="untimed rounds first (default 1)")
    parser.add_argument("--threads", type=threads(), default=0, help="torch threads (default 0: txl's choice, as every command)")
    parser.add_argument("--impl", default="auto", help="attention_impl: auto, eager or fast")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    result = benchmark(list(args.attn_len), config=args.config, ckpt=args.ckpt, tgt_len=args.tgt_len, windows=args.windows,
                       warmup=args.warmup, steps=args.steps, threads=args.threads, impl=args.impl)
    print(json.dumps(result, indent=2) if args.json else f"## {TITLE}\n\n{markdown(result)}")
    return 0


def main(argv=None) -> int:
    from txl.errors import TxlError

    parser = argparse.ArgumentParser(prog="python -m txl.bench.eval_speedup", description=TITLE)
    configure(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except TxlError as err:
        print(f"eval-speedup: error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
