"""Reports of evaluations: the table `txl eval` prints (`result_table`), per-token losses on disk
(`save_per_token`, `load_per_token`), the memory sweep as markdown and as a plot, and `plain`, the
escape of user-given labels in plots."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from txl.errors import OutputError, UsageError, describe_os_error
from txl.eval.result import EvalResult
from txl.io import save_array, write_figure, write_text


def plain(text: str) -> str:
    """`text` as matplotlib draws it literally: a `$` starts mathtext there (a run named `$\\x$` raised a
    parse error, `cost $5 and $6` lost its dollars), so each one is escaped. For run names, checkpoint
    labels and titles, which come from users and directory names."""
    return text.replace("$", "\\$")


def sweep_markdown(results: Sequence[EvalResult], *, title: str = "") -> str:
    metric = results[0].metric if results else "bpc"
    lines = [f"{title}\n" if title else ""]
    lines.append(f"| mem_len | tgt_len | attention length | {metric} | loss (nats) | tokens | seconds |")
    lines.append("|---:|---:|---:|---:|---:|---:|---:|")
    best = min(results, key=lambda r: r.loss) if results else None
    for r in results:
        value = f"**{r.value:.4f}**" if r is best else f"{r.value:.4f}"
        lines.append(f"| {r.mem_len} | {r.tgt_len} | {r.attn_len} | {value} | {r.loss:.4f} | {r.tokens:,} | "
                     f"{r.seconds:.1f} |")
    return "\n".join(lines).lstrip("\n") + "\n"


def plot_sweep(results: Sequence[EvalResult], path: str | Path, *, title: str = "",
               train_attn_len: int | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    metric = results[0].metric
    # Without memory the first tokens of every segment have almost no context, so mem_len 0 sits far
    # above the rest; a second panel then shows mem_len > 0 on its own scale, where the differences
    # past the training attention length live.
    with_memory = [r for r in results if r.mem_len > 0]
    panels = [results, with_memory] if len(with_memory) >= 2 and len(with_memory) < len(results) else [results]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4), squeeze=False)
    for ax, shown in zip(axes[0], panels):
        ax.plot([r.attn_len for r in shown], [r.value for r in shown], "o-")
        if train_attn_len:
            ax.axvline(train_attn_len, color="grey", linestyle="--", linewidth=1, label="training attention length")
            ax.legend()
        ax.set_xlabel("attention length at evaluation (mem_len + tgt_len)")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    axes[0][0].set_title(title or f"{metric} against evaluation attention length")
    if len(panels) == 2:
        axes[0][1].set_title("mem_len > 0, own scale")
    fig.tight_layout()
    return write_figure(fig, path, dpi=120)

def save_per_token(values: np.ndarray, path: str | Path) -> Path:
    """Per-token NLL (nats, corpus order) as .npy (numpy, no pickle) or .txt (one value per line)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".npy":
            save_array(path, np.asarray(values, dtype=np.float32))
        elif path.suffix == ".txt":
            write_text(path, "".join(f"{v:.8g}\n" for v in np.asarray(values, dtype=np.float64).tolist()))
        else:
            raise UsageError(f"--per-token {path}: use a .npy or .txt file name")
    except OSError as err:
        raise OutputError(f"cannot write {path}: {describe_os_error(err)}") from None
    return path


def load_per_token(path: str | Path) -> np.ndarray:
    path = Path(path)
    if path.suffix == ".npy":
        return np.load(path, allow_pickle=False)
    return np.loadtxt(path, dtype=np.float64, ndmin=1)


def result_table(result: EvalResult) -> str:
    """The readable summary `txl eval` prints."""
    r = result
    rows = [("split", r.split or "-"), (r.metric, f"{r.value:.4f}"), ("loss (nats/token)", f"{r.loss:.4f}"),
            ("tokens scored", f"{r.tokens:,}"), ("seconds", f"{r.seconds:.2f}"),
            ("tokens/s", f"{r.tokens_per_second:,.0f}")]
    if r.mode == "mlm":
        rows += [("evaluator", "masked LM (BERT 80/10/10): loss, bpc/ppl and accuracy of the masked tokens"),
                 ("masked-token accuracy", f"{r.accuracy:.4f}"), ("mask_prob", str(r.mask_prob)),
                 ("tgt_len (window)", str(r.tgt_len)), ("windows per forward", str(r.batch_size))]
    elif r.mode == "dynamic":
        rows += [("evaluator", "dynamic evaluation (Krause et al. 2018): one stream with memory, an SGD step on "
                               "each segment after scoring it"),
                 ("learning rate η", f"{r.dynamic_lr:g}"), ("decay λ", f"{r.dynamic_decay:g}"),
                 ("mem_len", str(r.mem_len)), ("tgt_len", str(r.tgt_len)), ("attention length", str(r.attn_len))]
    elif r.mode == "vanilla":
        rows += [("evaluator", "vanilla (Al-Rfou et al. 2018): a fresh window per token, no memory"),
                 ("attention length", str(r.attn_len)), ("stride", str(r.stride)),
                 ("windows per forward", str(r.batch_size)), ("clamp_len", str(r.clamp_len))]
    else:
        rows += [("evaluator", "Transformer-XL: segments with memory"), ("mem_len", str(r.mem_len)),
                 ("tgt_len", str(r.tgt_len)), ("attention length", str(r.attn_len)),
                 ("clamp_len", f"{r.clamp_len} (0 = no clamp)" if r.clamp_len is not None else "-"),
                 ("same_length", str(r.same_length)), ("batch size (streams)", str(r.batch_size)),
                 ("warm memory", str(r.warm_memory))]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
