"""What a training run records as it goes: metrics.jsonl (+ TensorBoard when installed) and a
progress display (a tqdm bar on a terminal, plain log lines otherwise)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from txl.errors import OutputError, describe_os_error
from txl.eval.result import metric_value
from txl.io import METRICS_LIMIT, open_append, write_text
from txl.io.rundir import read_text_nofollow


class MetricsLog:
    def __init__(self, out: Path, *, enabled: bool, truncate_after: int):
        self.enabled = enabled
        self.path = out / "metrics.jsonl"
        self.file = None
        self.tb = None
        if not enabled:
            return
        # never through a link: the run directory may come from someone else (txl.io.rundir)
        try:
            text = read_text_nofollow(self.path, METRICS_LIMIT)  # a damaged line is dropped below
        except OSError as err:
            raise OutputError(f"cannot read {self.path}: {describe_os_error(err, reading=True)}") from None
        if text is not None:  # a resumed run: drop records the crashed session wrote after the checkpoint
            keep = [line for line in text.splitlines() if line.strip() and _record_step(line) <= truncate_after]
            write_text(self.path, "".join(line + "\n" for line in keep))
        self.file = open_append(self.path, what="the metrics log")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tensorboard"))
        except Exception:  # tensorboard is an optional dependency
            self.tb = None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as err:
            raise OutputError(f"cannot write {self.path}: {describe_os_error(err)}") from None
        if self.tb is not None:
            for key, value in record.items():
                if key not in ("split", "step") and isinstance(value, (int, float)):
                    self.tb.add_scalar(f"{record['split']}/{key}", value, record["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def _record_step(line: str) -> int:
    """The step of a metrics.jsonl record; a damaged record sorts after every step (and is dropped)."""
    try:
        record = json.loads(line)
        return int(record.get("step", 0)) if isinstance(record, dict) else 1 << 62
    except (ValueError, TypeError, OverflowError, RecursionError):
        return 1 << 62


class Progress:
    """A tqdm bar (loss, bpc/ppl, tokens/s, lr, ETA) on a terminal; plain log lines otherwise. Its total is
    the step the run will end at: max_steps, or the step the minutes budget will likely stop it at."""

    def __init__(self, *, total: int, initial: int, enabled: bool, metric: str):
        self.enabled, self.metric = enabled, metric
        self.bar = None
        self.tty = sys.stderr.isatty()
        if enabled and self.tty:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)

    def advance(self, step: int, *, total: int | None = None) -> None:
        """Move to `step`; `total`: the step the run will end at as now projected (max_steps, or sooner when
        the minutes budget binds), so the bar's length and ETA follow whichever budget binds."""
        if self.bar is not None:
            if total is not None and total != self.bar.total:
                self.bar.total = max(total, step)  # drawn with the update below
            self.bar.update(step - self.bar.n)

    def show(self, *, step: int, loss: float, lr: float, speed: float) -> None:
        if not self.enabled:
            return
        value = metric_value(loss, self.metric)
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.3f} {self.metric} {value:.3f} {speed:,.0f} tok/s lr {lr:.2e}")
        else:
            print(f"step {step}: loss {loss:.4f} {self.metric} {value:.4f} {speed:,.0f} tok/s lr {lr:.3e}",
                  file=sys.stderr, flush=True)

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

