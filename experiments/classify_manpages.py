"""Long-document classification on real documents: Debian's manual pages labelled by section (issue 47
item 3; the result is docs/results/classify.md).

    apt-get install -y manpages manpages-dev man-db     # the data source (Debian 12: 6.03-2)
    python experiments/classify_manpages.py build --dest /tmp/txl-manpages
    python experiments/classify_manpages.py run --dest /tmp/txl-manpages --seeds 1 2 3

An experiment, not part of the installed package: `build` writes a `docs:` collection outside the
checkout (nothing of it is committed), `run` drives the public command line (`txl train --objective
classify`, `txl eval --json`) and reads what the runs write.

The data: the section 2 (system calls), 3 (library functions) and 7 (overviews, conventions) pages that
the `manpages` and `manpages-dev` packages install (the files `dpkg -L` lists, so pages other packages add
to the same folders are left out; aliases, which Debian installs as symbolic links, are skipped), rendered to text by `man -l` (MANWIDTH=80, `col -bx`). The label must
not be in the text: the header line ("open(2)  System Calls Manual  open(2)") and the footer are dropped,
every section mark `name(N...)` becomes `name`, and `.so` stubs (one-line redirects to another page) are
skipped. Lines are stripped of their indentation and blank runs collapsed. At most `--per-label` pages per
section (a seeded sample), split 70/10/20 by a hash of the file name into train/valid/test.

The comparison: the same small model and budget, reading each document's first segment only
(`--set classifier_segments=first`) against reading the whole document segment by segment with the memory,
`--seeds` each; test accuracy and macro-F1, mean ± sample std and min-max.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

SECTIONS = {"2": "system-calls", "3": "library-functions", "7": "overviews"}
PACKAGES = ("manpages", "manpages-dev")
SECTION_MARK = re.compile(r"(\w[\w.+-]*)\(\d[a-zA-Z]*\)")


def package_pages() -> dict[str, list[Path]]:
    """The .gz pages of SECTIONS that PACKAGES install, per section."""
    listed = subprocess.run(["dpkg", "-L", *PACKAGES], capture_output=True, text=True, check=True).stdout.split()
    pages: dict[str, list[Path]] = {s: [] for s in SECTIONS}
    for name in listed:
        m = re.fullmatch(r"/usr/share/man/man(\d)/[^/]+\.gz", name)
        if m and m.group(1) in SECTIONS:
            pages[m.group(1)].append(Path(name))
    return {s: sorted(p) for s, p in pages.items()}


def is_stub(path: Path) -> bool:
    with gzip.open(path, "rt", errors="replace") as f:
        lines = [ln for ln in f.read(4096).splitlines() if ln.strip() and not ln.startswith('.\\"')]
    return len(lines) <= 2 and any(ln.startswith(".so ") for ln in lines)


def render(path: Path) -> str:
    """The page as plain text without its section: header/footer lines dropped, section marks removed."""
    env = {**os.environ, "MANWIDTH": "80", "MAN_KEEP_FORMATTING": "", "LANG": "C.UTF-8"}
    raw = subprocess.run(["man", "-l", str(path)], capture_output=True, env=env, timeout=60).stdout
    text = subprocess.run(["col", "-bx"], input=raw, capture_output=True, timeout=60).stdout.decode("utf-8", "replace")
    lines = [ln.strip() for ln in text.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    lines = lines[1:-1]  # "open(2)  System Calls Manual  open(2)" ... "Linux man-pages 6.03  2023-02-05  open(2)"
    out: list[str] = []
    for ln in lines:
        if ln or (out and out[-1]):
            out.append(SECTION_MARK.sub(r"\1", ln))
    return "\n".join(out).strip() + "\n"


def split_of(name: str) -> str:
    bucket = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little") % 100
    return "train" if bucket < 70 else "valid" if bucket < 80 else "test"


def build(args) -> None:
    dest = Path(args.dest)
    if dest.exists() and any(dest.iterdir()):
        sys.exit(f"{dest} is not empty; remove it or choose another --dest")
    rng = random.Random(0)
    counts: dict[str, dict[str, int]] = {}
    for section, pages in package_pages().items():
        pages = [p for p in pages if not p.is_symlink() and not is_stub(p)]  # aliases: links or .so redirects
        chosen = sorted(rng.sample(pages, min(args.per_label, len(pages))))
        label = f"{section}-{SECTIONS[section]}"
        counts[label] = {"installed (non-stub)": len(pages), "train": 0, "valid": 0, "test": 0}
        for page in chosen:
            text = render(page)
            if len(text) < 200:  # nothing but a name
                continue
            split = split_of(page.name)
            out = dest / split / label / (page.name.removesuffix(".gz") + ".txt")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
            counts[label][split] += 1
    (dest / "SOURCE.json").write_text(json.dumps({"packages": {p: package_version(p) for p in PACKAGES},
                                                  "counts": counts}, indent=2) + "\n")
    print(json.dumps(counts, indent=2))


def package_version(name: str) -> str:
    return subprocess.run(["dpkg-query", "-W", "-f=${Version}", name], capture_output=True, text=True).stdout


def cpu_load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.2f}/{five:.2f} (1/5 min) on {os.cpu_count()} cores"


def run(args) -> None:
    dest = Path(args.dest).absolute()
    data = f"docs:{dest}?max_tokens={args.max_tokens}"
    runs = Path(args.runs)
    model = ["--set", "model.n_layer=2", "--set", "model.d_model=64", "--set", "model.n_head=4", "--set",
             "model.d_head=16", "--set", "model.d_inner=128", "--set", f"model.mem_len={args.tgt_len}", "--set",
             "model.dropout=0.1", "--set", f"tgt_len={args.tgt_len}", "--set", f"batch_size={args.batch_size}",
             "--set", "eval_batch_size=16", "--set", f"eval_interval={max(args.steps // 4, 1)}", "--set", "lr=0.001",
             "--set", f"warmup_steps={args.steps // 10}"]
    rows = []
    for reading in ("first", "all"):
        for seed in args.seeds:
            out = runs / f"{reading}-seed{seed}"
            train = [sys.executable, "-m", "txl", "train", "--objective", "classify", "--data", data, "--seed",
                     str(seed), "--max-steps", str(args.steps), "--max-minutes", "0", "--out", str(out), "--threads", str(args.threads),
                     "--quiet", "--force", *model, "--set", f"classifier_segments={reading}"]
            load_before = cpu_load()
            start = time.time()
            subprocess.run(train, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            seconds = time.time() - start
            evaluate = [sys.executable, "-m", "txl", "eval", str(out), "--split", "test", "--json", "--threads",
                        str(args.threads)]
            scores = json.loads(subprocess.run(evaluate, check=True, capture_output=True, text=True,
                                               env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}).stdout)
            row = {"reading": reading, "seed": seed, "accuracy": scores["accuracy"], "macro_f1": scores["macro_f1"],
                   "documents": scores["documents"], "confusion": scores["confusion"], "labels": scores["labels"],
                   "train_seconds": round(seconds, 1), "load_before": load_before, "load_after": cpu_load(),
                   "command": "txl " + shlex.join(train[3:]), "eval": "txl " + shlex.join(evaluate[3:])}
            print(json.dumps({k: row[k] for k in ("reading", "seed", "accuracy", "macro_f1", "train_seconds",
                                                   "load_after")}), flush=True)
            rows.append(row)
    write_results(args, data, rows)


def summary(values: list[float]) -> str:
    mean = statistics.mean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.3f} ± {std:.3f} ({min(values):.3f}-{max(values):.3f})"


def write_results(args, data: str, rows: list[dict]) -> None:
    source = json.loads((Path(args.dest) / "SOURCE.json").read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: getattr(args, k) for k in ("steps", "tgt_len", "max_tokens", "batch_size", "threads", "seeds")}
    (out / "classify.json").write_text(json.dumps({"data": data, "source": source, "settings": settings,
                                                   "runs": rows}, indent=2) + "\n")
    by = {r: [x for x in rows if x["reading"] == r] for r in ("first", "all")}
    names = {"first": "first segment only (no memory)", "all": "whole document, segment by segment with memory"}
    table = ["| reading | seeds | test accuracy: mean ± std (min-max) | test macro-F1: mean ± std (min-max) | "
             "train time per run |", "|---|---|---|---|---|"]
    for reading, group in by.items():
        if group:
            table.append(f"| {names[reading]} | {', '.join(str(g['seed']) for g in group)} | "
                         f"{summary([g['accuracy'] for g in group])} | {summary([g['macro_f1'] for g in group])} | "
                         f"{statistics.mean(g['train_seconds'] for g in group):.0f} s |")
    diff = ""
    if by["first"] and by["all"]:
        diffs = [a["accuracy"] - f["accuracy"] for a, f in zip(by["all"], by["first"])]
        diff = f"Accuracy difference (memory - first segment), paired by seed: **{summary(diffs)}**.\n"
    counts = source["counts"]
    lines = [
        "# Long-document classification: Debian manual pages by section", "",
        "Issue 47 item 3. The same small Transformer-XL classifier reads each manual page either through its "
        "first segment only (`--set classifier_segments=first`: no memory, what a fixed-context classifier "
        "sees) or whole, segment by segment with the memory carrying the earlier segments, and is classified "
        "from its last segment (mean of the final hidden states). Written by `experiments/classify_manpages.py`.",
        "", "## Result (test split)", "", *table, "", diff,
        "## Data", "",
        f"- Source: the Debian packages {', '.join(f'`{p}` {v}' for p, v in source['packages'].items())} "
        "(`apt-get install -y manpages manpages-dev man-db`), the pages of sections 2 (system calls), 3 (library "
        "functions) and 7 (overviews) that they install; aliases (symbolic links and `.so` stubs) skipped; at most "
        "200 pages per section (seeded sample); rendered by `man -l` (MANWIDTH=80, `col -bx`).",
        "- The label is not in the text: the header line (\"open(2)  System Calls Manual  open(2)\") and the footer "
        "are dropped and every section mark `name(N)` becomes `name`.",
        "- Split 70/10/20 by a hash of the file name: " + "; ".join(
            f"{label}: {c['train']}/{c['valid']}/{c['test']} (of {c['installed (non-stub)']} installed)"
            for label, c in counts.items()) + " (train/valid/test).",
        f"- Read as bytes, each page cut to its first {args.max_tokens} bytes (`docs:DIR?max_tokens={args.max_tokens}`): "
        f"at most {args.max_tokens // args.tgt_len} segments of {args.tgt_len}.",
        "", "## Model and budget", "",
        f"- 2 layers, d_model 64, 4 heads of 16, d_inner 128, dropout 0.1, tgt_len = mem_len = {args.tgt_len}; "
        f"{args.steps} steps of {args.batch_size} documents, Adam lr 1e-3 with {args.steps // 10} warm-up steps, cosine schedule, no time "
        f"budget (the same steps for both readings), validated every {max(args.steps // 4, 1)} steps; the checkpoint with the best valid loss is scored on test.",
        f"- CPU, {args.threads} torch thread per run, runs one after another; the machine was shared with other "
        f"work: load average before/after each run in `classify.json` (first run: {rows[0]['load_before']}; last: "
        f"{rows[-1]['load_after']}). Times are wall clock under that load, not benchmarks.",
        "", "## Commands", "", "```bash",
        "apt-get install -y manpages manpages-dev man-db",
        f"python experiments/classify_manpages.py build --dest {args.dest}",
        f"python experiments/classify_manpages.py run --dest {args.dest} --seeds {' '.join(map(str, args.seeds))} "
        f"--steps {args.steps}",
        "# each run is:", rows[0]["command"], rows[-1]["command"], rows[-1]["eval"], "```", ""]
    (out / "classify.md").write_text("\n".join(lines))
    print("\n".join(table) + "\n" + diff)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="render the pages into a docs: collection")
    b.add_argument("--dest", default="/tmp/txl-manpages")
    b.add_argument("--per-label", type=int, default=200)
    r = sub.add_parser("run", help="train and evaluate first-segment vs whole-document readers")
    r.add_argument("--dest", default="/tmp/txl-manpages")
    r.add_argument("--runs", default="/tmp/txl-manpages-runs")
    r.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs" / "results"))
    r.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    r.add_argument("--steps", type=int, default=600)
    r.add_argument("--tgt-len", type=int, default=128)
    r.add_argument("--max-tokens", type=int, default=2048)
    r.add_argument("--batch-size", type=int, default=8)
    r.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    build(args) if args.command == "build" else run(args)


if __name__ == "__main__":
    main()
