"""`txl bench`: every benchmark runs end to end on a tiny budget (numbers are never asserted: speed
lives in docs/results/benchmarks.md, not in tests)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from txl.bench.common import SHAPES, Shape, hf_available, shape_named
from txl.bench.mfu import forward_flops, train_step_flops
from txl.cli.bench import BENCHES
from txl.cli.main import main

# A shape even smaller than `tiny`, so the smoke runs take seconds.
SHAPES.setdefault("smoke", Shape("smoke", n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, tgt_len=16,
                                 mem_len=16, batch=2, eval_tgt_len=8, eval_batch=2, eval_mem_lens=(8, 24)))


@pytest.fixture
def smoke_shape(monkeypatch):
    # the CLI only offers tiny|base; run the smoke shape under the name "tiny"
    monkeypatch.setitem(SHAPES, "tiny", SHAPES["smoke"])


def run_cli(args, tmp_path, capsys):
    out_json = tmp_path / "result.json"
    assert main(["bench", *args, "--json", str(out_json)]) == 0
    return json.loads(out_json.read_text()), capsys.readouterr().out


@pytest.mark.slow
def test_bench_cli_imports_no_torch():
    code = "import sys, txl.cli.bench; print(any(m == 'torch' or m.startswith('torch.') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_train_bench(smoke_shape, tmp_path, capsys):
    result, text = run_cli(["train", "--steps", "1", "--warmup", "0", "--no-rss"], tmp_path, capsys)
    assert [row["contender"] for row in result["rows"]] == ["txl-eager", "txl-fast"]
    assert all(row["tokens_per_s"] > 0 for row in result["rows"])
    assert "| txl-fast |" in text and "cpu" in result["machine"] and result["profiles"] == {}


def test_train_bench_profiles_where_a_step_goes(smoke_shape, tmp_path, capsys):
    result, text = run_cli(["train", "--steps", "1", "--warmup", "0", "--no-rss", "--impl", "fast", "--profile", "2"],
                           tmp_path, capsys)
    ops = result["profiles"]["txl-fast"]
    assert 0 < len(ops) <= 25 and all(op["self_ms_per_step"] >= 0 for op in ops)
    assert ops == sorted(ops, key=lambda op: -op["self_ms_per_step"]) and sum(op["percent"] for op in ops) <= 100.001
    assert any("mm" in op["op"] or "linear" in op["op"] for op in ops)  # a training step multiplies matrices
    assert "**profile of txl-fast**" in text


@pytest.mark.parametrize("preset", ["ptb-char-small", "ptb-word-small"])
def test_train_bench_times_a_presets_shape(preset, tmp_path, capsys, monkeypatch):
    import dataclasses

    from txl.train.config import load_preset

    values = load_preset(preset)
    shape = shape_named(preset)  # the preset's own model, segment, memory and batch
    assert (shape.n_layer, shape.d_model, shape.mem_len) == tuple(values["model"][k] for k in ("n_layer", "d_model", "mem_len"))
    assert (shape.tgt_len, shape.batch) == (values["train"]["tgt_len"], values["train"]["batch_size"])
    assert shape.model_config().cutoffs == tuple(values["model"].get("cutoffs", ()))
    # the same keys at a smaller size, so the smoke run takes a second
    monkeypatch.setitem(SHAPES, preset, dataclasses.replace(shape, n_layer=1, batch=2, tgt_len=8, mem_len=8))
    result, text = run_cli(["train", "--config", preset, "--steps", "1", "--warmup", "0", "--no-rss", "--impl",
                            "fast"], tmp_path, capsys)
    assert result["config"] == preset and result["rows"][0]["tokens_per_s"] > 0 and preset in text
    if "cutoffs" in values["model"]:
        assert main(["bench", "mfu", "--config", preset]) == 2
        assert "adaptive softmax" in capsys.readouterr().err


@pytest.mark.skipif(hf_available() is None, reason="needs transformers==4.35.2 (bench extra)")
def test_train_bench_against_hf_with_rss_probe(smoke_shape, tmp_path, capsys, monkeypatch):
    # the probe subprocess cannot see the monkeypatched shape: measure RSS with the real tiny
    from txl.bench import train

    monkeypatch.setattr(train, "probe", lambda kind, payload, **kw: {"peak_rss_mb": 1.0, "work_rss_mb": 0.5})
    result, text = run_cli(["train", "--steps", "1", "--warmup", "0", "--against", "hf", "--impl", "fast"],
                           tmp_path, capsys)
    rows = {row["contender"]: row for row in result["rows"]}
    assert set(rows) == {"txl-fast", "hf"} and rows["hf"]["x_hf"] == 1.0
    assert "× HF" in text


@pytest.mark.slow
def test_probe_measures_a_fresh_process():
    out = subprocess.run(
        [sys.executable, "-m", "txl.bench.probe", "eval",
         json.dumps({"name": "txl-fast", "config": "tiny", "precision": "fp32", "mem_len": 8, "steps": 1})],
        capture_output=True, text=True, check=True,
    )
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    assert answer["peak_rss_mb"] >= answer["base_rss_mb"] > 0


def test_eval_bench(smoke_shape, tmp_path, capsys):
    result, _ = run_cli(["eval", "--steps", "1", "--warmup", "0", "--no-rss", "--mem-lens", "8,24",
                         "--precision", "bf16"], tmp_path, capsys)
    assert [(r["mem_len"], r["contender"]) for r in result["rows"]] == [
        (8, "txl-eager"), (8, "txl-fast"), (24, "txl-eager"), (24, "txl-fast")]


def test_generate_bench(smoke_shape, tmp_path, capsys):
    result, _ = run_cli(["generate", "--steps", "1", "--warmup", "0", "--context", "32", "--impl", "fast"],
                        tmp_path, capsys)
    modes = {row["mode"]: row for row in result["rows"]}
    assert set(modes) == {"memory reuse", "full re-run"} and modes["memory reuse"]["speedup"] > 0


def test_mfu_bench_runs_both_precisions(smoke_shape, tmp_path, capsys, monkeypatch):
    from txl.bench import mfu

    monkeypatch.setattr(mfu, "PEAK_N", 128)
    result, text = run_cli(["mfu", "--steps", "1", "--warmup", "0", "--impl", "fast"], tmp_path, capsys)
    assert [row["precision"] for row in result["rows"]] == ["fp32", "bf16"]
    assert all(row["mfu"] > 0 for row in result["rows"]) and "MFU" in text


def test_kernel_bench(smoke_shape, tmp_path, capsys):
    result, text = run_cli(["kernel", "--steps", "1", "--warmup", "0"], tmp_path, capsys)
    assert [row["mode"] for row in result["rows"]] == ["forward+backward", "forward"]
    assert all(row["speedup"] > 0 for row in result["rows"]) and "fast × eager" in text


def test_curve_bench(smoke_shape, tmp_path, capsys):
    from txl.bench.curve import plot

    result, text = run_cli(["curve", "--quick"], tmp_path, capsys)
    assert [row["run"] for row in result["rows"]] == ["fp32", "fp32 (dropout seed 1)", "bf16"]
    assert all(len(c) == 20 for c in result["curves"].values()) and "noise" in text
    plot(result, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 0


def test_flop_count_by_hand():
    shape = SHAPES["smoke"]  # t = 32 tokens, n = 32 keys, d = HD = 32, d_inner 64, vocab 256
    t, n, b = 32, 32, 2
    layer = 2 * t * 32 * 32 + 2 * b * n * 32 * 64 + 2 * t * 32 * 32 + 2 * t * 32 * 64 * 2 + 2 * n * 32 * 32 \
        + 3 * 2 * b * 2 * 16 * n * 16
    assert forward_flops(shape) == 2 * layer + 2 * t * 32 * 256
    assert train_step_flops(shape) == 3 * forward_flops(shape)


@pytest.mark.slow
def test_all_quick_writes_the_report(smoke_shape, tmp_path, capsys, monkeypatch):
    from txl.bench import mfu, report

    monkeypatch.setattr(mfu, "PEAK_N", 128)
    monkeypatch.setattr(report, "EXTERNAL", ())  # other issues' benchmarks test themselves
    out = tmp_path / "docs"
    assert main(["bench", "all", "--quick", "--no-rss", "--steps", "1", "--warmup", "0", "--out", str(out)]) == 0
    text = (out / "benchmarks.md").read_text()
    for heading in ("## Machine", "Attention kernel", "Training throughput", "Evaluation throughput", "Generation",
                    "Model FLOP"):
        assert heading in text
    assert (out / "bench_train.png").stat().st_size > 0
    assert any(p.name.startswith("bench_eval_") for p in out.glob("*.png"))
    report = json.loads((out / "benchmarks.json").read_text())
    assert {r["bench"] for r in report["results"]} >= {"train", "eval", "generate", "mfu"}


@pytest.mark.slow
def test_unknown_or_missing_bench_is_a_one_line_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "txl", "bench", "nonsense"], capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "txl", "bench", "train", "--steps", "0"], capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "--steps" in proc.stderr
    assert set(BENCHES) >= {"train", "eval", "generate", "mfu", "eval-speedup"}


@pytest.mark.parametrize("name", ["train", "all"])
def test_each_bench_has_help(name, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", name, "--help"])
    assert info.value.code == 0 and "--json" in capsys.readouterr().out


def test_every_attention_scaling_variant_builds_and_runs_one_layer():
    """Each kernel listed by `txl bench attention-scaling` (the issue-21 rest included: the
    bidirectional sliding window, memory tokens) runs one layer forward and backward at a tiny length."""
    import argparse

    from txl.bench import attention_scaling as scaling

    parser = argparse.ArgumentParser()
    scaling.configure(parser)
    args = parser.parse_args(["--heads", "2", "--d-head", "8", "--window", "8", "--stride", "4", "--features", "8",
                              "--linformer-k", "8"])
    assert {"sliding-bidirectional", "memory-tokens"} <= set(scaling.VARIANTS)
    for name in scaling.VARIANTS:
        assert scaling.unsupported(name, args) is None, name
        for backward in (False, True):
            args.backward_mode = backward
            scaling.build_layer(name, 32, args)()


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_bench_json_never_writes_through_a_planted_link(kind, tmp_path, capsys):
    """`--json FILE` where FILE is a link to a file elsewhere: a symbolic link is refused in one line
    before anything is measured; a hard link is replaced by a new file, and the other name keeps its
    bytes (issue 50: the bench wrote through both)."""
    target = tmp_path / "precious.txt"
    target.write_text("years of work")
    out = tmp_path / "result.json"
    (out.symlink_to if kind == "symlink" else out.hardlink_to)(target)
    code = main(["bench", "kernel", "--quick", "--steps", "1", "--warmup", "0", "--json", str(out)])
    err = capsys.readouterr().err
    assert target.read_text() == "years of work"
    if kind == "symlink":
        assert code == 2 and "symbolic link" in err and len(err.strip().splitlines()) == 1
    else:
        assert code == 0, err
        assert json.loads(out.read_text())["bench"] == "kernel" and out.stat().st_nlink == 1
