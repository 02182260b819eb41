"""Fixtures and rules shared by the test modules (pytest loads this file for every test under tests/).

Two tiers, one marker (issue 45):

    pytest -m "not slow"    the fast tier, what you run while working: in-process tests only, on up to
                            four pytest-xdist workers (one per CPU this process may use); under 2 minutes
                            on 2 cores
    pytest                  the whole suite, what CI (.ci/run) and the README run: every test, on the same
                            workers (whole files per worker; 15 minutes on 2 cores where one process took
                            22-23); `pytest -n 0` runs it in one process

`slow` marks what a developer need not wait for on every change: a test that starts a Python process or
forks (the `txl` command line as a process, DDP, process-wide limits, `torch.compile`'s workers, the
browser), a whole journey (train, evaluate, generate, resume) and more than MAX_FAST_STEPS optimizer steps.
Each behaviour keeps a cheaper test in the fast tier: HF parity, fast = eager, segments with memory = one
long pass, resume, bad inputs (the in-process cases of tests/test_robustness.py), the package layout.
This file enforces the rule: a test without the marker that starts a Python process, forks, or steps an
optimizer more than MAX_FAST_STEPS times fails and says to mark it. A parametrized case that needs the
marker while its siblings do not is listed in SLOW_CASES.

Outcomes never depend on the machine's speed: budgets are steps, not minutes (a `max_minutes` test injects
its clock), subprocess timeouts are hang guards; numeric tolerances follow the dtype's rounding, not one
CPU's (tests/test_linear_fast.py). Every test runs with one intra-op torch thread (below).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from txl import TransformerXLConfig

TINY = dict(vocab_size=61, n_layer=2, d_model=32, n_head=4, d_head=8, d_inner=48, mem_len=8, dropout=0.0)

# More optimizer steps than this in one test (its fixtures' set-up included) belong in the slow tier. The
# fast tier's largest trainers take 150 steps of a tiny model (a copy task learned, tests/test_seq2seq.py).
MAX_FAST_STEPS = 200

# Cases of a parametrized test that start a process while the test's other cases do not
SLOW_CASES = {
    "tests/test_robustness.py::test_bad_input[file-size-limit]",  # `txl train` under RLIMIT_FSIZE
    "tests/test_robustness.py::test_bad_input[out-locked]",  # a second process holds the lock
    "tests/test_robustness.py::test_bad_input[run-locked]",
}

# Both tiers run on this many pytest-xdist workers at most: each imports torch and collects the
# suite (seconds), so more workers than this gain little on ~2,000 tests of a fraction of a second.
MAX_WORKERS = 4


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """`pytest` and `pytest -m "not slow"` as typed (or on folders) run on pytest-xdist workers, whole files
    per worker (module fixtures build their tiny runs once); `-n N` (`-n 0`: one process), `-p no:xdist`,
    test files or node ids named on the command line, or any other `-m` keep pytest's own behaviour."""
    option = config.option
    if (" ".join(str(getattr(option, "markexpr", "")).split()) not in ("not slow", "")
            or not config.pluginmanager.hasplugin("xdist") or os.environ.get("PYTEST_XDIST_WORKER")
            or getattr(option, "numprocesses", 0) is not None or getattr(option, "tx", None)
            or option.collectonly or option.usepdb
            or any(".py" in arg for arg in config.args)):
        return
    workers = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
                  MAX_WORKERS)
    if workers > 1:
        option.numprocesses = workers
        if option.dist == "no":
            option.dist = "loadfile"


def pytest_configure(config):
    # Tiny tensors gain nothing from intra-op threads, and on a busy machine every parallel region of the
    # many small ops waits for a descheduled thread (measured: minutes instead of seconds; the fast tier
    # spent 4-5x the CPU at torch's default of one thread per core).
    torch.set_num_threads(1)
    # The same for `txl` commands, in this process and in the ones a test starts: txl's own thread count
    # follows the machine's load (txl.cli.arguments.default_threads), so two runs that a test compares
    # bit for bit (a run and its resumed copy) could get 1 and 2 threads on a busy machine and differ in
    # the last bits; with OMP_NUM_THREADS set the environment decides, the same for every run. A test of
    # txl's own choice removes it (tests/test_demo.py).
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # before `-m` deselects
    for item in items:
        if item.nodeid in SLOW_CASES:
            item.add_marker(pytest.mark.slow)


# ---------------------------------------------------------------------------------------------
# The tier rule, checked on every test without the slow marker


class _Work:
    """What the running test started: Python processes and forks, optimizer steps."""

    processes: list[str] = []
    steps = 0


def _is_python(args, executable) -> bool:
    program = executable or (args if isinstance(args, (str, bytes, os.PathLike)) else args[0])
    name = Path(os.fsdecode(program)).name
    return os.fsdecode(program) == sys.executable or name.startswith("python") or name == "txl"


_execute_child = subprocess.Popen._execute_child


def _counting_execute_child(self, args, executable, *rest, **kwargs):
    if _is_python(args, executable):
        _Work.processes.append(" ".join(map(os.fsdecode, args)) if isinstance(args, (list, tuple)) else str(args))
    return _execute_child(self, args, executable, *rest, **kwargs)


subprocess.Popen._execute_child = _counting_execute_child
os.register_at_fork(before=lambda: _Work.processes.append("os.fork()"))
register_optimizer_step_post_hook(lambda *_: setattr(_Work, "steps", _Work.steps + 1))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    _Work.processes, _Work.steps = [], 0
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    if item.get_closest_marker("slow") is None:
        where = "@pytest.mark.slow" + (f" (or its id in SLOW_CASES, {__file__})" if "[" in item.name else "")
        if _Work.processes:
            raise pytest.fail.Exception(
                f"{item.nodeid} starts a Python process or forks ({_Work.processes[0][:120]}): the fast tier is "
                f"in-process; mark it {where}", pytrace=False)
        if _Work.steps > MAX_FAST_STEPS:
            raise pytest.fail.Exception(
                f"{item.nodeid} takes {_Work.steps} optimizer steps, more than the fast tier's {MAX_FAST_STEPS}: "
                f"fewer steps, or mark it {where}", pytrace=False)
    return result


# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """A test may set its own thread count (an in-process `txl` command applies `--threads`); the next
    test starts at one again."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`): the
    session's setting since the test tiers (pytest_configure above); kept for the modules that name it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny():
    """`tiny(**overrides)`: a small TransformerXLConfig (2 layers, d_model 32, 4 heads, no dropout)."""

    def make(**overrides) -> TransformerXLConfig:
        return TransformerXLConfig(**{**TINY, **overrides})

    return make
