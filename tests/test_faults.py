"""SIGKILL at random points of a training run: `--resume` always works, the continued losses equal an
uninterrupted run's bit for bit (CPU), and the checkpoint directory is never left half-written.

One run of a tiny model that checkpoints every step is killed again and again, each time resumed with
`txl train --resume`. Where each kill lands is drawn from a seeded RNG: inside a training step, half-way
through a safetensors or JSON file, between the two renames that swap a checkpoint in, before the old
checkpoint is deleted, half-way through a metrics line, or after a random delay (wall clock). The
event kills are injected by a small harness that wraps one library call and SIGKILLs its own process
at the n-th call, so they land at the same place on every machine; txl itself has no test hooks.

Every `txl train` session is a process of its own, forked from a server that imported torch and txl
once (and ran no torch op, so forking is safe): the same `txl.cli.main.main` a user runs, without paying
the interpreter start-up and torch import a dozen times.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import helpers
from helpers import saved_step, train_losses, write_config
from txl.models.pretrained import load_tensors
from txl.train import LAST, STATE_FILE

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork (POSIX)")]
corpus, cache_dir = helpers.corpus, helpers.cache_dir  # fixtures

# A fork server: for each JSON command on stdin it forks a child that arranges for SIGKILL at the
# n-th occurrence of one event, then runs `txl.cli.main.main(argv)`; it answers with the child's pid, then
# with its exit status (negative: killed by that signal).
SERVER = r'''
import json, os, shutil, signal, sys

import safetensors.torch
import torch._dynamo  # imported by torch.optim on first use: once here rather than in every session
import txl.cli.main
import txl.io.files
import txl.train

if os.path.isdir("/proc/self/task"):
    assert len(os.listdir("/proc/self/task")) == 1  # no threads yet: safe to fork


def arrange_kill(kind, nth):
    seen = [0]

    def due():
        seen[0] += 1
        return seen[0] == nth

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if kind == "step":  # after forward and backward, before the optimiser update
        real_step = txl.train.Trainer.optimizer_step

        def optimizer_step(self, *args, **kwargs):
            if due():
                die()
            return real_step(self, *args, **kwargs)

        txl.train.Trainer.optimizer_step = optimizer_step
    elif kind == "tensors":  # half of a safetensors file is on disk
        real_save = safetensors.torch.save_file

        def save_file(tensors, path, metadata=None):
            real_save(tensors, path, metadata=metadata)
            if due():
                with open(path, "r+b") as f:
                    f.truncate(os.path.getsize(path) // 2)
                die()

        safetensors.torch.save_file = save_file
    elif kind == "json":  # half of a JSON file (config, optimizer, trainer state, run.json) is on disk
        real_write_bytes = txl.io.files.write_bytes

        def write_bytes(path, data):  # what txl.io's writer does, killed half-way through the file
            if str(path).endswith(".json") and due():
                with txl.io.files.atomic_file(path) as f:
                    f.write(data[: len(data) // 2])
                    f.flush()
                    os.fsync(f.fileno())
                    die()
            return real_write_bytes(path, data)

        txl.io.files.write_bytes = write_bytes
    elif kind == "rename":  # before one of the renames that swap a checkpoint directory in
        real_rename = os.rename

        def rename(src, dst, *args, **kwargs):
            if due():
                die()
            return real_rename(src, dst, *args, **kwargs)

        os.rename = rename
    elif kind == "rmtree":  # the new checkpoint is in place, the old one not yet deleted
        real_rmtree = shutil.rmtree

        def rmtree(path, *args, **kwargs):
            if ".last.old-" in str(path) and due():
                die()
            return real_rmtree(path, *args, **kwargs)

        shutil.rmtree = rmtree
    elif kind == "metrics":  # half a line of metrics.jsonl
        real_write = txl.train.MetricsLog.write

        def write(self, record):
            if due():
                line = json.dumps(record)
                self.file.write(line[: len(line) // 2])
                self.file.flush()
                die()
            return real_write(self, record)

        txl.train.MetricsLog.write = write


for line in sys.stdin:
    command = json.loads(line)
    pid = os.fork()
    if pid == 0:
        log = os.open(command["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        arrange_kill(command["kind"], command["nth"])
        try:
            code = txl.cli.main.main(command["argv"])
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"exit": os.waitstatus_to_exitcode(status)}), flush=True)
'''


class Sessions:
    """Talks to the fork server: `start` one `txl` session, `wait` for its exit status."""

    def __init__(self, tmp_path: Path):
        script = tmp_path / "fork_server.py"
        script.write_text(SERVER)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.server = subprocess.Popen([sys.executable, str(script)], env=env, stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
        self.log = tmp_path / "session.log"

    def start(self, kind: str, nth: int, *argv: str) -> int:
        self.server.stdin.write(json.dumps({"kind": kind, "nth": nth, "argv": list(argv), "log": str(self.log)}) + "\n")
        self.server.stdin.flush()
        return json.loads(self.server.stdout.readline())["pid"]

    def wait(self) -> tuple[int, str]:
        line = self.server.stdout.readline()
        assert line, "the fork server died"
        return json.loads(line)["exit"], self.log.read_text()

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=60)


STEPS = 30
TRIALS = 12
# event kind -> largest n (kills land within a few steps of the resume point, so the run lasts)
KINDS = {"step": 3, "tensors": 6, "json": 6, "rename": 4, "rmtree": 2, "metrics": 3, "time": 0}
CHECKPOINT_FILES = {"config.json", "model.safetensors", "vocab.json", "optimizer.safetensors",
                    "optimizer.json", "trainer.safetensors", STATE_FILE}


def complete_checkpoint(directory: Path) -> bool:
    """Every file a resume reads is there, parses, and (tensors) matches its SHA-256."""
    if {p.name for p in directory.iterdir()} != CHECKPOINT_FILES:
        return False
    for name in CHECKPOINT_FILES:
        if name.endswith(".json"):
            json.loads((directory / name).read_text())
        else:
            load_tensors(directory / name)  # raises CheckpointError on truncation or a bad digest
    return True


def assert_never_half_written(run: Path) -> None:
    """What a kill may leave: `last` complete, or (killed between the two renames of a swap) no `last`
    and the previous checkpoint complete under `.last.old-*/last`. Temporary directories may remain;
    they are never read and the next start deletes them."""
    set_aside = list(run.glob(".last.old-*/last"))
    if (run / LAST).exists():
        assert complete_checkpoint(run / LAST)
    else:
        assert len(set_aside) == 1 and complete_checkpoint(set_aside[0]), sorted(p.name for p in run.iterdir())


def test_random_sigkills_then_resume_match_an_uninterrupted_run_bitwise(tmp_path, corpus):
    config = write_config(tmp_path, corpus, steps=STEPS)
    reference, run = tmp_path / "reference", tmp_path / "run"
    sessions = Sessions(tmp_path)
    try:
        sessions.start("none", 0, "train", "--config", str(config), "--out", str(reference), "--quiet")
        code, log = sessions.wait()
        assert code == 0, log

        rng = random.Random(7)
        kinds = sorted(KINDS) + rng.choices(sorted(KINDS), k=TRIALS - 1 - len(KINDS))  # each kind at least once
        rng.shuffle(kinds)
        plan = [("step", 3)] + [(kind, rng.randint(1, KINDS[kind]) if KINDS[kind] else 0) for kind in kinds]
        trials = []
        for i, (kind, nth) in enumerate(plan):
            args = ["--config", str(config), "--out", str(run)] if i == 0 else ["--resume", str(run)]
            before = saved_step(run)
            pid = sessions.start(kind, nth, "train", *args, "--quiet")
            if kind == "time":  # a wall-clock kill: once this session has saved a step, after a random delay
                deadline = time.time() + 120
                while saved_step(run) <= before and time.time() < deadline:
                    time.sleep(0.005)
                time.sleep(rng.uniform(0.0, 0.1))
                os.kill(pid, signal.SIGKILL)
            code, log = sessions.wait()
            assert code == -signal.SIGKILL, f"trial {i} ({kind} #{nth}) was not killed (exit {code}): {log}"
            assert_never_half_written(run)
            trials.append((kind, nth, before, saved_step(run)))
        sessions.start("none", 0, "train", "--resume", str(run), "--quiet")
        code, log = sessions.wait()
        assert code == 0, log
    finally:
        sessions.close()

    print("\nkill trials (event, n: saved step before -> after):",
          ", ".join(f"{k} #{n}: {a} -> {b}" for k, n, a, b in trials))
    assert len(trials) >= 10
    a, b = train_losses(reference), train_losses(run)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    assert all(a[s] == b[s] for s in a), [(s, a[s], b[s]) for s in a if a[s] != b[s]][:3]
    wa, _ = load_tensors(reference / LAST / "model.safetensors")
    wb, _ = load_tensors(run / LAST / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    leftovers = [p.name for p in run.iterdir() if p.name.startswith(".")]
    assert leftovers == [], leftovers  # the finished run cleaned up every temporary name
