"""`txl serve` (issue 20): the JSON API against the CLI it fronts (streamed text = `txl generate`,
/api/score NLL = `txl eval` per token), attention rows, client sessions, bounded and malformed
requests, what the server will not read, a bounded load test and a disconnect mid-stream, all over
real HTTP on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from serve_helpers import request, running, train_run
from txl.cli.main import build_parser, main
from txl.serve.app import Limits, create_app
from txl.serve.engine import open_run
from txl.serve.load import run_load, sse_events, stream_generation

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = ("the memory of the segment and the attention of the layer\nrelative position token memory and the "
        "segment of the model\nattention memory the of and layer token relative position of the memory\n")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return train_run(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def served(run_dir):
    return open_run(run_dir)


@pytest.fixture(scope="module")
def url(served):
    with running(create_app([served], Limits(max_new_tokens=300, max_concurrent=4))) as base:
        yield base


def generation(url: str, **body) -> tuple[list[dict], dict, dict]:
    """(token events, start event, done event) of one streamed generation."""
    result = stream_generation(url, body)
    assert result["status"] == 200 and result["error"] is None, result
    events = result["events"]
    assert events[0][0] == "start" and events[-1][0] == "done", [e for e, _ in events]
    return [d for e, d in events if e == "token"], events[0][1], events[-1][1]


def cli(capsys, *argv) -> str:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


@pytest.mark.parametrize("settings", [{}, {"temperature": 0.7, "top_p": 0.9, "top_k": 0}, {"mem_len": 0}],
                         ids=["defaults", "nucleus", "no-memory-window"])
def test_streamed_text_equals_txl_generate_with_the_same_seed(url, run_dir, capsys, settings):
    tokens, start, done = generation(url, prompt="the memory of", max_new_tokens=60, seed=11, **settings)
    flags = [x for k, v in settings.items() for x in (f"--{k.replace('_', '-')}", v)]
    sample = json.loads(cli(capsys, "generate", run_dir, "--prompt", "the memory of", "--max-new-tokens", 60,
                            "--seed", 11, "--json", *flags))["samples"][0]
    assert len(tokens) == 60 and done["tokens"] == 60 and done["stopped_by"] == "max_new_tokens"
    assert [t["id"] for t in tokens] == sample["ids"]
    assert "".join(t["text"] for t in tokens) == sample["text"]
    assert np.allclose([t["logprob"] for t in tokens], sample["logprobs"], atol=1e-5)
    assert start["prompt_ids"] == sample["prompt_ids"] and start["seed"] == 11
    assert [t["i"] for t in tokens] == list(range(len(start["prompt_ids"]), len(start["prompt_ids"]) + 60))


def test_score_nll_equals_txl_eval_per_token(url, run_dir, tmp_path, capsys):
    path = tmp_path / "text.txt"
    path.write_text(TEXT)
    cli(capsys, "eval", run_dir, "--text", path, "--batch-size", 1, "--per-token", tmp_path / "nll.npy", "--quiet")
    expected = np.load(tmp_path / "nll.npy")
    status, body, _ = request(url, "POST", "/api/score", {"text": TEXT})
    assert status == 200, body
    assert len(body["nll"]) == len(TEXT.encode()) - 1 == len(expected) > 3 * (body["tgt_len"] + body["mem_len"])
    np.testing.assert_allclose(body["nll"], expected, atol=1e-5)
    assert body["mean_nll"] == pytest.approx(float(expected.mean()), abs=1e-5)
    assert "".join(body["tokens"]) == TEXT
    # memory matters: without it the same text scores worse on this trained model
    _, without, _ = request(url, "POST", "/api/score", {"text": TEXT, "mem_len": 0})
    assert without["mem_len"] == 0 and without["mean_nll"] > body["mean_nll"]


@pytest.mark.parametrize("token", [1, 5, 16, 17, 40, 150])
def test_attention_rows_sum_to_one_over_memory_and_segment(url, served, token):
    layer, head = 1, 1
    status, body, _ = request(url, "POST", "/api/score",
                              {"text": TEXT, "attention": {"token": token, "layer": layer, "head": head}})
    assert status == 200, body
    a = body["attention"]
    tgt_len, mem_len = body["tgt_len"], body["mem_len"]
    query = token - 1
    start = query // tgt_len * tgt_len
    assert (a["query"], a["segment_start"]) == (query, start)
    assert a["first_key"] == max(0, start - mem_len)  # keys = [memory ; segment]
    rows = np.array(a["rows"])  # (layers, heads, keys)
    config = served.model.config
    assert rows.shape == (config.n_layer, config.n_head, a["segment_end"] - a["first_key"])
    np.testing.assert_allclose(rows.sum(-1), 1.0, atol=1e-5)
    future = query + 1 - a["first_key"]
    assert np.all(rows[..., future:] == 0)  # causal: nothing after the query
    matrix = np.array(a["matrix"])  # the whole segment, layer 1 head 1
    np.testing.assert_allclose(matrix.sum(-1), 1.0, atol=1e-3)
    np.testing.assert_allclose(matrix[query - start], rows[layer, head], atol=1e-5)
    positions = np.arange(a["first_key"], a["segment_end"])
    np.testing.assert_allclose(a["avg_distance"], (rows * (query - positions)).sum(-1), rtol=1e-4, atol=1e-4)


def test_each_session_keeps_its_own_memory(url):
    """Greedy: 12 tokens, then 12 more continuing the same session = 24 in one go, even with another
    session generating in between."""
    whole, _, _ = generation(url, prompt="attention of", max_new_tokens=24, temperature=0)
    first, start, _ = generation(url, prompt="attention of", max_new_tokens=12, temperature=0, session="session-aaaa")
    generation(url, prompt="layer token relative", max_new_tokens=30, temperature=0, session="session-bbbb")
    second, again, _ = generation(url, max_new_tokens=12, temperature=0, session="session-aaaa", **{"continue": True})
    assert [t["id"] for t in first + second] == [t["id"] for t in whole]
    assert start["session"] == again["session"] == "session-aaaa" and again["first"] == len(start["prompt_ids"]) + 12
    # a continuation with more text feeds it on top of the memory
    more, _, _ = generation(url, prompt=" memory", max_new_tokens=3, temperature=0, session="session-aaaa",
                            **{"continue": True})
    assert more[0]["i"] == len(start["prompt_ids"]) + 24 + len(" memory")


def test_a_sampled_continuation_draws_on_from_the_sessions_seed(url):
    """Issue 45: continuing without a seed draws on from the session's random stream, so 20 sampled tokens
    continued by 15 are the 35 of one generation with that seed; a seed given with "continue" restarts it."""
    whole, _, _ = generation(url, prompt="the memory of", max_new_tokens=35, seed=7)
    first, start, _ = generation(url, prompt="the memory of", max_new_tokens=20, seed=7, session="session-seed")
    second, again, _ = generation(url, max_new_tokens=15, session="session-seed", **{"continue": True})
    assert [t["id"] for t in first + second] == [t["id"] for t in whole]
    assert start["reseeded"] and not again["reseeded"] and again["seed"] == 7 and again["prompt_ids"] == []
    third, restarted, _ = generation(url, max_new_tokens=5, seed=3, session="session-seed", **{"continue": True})
    assert restarted["reseeded"] and restarted["seed"] == 3 and third[0]["i"] == len(start["prompt_ids"]) + 35


def test_prompt_words_read_as_unk_are_named_in_the_start_event(tmp_path):
    """Issue 45: a words vocabulary turned unknown prompt words into <unk> silently; the start event now
    carries txl.generate.text.prompt_notice's line (null when every word is known)."""
    from serve_helpers import word_checkpoint

    with running(create_app([open_run(word_checkpoint(tmp_path / "words"))])) as base:
        _, start, _ = generation(base, prompt="The Company said that Bob's", max_new_tokens=3, seed=1)
        assert start["prompt_ids"] == [0, 0, 4, 5, 0]
        assert "3 words" in start["notice"] and "<unk>" in start["notice"] and "'the' for 'The'" in start["notice"]
        assert "\n" not in start["notice"]
        _, start, _ = generation(base, prompt="the company said", max_new_tokens=3, seed=1)
        assert start["notice"] is None


