"""`txl serve` refusing at start-up (issue 50, item 4): out-of-range numbers, damaged weights and hostile
run files each end in one line, exit 2, before anything listens. What the running server answers to bad
requests and hostile clients (HTTP 4xx/503, timeouts, the connection cap): tests/test_serve.py and
tests/test_serve_hostile.py."""

from __future__ import annotations

import json
import os
import shutil

from test_robustness import Ctx, Outcome, api, call_cli, case, cli, env, train_args  # noqa: F401

HOSTILE = "tests/test_serve_hostile.py"


def _serve(run, *argv: str) -> Outcome:
    return cli("serve", str(run), "--port", "0", "--threads", "1", *argv)


@case("serve-timeout-nan", "`txl serve --timeout nan` (every deadline comparison false)", "txl serve RUN --timeout nan",
      "--timeout", "finite", test=f"{HOSTILE}::test_out_of_range_numbers_end_in_one_line")
def _(ctx):
    return _serve(ctx.run_copy(), "--timeout", "nan")


@case("serve-timeout-huge", "a request time limit of 30 years", "txl serve RUN --timeout 1e9", "--timeout",
      "<= 86,400")
def _(ctx):
    return _serve(ctx.run_copy(), "--timeout", "1e9")


@case("serve-session-memory-nan", "a session memory budget that is not a number", "txl serve RUN --session-memory nan",
      "--session-memory", "finite")
def _(ctx):
    return _serve(ctx.run_copy(), "--session-memory", "nan")


@case("serve-header-timeout-inf", "no time limit on request headers", "txl serve RUN --header-timeout inf",
      "--header-timeout", "finite")
def _(ctx):
    return _serve(ctx.run_copy(), "--header-timeout", "inf")


@case("serve-max-connections-0", "a connection cap of 0", "txl serve RUN --max-connections 0", "--max-connections",
      ">= 1")
def _(ctx):
    return _serve(ctx.run_copy(), "--max-connections", "0")


@case("serve-max-score-tokens-huge", "texts of a billion tokens to score", "txl serve RUN --max-score-tokens 1e9",
      "--max-score-tokens", "<= 1,000,000")
def _(ctx):
    return _serve(ctx.run_copy(), "--max-score-tokens", "1000000000")


@case("serve-nan-weights", "a checkpoint whose weights are NaN (every answer a 500 with a traceback)",
      "txl serve DIR/nan", "NaN or infinite", "another", test=f"{HOSTILE}::test_nan_weights_are_refused_at_start_in_one_line")
def _(ctx):
    import torch

    from txl.models.checkpoint import load_checkpoint

    ckpt = load_checkpoint(ctx.run_copy())
    with torch.no_grad():
        next(ckpt.model.parameters()).fill_(float("nan"))
    ckpt.model.save_pretrained(ctx.dir / "nan")
    shutil.copy(ckpt.path / "vocab.json", ctx.dir / "nan" / "vocab.json")
    return _serve(ctx.dir / "nan")


@case("serve-fifo-metrics", "a FIFO planted as the run's metrics.jsonl (serve waited on it for ever)",
      "txl serve RUN", "metrics.jsonl", "not a regular file", test=f"{HOSTILE}::test_a_fifo_in_the_run_does_not_hang_serve")
def _(ctx):
    run = ctx.run_copy()
    (run / "metrics.jsonl").unlink()
    os.mkfifo(run / "metrics.jsonl")
    return _serve(run)


def _run_json(ctx: Ctx, key: str, value) -> Outcome:
    run = ctx.run_copy()
    shutil.rmtree(run / "last")  # best/ then takes its settings from run.json
    record = json.loads((run / "run.json").read_text())
    record["config"]["train"][key] = value
    (run / "run.json").write_text(json.dumps(record))
    return _serve(run)


@case("serve-run-eval-tgt-len-word", "a run.json whose eval_tgt_len is a word (a 500 on every page load)",
      "txl serve RUN", "train.eval_tgt_len", "run.json", test=f"{HOSTILE}::test_hostile_lengths_in_run_json_end_in_one_line")
def _(ctx):
    return _run_json(ctx, "eval_tgt_len", "abc")


@case("serve-run-eval-mem-len-huge", "a run.json whose eval_mem_len is 1e11 (memory without end)", "txl serve RUN",
      "train.eval_mem_len", "run.json")
def _(ctx):
    return _run_json(ctx, "eval_mem_len", 1e11)


@case("serve-run-tgt-len-negative", "a run.json whose tgt_len is -5", "txl serve RUN", "train.tgt_len", ">= 1")
def _(ctx):
    return _run_json(ctx, "tgt_len", -5)


@case("serve-allow-host-url", "a URL where --allow-host takes host names", "txl serve RUN --allow-host http://box.lan:8000",
      "--allow-host takes host names", "without scheme or port",
      test="tests/test_serve.py::test_txl_serve_on_0000_serves_requests_by_ip_address_and_allowed_names")
def _(ctx):
    return _serve(ctx.run_copy(), "--allow-host", "http://box.lan:8000")
