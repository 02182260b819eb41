"""`txl bench curve`: does bf16 autocast train like fp32? A loss curve, side by side.

Three runs of the same model from the same initial weights on the same byte stream (this Python's
standard-library sources, vocabulary 256, no download): fp32, fp32 with another dropout seed, and bf16
autocast with the first seed. The fp32-vs-fp32 gap is the noise; bf16 should differ from fp32 by no more
than that. The runs alternate step by step; each trains with Adam (lr 1e-3, higher than the paper's
2.5e-4 so that 200 steps show a clear descent) and gradient clipping 0.25, with memory carried across
segments.
"""

from __future__ import annotations

import statistics
import sysconfig
from pathlib import Path

from txl.bench.common import (
    BenchOptions,
    autocast,
    build_ours,
    machine,
    markdown_table,
    options_dict,
    setup_torch,
)
from txl.io import STATE_LIMIT, read_bytes, save_figure

TITLE = "bf16 autocast against fp32: training loss curve"
STEPS = 200
LR = 1e-3


def byte_stream(n_bytes: int):
    """The first n_bytes of this interpreter's standard-library sources, as a uint8 tensor."""
    import torch

    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = read_bytes(path, what="standard-library source", limit=STATE_LIMIT, follow_links=True)
        chunks.append(data)
        total += len(data)
        if total >= n_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:n_bytes]), dtype=torch.uint8).long()


def run(options: BenchOptions) -> dict:
    import torch

    from txl.nn.memory import Memory

    setup_torch(options)
    shape = options.shape
    steps = int(options.extra.get("curve_steps") or (20 if options.quick else STEPS))
    batch, tgt = shape.batch, shape.tgt_len
    stream = byte_stream(batch * (steps * tgt + 1)).view(batch, -1)
    runs = {"fp32": ("fp32", 0), "fp32 (dropout seed 1)": ("fp32", 1), "bf16": ("bf16", 0)}
    state = {}
    for name, (precision, seed) in runs.items():
        model = build_ours(shape, "fast")  # same initial weights for every run (seeded inside)
        state[name] = {
            "model": model,
            "optimizer": torch.optim.Adam(model.parameters(), lr=LR),
            "memory": Memory.zeros(shape.n_layer, batch, shape.mem_len, shape.d_model),
            "rng": torch.manual_seed(seed).get_state(),  # the global generator, per run
            "precision": precision,
            "losses": [],
        }
    for step in range(steps):
        inputs = stream[:, step * tgt : (step + 1) * tgt]
        labels = stream[:, step * tgt + 1 : (step + 1) * tgt + 1]
        for run_state in state.values():
            torch.random.set_rng_state(run_state["rng"])  # each run draws dropout masks from its own seed
            model = run_state["model"]
            with autocast(run_state["precision"]):
                out = model(inputs, memory=run_state["memory"], labels=labels)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            run_state["optimizer"].step()
            run_state["optimizer"].zero_grad(set_to_none=True)
            run_state["memory"] = out.memory
            run_state["losses"].append(float(out.loss.detach()))
            run_state["rng"] = torch.random.get_rng_state()
    tail = max(1, steps // 10)
    final = {name: statistics.mean(s["losses"][-tail:]) for name, s in state.items()}
    noise = abs(final["fp32"] - final["fp32 (dropout seed 1)"])
    rows = [{"run": name, "first_loss": s["losses"][0], "final_loss": final[name],
             "vs_fp32": final[name] - final["fp32"]} for name, s in state.items()]
    return {
        "bench": "curve",
        "title": TITLE,
        "config": shape.name,
        "shape": shape.describe() + f"; tgt_len {tgt}, mem_len {shape.mem_len}, batch {batch}; Adam lr {LR}",
        "precision": "fp32,bf16",
        "steps": steps,
        "final_window": tail,
        "noise": noise,
        "bf16_gap": abs(final["bf16"] - final["fp32"]),
        "curves": {name: s["losses"] for name, s in state.items()},
        "options": options_dict(options),
        "machine": machine(),
        "rows": rows,
    }


def table(result: dict) -> str:
    columns = [("run", "run"), ("first_loss", "first loss (nats)"), ("final_loss", "final loss"),
               ("vs_fp32", "final − fp32")]
    verdict = "within" if result["bf16_gap"] <= max(result["noise"], 1e-9) * 1.5 else "outside"
    head = (f"**{result['config']}**, {result['steps']} steps — {result['shape']}. Final = mean of the last "
            f"{result['final_window']} steps. bf16 − fp32 gap {result['bf16_gap']:.4f} vs fp32 seed-to-seed "
            f"noise {result['noise']:.4f}: {verdict} noise (1.5× margin).\n\n")
    rows = [dict(row, vs_fp32=f"{row['vs_fp32']:+.4f}") for row in result["rows"]]
    return head + markdown_table(rows, columns)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in result["curves"].items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1)
    ax.set(xlabel="step", ylabel="training loss (nats/byte)", title=f"bf16 vs fp32 ({result['config']})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
