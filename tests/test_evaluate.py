"""Evaluation: memory = one full pass, batch-size invariance, per-token dumps, the vanilla baseline, the
memory sweep, `txl eval` = the Python API, and bad inputs ending in one line with exit code 2."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from txl.cli.main import main
from txl.data import parse_spec
from txl.errors import CheckpointError
from txl.eval.api import evaluate_checkpoint
from txl.eval.report import load_per_token
from txl.eval.segments import evaluate
from txl.eval.vanilla import context_nll, evaluate_vanilla
from txl.models.checkpoint import load_checkpoint
from txl.models.pretrained import resolve_checkpoint
from txl.train import Trainer
from txl.train.config import build_run_config

TOML = """
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
batch_size = 8
lr = 3e-3
warmup_steps = 10
max_steps = 120
log_interval = 1000
eval_interval = 120
eval_max_tokens = 2000
eval_batch_size = 4
final_splits = []
"""


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from threads, and on a shared 2-core machine they lose 10× to contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("txl-cache")


@pytest.fixture(autouse=True)
def _cache_env(cache, monkeypatch):
    monkeypatch.setenv("TXL_CACHE_DIR", str(cache))


def write_corpus(path: Path, seed: int = 0, lines: int = 700) -> Path:
    """Short lines of a few words, each line repeated once: some context is worth remembering."""
    rng = random.Random(seed)
    words = ["memory", "segment", "attention", "relative", "position", "token", "layer", "the", "of", "and"]
    out = []
    for _ in range(lines):
        line = " ".join(rng.choice(words) for _ in range(rng.randint(2, 6)))
        out += [line, line]
    path.write_text("\n".join(out) + "\n")
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, cache) -> tuple[Path, str]:
    """A tiny model trained for a few seconds with the real trainer: (run directory, data spec)."""
    import os

    os.environ["TXL_CACHE_DIR"] = str(cache)
    base = tmp_path_factory.mktemp("run")
    corpus = write_corpus(base / "corpus.txt")
    config = base / "run.toml"
    config.write_text(TOML.format(corpus=corpus))
    torch.manual_seed(0)
    Trainer(build_run_config(config_file=config), base / "run", quiet=True).fit()
    return base / "run", f"text:{corpus}?tokenizer=bytes"


@pytest.fixture(scope="module")
def ckpt(run_dir):
    return load_checkpoint(run_dir[0])


def full_pass_nll(model, tokens: np.ndarray) -> np.ndarray:
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    with torch.no_grad():
        return model(ids[None, :-1], labels=ids[None, 1:], mem_len=0).nll[0].numpy()


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# -- invariances ------------------------------------------------------------------------------------


def test_memory_covering_the_split_equals_one_full_pass(ckpt, run_dir):
    _, tokens = _valid(ckpt, run_dir, 400)
    per_token = np.zeros(len(tokens) - 1, np.float32)
    result = evaluate(ckpt.model, tokens, metric="bpc", batch_size=1, tgt_len=7, mem_len=len(tokens),
                      per_token=per_token)
    reference = full_pass_nll(ckpt.model, tokens)
    assert result.tokens == len(tokens) - 1
    np.testing.assert_allclose(per_token, reference, atol=2e-5)
    assert result.loss == pytest.approx(float(reference.mean()), abs=1e-6)


def test_row_groups_and_in_place_memory_change_nothing(ckpt, run_dir, monkeypatch):
    """Long-memory evaluation runs streams in row groups that overwrite one memory in place; forced
    down to one row per group, it must score every token as the plain allocating forward does."""
    import txl.eval.segments

    _, tokens = _valid(ckpt, run_dir, 600)
    settings = dict(metric="bpc", batch_size=4, tgt_len=8, mem_len=24)
    expected = np.zeros(len(tokens) - 1, np.float32)
    evaluate(ckpt.model, tokens, per_token=expected, **settings)
    monkeypatch.setattr(txl.eval.segments, "EVAL_GROUP_ELEMENTS", 1)  # one row per group
    grouped = np.zeros(len(tokens) - 1, np.float32)
    evaluate(ckpt.model, tokens, per_token=grouped, **settings)
    np.testing.assert_allclose(grouped, expected, atol=1e-6)


def _valid(ckpt, run_dir, n: int):
    from txl.data import open_corpus

    corpus = open_corpus(run_dir[1])
    return corpus, np.asarray(corpus.split("valid")[:n])


def test_batch_sizes_agree_and_warm_memory_shrinks_the_gap(ckpt, run_dir):
    losses = {}
    for batch in (1, 4):
        for warm in (False, True):
            result, _ = evaluate_checkpoint(ckpt, split="valid", batch_size=batch, warm_memory=warm, tgt_len=16)
            losses[batch, warm] = result.loss
    assert losses[1, False] == losses[1, True]  # one stream: nothing to warm
    cold = abs(losses[4, False] - losses[1, False]) / losses[1, False]
    warm = abs(losses[4, True] - losses[1, True]) / losses[1, True]
    print(f"\nbatch 1 vs 4, relative loss gap: without warm memory {cold:.5%}, with warm memory {warm:.5%}")
    assert cold < 0.005
    assert warm < cold


def test_per_token_dump_is_in_corpus_order_and_sums_to_the_loss(ckpt, run_dir, tmp_path, capsys):
    run, _ = run_dir
    for name in ("nll.npy", "nll.txt"):
        # batch 4 with warm memory covering the split: every token sees its whole history, so the
        # dump must equal one full pass position by position, whatever stream scored it
        code, out, err = run_cli(capsys, "eval", run, "--batch-size", 4, "--max-tokens", 300, "--mem-len", 400,
                                 "--tgt-len", 8, "--json", "--per-token", tmp_path / name)
        assert code == 0, err
        result = json.loads(out)
        values = load_per_token(tmp_path / name)
        assert values.shape == (300,)
        assert float(np.mean(values, dtype=np.float64)) == pytest.approx(result["loss"], rel=1e-6)
        _, tokens = _valid(ckpt, run_dir, 301)
        np.testing.assert_allclose(values, full_pass_nll(ckpt.model, tokens), atol=2e-5)
    with open(tmp_path / "nll.npy", "rb") as f:
        assert f.read(6) == b"\x93NUMPY"  # plain numpy array: np.load(allow_pickle=False) reads it


def test_cli_and_python_api_give_the_same_number(run_dir, capsys):
    run, spec = run_dir
    code, out, err = run_cli(capsys, "eval", run, "--split", "test", "--batch-size", 3, "--clamp-len", 20,
                             "--same-length", "--json")
    assert code == 0, err
    cli = json.loads(out)
    api, _ = evaluate_checkpoint(run, split="test", batch_size=3, clamp_len=20, same_length=True)
    assert cli["loss"] == api.loss and cli["bpc"] == api.value and cli["tokens"] == api.tokens
    assert cli["data"] == parse_spec(spec).canonical()  # --data defaults to the run's corpus (stored absolute)
    assert (cli["clamp_len"], cli["same_length"], cli["mem_len"], cli["tgt_len"]) == (20, True, 16, 16)
    assert cli["attn_len"] == 16  # same_length: every query sees exactly mem_len keys
    code, out, _ = run_cli(capsys, "eval", run, "--split", "test", "--batch-size", 3)
    assert code == 0 and "bpc" in out and "warm memory" in out and "tokens/s" in out


# -- the vanilla baseline ----------------------------------------------------------------------------


def test_vanilla_with_a_long_window_equals_full_context_scoring(ckpt, run_dir):
    _, tokens = _valid(ckpt, run_dir, 200)
    reference = full_pass_nll(ckpt.model, tokens)
    per_token = np.zeros(199, np.float32)
    result = evaluate_vanilla(ckpt.model, tokens, metric="bpc", attn_len=256, per_token=per_token)
    np.testing.assert_allclose(per_token, reference, atol=2e-5)
    assert result.tokens == 199 and result.mode == "vanilla"
    # a shorter window: the first L targets still see their whole history
    per_token = np.zeros(199, np.float32)
    evaluate_vanilla(ckpt.model, tokens, metric="bpc", attn_len=50, batch_size=7, per_token=per_token)
    np.testing.assert_allclose(per_token[:50], reference[:50], atol=2e-5)


def test_vanilla_scores_each_token_from_exactly_its_window(ckpt, run_dir):
    _, tokens = _valid(ckpt, run_dir, 120)
    L = 20
    per_token = np.zeros(119, np.float32)
    evaluate_vanilla(ckpt.model, tokens, metric="bpc", attn_len=L, batch_size=6, per_token=per_token)
    for k in (21, 57, 119):  # target k from tokens[k - L : k] alone, one forward each
        direct = full_pass_nll(ckpt.model, tokens[k - L : k + 1])[-1]
        assert per_token[k - 1] == pytest.approx(float(direct), abs=2e-5)
    np.testing.assert_allclose(context_nll(ckpt.model, tokens, np.arange(1, 120), context_len=L), per_token,
                               atol=2e-5)
    # stride: every target scored once, the loss is their mean; context shrinks for earlier positions
    strided = np.full(119, np.nan, np.float32)
    result = evaluate_vanilla(ckpt.model, tokens, metric="bpc", attn_len=L, stride=7, per_token=strided)
    assert result.tokens == 119 and not np.isnan(strided).any()
    assert result.loss == pytest.approx(float(strided.mean(dtype=np.float64)), rel=1e-6)
    assert strided[L + 7 - 1] == pytest.approx(float(per_token[L + 7 - 1]), abs=2e-5)  # last of a window: L


def test_vanilla_cli(run_dir, capsys):
    code, out, err = run_cli(capsys, "eval", run_dir[0], "--vanilla", "--attn-len", 24, "--max-tokens", 60,
                             "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["mode"] == "vanilla" and result["attn_len"] == 24 and result["tokens"] == 60


# -- the memory sweep ---------------------------------------------------------------------------------


def test_sweep_writes_a_table_and_a_png(run_dir, tmp_path, capsys):
    prefix = tmp_path / "docs" / "sweep"
    code, out, err = run_cli(capsys, "eval", run_dir[0], "--sweep-mem", "0,8,32", "--max-tokens", 500,
                             "--sweep-out", prefix)
    assert code == 0, err
    assert "| mem_len | tgt_len | attention length | bpc |" in out
    table = prefix.with_suffix(".md").read_text()
    assert "| 32 | 16 | 48 |" in table
    assert prefix.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads(prefix.with_suffix(".json").read_text())
    assert [r["mem_len"] for r in rows] == [0, 8, 32]


# -- the eval speed-up benchmark (timing itself lives in `txl bench`; this only checks it runs) ---------


def test_eval_speedup_bench_runs(capsys):
    from txl.bench.eval_speedup import main as bench

    assert bench(["--attn-len", "24,40", "--config", "tiny", "--tgt-len", "16", "--steps", "1", "--warmup", "0",
                  "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["attn_len"] for r in result["rows"]] == [24, 40]
    assert all(r["speedup"] > 0 and r["tgt_len"] == 16 for r in result["rows"])
    with pytest.raises(SystemExit) as refused:  # argparse's own exit: one line, status 2
        bench(["--attn-len", "0", "--config", "tiny"])
    assert refused.value.code == 2
    assert "--attn-len" in capsys.readouterr().err


# -- checkpoints ---------------------------------------------------------------------------------------


def test_resolve_checkpoint_accepts_runs_and_model_directories(run_dir, tmp_path):
    run, _ = run_dir
    assert resolve_checkpoint(run) == run / "best"
    assert resolve_checkpoint(run / "last") == run / "last"
    only_last = tmp_path / "only-last"
    only_last.mkdir()
    (only_last / "last").symlink_to(run / "last")
    assert resolve_checkpoint(only_last) == only_last / "last"
    with pytest.raises(CheckpointError, match="not found"):
        resolve_checkpoint(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="neither a checkpoint"):
        resolve_checkpoint(tmp_path)


# -- bad inputs: one line, exit code 2, no traceback -------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--data", "text:{corpus}?tokenizer=chars"], "vocabulary mismatch"),
        (["--mem-len", "-1"], "--mem-len must be >= 0"),
        (["--split", "nope"], "no split 'nope'"),
        (["--tgt-len", "0"], "--tgt-len must be >= 1"),
        (["--per-token", "x.csv"], ".npy or .txt"),
        (["--same-length", "--mem-len", "0"], "same_length needs mem_len >= 1"),
        (["--sweep-mem", "0,-4"], "must be >= 0"),
        (["--attn-len", "10"], "add --vanilla"),
    ],
)
def test_bad_inputs_end_in_one_line(run_dir, capsys, extra, expected):
    run, spec = run_dir
    corpus = spec.removeprefix("text:").split("?")[0]
    code, out, err = run_cli(capsys, "eval", run, *[e.format(corpus=corpus) for e in extra])
    assert code == 2, (out, err)
    assert expected in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_an_unwritable_output_is_one_line(run_dir, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    code, _, err = run_cli(capsys, "eval", run_dir[0], "--max-tokens", 50, "--per-token", tmp_path / "file" / "x.npy")
    assert code == 2 and "cannot write" in err and len(err.strip().splitlines()) == 1


def test_unknown_checkpoint_directory(tmp_path, capsys):
    code, _, err = run_cli(capsys, "eval", tmp_path / "nowhere", "--data", "builtin")
    assert code == 2 and "checkpoint not found" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(capsys, "eval", tmp_path)
    assert code == 2 and "neither a checkpoint" in err


@pytest.mark.slow
def test_bad_input_in_a_subprocess_has_no_traceback(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "txl", "eval", str(tmp_path / "nowhere")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("txl eval: error: checkpoint not found")
    assert "Traceback" not in proc.stderr


# -- a run whose corpus has no valid split (issue 45): the `txl eval RUN` that `txl train` prints works ----

TINY = ["--set", "model.n_layer=1", "--set", "model.d_model=16", "--set", "model.d_head=8", "--set",
        "model.d_inner=32", "--set", "model.mem_len=8", "--set", "tgt_len=8", "--set", "max_steps=2",
        "--set", "sample_tokens=0"]


@pytest.mark.parametrize(("files", "scored", "note"), [
    (("train.txt",), "train", "the text the run learned from"),
    (("train.txt", "test.txt"), "test", "held-out"),
])
def test_eval_of_a_run_without_a_valid_split_scores_the_split_it_has(tmp_path, capsys, files, scored, note):
    corpus = tmp_path / "texts"
    corpus.mkdir()
    for name in files:
        write_corpus(corpus / name, seed=len(name), lines=100)
    code, out, err = run_cli(capsys, "train", "--data", f"text:{corpus}", "--out", tmp_path / "run", "--quiet", *TINY)
    assert code == 0, err
    assert f"txl eval {tmp_path / 'run'} " in out  # the hint this test follows
    code, out, err = run_cli(capsys, "eval", tmp_path / "run", "--device", "cpu", "--json")
    assert code == 0, err
    assert json.loads(out)["split"] == scored
    assert f"scoring {scored}" in err and note in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(capsys, "eval", tmp_path / "run", "--device", "cpu", "--split", "valid")
    assert code == 2 and "no split 'valid'" in err  # asked for by name: still one line, no fallback
