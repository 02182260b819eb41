"""`txl plot RUN_DIR [RUN_DIR ...]`: training curves from metrics.jsonl as PNG.

One figure with panels for loss, bpc and/or perplexity, learning rate and tokens/s against the step;
train (solid) and valid (dashed, markers) records drawn separately; several runs overlay for
comparison, each in one colour.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from txl.errors import UsageError
from txl.eval.report import plain
from txl.io import METRICS_LIMIT, read_text, write_figure

KEYS = ("loss", "bpc", "ppl", "lr", "tokens_per_second")  # the numbers drawn
MAX_STEP = 2**62  # a step a run can reach; beyond it (or below 0) the record is damaged
# Values beyond this magnitude (and NaN, +-inf) are left out of a panel, with a note: matplotlib overflows
# computing axis limits and ticks near the largest float (a "loss" of 1e308 raised inside savefig).
DRAWN = 1e300


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists() and not path.is_symlink():
        raise UsageError(f"{run_dir} has no metrics.jsonl; pass the --out directory of a `txl train` run")
    # bounded, a regular file, not followed through a link: a FIFO here would hang the plot for ever
    text = read_text(path, what="metrics file", limit=METRICS_LIMIT, error=UsageError)
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
                             f"step in [0, 2**62] and numeric values); the file is damaged")
        records.append(record)
    return records


def _valid_record(record) -> bool:
    if not isinstance(record, dict) or not isinstance(record.get("split"), str):
        return False
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        return False
    return all(record.get(key) is None or _is_number(record[key]) for key in KEYS)


def _is_number(value) -> bool:
    """A JSON number a float can hold (NaN and infinities included: a diverged run records them)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return isinstance(value, float) or abs(value) < 2**1023  # float(10**400) overflows


def _drawable(key: str, value: float) -> bool:
    return math.isfinite(value) and abs(value) <= DRAWN and (key != "ppl" or value > 0)  # ppl: a log axis


def run_metric(run_dir: str | Path, records: list[dict]) -> str:
    """bpc or ppl: what the run's records hold (bpc first), else bpc."""
    return next((m for m in ("bpc", "ppl") if any(m in r for r in records)), "bpc")


def plot_runs(run_dirs: list[str | Path], out: str | Path, *, title: str | None = None,
              notes: list[str] | None = None) -> Path:
    """Draw the runs (`draw_runs`) into an image file; returns its path."""

    return _save(draw_runs(run_dirs, title=title, notes=notes), Path(out))


def draw_runs(run_dirs: list[str | Path], *, title: str | None = None, notes: list[str] | None = None):
    """The figure. Panels: loss, then one per metric the runs use (bpc and/or ppl: a run is drawn only on its own
    metric's panel), learning rate and tokens/s. Each run keeps one colour in every panel; a series of
    a single point is drawn as a marker. `notes` receives what a reader should be told."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(Path(r), read_metrics(r)) for r in run_dirs]
    metrics = [m for m in ("bpc", "ppl") if any(run_metric(d, rec) == m for d, rec in runs)]
    if len(metrics) > 1 and notes is not None:
        notes.append("the runs are measured in bpc and ppl: each metric has its own panel, and a run appears "
                     "only on its own")
    panels = [("loss", "loss (nats/token)"), *[(m, m) for m in metrics], ("lr", "learning rate"),
              ("tokens_per_second", "train tokens/s")]
    columns = 3 if len(panels) > 4 else 2
    fig, grid = plt.subplots(2, columns, figsize=(5.5 * columns, 7))
    axes = list(grid.flat)
    for extra in axes[len(panels):]:
        extra.set_visible(False)
    for number, (run_dir, records) in enumerate(runs):
        colour = f"C{number % 10}"  # one colour per run, in every panel
        metric = run_metric(run_dir, records)
        left_out = 0
        for split, line in (("train", "-"), ("valid", "--"), ("valid_ema", ":")):  # valid_ema: train.ema
            rows = [r for r in records if r.get("split") == split]
            if not rows:
                continue
            steps = [r["step"] for r in rows]
            for ax, (key, _) in zip(axes, panels):
                if key in ("bpc", "ppl") and key != metric:
                    continue
                if key in ("lr", "tokens_per_second") and split != "train":
                    continue
                given = [(s, float(r[key])) for s, r in zip(steps, rows) if r.get(key) is not None]
                points = [(s, v) for s, v in given if _drawable(key, v)]
                left_out += len(given) - len(points)
                if not points:
                    continue
                xs, ys = zip(*points)
                marker = ("s" if split != "train" else "o") if split != "train" or len(points) == 1 else None
                ax.plot(xs, ys, line if len(points) > 1 else "", marker=marker, color=colour,
                        label=plain(f"{run_dir.name} {split}"), markersize=4 if len(points) > 1 else 6)
        if left_out and notes is not None:
            notes.append(f"{run_dir.name}: {left_out} values not drawn (NaN, infinite, beyond ±1e300 or a "
                         "perplexity <= 0: the run diverged there, or the file was edited)")
    for ax, (key, ylabel) in zip(axes, panels):
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if key == "ppl":
            ax.set_yscale("log")
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(plain(title or ", ".join(d.name for d, _ in runs)))
    fig.tight_layout()
    return fig


def _save(fig, out: Path) -> Path:
    import matplotlib.pyplot as plt

    if not out.suffix:
        out = out.with_suffix(".png")
    formats = fig.canvas.get_supported_filetypes()
    if out.suffix.lstrip(".").lower() not in formats:
        plt.close(fig)
        raise UsageError(f"--out {out}: unknown image format {out.suffix!r}; end the name with .png, .pdf or .svg")
    return write_figure(fig, out, dpi=120)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", help="run directories (the --out of `txl train`)")
    parser.add_argument("--out", help="PNG path (default: RUN_DIR/curves.png for one run, curves.png otherwise)")
    parser.add_argument("--title", help="figure title (default: the run names)")


def run(args: argparse.Namespace) -> int:
    out = args.out or (Path(args.runs[0]) / "curves.png" if len(args.runs) == 1 else Path("curves.png"))
    notes: list[str] = []
    path = plot_runs(args.runs, out, title=args.title, notes=notes)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"wrote {path}")
    return 0
