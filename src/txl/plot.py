"""`txl plot RUN_DIR [RUN_DIR ...]`: training curves from metrics.jsonl as PNG.

One figure with four panels (loss, bpc or perplexity, learning rate, tokens/s) against the step;
train and valid records drawn separately; several runs overlay for comparison.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from txl.errors import OutputError, UsageError, describe_os_error
from txl.rundir import save_figure


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UsageError(f"{run_dir} has no metrics.jsonl; pass the --out directory of a `txl train` run")
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as err:
        raise UsageError(f"cannot read {path}: {describe_os_error(err)}") from None
    except UnicodeDecodeError as err:
        raise UsageError(f"{path} is not UTF-8 text (byte {err.start}); the file is damaged") from None
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            raise UsageError(f"{path}:{number} is not a JSON record; the file is damaged") from None
        if not _valid_record(record):
            raise UsageError(f"{path}:{number} is not a metrics record (an object with split, an integer "
                             "step and numeric values); the file is damaged")
        records.append(record)
    return records


def _valid_record(record) -> bool:
    if not isinstance(record, dict) or not isinstance(record.get("split"), str):
        return False
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return False
    return all(isinstance(record.get(key), int | float | None) and not isinstance(record.get(key), bool)
               for key in ("loss", "bpc", "ppl", "lr", "tokens_per_second"))


def plot_runs(run_dirs: list[str | Path], out: str | Path, *, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    panels = [("loss", "loss (nats/token)"), (None, ""), ("lr", "learning rate"),
              ("tokens_per_second", "train tokens/s")]
    metric_name = None
    for run_dir in run_dirs:
        records = read_metrics(run_dir)
        label = Path(run_dir).name
        metric_name = metric_name or next((m for m in ("bpc", "ppl") if any(m in r for r in records)), "bpc")
        for split, style in (("train", "-"), ("valid", "o-")):
            rows = [r for r in records if r.get("split") == split]
            if not rows:
                continue
            steps = [r["step"] for r in rows]
            for ax, (key, _) in zip(axes.flat, panels):
                key = key or metric_name
                if key in ("lr", "tokens_per_second") and split != "train":
                    continue
                values = [r.get(key) for r in rows]
                if all(v is None for v in values):
                    continue
                ax.plot(steps, values, style, label=f"{label} {split}", markersize=3)
    panels[1] = (metric_name, metric_name)
    for ax, (_, ylabel) in zip(axes.flat, panels):
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel or metric_name)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    if metric_name == "ppl":
        axes.flat[1].set_yscale("log")
    fig.suptitle(title or ", ".join(Path(r).name for r in run_dirs))
    fig.tight_layout()
    out = Path(out)
    if not out.suffix:
        out = out.with_suffix(".png")
    formats = fig.canvas.get_supported_filetypes()
    if out.suffix.lstrip(".").lower() not in formats:
        plt.close(fig)
        raise UsageError(f"--out {out}: unknown image format {out.suffix!r}; end the name with .png, .pdf or .svg")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_figure(fig, out, dpi=120)
    except OSError as err:
        raise OutputError(f"cannot write {out}: {describe_os_error(err)}") from None
    finally:
        plt.close(fig)
    return out


def configure_cli(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", help="run directories (the --out of `txl train`)")
    parser.add_argument("--out", help="PNG path (default: RUN_DIR/curves.png for one run, curves.png otherwise)")
    parser.add_argument("--title")


def run_cli(args: argparse.Namespace) -> int:
    out = args.out or (Path(args.runs[0]) / "curves.png" if len(args.runs) == 1 else Path("curves.png"))
    path = plot_runs(args.runs, out, title=args.title)
    print(f"wrote {path}")
    return 0
