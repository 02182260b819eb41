"""txl against the 2019 reference code (kimiyoung/transformer-xl, PyTorch), side by side on one machine.

The reference is not shipped: fetch it into a scratch folder outside this repository and patch it for
modern PyTorch, nothing else (issue 49's method):

    git clone https://github.com/kimiyoung/transformer-xl /tmp/kimiyoung
    sed -i 's/\\.byte()/.bool()/g' /tmp/kimiyoung/pytorch/mem_transformer.py           # masks must be bool now
    sed -i "s/torch.version.cuda.split/(torch.version.cuda or '0.0').split/" \\
        /tmp/kimiyoung/pytorch/utils/proj_adaptive_softmax.py                         # its CUDA-version probe
    python experiments/reference_speed.py --reference /tmp/kimiyoung/pytorch --config tiny,ptb-char-small

Both sides train the same shape (a `txl bench` config: tiny, base, or a preset's) on the same random
tokens with torch Adam (lr 2.5e-4) and gradient clipping at 0.25, the reference's `MemTransformerLM` with
attn_type 0 (Transformer-XL), the same dropout, no adaptive softmax; txl runs what `txl bench train` and
`txl bench eval` time (`txl.bench.train.make_step`, `txl.bench.evaluation.make_eval_step`). Evaluation
is a no-grad forward with the full memory at the config's evaluation segment, batch and memory length.
Steps are timed in interleaved rounds (reference, txl, reference, ...) after a warm-up, at each thread
count asked, and reported as medians and the ratio txl / reference in tokens per second, with the CPU
model. Writes OUT/reference_speed.json and .md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path


def reference_model(pytorch_dir: Path, shape, *, tgt_len: int, mem_len: int, train: bool):
    """The reference's MemTransformerLM at `shape` (imported from the patched scratch copy)."""
    paths = [str(pytorch_dir), str(pytorch_dir / "utils")]  # it imports utils/ as `sys.path.append('utils')` would
    sys.path[:0] = paths
    try:
        module = importlib.import_module("mem_transformer")
    finally:
        del sys.path[:len(paths)]
    model = module.MemTransformerLM(
        shape.vocab, shape.n_layer, shape.n_head, shape.d_model, shape.d_head, shape.d_inner,
        shape.dropout if train else 0.0, 0.0, tie_weight=True, d_embed=shape.d_model, div_val=1,
        tie_projs=[False], pre_lnorm=False, tgt_len=tgt_len, ext_len=0, mem_len=mem_len, cutoffs=[],
        same_length=False, attn_type=0, clamp_len=-1, sample_softmax=-1,
    )
    return model.train(train)


def reference_train_step(pytorch_dir: Path, shape, *, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    model = reference_model(pytorch_dir, shape, tgt_len=shape.tgt_len, mem_len=shape.mem_len, train=True)
    params = list(model.parameters())
    optimizer = torch.optim.Adam(params, lr=2.5e-4)
    generator = torch.Generator().manual_seed(seed)
    tgt = shape.tgt_len
    stream = torch.randint(0, shape.vocab, (16 * tgt + 1, shape.batch), generator=generator)  # (time, batch)
    mems = [[torch.zeros(shape.mem_len, shape.batch, shape.d_model) for _ in range(shape.n_layer + 1)]]
    position = [0]

    def step() -> None:
        start = position[0]
        position[0] = (start + tgt) % (15 * tgt)
        out = model(stream[start:start + tgt], stream[start + 1:start + tgt + 1], *mems[0])
        loss = out[0].float().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.25)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mems[0] = out[1:]

    return step


def reference_eval_step(pytorch_dir: Path, shape, *, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    mem_len, tgt, batch = shape.eval_mem_lens[0], shape.eval_tgt_len, shape.eval_batch
    model = reference_model(pytorch_dir, shape, tgt_len=tgt, mem_len=mem_len, train=False)
    generator = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, shape.vocab, (8 * tgt + 1, batch), generator=generator)
    mems = [[torch.zeros(mem_len, batch, shape.d_model) for _ in range(shape.n_layer + 1)]]
    position = [0]

    @torch.no_grad()
    def step() -> None:
        start = position[0]
        position[0] = (start + tgt) % (7 * tgt)
        mems[0] = model(stream[start:start + tgt], stream[start + 1:start + tgt + 1], *mems[0])[1:]

    return step


