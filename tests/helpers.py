"""Shared by the trainer, fault and robustness tests: a tiny run config, a word corpus, and the
subprocess helpers that start `python -m txl` and read what a run left on disk.

A plain module (not conftest.py), imported as `helpers` from tests/ (pytest puts the test file's
directory on sys.path); the fixtures here are used by importing them into a test module.
"""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from txl.train import LAST

TOML = """
[model]
n_layer = 2
d_model = 32
n_head = 2
d_head = 16
d_inner = 64
mem_len = 16
dropout = {dropout}

[train]
data = "text:{corpus}?tokenizer=bytes"
tgt_len = 16
batch_size = 4
lr = 2e-3
max_steps = {steps}
log_interval = 1
eval_interval = {eval_interval}
save_interval = 1
eval_max_tokens = 2000
eval_batch_size = 4
final_splits = []
varlen = {varlen}
roll = {varlen}
"""


def make_corpus(path: Path, lines: int = 3000, seed: int = 0) -> Path:
    """Random lines of ten words: enough text for a few hundred tiny-model steps."""
    import random

    rng = random.Random(seed)
    words = ["memory", "segment", "attention", "relative", "position", "token", "layer", "the", "of", "and"]
    text = "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(lines))
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch) -> Path:
    """One prepared-corpus cache per test session (also for the `python -m txl` subprocesses)."""
    path = tmp_path_factory.getbasetemp() / "txl-cache"
    monkeypatch.setenv("TXL_CACHE_DIR", str(path))
    return path


def write_config(tmp_path, corpus, *, steps=30, dropout=0.1, varlen="true", eval_interval=1000) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(TOML.format(corpus=corpus, steps=steps, dropout=dropout, varlen=varlen,
                                eval_interval=eval_interval))
    return path


def txl(*args, **kwargs) -> subprocess.Popen:
    """`python -m txl ARGS` with its output captured."""
    # one thread unless the caller says otherwise: txl's default counts idle cores, so two runs compared bit for
    # bit (a run and its resume) could otherwise use different thread counts, hence different fp32 sum orders
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1", **kwargs.pop("env", {})}
    return subprocess.Popen([sys.executable, "-m", "txl", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def finish(proc: subprocess.Popen, timeout=300) -> tuple[int, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err


def train_losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["split"] == "train"}


def saved_step(run_dir: Path) -> int:
    try:
        return json.loads((run_dir / LAST / "trainer_state.json").read_text())["step"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return -1


class HostileServer:
    """mode: "bomb" (announces 10 GiB), "endless" (no length, zeros forever), "trickle" (1 byte per
    50 ms), "file" (serves `self.body` with its length)."""

    def __init__(self):
        self.mode, self.body, self.sent = "file", b"", 0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.send_response(200)
                try:
                    if server.mode == "bomb":
                        self.send_header("Content-Length", str(10 << 30))
                        self.end_headers()
                        while True:
                            self.wfile.write(b"\0" * 65536)
                    elif server.mode == "endless":
                        self.end_headers()
                        while True:
                            self.wfile.write(b"\0" * 65536)
                            server.sent += 65536
                    elif server.mode == "trickle":
                        self.send_header("Content-Length", "1000000")
                        self.end_headers()
                        while True:
                            self.wfile.write(b"x")
                            self.wfile.flush()
                            time.sleep(0.05)
                    else:
                        self.send_header("Content-Length", str(len(server.body)))
                        self.end_headers()
                        self.wfile.write(server.body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/archive"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def stranger_bpe_vocab(change, *, vocab_size: int) -> dict:
    """A txl BPE vocab.json (as a dict) whose inner tokenizer JSON `change(inner)` has edited: what a
    stranger's file can hold (tests/test_hostile.py, tests/test_robustness.py)."""
    tokenizers = pytest.importorskip("tokenizers")
    from txl.data.vocab import Vocab

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["attention is all you need"] * 20, trainer=trainer)
    inner = json.loads(tok.to_str())
    change(inner)
    outer = json.loads(Vocab("bpe", bpe=tok.to_str()).to_json())
    outer["bpe"] = json.dumps(inner)
    return outer


@contextlib.contextmanager
def hang_guard(seconds: int = 60):
    """Fail instead of hanging for ever (a FIFO opened for reading blocks until a writer comes)."""

    def alarm(signum, frame):
        raise AssertionError(f"still blocked after {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# A tiny model for the hostile-input tests (a fraction of a second to train or load)
TINY = ["--set", "model.n_layer=1", "--set", "model.d_model=16", "--set", "model.d_head=8",
        "--set", "model.d_inner=32", "--set", "model.mem_len=8", "--set", "tgt_len=8"]


def call(*argv: str) -> tuple[int, str]:
    """`txl ARGV` in this process: (exit code, stderr)."""
    from txl.cli.main import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    return code, err.getvalue()


def one_error_line(err: str) -> str:
    assert "Traceback" not in err and "internal error" not in err, err
    lines = [line for line in err.strip().splitlines() if ": error: " in line]
    assert len(lines) == 1 and err.strip().splitlines()[-1] == lines[0], err
    return lines[0]
