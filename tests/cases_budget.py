"""Bad inputs of the demo's command line (issue 45, H1): a mistyped option of any command gets its closest
option in one line (as `--set` typos get "did you mean"), and a bad thread count names its range."""

from __future__ import annotations

from test_robustness import Ctx, Outcome, api, call_cli, case, cli, env, train_args  # noqa: F401


@case("budget-option-typo", "a mistyped option of `txl train` (it printed the top-level usage)",
      "txl train --max-stpes 5", "--max-stpes", "did you mean '--max-steps'", "txl train --help")
def _(ctx):
    return cli("train", "--max-stpes", "5")


@case("budget-option-typo-eval", "a mistyped option of `txl eval`", "txl eval RUN --splt test", "--splt",
      "did you mean '--split'", "txl eval --help")
def _(ctx):
    return cli("eval", str(ctx.dir / "run"), "--splt", "test")


@case("budget-option-unknown-nested", "an option no benchmark has", "txl bench train --stepz 3", "--stepz",
      "did you mean '--steps'", "txl bench train --help")
def _(ctx):
    return cli("bench", "train", "--stepz", "3")


@case("budget-option-stray-value", "a second checkpoint where `txl generate` takes one", "txl generate RUN OTHER",
      "unrecognized arguments: other", "txl generate --help")
def _(ctx):
    return cli("generate", str(ctx.dir / "run"), "other")


@case("budget-threads-negative", "a negative thread count", "txl train --threads -1", "--threads", ">= 0",
      "txl's choice")
def _(ctx):
    return cli(*train_args(ctx, "--threads", "-1"))
