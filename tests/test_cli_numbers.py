"""Numbers from the command line: every numeric flag of `txl bench`, `recl`, `eval`, `generate` and
`train` is type- and range-checked where it is read, and every refusal is one line with exit 2 (issue
50: 18 tracebacks, hangs and a libgomp abort from 0, -1, 1e9, nan, inf and words). Plot titles and
labels taken from run names are drawn as plain text (a run named `$\\x$` crashed `txl plot`)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import signal
from pathlib import Path

import pytest

from txl.cli.main import build_parser, main

# The commands whose numbers this file pins (data, serve and import-hf check theirs in their own tests).
COMMANDS = ("bench", "recl", "eval", "generate", "train")
MISSING = "/nonexistent/txl-checkpoint"  # a checkpoint that is never opened: the number is refused first
HUGE = "1" + "0" * 30  # an integer past every bound (and past int64)
# Values no numeric flag accepts, whatever its range.
NOT_NUMBERS = ("abc", "nan", "inf", "-inf", "1e400", "", "0x10")


def call(argv: list[str], seconds: int = 60) -> tuple[int, str]:
    """`txl ARGV` in this process: (exit code, stderr); a hang guard of `seconds`, not a speed test."""
    def hung(*_):
        raise TimeoutError(f"txl {' '.join(argv)} still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return code, err.getvalue()


def one_line(code: int, err: str) -> str:
    assert code == 2 and "Traceback" not in err and "internal error" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and ": error: " in lines[0], err
    return lines[0]


def _numeric_flags():
    """(command words, flag, action) for each numeric flag of COMMANDS: a plain int/float type or one
    of txl.argtypes' (whose functions carry the names integer, real and integer list)."""
    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, [*path, name])
            elif action.option_strings and (action.type in (int, float) or getattr(action.type, "__name__", "")
                                            in ("integer", "real", "integer list")):
                yield path, action

    for command in COMMANDS:
        for path, action in walk(build_parser(only=command), []):
            if path[0] == command:
                yield path, action.option_strings[-1], action


FLAGS = list(_numeric_flags())


def _argv(path: list[str], flag: str, value: str) -> list[str]:
    positional = {"eval": [MISSING], "generate": [MISSING, "--prompt", "x"], "recl": [MISSING, "--contexts", "4,8"],
                  "train": ["--out", "never-written"]}
    extra = {"--length-penalty": ["--beam-size", "2"], "--dynamic-decay": ["--dynamic-lr", "0.1"],
             "--attn-len": ["--vanilla"], "--stride": ["--vanilla"]}
    return [*path, *positional.get(path[0], []), *extra.get(flag, []), f"{flag}={value}"]


def _names_the_flag(line: str, flag: str) -> bool:
    name = flag.lstrip("-")
    return any(word in line for word in (flag, name, name.replace("-", "_")))


def test_the_sweep_covers_every_command():
    assert {path[0] for path, _, _ in FLAGS} == set(COMMANDS)
    benches = {path[1] for path, _, _ in FLAGS if path[0] == "bench"}
    assert benches >= {"train", "eval", "generate", "mfu", "kernel", "eval-speedup", "attention-scaling", "all"}
    assert len(FLAGS) > 75  # 79 since the studies' 19 left `txl bench` (tests/test_experiments.py sweeps theirs)


@pytest.mark.parametrize("value", NOT_NUMBERS)
def test_no_numeric_flag_takes_a_word_or_a_non_finite_number(value, tmp_path, monkeypatch):
    """Each of ~100 flags, each non-number: one line naming the flag, exit 2 (no traceback, nothing run)."""
    monkeypatch.chdir(tmp_path)
    for path, flag, _ in FLAGS:
        argv = _argv(path, flag, value)
        line = one_line(*call(argv))
        assert _names_the_flag(line, flag), (argv, line)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", [HUGE, "-" + HUGE])
