"""`pydoc-summaries`: a real summarisation set that every machine has offline.

From each function and method of the interpreter's standard library that has a docstring: source = the
function's code with its docstring removed (signature and body, dedented), target = the first line of the
docstring (its summary line, PEP 257). Test packages (`test`, `tests`, `idlelib/idle_test`) are left out,
as are summaries shorter than 3 words and functions whose body is only the docstring. Pairs are split by
module (sha256 of the module's relative path, as the `builtin` corpus: <90 train, <95 valid, else test),
so no module's functions are both trained on and tested. `pydoc_pairs()` caches the pairs as JSONL under
the data cache (`txl data prepare pydoc-summaries` builds it), keyed by Python version and library path.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import sys
import textwrap
import warnings
from pathlib import Path

from txl.data.cache import cache_root
from txl.data.readers import stdlib_files, stdlib_split
from txl.errors import DataError, parse_json
from txl.io import read_text, write_text

SOURCE_LIMIT = 64 << 20  # one standard-library file (the largest is under 1 MB)
CACHE_LIMIT = 512 << 20  # the cached pairs (about 20 MB for CPython 3.11)

VERSION = 1
SKIP_PARTS = {"test", "tests", "idle_test"}


def _summary(docstring: str) -> str:
    for line in docstring.strip().splitlines():
        line = " ".join(line.split())
        if line:
            return line
    return ""


def function_pairs(path: Path) -> list[tuple[str, str, str]]:
    """(source without docstring, summary line, function name) of every documented function in a file."""
    try:
        text = read_text(path, what="standard-library file", limit=SOURCE_LIMIT, follow_links=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in old modules
            tree = ast.parse(text)
    except (DataError, SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node, clean=True)
        if not doc or len(node.body) < 2:
            continue
        summary = _summary(doc)
        if len(summary.split()) < 3:
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        doc_node = node.body[0]
        kept = lines[first - 1: doc_node.lineno - 1] + lines[doc_node.end_lineno: node.end_lineno]
        source = textwrap.dedent("\n".join(kept)).strip("\n")
        if source:
            out.append((source, summary, node.name))
    return out


def build_pairs() -> dict[str, list[dict]]:
    root, files = stdlib_files()
    splits: dict[str, list[dict]] = {"train": [], "valid": [], "test": []}
    for path in files:
        rel = path.relative_to(root).as_posix()
        if SKIP_PARTS & set(rel.split("/")[:-1]) or rel.startswith("test_") or "/test_" in rel:
            continue
        split = stdlib_split(rel)
        for source, summary, name in function_pairs(path):
            splits[split].append({"source": source, "target": summary, "name": name, "module": rel})
    if not splits["train"]:
        raise DataError(f"pydoc-summaries: no documented functions found under {root}")
    return splits


def cache_file() -> Path:
    root, _ = stdlib_files()
    key = hashlib.sha256(f"{VERSION}:{root}:{sys.version}".encode()).hexdigest()[:16]
    return cache_root(None) / "pairs" / f"pydoc-summaries-{key}.jsonl"


def prepare(force: bool = False) -> tuple[Path, dict[str, int]]:
    """Build (or reuse) the cached JSONL: one object per pair with its split."""
    path = cache_file()
    if path.is_file() and not force:
        counts: dict[str, int] = {}
        for row in _read(path):
            counts[row["split"]] = counts.get(row["split"], 0) + 1
        return path, counts
    splits = build_pairs()
    body = "".join(json.dumps({**row, "split": split}, ensure_ascii=False) + "\n"
                   for split, rows in splits.items() for row in rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, body)
    return path, {split: len(rows) for split, rows in splits.items()}


def _read(path: Path) -> list[dict]:
    fix = "run `txl data prepare pydoc-summaries --force`"
    try:
        text = read_text(path, what="the pydoc-summaries cache", limit=CACHE_LIMIT)
    except DataError as err:
        raise DataError(f"{err}; {fix}") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line:
            continue
        try:
            row = parse_json(line)
        except (ValueError, RecursionError) as err:
            raise DataError(f"the pydoc-summaries cache {path} is damaged (line {n}: {str(err)[:100]}); {fix}") from None
        if not (isinstance(row, dict) and row.get("split") in ("train", "valid", "test")
                and all(isinstance(row.get(k), str) for k in ("source", "target", "name", "module"))):
            raise DataError(f"the pydoc-summaries cache {path} is damaged (line {n} is not a pair); {fix}")
        rows.append(row)
    return rows


def pydoc_rows() -> dict[str, list[dict]]:
    path, _ = prepare()
    out: dict[str, list[dict]] = {"train": [], "valid": [], "test": []}
    for row in _read(path):
        out[row["split"]].append(row)
    return out


def pydoc_pairs() -> dict[str, list[tuple[str, str]]]:
    return {split: [(r["source"], r["target"]) for r in rows] for split, rows in pydoc_rows().items()}


def name_baseline(corpus, split: str, max_pairs: int = 0) -> list[str]:
    """The trivial summary of each pair of `split`: its function's name split into words
    (`read_config_file` -> "read config file"), in the corpus's order."""
    names = {(r["source"], r["target"]): r["name"] for r in pydoc_rows()[split]}
    texts = corpus.references(split)
    texts = texts[:max_pairs] if max_pairs else texts
    return [split_identifier(names.get(pair, "")) for pair in texts]


def split_identifier(name: str) -> str:
    """`read_config_file` / `readConfigFile` -> "read config file": the trivial summary baseline."""
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name.strip("_")).replace("_", " ").split()
    return " ".join(w.lower() for w in words)
