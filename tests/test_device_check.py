"""The CPU-side logic of the device check (scripts/device_check.py, issue 46 item 6): arguments, the
wheels it installs, the FLOP formula, the summary writer, and a whole smoke run on the CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from txl.bench.common import hf_available
from txl.bench.mfu import train_step_flops
from txl.io import CONFIG_LIMIT, read_json, read_text, write_bytes

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "device_check.py"


@pytest.fixture(scope="module")
def dc():
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------
# FLOPs


def test_plain_shapes_count_the_flops_of_txl_bench_mfu(dc):
    for name in ("tiny", "base"):
        shape = dc.shapes()[name]
        assert dc.train_flops(shape) == train_step_flops(shape)
    base = dc.shapes()["base"]
    assert (base.batch, base.tgt_len, base.mem_len) == (22, 512, 512)  # the paper's enwik8-base step


def test_an_adaptive_head_counts_each_cluster_for_its_share_of_the_tokens(dc):
    shape = dc.shapes()["micro-adaptive"]  # d 32, vocab 300, cutoffs 40 / 120, div_val 2
    f = dc.cluster_fractions(shape)
    assert len(f) == 3 and sum(f) == pytest.approx(1.0)
    harmonic = [sum(1 / r for r in range(1, n + 1)) for n in (40, 120, 300)]
    assert f[0] == pytest.approx(harmonic[0] / harmonic[2])
    t = 1000
    expected = (t * (2 * 32 * 32 + 2 * 32 * (40 + 2)) + f[0] * t * 2 * 32 * 32  # head cluster + input projection
                + f[1] * t * (2 * 32 * 16 + 2 * 16 * 80) + f[1] * t * 2 * 32 * 16
                + f[2] * t * (2 * 32 * 8 + 2 * 8 * 180) + f[2] * t * 2 * 32 * 8)
    assert dc.head_flops(shape, t) == pytest.approx(expected)
    large = dc.shapes()["large"]
    assert 0.75 < dc.cluster_fractions(large)[0] < 0.85  # Zipf tokens: most in the head, as in WikiText-103
    assert dc.train_flops(large) < train_step_flops(large)  # far below a full 267k-way softmax


def test_zipf_tokens_for_an_adaptive_shape_and_uniform_ones_otherwise(dc):
    shape = dc.shapes()["micro-adaptive"]
    tokens = dc.token_stream(shape, 4, 500)
    assert tokens.shape == (4, 500) and int(tokens.min()) >= 0 and int(tokens.max()) < 300
    assert 0.6 < float((tokens < 40).float().mean()) < 0.9
    plain = dc.token_stream(dc.shapes()["micro"], 4, 500)
    assert float((plain < 40).float().mean()) < 0.3


# ---------------------------------------------------------------------------------------------
# Summary


def test_the_summary_has_ratios_errors_and_every_table(dc, tmp_path):
    train = [{"shape": "base", "precision": p, "contender": c, "tokens_per_s": v, "mfu": 0.25}
             for p, c, v in (("bf16", "txl-eager", 100.0), ("bf16", "txl-fast", 150.0), ("bf16", "hf", 50.0),
                             ("fp32", "txl-eager", 40.0), ("fp32", "hf", 80.0))]
    train.append({"shape": "large", "precision": "bf16", "contender": "hf", "error": "OutOfMemoryError: CUDA"})
    result = {
        "status": "done", "started_unix": 0.0, "args": {"device": "cuda"}, "errors": [
            {"stage": "train", "what": "large bf16 hf", "error": "OutOfMemoryError: CUDA", "where": "x.py:1 f"}],
        "env": {"gpu": "NVIDIA H100 80GB HBM3", "capability": "9.0", "memory_gib": 79.1, "torch": "2.11.0+cu130"},
        "peak": {"n": 8192, "bf16": 700.0, "fp32": 50.0}, "train": train, "eval": [],
        "generate": [{"shape": "base", "precision": "bf16", "contender": c, "mode": m, "tokens_per_s": v}
                     for c, m, v in (("txl-eager", "memory reuse", 100.0), ("txl-fast", "memory reuse", 300.0),
                                     ("txl-eager", "full re-run", 10.0), ("txl-fast", "full re-run", 20.0))],
        "tests": {"rc": 1, "summary": "14 passed, 1 failed in 50.00s", "seconds": 50.0,
                  "outcomes": [{"test": "test_a", "outcome": "PASSED"}, {"test": "test_b", "outcome": "FAILED"}],
                  "figures": [{"test": "gpu_equals_cpu[eager]", "device": "cuda", "logits": 3e-6}]},
    }
    dc.write_summary(result, tmp_path)
    saved = read_json(tmp_path / "device_check.json", what="summary")
    rows = {(r["precision"], r["contender"]): r for r in saved["train"] if r["shape"] == "base"}
    assert rows["bf16", "txl-fast"]["x_hf"] == pytest.approx(3.0)
    assert rows["bf16", "txl-fast"]["x_eager"] == pytest.approx(1.5)
    assert rows["fp32", "txl-eager"]["x_hf"] == pytest.approx(0.5)
    assert rows["fp32", "hf"]["x_eager"] == pytest.approx(2.0)
    reuse = {r["contender"]: r for r in saved["generate"] if r["mode"] == "memory reuse"}
    assert reuse["txl-fast"]["x_eager"] == pytest.approx(3.0)  # compared within its mode only
    text = read_text(tmp_path / "device_check.md", what="summary", limit=CONFIG_LIMIT)
    assert "NVIDIA H100 80GB HBM3" in text and "bf16 700.0 TFLOP/s" in text
    assert "| base | bf16 | txl-fast | 150 |" in text and "25.0%" in text
    assert "test_b | FAILED" in text and "test_a " not in text  # only what did not pass is listed
    assert "gpu_equals_cpu[eager]" in text and "logits 3e-06" in text
    assert "train / large bf16 hf: OutOfMemoryError: CUDA" in text


def test_pytest_output_is_read_into_outcomes_and_its_summary(dc):
    output = ("tests/test_cuda.py::test_a[eager] PASSED  [ 50%]\n"
              "tests/test_cuda.py::test_b FAILED  [100%]\n"
              "FAILED tests/test_cuda.py::test_b - AssertionError: 1e-3\n"
              "==================== 1 failed, 1 passed in 9.12s ====================\n")
    outcomes, summary = dc.parse_pytest(output)
    assert outcomes == [{"test": "test_a[eager]", "outcome": "PASSED"}, {"test": "test_b", "outcome": "FAILED"}]
    assert summary == "1 failed, 1 passed in 9.12s"
    assert dc.parse_pytest("Killed\n")[1] == "no summary line"


# ---------------------------------------------------------------------------------------------
# Arguments and wheels


def test_bad_arguments_end_in_one_line(dc, capsys):
    for argv, expected in ((["--stages", "env,bogus"], "unknown bogus"), (["--reps", "0"], "--reps must be >= 1"),
                           (["--shapes", ""], "at least one value"), (["--device", "tpu"], "invalid choice")):
        with pytest.raises(SystemExit) as exit_info:
            dc.parse_args(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("device_check: error:") and expected in err, err


def test_cuda_without_a_gpu_is_one_line_and_exit_2(dc, tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert dc.main([str(tmp_path), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cpu" in err


def test_dry_run_writes_the_plan_and_runs_nothing(dc, tmp_path, capsys):
    assert dc.main([str(tmp_path / "out"), "--dry-run", "--stages", "train,generate", "--shapes", "tiny,large"]) == 0
    plan = read_json(tmp_path / "out" / "device_check.json", what="plan")["plan"]
    assert "train: large bf16 hf" in plan and "train: tiny fp32 txl-eager" in plan
    assert len([p for p in plan if p.startswith("train:")]) == 2 * 3 * 2
    assert [p for p in plan if p.startswith("generate:")] == [
        "generate: base context 1024 bf16 txl-eager", "generate: base context 1024 fp32 txl-eager",
        "generate: base context 1024 bf16 txl-fast", "generate: base context 1024 fp32 txl-fast"]
    assert "train: large bf16 hf" in capsys.readouterr().out


def test_the_wheels_picked_are_the_three_always_and_what_this_python_lacks(dc, tmp_path):
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    names = ["transformers-4.35.2-py3-none-any.whl", "huggingface_hub-0.20.3-py3-none-any.whl",
             "packaging-26.4-py3-none-any.whl",  # installed here (pytest needs it): not shadowed
             "pyyaml-6.0.4-cp399-cp399-manylinux2014_x86_64.whl",  # another Python's build
             "no_such_module_here-1.0-py3-none-any.whl",
             f"tokenizers-0.15.2-{tag}-{tag}-manylinux_2_17_x86_64.whl"]
    for name in names:
        write_bytes(tmp_path / name, b"")
    picked = sorted(p.name for p in dc.pick_wheels(tmp_path))
    assert picked == sorted([names[0], names[1], names[4], names[5]])
    assert dc.wheel_distribution("PyYAML-6.0-cp312-cp312-x.whl") == "pyyaml"


# ---------------------------------------------------------------------------------------------
# The whole script on the CPU


@pytest.mark.slow
def test_the_script_runs_every_stage_on_the_cpu_and_writes_its_summary(tmp_path):
    contenders = "txl-eager,txl-fast" + (",hf" if hf_available() else "")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TXL_WHEELS": str(tmp_path / "no-wheels"),
           "TXL_DEVICE_SITE": str(tmp_path / "site")}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), str(tmp_path / "out"), "--device", "cpu",
                           "--quick", "--stages", "env,train,eval,generate", "--contenders", contenders],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    result = read_json(out / "device_check.json", what="summary")
    assert result["status"] == "done" and result["errors"] == [], result["errors"]
    n = len(contenders.split(","))
    assert len(result["train"]) == 2 * n * 2  # micro and micro-adaptive, bf16 and fp32
    assert all(row["tokens_per_s"] > 0 and row["mfu"] > 0 for row in result["train"])
    assert len(result["eval"]) == n * 2 and all(row["tokens_per_s"] > 0 for row in result["eval"])
    assert len(result["generate"]) == 2 * 2 * 2  # two impls, two precisions, reuse and re-run
    assert {"bf16", "fp32"} <= result["peak"].keys()
    log = read_text(out / "device_check.log", what="log", limit=CONFIG_LIMIT)
    assert "no wheels" in log and "stage generate" in log and "device check done" in log
    text = read_text(out / "device_check.md", what="summary", limit=CONFIG_LIMIT)
    assert "## Training throughput" in text and "micro-adaptive" in text
    assert json.loads(json.dumps(result))  # plain JSON throughout