BAD = [  # (method, path, body, headers, status, words in the error)
    ("POST", "/api/generate", b"{not json", {"Content-Type": "application/json"}, 400, "not valid JSON"),
    ("POST", "/api/generate", b"[1, 2]", {"Content-Type": "application/json"}, 400, "JSON object"),
    ("POST", "/api/generate", b"\xff\xfe", {"Content-Type": "application/json"}, 400, "not UTF-8"),
    ("POST", "/api/generate", b'{"prompt": "x"}', {}, 415, "application/json"),
    ("POST", "/api/generate", {"prompt": "x", "path": "/etc/passwd"}, {}, 400, "unknown field 'path'"),
    ("POST", "/api/generate", {"prompt": 3}, {}, 422, "'prompt' must be a string"),
    ("POST", "/api/generate", {"max_new_tokens": "50"}, {}, 422, "'max_new_tokens' must be an integer"),
    ("POST", "/api/generate", {"max_new_tokens": 10**6}, {}, 413, "must be <= 300"),
    ("POST", "/api/generate", {"max_new_tokens": 0}, {}, 422, "must be >= 1"),
    ("POST", "/api/generate", {"temperature": -1}, {}, 422, "'temperature' must be >= 0"),
    ("POST", "/api/generate", {"top_p": 0}, {}, 422, "'top_p' must be in (0, 1]"),
    ("POST", "/api/generate", {"prompt": "x" * 20000}, {}, 413, "too long"),
    ("POST", "/api/generate", {"prompt": "x" * 16000}, {}, 413, "at most 2,048"),
    ("POST", "/api/generate", b'{"prompt": "' + b"x" * 300_000 + b'"}', {"Content-Type": "application/json"}, 413,
     "larger than"),
    ("POST", "/api/generate", {"run": 1}, {}, 422, "'run' must be 0"),
    ("POST", "/api/generate", {"run": "/tmp/other-run"}, {}, 422, "'run' must be an integer"),
    ("POST", "/api/generate", {"session": "../../x"}, {}, 422, "'session'"),
    ("POST", "/api/generate", {"continue": True}, {}, 422, "needs the \"session\""),
    ("POST", "/api/generate", {"continue": True, "session": "never-started"}, {}, 404, "no such session"),
    ("POST", "/api/score", {"text": "the"}, {}, 200, None),
    ("POST", "/api/score", {"text": "t"}, {}, 422, "at least 2"),
    ("POST", "/api/score", {}, {}, 422, "exactly one of"),
    ("POST", "/api/score", {"text": "the", "ids": [1, 2]}, {}, 422, "exactly one of"),
    ("POST", "/api/score", {"ids": [1, 999]}, {}, 422, "outside the vocabulary"),
    ("POST", "/api/score", {"ids": [1, True]}, {}, 422, "list of integers"),
    ("POST", "/api/score", {"ids": list(range(5000))}, {}, 413, "too long"),
    ("POST", "/api/score", {"text": "the", "attention": {"token": 9}}, {}, 422, "attention.token"),
    ("POST", "/api/score", {"text": "the", "attention": {"token": 1, "layer": 7}}, {}, 422, "attention.layer"),
    ("POST", "/api/score", {"text": "the", "attention": {"token": 1, "file": "x"}}, {}, 400, "unknown field 'file'"),
    ("POST", "/api/score", {"text": "the", "mem_len": 1e9}, {}, 422, "'mem_len' must be an integer"),
    ("GET", "/api/generate", None, {}, 405, "not allowed"),
    ("DELETE", "/api/model", None, {}, 405, "not allowed"),
    ("GET", "/api/nothing", None, {}, 404, "not found"),
]


