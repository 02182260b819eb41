"""txl keeps freed memory in the process on glibc (txl/allocator.py): set once, reported, and off on request."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

PROBE = """
import json
from txl.allocator import freed_memory_kept, keep_freed_memory
before = freed_memory_kept()
first, second = keep_freed_memory(), keep_freed_memory()
from txl.bench.common import machine
print(json.dumps({"before": before, "first": first, "second": second, "after": freed_memory_kept(),
                  "machine": machine()["allocator"]}))
"""


def probe(**env) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not GLIBC, reason="glibc only")
@pytest.mark.slow
def test_thresholds_are_set_once_and_reported():
    seen = probe(TXL_SYSTEM_MALLOC="")
    assert seen["before"] is False and seen["first"] is True and seen["second"] is True and seen["after"] is True
    assert "freed memory kept" in seen["machine"]


@pytest.mark.slow
def test_system_malloc_leaves_the_c_library_alone():
    seen = probe(TXL_SYSTEM_MALLOC="1")
    assert seen["first"] is False and seen["after"] is False
    assert seen["machine"] == "the C library's defaults"


@pytest.mark.skipif(not GLIBC, reason="glibc only")
@pytest.mark.slow
def test_every_txl_command_sets_it():
    code = ("import sys, txl.cli.main, txl.allocator as a; txl.cli.main.main(['data', 'list']); "
            "print('kept' if a.freed_memory_kept() else 'not kept', file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TXL_SYSTEM_MALLOC": ""},
                         capture_output=True, text=True, check=True)
    assert out.stderr.strip().endswith("kept") and "not kept" not in out.stderr