def measure(pytorch_dir: Path, config: str, threads: int, *, warmup: int, steps: int, profile: int = 0) -> list[dict]:
    import torch

    from txl.bench.common import interleaved_medians, shape_named
    from txl.bench.evaluation import make_eval_step
    from txl.bench.train import make_step, op_kinds, profile_steps

    torch.set_num_threads(threads)
    shape = shape_named(config)
    eval_shape = shape
    rows = []
    for kind in ("train", "eval"):
        if kind == "train":
            contenders = {"kimiyoung": reference_train_step(pytorch_dir, shape),
                          "txl": make_step("txl-fast", shape, "fp32")}
            tokens = shape.batch * shape.tgt_len
        else:
            contenders = {"kimiyoung": reference_eval_step(pytorch_dir, eval_shape),
                          "txl": make_eval_step("txl-fast", eval_shape, "fp32", mem_len=eval_shape.eval_mem_lens[0])}
            tokens = eval_shape.eval_batch * eval_shape.eval_tgt_len
        got = interleaved_medians(contenders, warmup=warmup, timed=steps)
        ref, ours = (tokens / got[name]["median_s"] for name in ("kimiyoung", "txl"))
        rows.append({"config": config, "kind": kind, "threads": threads, "tokens_per_step": tokens,
                     "kimiyoung_tok_s": round(ref, 1), "txl_tok_s": round(ours, 1), "ratio": round(ours / ref, 3),
                     "times_s": {name: value["times_s"] for name, value in got.items()}})
        if profile:  # where each side's step goes, by operator kind (ms per step, profiled apart from the timing)
            kinds = {name: op_kinds(profile_steps(step, profile, top=None)) for name, step in contenders.items()}
            rows[-1]["profile_ms"] = {name: {k: round(v, 2) for k, v in value.items()} for name, value in kinds.items()}
            # the ratio txl would reach if everything but its matrix products took no time at all
            rows[-1]["matmul_bound"] = round(1000 * got["kimiyoung"]["median_s"] / kinds["txl"]["matmul"], 2)
        print(f"{config} {kind} {threads} thread(s): kimiyoung {ref:,.0f} tok/s, txl {ours:,.0f} tok/s, "
              f"x{ours / ref:.2f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", type=Path, required=True, help="the patched reference's pytorch/ folder")
    parser.add_argument("--config", default="tiny,ptb-char-small", help="txl bench configs, comma-separated")
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15, help="timed rounds (one step of each side per round)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile N more steps of each side: milliseconds per step in matrix products, "
                             "copies, random draws and the rest, and the ratio txl's matrix products alone allow")
    parser.add_argument("--out", type=Path, default=Path("reference_speed"))
    args = parser.parse_args(argv)
    if not (args.reference / "mem_transformer.py").is_file():
        parser.error(f"--reference {args.reference}: no mem_transformer.py there (the reference's pytorch/ folder)")
    from txl.bench.common import machine, machine_markdown

    rows = [row for config in args.config.split(",") for threads in map(int, args.threads.split(","))
            for row in measure(args.reference, config, threads, warmup=args.warmup, steps=args.steps,
                               profile=args.profile)]
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine(), "warmup": args.warmup, "steps": args.steps, "rows": rows}
    (args.out / "reference_speed.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# txl against the reference code (kimiyoung), fp32, tokens/s (medians of interleaved steps)", "",
             machine_markdown(result["machine"]), "",
             "| config | step | threads | kimiyoung | txl | txl / kimiyoung |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['config']} | {r['kind']} | {r['threads']} | {r['kimiyoung_tok_s']:,.0f} | {r['txl_tok_s']:,.0f} | "
              f"{r['ratio']:.2f} |" for r in rows]
    profiled = [r for r in rows if "profile_ms" in r]
    if profiled:
        lines += ["", "Where a step goes (ms per step, profiled; `outside ops`: the median step minus the time the profiler "
                  "saw inside operators, i.e. Python and dispatch; `bound`: kimiyoung's step over txl's matrix products "
                  "alone, the ratio txl would reach if nothing else took any time)", "",
                  "| config | step | threads | side | step ms | matmul | copy | random | other | outside ops | bound |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in profiled:
            for name, kinds in r["profile_ms"].items():
                step_ms = 1000 * statistics.median(r["times_s"][name])
                bound = f"{r['matmul_bound']:.2f}" if name == "txl" else ""
                lines.append(f"| {r['config']} | {r['kind']} | {r['threads']} | {name} | {step_ms:.1f} | {kinds['matmul']:.1f} | "
                             f"{kinds['copy']:.1f} | {kinds['random']:.1f} | {kinds['other']:.1f} | "
                             f"{step_ms - kinds['ops']:.1f} | {bound} |")
    (args.out / "reference_speed.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / 'reference_speed.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
