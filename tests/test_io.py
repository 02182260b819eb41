"""txl.io: the one link-safe writer and the one bounded reader, and the source rule that every file txl
touches goes through them (issue 50: writes through links, unbounded readers, FIFOs that hang)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from helpers import hang_guard
from txl.errors import CheckpointError, DataError, OutputError
from txl.io import (
    CONFIG_LIMIT,
    open_append,
    open_regular,
    read_bytes,
    read_json,
    read_text,
    write_bytes,
    write_json,
    write_text,
)
from txl.io.rundir import LOCK_NAME, RunLock

SRC = Path(__file__).resolve().parent.parent / "src" / "txl"




# ---------------------------------------------------------------------------------------------
# Reading


def test_a_fifo_is_refused_at_once_in_one_line(tmp_path):
    fifo = tmp_path / "run.json"
    os.mkfifo(fifo)
    for read in (lambda: read_json(fifo, what="run record"), lambda: read_text(fifo, limit=100),
                 lambda: read_bytes(fifo, limit=100)):
        with hang_guard(), pytest.raises((DataError, CheckpointError), match="is a FIFO, not a regular file") as err:
            read()
        assert "\n" not in str(err.value) and str(fifo) in str(err.value)


def test_a_device_is_refused(tmp_path):
    with pytest.raises(DataError, match="a character device"):
        read_bytes("/dev/zero", limit=10, follow_links=True)


def test_a_directory_is_refused(tmp_path):
    with pytest.raises(DataError, match="a directory"):
        read_bytes(tmp_path, limit=10)


def test_size_is_checked_before_reading(tmp_path):
    sparse = tmp_path / "config.json"
    with open(sparse, "wb") as f:  # a sparse 1 GiB file: nothing is stored, a whole read would cost 1 GiB
        f.truncate(2**30)
    with pytest.raises(CheckpointError, match=r"is 1 GiB, more than the 4 MiB txl reads"):
        read_json(sparse, what="model config")
    write_text(sparse, "{}")
    assert read_json(sparse) == {}


def test_links_are_followed_only_when_asked(tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text('{"a": 1}')
    link = tmp_path / "config.json"
    link.symlink_to(target)
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        read_json(link)
    assert read_json(link, follow_links=True) == {"a": 1}  # a path the user typed may be a link


def test_json_damage_is_one_line(tmp_path):
    cases = {"dup": '{"n": 1, "n": 2}', "deep": "[" * 100_000 + "]" * 100_000, "bad": "{", "notutf8": b"{\xff}"}
    for name, text in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(CheckpointError) as err:
            read_json(path, what="state")
        assert "\n" not in str(err.value) and len(str(err.value)) < 400, name


def test_missing_file_names_it(tmp_path):
    with pytest.raises(DataError, match="vocabulary not found"):
        open_regular(tmp_path / "vocab.json", what="vocabulary")


def test_limit_constant_is_what_configs_get():
    assert CONFIG_LIMIT == 4 * 2**20


# ---------------------------------------------------------------------------------------------
# Writing


def test_a_write_never_goes_through_a_link(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / "sample.txt").symlink_to(outside)
    for write in (lambda p: write_text(p, "x"), lambda p: write_bytes(p, b"x"), lambda p: write_json(p, {})):
        with pytest.raises(OutputError, match="is a symbolic link"):
            write(run / "sample.txt")
    assert outside.read_text() == "precious"


def test_a_write_replaces_a_hard_link_instead_of_changing_its_other_name(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    os.link(outside, run / "result.json")
    write_json(run / "result.json", {"ok": True})
    assert outside.read_text() == "precious" and read_json(run / "result.json") == {"ok": True}


def test_append_refuses_a_hard_link_and_a_fifo(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    os.link(outside, run / "metrics.jsonl")
    with pytest.raises(OutputError, match="2 hard links"):
        open_append(run / "metrics.jsonl")
    os.mkfifo(run / "log")
    with hang_guard(), pytest.raises(OutputError, match="FIFO"):
        open_append(run / "log")
    assert outside.read_text() == "precious"


def test_a_hard_linked_lock_is_never_truncated(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious data, not a pid")
    run = tmp_path / "run"
    run.mkdir()
    os.link(outside, run / LOCK_NAME)
    with pytest.raises(OutputError, match="hard links"):
        RunLock.acquire(run)
    assert outside.read_text() == "precious data, not a pid"


def test_a_fifo_lock_does_not_hang(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / LOCK_NAME)
    with hang_guard(), pytest.raises(OutputError, match="FIFO"):
        RunLock.acquire(run)


# ---------------------------------------------------------------------------------------------
# The source rule: no file is opened, read or written outside txl.io except through it


# `open(...)`, and these methods called on anything: the path methods that open a file themselves
# (following links, reading without bound) and matplotlib's savefig to a path.
FORBIDDEN_METHODS = {"write_text", "write_bytes", "read_text", "read_bytes", "savefig"}


def unguarded_io(source: str) -> list[str]:
    """'LINE: call' for each file access in `source` that bypasses txl.io."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "open":
            found.append(f"{node.lineno}: open(...)")
        elif isinstance(func, ast.Attribute) and func.attr in FORBIDDEN_METHODS:
            if func.attr == "savefig" and node.args and _is_buffer(node.args[0]):
                continue
            found.append(f"{node.lineno}: .{func.attr}(...)")
        elif (isinstance(func, ast.Attribute) and func.attr == "load" and isinstance(func.value, ast.Name)
              and func.value.id == "json"):
            found.append(f"{node.lineno}: json.load(...)")
    return found


def _is_buffer(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("buffer", "buf")


def test_every_file_access_goes_through_txl_io():
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if path.parent.name == "io" and path.parent.parent == SRC:
            continue
        offenders += [f"{path.relative_to(SRC.parent)}:{hit}" for hit in unguarded_io(path.read_text())]
    assert not offenders, "file access outside txl.io (use its writer and reader):\n" + "\n".join(offenders)


@pytest.mark.parametrize("planted", [
    'Path("x").write_text("y")',
    'open("x", "w").write("y")',
    'fig.savefig(out / "plot.png")',
    'json.load(open("x"))',
    'text = path.read_text()',
])
def test_a_planted_bare_access_is_found(planted):
    assert unguarded_io(f"from pathlib import Path\nimport json\n\ndef f(path, fig, out):\n    {planted}\n")
    assert not unguarded_io("from txl.io import write_text\n\ndef f(path):\n    write_text(path, 'y')\n")