@pytest.mark.parametrize(("method", "path", "body", "headers", "status", "words"), BAD,
                         ids=[f"{i}-{b[1]}-{b[4]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_one_json_4xx_and_the_server_stays_up(url, method, path, body, headers, status, words):
    got, answer, response_headers = request(url, method, path, body, headers)
    assert got == status, answer
    if words is not None:
        assert set(answer) == {"error"} and words in answer["error"] and "\n" not in answer["error"]
        assert response_headers["content-type"] == "application/json"
    assert request(url, "GET", "/health")[1]["status"] == "ok"


def test_default_bind_is_loopback():
    args = build_parser(only="serve").parse_args(["serve", "RUN"])
    assert args.host == "127.0.0.1"


def test_nothing_outside_the_page_is_readable(url, run_dir):
    secret = "SECRET-7f3a91"
    (run_dir / "secret.txt").write_text(secret)
    (run_dir.parent / "secret.txt").write_text(secret)
    tries = ["/static/../secret.txt", "/static/..%2fsecret.txt", "/static/%2e%2e/%2e%2e/secret.txt",
             "/static/..%2F..%2Frun%2Fsecret.txt", "/static/app.js/../../secret.txt", "/static/", "/static/x/y",
             "//etc/passwd", "/../../../../etc/passwd", "/static/..%5c..%5csecret.txt", "/run/best/config.json",
             "/static/__init__.py", "/static/engine.py", "/secret.txt", "/api/model/../../secret.txt"]
    for path in tries:
        status, body, _ = request(url, "GET", path)
        assert status == 404 and secret not in json.dumps(body), path
    _, model, _ = request(url, "GET", "/api/model")
    assert secret not in json.dumps(model) and str(run_dir.parent) not in json.dumps(model)
    for name in ("index.html", "app.js", "style.css"):  # what it serves: the page, with a strict policy
        status, _, headers = request(url, "GET", f"/static/{name}")
        assert status == 200 and headers["content-security-policy"].startswith("default-src 'self'")


def test_other_host_names_are_refused(url):
    """A page elsewhere that rebinds its own name to 127.0.0.1 cannot drive the server."""
    status, body, _ = request(url, "GET", "/api/model", headers={"Host": "attacker.example:8000"})
    assert status == 400 and "not served here" in body["error"]
    assert request(url, "GET", "/health", headers={"Host": "localhost:1"})[0] == 200


HOSTS = [("127.0.0.1:8000", True), ("192.168.1.20:8000", True), ("10.0.0.5", True), ("[::1]:8000", True),
         ("[fe80::1]:8000", True), ("localhost", True), ("LOCALHOST:1", True), ("box.lan:8000", True),
         ("Box.Lan", True), ("attacker.example:8000", False), ("box.lan.attacker.example", False),
         ("192.168.1.20.nip.io", False), ("0x7f.1:8000", False)]


def test_ip_addresses_and_allowed_names_are_served_other_names_refused(served):
    """Issue 45: a Host that is an IP address cannot come from DNS rebinding (no name to re-point), so it
    is served; names only when loopback or given (--allow-host)."""
    with running(create_app([served], allowed_hosts=("box.lan",))) as base:
        for host, allowed in HOSTS:
            status, body, _ = request(base, "GET", "/health", headers={"Host": host})
            assert (status == 200) == allowed, (host, body)
            if not allowed:
                assert "not served here" in body["error"] and "--allow-host" in body["error"], body


@pytest.mark.slow
def test_txl_serve_on_0000_serves_requests_by_ip_address_and_allowed_names(run_dir, capsys):
    """Issue 45: `--host 0.0.0.0` warned that anyone could reach the model, then refused every request
    addressed by IP (Host: 192.168.1.20:8000). Now: addresses and --allow-host names are served, other
    names refused; a bad --allow-host ends in one line."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "txl", "serve", str(run_dir), "--port", "0", "--threads", "1",
                             "--host", "0.0.0.0", "--allow-host", "box.lan, other.lan"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("txl serve: run at http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
        port = line.split(" at ")[1].split("/ ")[0].rsplit(":", 1)[1]
        base = f"http://127.0.0.1:{port}"
        for host in (f"192.168.1.20:{port}", f"127.0.0.1:{port}", f"box.lan:{port}", "other.lan", f"[fe80::1]:{port}"):
            status, body, _ = request(base, "GET", "/api/model", headers={"Host": host})
            assert status == 200 and body["runs"], (host, body)
        status, body, _ = request(base, "GET", "/api/model", headers={"Host": f"attacker.example:{port}"})
        assert status == 400 and "not served here" in body["error"]
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert "warning: listening on 0.0.0.0: anyone who can reach this machine" in err
    assert main(["serve", str(run_dir), "--allow-host", "http://box.lan:8000", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--allow-host takes host names" in err and "\n" not in err


@pytest.mark.slow
def test_bounded_load_no_errors(url, capsys):
    stats = run_load(url, clients=16, requests=20, tokens=8)
    assert stats["requests"] == 320 and stats["errors"] == 0, stats["first_errors"]
    assert stats["tokens"] == 320 * 8
    with capsys.disabled():
        print(f"\nload 16 clients × 20 requests × 8 tokens: p50 {stats['p50_ms_per_token']:.1f} ms/token, p95 "
              f"{stats['p95_ms_per_token']:.1f} ms/token, first token p50 {stats['p50_ms_first_token']:.1f} ms, "
              f"{stats['tokens_per_second']:.0f} tokens/s")
    assert request(url, "GET", "/health")[1]["active"] == 0


def test_a_disconnect_mid_stream_frees_its_slot(served, capsys):
    """One slot; a client asks for 20000 tokens, reads three and hangs up: the work stops at once and the
    next client gets the slot."""
    with running(create_app([served], Limits(max_new_tokens=20000, max_concurrent=1))) as base:
        host, port = base.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/api/generate", json.dumps({"prompt": "the", "max_new_tokens": 20000}),
                     {"Content-Type": "application/json"})
        events = sse_events(conn.getresponse())
        assert next(events)[0] == "start"
        for _ in range(3):
            assert next(events)[0] == "token"
        assert request(base, "GET", "/health")[1]["active"] == 1
        conn.sock.close()
        conn.close()
        closed = time.perf_counter()
        while (health := request(base, "GET", "/health")[1])["active"]:
            assert time.perf_counter() - closed < 60, health
            time.sleep(0.005)
        freed = time.perf_counter() - closed
        ended = health["recent"][-1]
        assert ended["stopped_by"] == "disconnected" and ended["tokens"] < 20000
        tokens, _, done = generation(base, prompt="the", max_new_tokens=5)
        assert len(tokens) == 5 and done["stopped_by"] == "max_new_tokens"
    with capsys.disabled():
        print(f"\ndisconnect after 3 tokens: slot free {1000 * freed:.0f} ms after the close, the stream stopped "
              f"at {ended['tokens']} of 20000 tokens")


def test_work_is_time_limited(served, monkeypatch):
    """The request's clock (txl.serve.app.monotonic) advances 0.01 s per reading: the 0.3 s limit stops the
    generation after about 30 readings, however fast or busy the machine."""
    import itertools

    import txl.serve.app as app_module

    ticks = itertools.count()
    monkeypatch.setattr(app_module, "monotonic", lambda: 0.01 * next(ticks))
    with running(create_app([served], Limits(max_new_tokens=100000, request_timeout=0.3))) as base:
        tokens, _, done = generation(base, prompt="the", max_new_tokens=100000)
        assert done["stopped_by"] == "time_limit" and 0 < len(tokens) < 100000


def test_two_runs_generate_side_by_side(served, run_dir, tmp_path):
    other = open_run(run_dir / "last")
    with running(create_app([served, other])) as base:
        _, model, _ = request(base, "GET", "/api/model")
        assert [r["name"] for r in model["runs"]] == ["run", "run"] and model["runs"][1]["checkpoint"] == "last"
        a, _, _ = generation(base, run=0, prompt="the", max_new_tokens=10, seed=1)
        b, _, _ = generation(base, run=1, prompt="the", max_new_tokens=10, seed=1)
        assert len(a) == len(b) == 10


def test_model_card_has_config_parameters_corpus_and_curve(url, served):
    status, body, _ = request(url, "GET", "/api/model")
    card = body["runs"][0]
    assert status == 200 and card["name"] == "run"
    assert card["parameters"] == sum(p.numel() for p in served.model.parameters())
    assert card["config"]["n_layer"] == 2 and card["vocab"] == {"kind": "bytes", "size": 256}
    assert card["corpus"] == "text:corpus.txt"  # no local directories on the page
    assert {"train", "valid"} <= set(card["curve"]) and card["curve"]["train"][0][0] == 5
    assert body["limits"]["max_new_tokens"] == 300


def test_serve_without_the_extra_names_the_fix(run_dir, capsys, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_uvicorn(name, *args, **kwargs):
        if name == "uvicorn":
            raise ImportError("No module named 'uvicorn'", name="uvicorn")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_uvicorn)
    assert main(["serve", str(run_dir), "--port", "0"]) == 2
    assert "pip install 'txl[serve]'" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "words"), [
    (["--port", "70000"], "--port must be in"),
    (["--max-concurrent", "0"], "--max-concurrent must be >= 1"),
    (["--timeout", "0"], "--timeout must be > 0"),
])
def test_bad_flags_end_in_one_line(run_dir, capsys, argv, words):
    assert main(["serve", str(run_dir), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err


def test_a_run_without_vocab_is_refused(tmp_path, capsys, tiny):
    from txl.models.transformer_xl.model import TransformerXL

    torch.manual_seed(0)
    TransformerXL(tiny()).save_pretrained(tmp_path / "novocab")
    assert main(["serve", str(tmp_path / "novocab"), "--port", "0"]) == 2
    assert "vocab.json" in capsys.readouterr().err


def test_a_bug_in_one_request_is_a_500_json_and_the_server_keeps_serving(served, monkeypatch):
    import txl.serve.app as app_module

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(app_module, "score", broken)
    monkeypatch.setattr(app_module, "generate", broken)
    with running(create_app([served])) as base:
        status, body, _ = request(base, "POST", "/api/score", {"text": "the memory"})
        assert status == 500 and body == {"error": "internal error (RuntimeError); the server keeps running"}
        result = stream_generation(base, {"prompt": "the", "max_new_tokens": 5})
        assert result["error"] == "internal error (RuntimeError); the server keeps running"
        assert [e for e, _ in result["events"]][-1] == "done"
        # the slot is freed when the worker thread has ended, which may be just after "done" is sent
        deadline = time.monotonic() + 60  # a hang guard, not a speed
        while request(base, "GET", "/health")[1]["active"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert request(base, "GET", "/health")[1]["active"] == 0


def open_stream(base: str, body: dict):
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", "/api/generate", json.dumps(body), {"Content-Type": "application/json"})
    return connection, connection.getresponse()


def test_a_full_server_queues_then_refuses(served):
    """One slot, one waiting place: the second request waits, the third is refused at once with 429, and
    the waiting one is served when the slot frees (no clock decides any of it: queue_timeout is a hang guard)."""
    limits = Limits(max_new_tokens=100000, max_concurrent=1, max_waiting=1, queue_timeout=60, request_timeout=60)
    with running(create_app([served], limits)) as base:
        busy, busy_response = open_stream(base, {"prompt": "the", "max_new_tokens": 100000})
        assert next(sse_events(busy_response))[0] == "start"
        waiting, response = open_stream(base, {"prompt": "the", "max_new_tokens": 5})
        while request(base, "GET", "/health")[1]["waiting"] == 0:
            time.sleep(0.01)
        status, body, _ = request(base, "POST", "/api/generate", {"prompt": "the", "max_new_tokens": 5})
        assert status == 429 and "busy" in body["error"]
        busy.sock.close()  # the busy client leaves: its generation stops at the next token and frees the slot
        busy.close()
        events = [event for event, _ in sse_events(response)]
        assert events[0] == "start" and events.count("token") == 5 and events[-1] == "done"
        waiting.close()


def test_a_request_that_waits_past_queue_timeout_gets_a_503_event(served):
    """The waiting request gives up after queue_timeout with a 503 event (the busy one, 100,000 tokens
    under a 60 s limit, outlasts any 0.2 s wait)."""
    limits = Limits(max_new_tokens=100000, max_concurrent=1, max_waiting=1, queue_timeout=0.2, request_timeout=60)
    with running(create_app([served], limits)) as base:
        busy, busy_response = open_stream(base, {"prompt": "the", "max_new_tokens": 100000})
        assert next(sse_events(busy_response))[0] == "start"
        waiting, response = open_stream(base, {"prompt": "the", "max_new_tokens": 5})
        event, data = next(sse_events(response))
        assert event == "error" and data["status"] == 503 and "no work slot" in data["error"]
        waiting.close()
        busy.sock.close()
        busy.close()


@pytest.mark.slow
def test_txl_serve_binds_loopback_and_stops_on_ctrl_c(run_dir):
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "txl", "serve", str(run_dir), "--port", "0", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("txl serve: run at http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() else "")
        base = line.split(" at ")[1].split("/ ")[0]
        status, body, _ = request(base, "GET", "/health")
        assert status == 200 and body["status"] == "ok"
        status, page, headers = request(base, "GET", "/")
        assert status == 200 and "txl playground" in page and headers["content-type"].startswith("text/html")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_bidirectional_model_is_refused(tmp_path, capsys, tiny):
    from txl.data import Vocab
    from txl.models.transformer_xl.model import TransformerXL

    torch.manual_seed(0)
    TransformerXL(tiny(vocab_size=256, causal=False, mem_len=0, pos_encoding="rope")).save_pretrained(tmp_path / "mlm")
    Vocab("bytes").save(tmp_path / "mlm" / "vocab.json")
    assert main(["serve", str(tmp_path / "mlm"), "--port", "0"]) == 2
    assert "bidirectional" in capsys.readouterr().err
    (tmp_path / "in.txt").write_text("abc\n")  # generate --input called it "a language model"
    assert main(["generate", str(tmp_path / "mlm"), "--input", str(tmp_path / "in.txt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "bidirectional encoder" in err and "cannot generate text" in err and "\n" not in err


def test_a_port_in_use_and_three_runs_end_in_one_line(run_dir, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["serve", str(run_dir), "--port", str(port)]) == 2
        err = capsys.readouterr().err.strip()
        assert f"127.0.0.1:{port} is in use" in err and "\n" not in err
    assert main(["serve", str(run_dir), str(run_dir), str(run_dir)]) == 2
    assert "one run or two" in capsys.readouterr().err


def test_training_curve_is_thinned_and_skips_damaged_lines(tmp_path):
    from txl.serve.engine import CURVE_POINTS, training_curve

    lines = [json.dumps({"split": "train", "step": s, "loss": 5.0 / s}) for s in range(1, 1001)]
    lines += ["{not json", json.dumps({"split": "valid", "step": 10, "loss": float("nan")}),
              json.dumps({"split": "valid", "step": 20, "loss": 1.5}), json.dumps({"step": 3})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    curve = training_curve(tmp_path / "metrics.jsonl")
    assert len(curve["train"]) == CURVE_POINTS and curve["train"][0] == [1, 5.0] and curve["train"][-1] == [1000, 0.005]
    assert curve["valid"] == [[20, 1.5]]
    assert training_curve(tmp_path / "missing.jsonl") == {}


def _other_run(kind: str, root: Path) -> Path:
    """A two-step run of a model that is not a language model, trained with the public command line."""
    tiny = ["--set", "model.n_layer=1", "--set", "model.d_model=16", "--set", "model.d_head=8", "--set",
            "model.d_inner=32", "--set", "batch_size=4", "--set", "eval_batch_size=8", "--set", "max_steps=2",
            "--set", "eval_interval=2", "--quiet", "--threads", "1"]
    run = root / kind
    if kind == "encoder-decoder":
        argv = ["--preset", "seq2seq-reverse", "--data", "reverse?size=40&max_len=5", "--set", "model.n_encoder_layer=1",
                "--set", "final_splits=[]"]
    elif kind == "style-transformer":
        (root / "a.txt").write_text("".join(f"to be or not to be that is {i}\n" for i in range(60)))
        (root / "b.txt").write_text("".join(f"the company said it expects a loss {i}\n" for i in range(60)))
        argv = ["--preset", "style-transfer", "--data", f"style:{root / 'a.txt'},{root / 'b.txt'}?min_len=3",
                "--set", "model.n_encoder_layer=1", "--set", "model.n_discriminator_layer=1",
                "--set", "model.pretrain_steps=1", "--set", "model.discriminator_steps=1",
                "--set", "model.generator_steps=1"]
    else:  # a document classifier
        for split, count in (("train", 6), ("valid", 2)):
            for label in ("west", "east"):
                for i in range(count):
                    path = root / "docs" / split / label / f"{i}.txt"
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(f"memory segment {label} layer token {i}")
        argv = ["--objective", "classify", "--data", f"docs:{root / 'docs'}", "--set", "model.mem_len=8",
                "--set", "tgt_len=8"]
    assert main(["train", *argv, "--out", str(run), *tiny]) == 0
    return run


@pytest.mark.parametrize(("kind", "what", "advice"), [
    ("encoder-decoder", "is a sequence-to-sequence model (encoder-decoder)",
     "decode sources with txl generate RUN --input FILE"),
    ("style-transformer", "is a Style Transformer",
     "rewrite sentences with txl generate RUN --style S --prompt TEXT (or --input FILE)"),
    ("classifier", "is a document classifier", "score documents with txl eval RUN"),
])
def test_a_run_that_is_not_a_language_model_is_refused_by_serve_and_generate(tmp_path, capsys, kind, what, advice):
    """`txl serve` of the encoder-decoder and the Style Transformer used to end in an AttributeError traceback (no
    mem_len), and the classifier was served (and `txl generate --prompt` ran), generating with the LM head its
    training never scores; `txl generate --input` called each of them "a language model"."""
    run = _other_run(kind, tmp_path)
    (tmp_path / "in.txt").write_text("abc\n")
    capsys.readouterr()
    assert main(["serve", str(run), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{what}: txl serve continues text with a language model; {advice}" in err and "\n" not in err
    given = [["--prompt", "abc"]] + ([] if kind == "encoder-decoder" else [["--input", str(tmp_path / "in.txt")]])
    for flags in given:  # (an encoder-decoder's --input is what it takes)
        assert main(["generate", str(run), *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert f"{what}: {advice}" in err and "\n" not in err and "Traceback" not in err