def test_no_numeric_flag_takes_a_number_past_every_bound(value, tmp_path, monkeypatch):
    """10^30 and -10^30: refused where read, before any model, thread pool or process is made (a
    huge --threads aborted the process in libgomp; a huge --nproc started that many trainers; a huge
    --steps, --profile or --contexts range never ended)."""
    monkeypatch.chdir(tmp_path)
    # more than the vocabulary: all of it; a huge temperature: uniform sampling; a huge dynamic-evaluation
    # step: a non-finite loss, which `txl eval` reports in one line
    unbounded = {"--top-k", "--temperature", "--dynamic-lr"}
    for path, flag, _ in FLAGS:
        if flag in unbounded and not value.startswith("-"):
            continue
        argv = _argv(path, flag, value)
        line = one_line(*call(argv))
        assert _names_the_flag(line, flag), (argv, line)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("argv", "expected"), [
    (["bench", "train", "--steps", "0"], "--steps must be >= 1 and <= 10,000, got 0"),
    (["bench", "train", "--steps", "1000000000"], "--steps must be >= 1 and <= 10,000"),
    (["bench", "train", "--warmup", "-1"], "--warmup must be >= 0"),
    (["bench", "train", "--threads", "-1"], "--threads must be >= 0 and <= 1024 (0 = txl's choice), got -1"),
    (["bench", "train", "--threads", "1000000000"], "--threads must be >= 0 and <= 1024"),
    (["bench", "train", "--profile", "1000000000"], "--profile must be >= 0 and <= 1000"),
    (["bench", "generate", "--context", "1"], "--context must be >= 2"),
    (["bench", "generate", "--context", "1000000000"], "--context must be >= 2 and <= 65,536"),
    (["bench", "eval", "--mem-lens", ","], "--mem-lens must be 1 to 64 comma-separated integers"),
    (["bench", "eval", "--mem-lens", "0,8"], "each >= 1 and <= 65,536"),
    (["bench", "eval-speedup", "--attn-len", "0"], "--attn-len must be 1 to 64 comma-separated integers"),
    (["bench", "attention-scaling", "--lengths", "512,abc"], "--lengths must be"),
    (["bench", "attention-scaling", "--max-gb", "0"], "--max-gb must be a finite number in (0, 1,000,000], got 0"),
    # the studies' numbers (experiments/arena.py, recipes.py, claims.py): tests/test_experiments.py
    (["recl", MISSING, "--contexts", "1:1000000000:1"], "at most 1,000 context lengths"),
    (["recl", MISSING, "--contexts", "8,100000000"], "<= 16,777,216"),
    (["recl", MISSING, "--contexts", "4,8", "--r", "0.1,nan"], "(0, 1]"),
    (["recl", MISSING, "--contexts", "-8,8"], "--flag=VALUE"),
    (["eval", MISSING, "--beam-size", "0"], "--beam-size must be >= 1 and <= 256, got 0"),
    (["eval", MISSING, "--beam-size", "1000000000"], "--beam-size must be >= 1 and <= 256"),
    (["eval", MISSING, "--length-penalty", "nan"], "--length-penalty must be a finite number in [0, 10]"),
    (["generate", MISSING, "--input", "in.txt", "--beam-size", "-3"], "--beam-size must be >= 1"),
    (["generate", MISSING, "--input", "in.txt", "--length-penalty", "-1"], "--length-penalty must be a finite number in [0, 10]"),
    (["train", "--nproc", "1000000000"], "--nproc must be >= 0 and <= 1024 (0 = this process only)"),
    (["train", "--nproc", "-2"], "--nproc must be >= 0"),
])
def test_each_out_of_range_number_is_one_line_naming_the_flag_and_its_range(argv, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_line(*call(argv))
    assert expected in line, line


def test_argparse_mistakes_are_one_line_too(capsys):
    """Unknown flags, missing values and bad choices: one line with the fix, no usage block."""
    for argv, expected in ((["bench", "nonsense"], "invalid choice"), (["recl", MISSING], "--contexts"),
                           (["--bogus"], "unrecognized arguments"), (["train", "--nproc"], "expected one argument")):
        line = one_line(*call(argv))
        assert expected in line and "usage:" not in line, line
        assert line.endswith("--help`"), line


def test_nproc_past_this_machines_cpus_is_refused_before_launching(monkeypatch, tmp_path):
    """More processes than cores only queue (and 10^5 of them filled the machine); the launcher refuses."""
    import os
    import subprocess

    import txl.cli.train as train_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(subprocess, "call", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.setattr(train_cli.sys, "argv", ["txl", "train", "--nproc", "3"])
    line = one_line(*call(["train", "--nproc", "3"]))
    assert "--nproc 3 is more than the 2 CPUs" in line and "--nproc 2 or fewer" in line


def test_seq2seq_generate_checks_its_sampling_numbers_before_reading_anything(tmp_path, monkeypatch):
    """`txl generate RUN --input FILE`: the sampling numbers an LM run checks are checked here too
    (a nan temperature silently meant greedy decoding)."""
    monkeypatch.chdir(tmp_path)
    for argv, expected in ((["--temperature", "nan"], "temperature"), (["--temperature", "-1"], "temperature"),
                           (["--temperature", "0.5", "--top-k", "-1"], "top_k"),
                           (["--max-new-tokens", "0"], "max_new_tokens"),
                           (["--max-new-tokens", "1000000000"], "max_new_tokens"),
                           (["--seed", "-1"], "seed")):
        line = one_line(*call(["generate", MISSING, "--input", "in.txt", "--beam-size", "1", *argv]))
        assert expected in line, line


def test_beam_search_refuses_sizes_and_penalties_it_cannot_use():
    import torch

    from txl.errors import UsageError
    from txl.generate.seq2seq import MAX_BEAM, beam_search
    from txl.models.seq2seq.config import EncoderDecoderConfig
    from txl.models.seq2seq.model import EncoderDecoder

    config = EncoderDecoderConfig(n_layer=1, n_encoder_layer=1, d_model=16, n_head=2, d_head=8,
                                  d_inner=32, vocab_size=12, pos_encoding="sinusoidal", dropout=0.0)
    model = EncoderDecoder(config).eval()
    source = torch.tensor([[3, 4, 5]])
    for kwargs, message in ((dict(beam_size=MAX_BEAM + 1), f"beam_size must be <= {MAX_BEAM}"),
                            (dict(beam_size=2, alpha=float("nan")), "alpha must be a finite number"),
                            (dict(beam_size=2, alpha=float("inf")), "alpha must be a finite number")):
        with pytest.raises(UsageError, match=message):
            beam_search(model, source, bos=1, eos=2, max_len=4, **kwargs)


# ---------------------------------------------------------------------------------------------
# Run names and titles drawn as plain text (matplotlib reads $...$ as mathtext)


MATH = ["$\\x$", "cost $5 and $6", "a_b^c $\\frac{1}{0}", "$$", "\\$x$"]


def _metrics_run(directory: Path) -> Path:
    directory.mkdir(parents=True)
    records = [{"split": "train", "step": s, "loss": 3.0 - 0.1 * s, "bpc": 4.0 - 0.1 * s, "lr": 1e-3,
                "tokens_per_second": 100.0} for s in range(1, 4)] + [{"split": "valid", "step": 3, "loss": 2.9,
                                                                       "bpc": 4.1}]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


@pytest.mark.parametrize("name", MATH)
def test_plot_of_a_run_named_with_mathtext_draws_the_name_as_written(name, tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    from txl.cli.plot import draw_runs

    run = _metrics_run(tmp_path / name.replace("/", "_"))
    code, err = call(["plot", str(run), "--out", str(tmp_path / "curves.png")])
    assert code == 0, err
    assert (tmp_path / "curves.png").stat().st_size > 0
    code, err = call(["plot", str(run), "--out", str(tmp_path / "titled.png"), "--title", name])
    assert code == 0, err
    fig = draw_runs([run], title=name)
    fig.canvas.draw()  # the text is laid out (where mathtext would be parsed)
    assert drawn_as(fig._suptitle.get_text()) == name
    labels = [drawn_as(t.get_text()) for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert labels and all(label.startswith(f"{run.name} ") for label in labels)
    import matplotlib.pyplot as plt

    plt.close(fig)


def drawn_as(text: str) -> str:
    """What matplotlib shows for `text`: plain text (no mathtext), its escaped dollars as dollars."""
    from matplotlib import cbook

    assert not cbook.is_math_text(text), f"{text!r} is drawn as mathtext"
    return text.replace("\\$", "$")


def test_recl_plot_draws_checkpoint_names_as_written(tmp_path):
    import numpy as np

    from txl.eval.recl import compute_recl, plot_recl

    rng = np.random.default_rng(0)
    contexts = [4, 8, 16]
    losses = {name: {c: rng.random(50) + 1 / c for c in contexts} for name in ("$\\x$", "plain")}
    result = compute_recl(losses, contexts, [0.5, 1.0], threshold=0.01)
    path = plot_recl(result, tmp_path / "recl.png", metric="bpc")
    assert Path(path).stat().st_size > 0


# ---------------------------------------------------------------------------------------------
# Numbers `txl plot` reads from metrics.jsonl


def _records_run(directory: Path, records: list[dict]) -> Path:
    directory.mkdir(parents=True)
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


@pytest.mark.parametrize("values", [
    [1e308, -1e308],  # a finite loss near the largest float raised ValueError inside savefig
    [float("nan"), float("inf"), float("-inf")],  # a diverged run records these (not 0.0)
    [-5.0, 0.0],  # perplexities the log axis cannot take
], ids=["huge", "non-finite", "non-positive-ppl"])
def test_plot_draws_what_it_can_and_notes_the_values_left_out(values, tmp_path):
    records = [{"split": "train", "step": s + 1, "loss": v, "ppl": v, "lr": v, "tokens_per_second": v}
               for s, v in enumerate(values)] + [{"split": "train", "step": 9, "loss": 2.0, "ppl": 7.4, "lr": 1e-3,
                                                   "tokens_per_second": 10.0}]
    run = _records_run(tmp_path / "run", records)
    code, err = call(["plot", str(run)])
    assert code == 0, err
    assert "Traceback" not in err and "Warning" not in err, err
    assert "values not drawn" in err and (run / "curves.png").stat().st_size > 0


@pytest.mark.parametrize("record", [
    {"split": "train", "step": 1, "loss": 10**400},  # no float holds it: OverflowError inside matplotlib
    {"split": "train", "step": -1, "loss": 1.0},
    {"split": "train", "step": 10**30, "loss": 1.0},
    {"split": "train", "step": 1, "lr": "0.1"},
], ids=["int-beyond-float", "negative-step", "huge-step", "string-value"])
def test_plot_refuses_a_record_no_run_writes_in_one_line(record, tmp_path):
    run = _records_run(tmp_path / "run", [record])
    line = one_line(*call(["plot", str(run)]))
    assert "metrics.jsonl:1 is not a metrics record" in line and "damaged" in line


def test_plot_reads_a_regular_metrics_file_and_nothing_else(tmp_path):
    """A FIFO in place of metrics.jsonl hung `txl plot` for ever; a link is not followed."""
    import os

    fifo = tmp_path / "fifo-run"
    fifo.mkdir()
    os.mkfifo(fifo / "metrics.jsonl")
    line = one_line(*call(["plot", str(fifo)], seconds=20))
    assert "metrics.jsonl" in line and "not a regular file" in line
    linked = tmp_path / "linked-run"
    linked.mkdir()
    _records_run(tmp_path / "elsewhere", [{"split": "train", "step": 1, "loss": 1.0}])
    (linked / "metrics.jsonl").symlink_to(tmp_path / "elsewhere" / "metrics.jsonl")
    line = one_line(*call(["plot", str(linked)]))
    assert "symbolic link" in line


def test_eval_sweep_and_recl_of_a_run_named_with_mathtext(tmp_path, monkeypatch):
    """Both plot titles and labels made of the run's directory name (`txl eval --sweep-mem`, `txl recl --out`)."""
    import helpers

    monkeypatch.setenv("TXL_CACHE_DIR", str(tmp_path / "cache"))
    corpus = helpers.make_corpus(tmp_path / "corpus.txt", lines=300)
    config = helpers.write_config(tmp_path, corpus, steps=2, varlen="false")
    run = tmp_path / "$\\x$"
    tiny = ["--set", "model.n_layer=1", "--set", "model.d_model=16", "--set", "model.d_head=8",
            "--set", "model.d_inner=32", "--set", "model.mem_len=8", "--set", "tgt_len=8"]
    code, err = call(["train", "--config", str(config), "--out", str(run), "--quiet", *tiny], seconds=300)
    assert code == 0, err
    code, err = call(["eval", str(run), "--device", "cpu", "--quiet", "--max-tokens", "200", "--sweep-mem", "0,8",
                      "--sweep-out", str(tmp_path / "sweep")], seconds=300)
    assert code == 0, err
    assert (tmp_path / "sweep.png").stat().st_size > 0
    code, err = call(["recl", str(run), "--device", "cpu", "--contexts", "4,8", "--positions", "50",
                      "--out", str(tmp_path / "recl")], seconds=300)
    assert code == 0, err
    assert (tmp_path / "recl.png").stat().st_size > 0


def test_recl_cache_reads_only_a_regular_file_of_the_expected_size(tmp_path):
    """A FIFO in a --cache directory hung `txl recl`; a .npy whose header claims 3 GiB on a sparse file
    was read into memory. Both are named in one line (delete the file), quickly."""
    import os

    import numpy as np

    from txl.errors import DataError
    from txl.eval.recl import _read_cached

    np.save(tmp_path / "good.npy", np.arange(10, dtype=np.float64))
    assert _read_cached(tmp_path / "good.npy", 10).tolist() == list(range(10))
    os.mkfifo(tmp_path / "fifo.npy")
    with pytest.raises(DataError, match="not a regular file"):
        _read_cached(tmp_path / "fifo.npy", 10)
    big = tmp_path / "big.npy"
    header = np.lib.format.header_data_from_array_1_0(np.zeros(1, np.float64)) | {"shape": (400_000_000,)}
    with open(big, "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        f.truncate(400_000_000 * 8 + 128)  # sparse: no disk used
    with pytest.raises(DataError, match="cached losses .*big.npy"):
        _read_cached(big, 10)
