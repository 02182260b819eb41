"""What the experiment scripts share: run many `txl train` processes side by side, reuse the finished
ones, read their records, and give each script txl's command-line manners (one-line errors, exit 2).

Not part of the installed package: the scripts in experiments/ import it from their own directory
(`python experiments/arena.py` puts that directory first on sys.path).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from txl.errors import TxlError, UsageError
from txl.io import METRICS_LIMIT, create_log, read_bytes, read_json, read_text, write_text

# The repository this script lives in, and where its studies' current pages live (docs/results).
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"


def script_main(name: str, description: str, configure: Callable[[argparse.ArgumentParser], None],
                run: Callable[[argparse.Namespace], int], argv: Sequence[str] | None = None) -> int:
    """Parse `argv` with txl's one-line-error parser and run; a user error (TxlError, a refused flag) is
    one line on stderr and exit 2, as with `txl` itself (`--debug` shows the traceback)."""
    from txl.cli.main import ArgumentMistake, Parser

    prog = f"python experiments/{name}.py"
    parser = Parser(prog=prog, description=description)
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    configure(parser)
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except ArgumentMistake as err:
        print(f"{prog}: error: {argument_line(str(err))}; see `{prog} --help`", file=sys.stderr)
        return 2
    try:
        return int(run(args) or 0)
    except TxlError as err:
        if args.debug:
            raise
        print(f"{prog}: error: {' '.join(str(err).split())}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def argument_line(message: str) -> str:
    """argparse's "argument --steps: must be >= 1, got 0" as txl states it: "--steps must be >= 1, got 0"."""
    message = " ".join(message.split())
    flag, sep, rest = message.partition(": must be ")
    if sep and flag.startswith("argument ") and " " not in flag.removeprefix("argument "):
        message = f"{flag.removeprefix('argument ').split('/')[-1]} must be {rest}"
    return message


def planned_run(argv: list[str], run_dir: Path, *, threads: int, fresh: bool, **fields) -> dict:
    """One planned `txl train` run for `train_variants` (arena, claims, recipes): its argv, its shell
    line and `fields`; marked finished (peak_rss_mb set) when `run_dir` holds a finished run of the
    same command, which is then reused instead of retrained (unless `fresh`)."""
    line = shell_line(argv, threads)
    item = {**fields, "argv": argv, "command": line, "run_dir": str(run_dir), "peak_rss_mb": None}
    stamp = None if fresh else finished_stamp(run_dir, line)
    if stamp:
        item["peak_rss_mb"] = stamp["peak_rss_mb"]
        print(f"reusing {run_dir.name}: {run_dir} (same command; --fresh retrains)")
    return item


def shell_line(argv: list[str], threads: int) -> str:
    return f"OMP_NUM_THREADS={threads} " + shlex.join(argv)


def read_record(path: Path) -> dict:
    """A JSON record of a finished run (result.json, run.json, arena.json), read bounded (txl.io)."""
    return read_json(path, what="run record", error=UsageError)


def read_records(path: Path) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    text = read_text(path, what="metrics log", limit=METRICS_LIMIT, error=UsageError)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def log_tail(path: str | Path) -> str:
    """The last line of a child's log, for the one-line error when it failed."""
    try:
        tail = read_bytes(path, what="log", limit=METRICS_LIMIT, error=UsageError).decode("utf-8", "replace")
    except TxlError:
        return "no output"
    lines = tail.strip().splitlines()
    return lines[-1] if lines else "no output"


def finished_stamp(run_dir: Path, line: str) -> dict | None:
    """The stamp of a run that finished with exactly this command line (reused instead of retrained)."""
    try:
        stamp = read_record(run_dir / "arena.json")
        result = read_record(run_dir / "result.json")
    except (OSError, ValueError, TxlError):
        return None
    finished = stamp.get("command") == line and stamp.get("peak_rss_mb") is not None and result.get("steps")
    return stamp if finished else None


def clear_for_training(run_dir: Path) -> None:
    """An arena run directory is retrained from scratch (--fresh, another command, or a run that was
    interrupted); anything else in the way is the user's and is left alone."""
    if not run_dir.exists():
        return
    if (run_dir / "arena.json").is_file():
        shutil.rmtree(run_dir)
    elif not run_dir.is_dir() or any(run_dir.iterdir()):
        raise UsageError(f"{run_dir} exists and is not an arena run directory; move it or pick another --runs")


def train_variants(plan: list[dict], args: argparse.Namespace, *, desc: str = "arena") -> None:
    """Run the planned trainings, `args.jobs` at a time; record each child's peak RSS (wait4)."""
    from tqdm.auto import tqdm

    todo = [p for p in plan if p.get("peak_rss_mb") is None]
    running: dict[int, tuple[dict, subprocess.Popen, object]] = {}
    bar = tqdm(total=len(todo), desc=desc, unit="run", dynamic_ncols=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    try:
        while todo or running:
            while todo and len(running) < args.jobs:
                item = todo.pop(0)
                run_dir = Path(item["run_dir"])
                clear_for_training(run_dir)
                run_dir.mkdir(parents=True, exist_ok=True)
                write_text(run_dir / "arena.json", json.dumps({"command": item["command"]}, indent=2) + "\n")
                log = create_log(run_dir.parent / f"{run_dir.name}.log")
                argv = [sys.executable, "-m", "txl", *item["argv"][1:]]
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
                running[proc.pid] = (item, proc, log)
                bar.write(f"started {item['name']}: {item['command']}")
            pid, status, usage = os.wait4(-1, 0)
            if pid not in running:
                continue
            item, proc, log = running.pop(pid)
            proc.returncode = os.waitstatus_to_exitcode(status)
            log.close()
            if proc.returncode != 0:
                raise UsageError(f"{desc} run {item['name']} failed (exit {proc.returncode}): "
                                 f"{log_tail(log.name)}; log {log.name}")
            item["peak_rss_mb"] = usage.ru_maxrss / 1024  # KiB on Linux
            write_text(Path(item["run_dir"]) / "arena.json", json.dumps(
                {"command": item["command"], "peak_rss_mb": item["peak_rss_mb"]}, indent=2) + "\n")
            bar.update(1)
            bar.write(f"finished {item['name']}")
    finally:
        for _, proc, log in running.values():
            proc.terminate()
            proc.wait()
            log.close()
        bar.close()
