"""Bad numbers on the command line (issue 50, item 6): each ends in one line naming the flag and its
range, exit 2, before anything is built, measured or launched. More of them, every numeric flag of every
command against words, nan, inf and 10^30: tests/test_cli_numbers.py."""

from __future__ import annotations

import json

from test_robustness import Ctx, Outcome, api, call_cli, case, cli, env, train_args  # noqa: F401


@case("cli-bench-steps-huge", "`txl bench` with a step count that would never end", "txl bench train --steps 1e9",
      "--steps", "<= 10,000")
def _(ctx):
    return cli("bench", "train", "--steps", "1000000000")


@case("cli-bench-not-an-integer", "`txl bench` with a word for a number", "txl bench train --steps abc", "--steps",
      "integer", "--help")
def _(ctx):
    return cli("bench", "train", "--steps", "abc")


@case("cli-bench-threads-negative", "a negative thread count", "txl bench train --threads -1", "--threads", ">= 0",
      "txl's choice")
def _(ctx):
    return cli("bench", "train", "--threads", "-1")


@case("cli-bench-threads-huge", "a thread count libgomp cannot allocate (the process aborted)",
      "txl bench train --threads 1e9", "--threads", "<= 1024")
def _(ctx):
    return cli("bench", "train", "--threads", "1000000000")


@case("cli-bench-profile-huge", "a profile of a billion steps", "txl bench train --profile 1e9", "--profile",
      "<= 1000")
def _(ctx):
    return cli("bench", "train", "--profile", "1000000000")


@case("cli-bench-context-huge", "a generation context past any model", "txl bench generate --context 1e9",
      "--context", "<= 65,536")
def _(ctx):
    return cli("bench", "generate", "--context", "1000000000")


@case("cli-bench-mem-lens-empty", "an empty memory-length list (it ran the default sweep)",
      "txl bench eval --mem-lens ,", "--mem-lens", "comma-separated integers")
def _(ctx):
    return cli("bench", "eval", "--mem-lens", ",")


@case("cli-train-minutes-nan", "a non-finite time budget", "txl train --max-minutes nan", "--max-minutes",
      "finite number")
def _(ctx):
    return cli("train", "--max-minutes", "nan")


@case("cli-recl-contexts-range-huge", "a RECL context range of a billion lengths (built before any check)",
      "txl recl CKPT --contexts 1:1000000000:1", "--contexts", "at most 1,000")
def _(ctx):
    return cli("recl", str(ctx.dir / "ckpt"), "--contexts", "1:1000000000:1")


@case("cli-recl-context-too-long", "a RECL context past any model", "txl recl CKPT --contexts 8,100000000",
      "--contexts", "<= 16,777,216")
def _(ctx):
    return cli("recl", str(ctx.dir / "ckpt"), "--contexts", "8,100000000")


@case("cli-value-starts-with-dash", "a flag value that starts with `-`", "txl recl CKPT --contexts -8,8",
      "--contexts", "--flag=VALUE")
def _(ctx):
    return cli("recl", str(ctx.dir / "ckpt"), "--contexts", "-8,8")


@case("cli-beam-size-zero", "beam size 0", "txl eval CKPT --beam-size 0", "--beam-size", ">= 1")
def _(ctx):
    return cli("eval", str(ctx.dir / "ckpt"), "--beam-size", "0")


@case("cli-beam-size-huge", "a beam of a billion hypotheses", "txl generate CKPT --input FILE --beam-size 1e9",
      "--beam-size", "<= 256")
def _(ctx):
    return cli("generate", str(ctx.dir / "ckpt"), "--input", str(ctx.write("in.txt", "abc\n")), "--beam-size",
               "1000000000")


@case("cli-length-penalty-nan", "a non-finite length penalty", "txl eval CKPT --length-penalty nan",
      "--length-penalty", "finite number in [0, 10]")
def _(ctx):
    return cli("eval", str(ctx.dir / "ckpt"), "--length-penalty", "nan")


@case("cli-nproc-huge", "a process count that would fill the machine", "txl train --nproc 1e9", "--nproc",
      "<= 1024")
def _(ctx):
    return cli(*train_args(ctx, "--nproc", "1000000000"))


@case("cli-plot-loss-beyond-float", "metrics.jsonl holding a loss matplotlib cannot scale (1e308)", "txl plot RUN",
      "values not drawn", "diverged")
def _(ctx):
    run = ctx.dir / "run"
    records = [{"split": "train", "step": 1, "loss": 1e308}, {"split": "train", "step": 2, "loss": -1e308},
               {"split": "train", "step": 3, "loss": 2.0}]
    ctx.write("run/metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    outcome = cli("plot", str(run), code=0)
    assert (run / "curves.png").stat().st_size > 0
    return outcome
