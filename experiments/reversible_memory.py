"""Activation memory of reversible blocks (config.reversible, txl.nn.reversible): peak resident memory of a
training step, each contender in a fresh process, at two depths.

    python experiments/reversible_memory.py [--layers 4,12] [--out docs/results]

Contenders, all pre-LN and the same size:
- `pre-ln`: the ordinary residual blocks (reversible=false);
- `reversible, plain autograd`: the reversible coupling with every activation kept
  (`model.reversible_backward = False`), the reference its backward is tested against;
- `reversible`: the same coupling with the backward that rebuilds each block's input.

Each child builds the model and the optimizer, records the peak RSS (getrusage of the process), runs
three training steps and records it again; the row's figure is the growth of the peak over the steps
(activations, gradients and Adam's state, the last two the same for every contender of a depth; the
parameters and torch itself are there before), beside the bytes autograd saved for one step's backward
(parameters apart). Seconds per step: the mean of steps 2 and 3. One thread; the machine may be shared, so the
seconds per step are indicative only. Writes reversible_memory.json and .md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

SIZE = dict(vocab_size=256, d_model=256, n_head=4, d_head=64, d_inner=1024, mem_len=256, dropout=0.1, dropatt=0.0,
            pre_lnorm=True)
BATCH, TGT_LEN = 8, 256
CONTENDERS = {"pre-ln": (False, True), "reversible, plain autograd": (True, False), "reversible": (True, True)}


def child(name: str, layers: int) -> dict:
    import torch

    from txl import TransformerXLConfig
    from txl.models.transformer_xl.model import TransformerXL

    torch.set_num_threads(1)
    reversible, rebuild = CONTENDERS[name]
    torch.manual_seed(0)
    model = TransformerXL(TransformerXLConfig(**SIZE, n_layer=layers, reversible=reversible)).train()
    model.reversible_backward = rebuild
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randint(0, 256, (BATCH, TGT_LEN + 1), generator=torch.Generator().manual_seed(0))
    memory = None

    def step(count_saved: bool = False) -> int:
        nonlocal memory
        saved: dict[int, int] = {}
        params = {p.data_ptr() for p in model.parameters()}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                saved[ptr] = max(saved.get(ptr, 0), t.untyped_storage().nbytes())
            return t

        optimizer.zero_grad(set_to_none=False)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if count_saved else _nothing():
            out = model(x[:, :-1], labels=x[:, 1:], memory=memory)
        out.loss.backward()
        optimizer.step()
        memory = out.memory
        return sum(saved.values())

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step()
    started = time.perf_counter()
    step()
    step()
    seconds = (time.perf_counter() - started) / 2
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    saved = step(count_saved=True)
    return {"contender": name, "layers": layers, "peak_growth_mib": (after - before) / 1024,
            "peak_rss_mib": after / 1024, "saved_for_backward_mib": saved / 2**20, "seconds_per_step": seconds}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="4,12")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "results"))
    parser.add_argument("--child", nargs=2, metavar=("CONTENDER", "LAYERS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]))))
        return
    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for layers in (int(n) for n in args.layers.split(",")):
        for name in CONTENDERS:
            done = subprocess.run([sys.executable, __file__, "--child", name, str(layers)], env=env, check=True,
                                  capture_output=True, text=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    out = Path(args.out)
    report = {"size": {**SIZE, "batch": BATCH, "tgt_len": TGT_LEN}, "rows": rows,
              "command": f"python experiments/reversible_memory.py --layers {args.layers}",
              "machine": f"{os.cpu_count()} CPUs, 1 thread per run, shared with other jobs (seconds indicative only)"}
    (out / "reversible_memory.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# Reversible blocks: activation memory", "",
             f"d_model {SIZE['d_model']}, d_inner {SIZE['d_inner']}, 4 heads, batch {BATCH} × {TGT_LEN} tokens, mem_len "
             f"{SIZE['mem_len']}, pre-LN, dropout 0.1; {report['machine']}.", "",
             "| layers | contender | peak RSS growth over 3 steps (MiB) | saved for backward (MiB) | peak RSS (MiB) | s/step |",
             "|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {r['layers']} | {r['contender']} | {r['peak_growth_mib']:.0f} | {r['saved_for_backward_mib']:.1f} | "
              f"{r['peak_rss_mib']:.0f} | {r['seconds_per_step']:.2f} |" for r in rows]
    lines += ["", f"`{report['command']}`", ""]
    (out / "reversible_memory.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
