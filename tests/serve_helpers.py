"""Shared by the `txl serve` tests: a tiny trained run and a real server on 127.0.0.1 in a thread."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from pathlib import Path

from helpers import make_corpus
from txl.cli.main import main

RUN_TOML = """
[model]
n_layer = 2
d_model = 32
n_head = 2
d_head = 16
d_inner = 64
mem_len = 16
dropout = 0.0

[train]
data = "text:{corpus}?tokenizer=bytes"
tgt_len = 16
batch_size = 4
lr = 3e-3
max_steps = {steps}
log_interval = 5
eval_interval = {eval_interval}
save_interval = 1000
eval_max_tokens = 1000
eval_batch_size = 4
final_splits = []
"""


# a recurrent run (AWD-LSTM): no attention to show, memory = the carried LSTM state
LSTM_MODEL = """
[model]
arch = "lstm"
n_layer = 2
d_model = 32
d_inner = 48
mem_len = 16
dropout = 0.0
"""


def train_run(root: Path, steps: int = 40, *, arch: str = "decoder") -> Path:
    """A byte-level run trained for a few steps (metrics.jsonl, best/, last/, vocab.json); arch "lstm":
    a recurrent one."""
    root.mkdir(parents=True, exist_ok=True)
    corpus = make_corpus(root / "corpus.txt", lines=1500)
    config = root / "run.toml"
    toml = RUN_TOML.format(corpus=corpus, steps=steps, eval_interval=max(steps // 2, 1))
    if arch == "lstm":
        toml = LSTM_MODEL + toml[toml.index("[train]"):]
    config.write_text(toml)
    code = main(["train", "--config", str(config), "--out", str(root / "run"), "--quiet"])
    assert code == 0, "training the tiny run for the serve tests failed"
    return root / "run"


@contextlib.contextmanager
def running(app, guard=None):
    """Serve `app` with uvicorn on 127.0.0.1 (a free port) in a thread, configured as `txl serve` does
    (txl.serve.connections); yields the base URL."""
    import uvicorn

    from txl.serve.connections import Guard, server_config

    guard = guard or getattr(app.state.server, "connections", None) or Guard(max_connections=256, header_timeout=10)
    app.state.server.connections = guard
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = uvicorn.Server(server_config(app, guard, log_level="error", graceful=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def request(url: str, method: str, path: str, body: bytes | str | dict | None = None,
            headers: dict | None = None) -> tuple[int, dict | str, dict]:
    """(status, parsed JSON or text, headers) of one plain request."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    if isinstance(body, dict):
        body = json.dumps(body)
        headers = {"Content-Type": "application/json", **(headers or {})}
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        raw = response.read().decode("utf-8", "replace")
        kind = response.getheader("content-type", "")
        return response.status, json.loads(raw) if kind.startswith("application/json") else raw, dict(response.getheaders())
    finally:
        conn.close()


PTB_WORDS = ["<unk>", "<eos>", "the", "company", "said", "that", "bob", "'s", "N"]


def word_checkpoint(path: Path) -> Path:
    """An untrained causal model with a PTB-like lower-case words vocabulary that has <unk>."""
    import torch

    from txl.data import Vocab
    from txl.models.transformer_xl.config import TransformerXLConfig
    from txl.models.transformer_xl.model import TransformerXL

    torch.manual_seed(0)
    config = TransformerXLConfig(n_layer=1, d_model=16, n_head=2, d_head=8, d_inner=32, mem_len=8, dropout=0.0,
                                 vocab_size=len(PTB_WORDS))
    TransformerXL(config).save_pretrained(path)
    Vocab("words", PTB_WORDS, eos="<eos>", unk="<unk>").save(path / "vocab.json")
    return path

