"""The vocab.pkl reader is bounded in work, not only in bytes (issue 50): opcodes, containers (empty ones
counted), the stack, the memo, nesting depth, shared-reference expansion and the hashing of keys all have
limits, and an error message quotes at most a short summary of a value.

The three files of the second hostile review run in a child process (no torch; an address-space limit
and a 60 s timeout only guard the machine and the test run): each ends in one refusal line while Python's
allocations (tracemalloc) stay under 300 MB. The work bounds are asserted through the reader's own
counters, never through wall-clock time."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import txl.io.plain_pickle as P
from txl.data.hf_vocab import read_hf_vocab
from txl.errors import CheckpointError
from txl.io.plain_pickle import PickleRefused, read_plain_pickle

MB = 1 << 20

# ---------------------------------------------------------------------------------------------
# The hostile files (each is valid pickle: the standard unpickler builds it, sharing every level)


def shared_tuple_key_bomb(levels: int = 23, dicts: int = 850) -> bytes:
    """~6 KB: T_0 = ('a', 'a'), T_i = (T_{i-1}, T_{i-1}) by memo reference, then `dicts` fresh dicts each
    keyed by T_levels. A tuple does not cache its hash: each key costs 2**(levels + 2) steps to hash."""
    out = bytearray(b"\x80\x04\x8c\x01a2\x86\x940")  # 'a' DUP TUPLE2 MEMOIZE(0) POP
    for level in range(1, levels + 1):
        out += b"h" + bytes([level - 1]) + b"h" + bytes([level - 1]) + b"\x86\x940"
    out += (b"}h" + bytes([levels]) + b"K\x01s0") * dicts  # EMPTY_DICT, key, 1, SETITEM, POP
    return bytes(out + b"N.")


def empty_set_bomb(count: int = 10_000_000) -> bytes:
    """10 MB of EMPTY_SET: each opcode allocates a set (~200 bytes): 3.1 GB before any item limit."""
    return b"\x80\x04" + b"\x8f" * count + b"."


def long_error_line_bomb(levels: int = 23) -> bytes:
    """250 bytes (the review's file had 231): {'idx2sym': ['a'], 'lower_case': L} with L_0 = ['a', 'a'] and
    L_i = [L_{i-1}, L_{i-1}] by memo reference; quoting L with repr() writes 2**(levels + 1) strings (100 MB
    at 23 levels)."""
    out = bytearray(b"\x80\x04}\x94(")  # EMPTY_DICT MEMOIZE(0) MARK
    out += b"\x8c\x07idx2sym(\x8c\x01al"  # 'idx2sym': ['a']
    out += b"\x8c\x0alower_case]\x94(\x8c\x01a\x8c\x01ae"  # 'lower_case': L_0 = ['a', 'a'] (memo 1)
    for level in range(1, levels + 1):  # memo level + 1 holds L_level
        out += b"0]\x94(h" + bytes([level]) + b"h" + bytes([level]) + b"e"
    return bytes(out + b"u.")


def _expanded(data: bytes) -> object:
    return pickle.loads(data)  # noqa: S301 - our own bytes, built above


def test_the_hostile_files_are_what_the_review_describes():
    assert len(shared_tuple_key_bomb()) < 6200 and len(long_error_line_bomb()) <= 250
    tuples = _expanded(shared_tuple_key_bomb(levels=3, dicts=2))
    assert tuples is None
    state = _expanded(long_error_line_bomb(levels=2))
    assert state["idx2sym"] == ["a"] and state["lower_case"] == [[["a", "a"]] * 2] * 2


# ---------------------------------------------------------------------------------------------
# Each ends in one line, in a child that could not take the machine down

CHILD = r"""
import json, resource, sys, time, tracemalloc
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # a guard for the machine, not the assertion
from txl.errors import TxlError
from txl.data.hf_vocab import read_hf_vocab
path = sys.argv[1]
tracemalloc.start()
start = time.process_time()
try:
    read_hf_vocab(path)
    message = None
except TxlError as err:
    message = str(err)
print(json.dumps({"message": message, "peak_mb": tracemalloc.get_traced_memory()[1] / 2**20,
                  "cpu_s": time.process_time() - start}))
"""


def _read_in_child(tmp_path: Path, data: bytes) -> dict:
    path = tmp_path / "vocab.pkl"
    path.write_bytes(data)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=60,
                          env=env)  # the timeout is a hang guard only
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize(
    ("bomb", "why"),
    [
        (shared_tuple_key_bomb, "pickle bomb"),
        (lambda: shared_tuple_key_bomb(levels=21), "key or set member of more than 1,000 items"),  # within MAX_ITEMS
        (empty_set_bomb, "containers"),
        (long_error_line_bomb, "pickle bomb"),
        (lambda: long_error_line_bomb(levels=20), "'lower_case' is [["),  # within the bounds: quoted, briefly
    ],
    ids=["6KB-shared-tuple-keys", "6KB-shared-tuple-keys-21-levels", "10MB-of-EMPTY_SET", "231B-100MB-error-line", "error-line-within-bounds"],
)
@pytest.mark.slow
def test_the_review_files_end_in_one_short_line_under_300_mb(tmp_path, bomb, why):
    got = _read_in_child(tmp_path, bomb())
    message = got["message"]
    assert message is not None and why in message, message and message[:300]
    assert "\n" not in message and len(message) < 400 + len(str(tmp_path)), len(message)
    assert got["peak_mb"] < 300, got


# ---------------------------------------------------------------------------------------------
# Each bound on its own (small limits patched in where a real-sized file would be slow)


def _laughs_key(levels: int) -> bytes:
    """{T_levels: 1} where T_0 = ('a', 'a') and T_i = (T_{i-1}, T_{i-1}): one key of 2**(levels+2)-1 items."""
    out = bytearray(b"\x80\x04}\x8c\x01a2\x86\x94")
    for level in range(1, levels + 1):
        out += b"0h" + bytes([level - 1]) + b"h" + bytes([level - 1]) + b"\x86\x94"
    return bytes(out + b"K\x01s.")


def test_a_large_key_is_refused_before_it_is_hashed(monkeypatch):
    hashed = []
    real = P._hash_each
    monkeypatch.setattr(P, "_hash_each", lambda items: hashed.extend(items) or real(items))
    assert read_plain_pickle(_laughs_key(7)) == {_expanded(_laughs_key(7)).popitem()[0]: 1}  # 511 items: a key
    hashed.clear()
    with pytest.raises(PickleRefused, match=r"a dictionary key or set member of more than 1,000 items"):
        read_plain_pickle(_laughs_key(8))  # 1,023 items
    assert hashed == [], "the key was hashed before its size was checked"


def test_the_total_hashing_work_is_bounded(monkeypatch):
    monkeypatch.setattr(P, "MAX_HASHED", 10_000)
    data = bytearray(b"\x80\x04\x8c\x01a2\x86\x94")  # T_0, memo 0
    for level in range(1, 6):  # T_5: 127 items
        data += b"0h" + bytes([level - 1]) + b"h" + bytes([level - 1]) + b"\x86\x94"
    data += b"0" + b"}h\x05K\x01s0" * 100 + b"N."  # 100 fresh dicts keyed by T_5: 12,700 items hashed
    with pytest.raises(PickleRefused, match=r"hashes more than 10,000 key items"):
        read_plain_pickle(bytes(data))


@pytest.mark.parametrize(
    ("limit", "value", "data", "why"),
    [
        ("MAX_OPS", 1000, b"\x80\x04" + b"N0" * 600 + b"N.", "more than 1,000 opcodes"),
        ("MAX_CONTAINERS", 100, b"\x80\x04" + b")0" * 101 + b"N.", "more than 100 containers"),  # empty tuples
        ("MAX_CONTAINERS", 100, b"\x80\x04" + b"]0" * 101 + b"N.", "more than 100 containers"),
        ("MAX_STACK", 100, b"\x80\x04" + b"N" * 101 + b"0" * 100 + b".", "more than 100 objects on its stack"),
        ("MAX_MEMO", 100, b"\x80\x04" + b"N\x94" * 101 + b"0" * 100 + b".", "more than 100 memo entries"),
    ],
    ids=["opcodes", "empty-tuples", "empty-lists", "stack", "memo"],
)
def test_each_count_has_a_limit(monkeypatch, limit, value, data, why):
    monkeypatch.setattr(P, limit, value)
    pickle.loads(data)  # noqa: S301 - valid pickle, refused for its size alone
    with pytest.raises(PickleRefused, match=why):
        read_plain_pickle(data)


def test_the_limits_leave_room_for_the_largest_published_vocabulary():
    """transfo-xl-wt103's vocab.pkl (267,735 symbols, 8 MB in the 4.35 layout) needs about 1.6M opcodes, 99
    containers, 268k memo entries and 1.3M expanded items; lm1b's 793k words about three times that."""
    assert P.MAX_OPS >= 3 * 3 * 1_610_000 and P.MAX_MEMO >= 3 * 3 * 268_140 and P.MAX_ITEMS >= 3 * 3 * 1_340_000
    assert P.MAX_CONTAINERS >= 1000 and P.MAX_STACK >= 10_000


def test_quoted_names_are_truncated():
    module = "m" * 200_000
    data = b"\x80\x04\x8d" + len(module).to_bytes(8, "little") + module.encode() + b"\x8c\x01f\x93N."
    with pytest.raises(PickleRefused) as caught:
        read_plain_pickle(data)
    assert "unpickling it could run code" in str(caught.value) and len(str(caught.value)) < 300


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("x" * 10_000, "'xxxxxxxx"),
        (list(range(10_000)), "[0, 1, 2, 3, ...]"),
        ({"a": {"b": {"c": {"d": 1}}}}, "{'a': {'b': {...}}}"),
        (b"\x00" * 1000, "b'\\x00"),
    ],
    ids=["str", "list", "dict", "bytes"],
)
def test_values_are_quoted_briefly(value, shown):
    text = P.brief(value)
    assert text.startswith(shown) and len(text) <= P.BRIEF_CHARS, text


def test_an_hf_setting_of_the_wrong_type_is_quoted_briefly(tmp_path):
    state = {"idx2sym": ["a", "b"], "lower_case": [["x" * 1000] * 1000] * 1000}
    (tmp_path / "vocab.pkl").write_bytes(pickle.dumps(state, protocol=4))
    with pytest.raises(CheckpointError, match=r"'lower_case' is \[\['xxx") as caught:
        read_hf_vocab(tmp_path / "vocab.pkl")
    assert len(str(caught.value)) < 300 + len(str(tmp_path))
