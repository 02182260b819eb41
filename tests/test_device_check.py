"""The CPU-side logic of the device check (scripts/device_check.py, issue 46 item 6): arguments, the
wheels it installs, the FLOP formula, the summary writer, and a whole smoke run on the CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
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
    train = [{"shape": "base", "precision": p, "contender": c, "tokens_per_s": v, "mfu": 0.25, "peak_gib": 8.0,
              "warmup_extra_s": 30.0 if c == "txl-flex" else 0.5}
             for p, c, v in (("bf16", "txl-eager", 100.0), ("bf16", "txl-fast", 150.0), ("bf16", "hf", 50.0),
                             ("bf16", "txl-sdpa", 200.0), ("bf16", "txl-flex", 300.0),
                             ("fp32", "txl-eager", 40.0), ("fp32", "hf", 80.0), ("fp32", "txl-sdpa", 50.0))]
    train.append({"shape": "large", "precision": "bf16", "contender": "hf", "error": "OutOfMemoryError: CUDA"})
    result = {
        "status": "done", "started_unix": 0.0, "args": {"device": "cuda"}, "errors": [
            {"stage": "train", "what": "large bf16 hf", "error": "OutOfMemoryError: CUDA", "where": "x.py:1 f"}],
        "skipped": [{"stage": "train", "what": "large bf16 txl-flex", "reason": "time budget: needs ~25 s, 3 s left"}],
        "budget": {"total_s": 480.0, "spent_before_s": 12.0, "stages": {"train": {"slice_s": 200.0, "used_s": 187.0},
                                                                        "eval": {"slice_s": 25.0}}},
        "env": {"gpu": "NVIDIA H100 80GB HBM3", "capability": "9.0", "memory_gib": 79.1, "torch": "2.11.0+cu130"},
        "peak": {"n": 8192, "bf16": 700.0, "fp32": 50.0}, "train": train,
        "eval": [{"shape": "base", "mem_len": 512, "precision": "bf16", "contender": c, "tokens_per_s": v}
                 for c, v in (("txl-sdpa", 1000.0), ("txl-flex", 500.0))],
        "checkpointing": [{"shape": "base", "precision": "bf16", "contender": "txl-sdpa", "checkpointing": m,
                           "tokens_per_s": v, "step_ms": s, "peak_gib": g}
                          for m, v, s, g in (("none", 300.0, 40.0, 12.0), ("blocks", 240.0, 50.0, 3.0))],
        "compile": [{"shape": "base", "precision": "bf16", "contender": "txl-sdpa compiled", "backend": "inductor",
                     "warmup_extra_s": 55.0, "tokens_per_s": 400.0, "step_ms": 30.0, "x_uncompiled": 2.0}],
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
    assert rows["bf16", "txl-sdpa"]["x_fp32"] == pytest.approx(4.0)  # bf16 over the same contender's fp32
    assert rows["bf16", "txl-eager"]["x_fp32"] == pytest.approx(2.5) and "x_fp32" not in rows["fp32", "hf"]
    assert "x_fp32" not in rows["bf16", "txl-flex"]  # no fp32 flex row to compare with
    assert rows["bf16", "txl-flex"]["x_sdpa"] == pytest.approx(1.5) and "x_sdpa" not in rows["bf16", "txl-sdpa"]
    assert saved["eval"][1]["x_sdpa"] == pytest.approx(0.5)
    blocks = saved["checkpointing"][1]
    assert blocks["x_peak"] == pytest.approx(0.25) and blocks["x_step"] == pytest.approx(1.25)
    reuse = {r["contender"]: r for r in saved["generate"] if r["mode"] == "memory reuse"}
    assert reuse["txl-fast"]["x_eager"] == pytest.approx(3.0)  # compared within its mode only
    text = read_text(tmp_path / "device_check.md", what="summary", limit=CONFIG_LIMIT)
    assert "NVIDIA H100 80GB HBM3" in text and "bf16 700.0 TFLOP/s" in text
    assert "| base | bf16 | txl-fast | 150 |" in text and "25.0%" in text
    assert "| base | bf16 | txl-flex | 300 | – | 30.0 | 8.00 |" in text  # warm-up extra s (compiling), peak GiB
    assert "bf16 × fp32" in text and "| 4.00 |" in text
    sdpa_flex = text.split("## Fused attention: sdpa against flex")[1].split("##")[0]
    assert "| train | base | – | bf16 | 200 | 300 | 1.50 | 8.00 | 8.00 | 30.0 |" in sdpa_flex
    assert "| eval | base | 512 | bf16 | 1,000 | 500 | 0.50 |" in sdpa_flex
    assert "| base | bf16 | txl-sdpa | blocks | 240 | 50.0 | 3.00 | 0.25 | 1.25 | – |" in text
    assert "| base | bf16 | txl-sdpa compiled | inductor | 55.0 | 400 | 30.0 | – | – | 2.00 | – |" in text
    assert "test_b | FAILED" in text and "test_a " not in text  # only what did not pass is listed
    assert "gpu_equals_cpu[eager]" in text and "logits 3e-06" in text
    assert "train / large bf16 hf: OutOfMemoryError: CUDA" in text
    assert "## Skipped" in text and "train / large bf16 txl-flex: time budget: needs ~25 s" in text
    assert "1 error(s), 1 skipped" in text and "train 187/200 s" in text and "eval 0/" not in text


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
                           (["--shapes", ""], "at least one value"), (["--device", "tpu"], "invalid choice"),
                           (["--contenders", "txl-flash"], "unknown txl-flash"),
                           (["--budget-minutes", "0"], "--budget-minutes must be > 0"),
                           (["--timed-s", "-1"], "--timed-s must be > 0"),
                           (["--budget-minutes", "0.5", "--reserve-s", "30"], "leaves nothing of a 0.5-minute budget"),
                           (["--ckpt-shapes", "huge"], "unknown huge")):
        with pytest.raises(SystemExit) as exit_info:
            dc.parse_args(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("device_check: error:") and expected in err, err


def test_defaults_measure_every_contender_and_quick_shrinks_every_stage(dc):
    args = dc.parse_args([])
    assert args.contenders == ["txl-eager", "txl-fast", "txl-sdpa", "txl-flex", "hf"]
    assert args.stages == list(dc.STAGES) and args.budget_minutes == 8.0
    assert (args.shapes, args.ckpt_shapes, args.compile_shape) == (["tiny", "base", "large"], ["base", "large"], "base")
    quick = dc.parse_args(["--quick", "--device", "cpu"])
    assert quick.shapes == ["micro", "micro-adaptive"] and quick.ckpt_shapes == ["micro"]
    assert (quick.compile_shape, quick.eval_shape, quick.peak_n) == ("micro", "micro", 256)


def test_cuda_without_a_gpu_is_one_line_and_exit_2(dc, tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert dc.main([str(tmp_path), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cpu" in err


def test_dry_run_writes_the_plan_with_its_estimates_and_runs_nothing(dc, tmp_path, capsys):
    assert dc.main([str(tmp_path / "out"), "--dry-run"]) == 0
    plan = read_json(tmp_path / "out" / "device_check.json", what="plan")["plan"]
    by = {(p["stage"], p["what"]): p["estimate_s"] for p in plan}
    assert ("train", "large bf16 hf") in by and ("train", "tiny fp32 txl-flex") in by
    assert len([p for p in plan if p["stage"] == "train"]) == 3 * 5 * 2  # shapes, contenders, precisions
    assert [p["what"] for p in plan if p["stage"] == "generate"] == [
        f"base context 1024 {p} txl-{impl}" for impl in ("eager", "fast", "sdpa") for p in ("bf16", "fp32")]
    assert [p["what"] for p in plan if p["stage"] == "checkpointing"][:2] == [
        "base bf16 txl-sdpa none", "base bf16 txl-sdpa blocks"]  # auto on CUDA is sdpa
    assert [p["what"] for p in plan if p["stage"] == "compile"] == ["base bf16 txl-sdpa compiled"]
    assert all(p["estimate_s"] > 0 for p in plan)
    # flex compiles its kernels per shape and precision; the same shape's sdpa does not
    assert by["train", "base fp32 txl-flex"] - by["train", "base fp32 txl-sdpa"] == pytest.approx(
        dc.FLEX_COMPILE_S["train"], abs=1.0)
    # the base shape's bf16 step at the H100's ~400 TFLOP/s and eager's efficiency: 4.28 TFLOP / 40 TFLOP/s
    step = dc.step_estimate_s(dc.train_flops(dc.shapes()["base"]), "txl-eager", "bf16", 12, {})
    assert step == pytest.approx(4.28e12 / (0.10 * 400e12), rel=0.01)
    text = capsys.readouterr().out
    assert "train: large bf16 hf (~" in text and "estimate (H100 peaks): set-up ~25 s, then env" in text
    assert "s for the 435 s that a 480-second budget leaves after the set-up and the 20-second reserve" in text


def test_plan_leaves_out_what_the_arguments_leave_out(dc):
    args = dc.parse_args(["--stages", "train,compile,generate", "--shapes", "tiny", "--contenders", "txl-flex,hf",
                          "--precisions", "fp32"])
    plan = dc.plan(args)
    assert [p["what"] for p in plan if p["stage"] == "train"] == ["tiny fp32 txl-flex", "tiny fp32 hf"]
    assert [p["stage"] for p in plan if p["stage"] == "generate"] == []  # neither flex nor hf generates
    # the compile stage measures the uncompiled model itself where the train stage does not
    assert [p["what"] for p in plan if p["stage"] == "compile"] == ["base fp32 txl-sdpa", "base fp32 txl-sdpa compiled"]


# ---------------------------------------------------------------------------------------------
# The time budget (a fake clock)


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_each_stage_ends_where_the_later_stages_slices_begin(dc):
    clock = FakeClock()
    slices = {"env": 10.0, "tests": 100.0, "train": 200.0, "eval": 30.0}
    budget = dc.Budget(400.0, ["env", "tests", "train", "eval"], reserve_s=20.0, spent_s=40.0, clock=clock,
                       slices=slices)
    assert budget.end == pytest.approx(1000 - 40 + 400 - 20)  # the shell's 40 s count; the reserve stays free
    assert budget.scale == pytest.approx(340 / 340)
    budget.begin("env")
    assert budget.left() == pytest.approx(340 - 330) and budget.fits(10.0) and not budget.fits(10.5)
    clock.now += 2.0  # env ends early: the tests may use what it left
    budget.begin("tests")
    assert budget.left() == pytest.approx(108.0)
    clock.now += 150.0  # the tests overran: train keeps only what is left before eval's slice
    budget.begin("train")
    assert budget.left() == pytest.approx(340 - 152 - 30)
    clock.now += 500.0
    budget.begin("eval")
    assert budget.left() < 0 and budget.total_left() < 0 and not budget.fits(0.0)


def test_slices_scale_to_the_budget_and_to_the_stages_chosen(dc):
    budget = dc.Budget(60.0 * 16, ["train", "eval"], reserve_s=0.0, clock=FakeClock())
    total = dc.STAGE_S["train"] + dc.STAGE_S["eval"]
    assert budget.slice_s("train") == pytest.approx(960 * dc.STAGE_S["train"] / total)
    assert sum(dc.STAGE_S.values()) + dc.SETUP_S + dc.RESERVE_S <= 8 * 60  # the default plan's slices fit 8 minutes


def make_check(dc, tmp_path, clock, *extra):
    return dc.Check(dc.parse_args([str(tmp_path), "--device", "cpu", "--quick", *extra]), clock=clock, spent_s=0.0)


def test_a_measurement_that_does_not_fit_is_recorded_as_skipped(dc, tmp_path):
    clock = FakeClock()
    check = make_check(dc, tmp_path, clock, "--stages", "train", "--budget-minutes", "1", "--reserve-s", "0")
    check.budget.begin("train")
    assert check.fits("train", "base bf16 txl-eager", 59.0)
    clock.now += 30.0
    assert not check.fits("train", "base bf16 txl-flex", 31.0)
    assert check.result["skipped"] == [{"stage": "train", "what": "base bf16 txl-flex",
                                        "reason": "time budget: needs ~31 s, 30 s left for stage train"}]


def test_timed_steps_fill_timed_s_and_stop_at_the_stage_end(dc, tmp_path):
    clock = FakeClock()
    check = make_check(dc, tmp_path, clock, "--stages", "train", "--budget-minutes", "1", "--reserve-s", "0",
                       "--reps", "50", "--timed-s", "0.05")
    check.budget.begin("train")
    calls = []

    def step():
        time.sleep(0.005)
        calls.append(1)

    warm, times = check.time_steps(step, warmup=1, reps=50)
    assert len(warm) == 1 and dc.MIN_REPS <= len(times) <= 10  # ~0.05 s of ~5 ms steps, not 50
    clock.now += 60.0 - 0.012  # 12 ms left: two steps fit
    warm, times = check.time_steps(step, warmup=1, reps=50)
    assert len(times) <= 2
    clock.now += 1.0
    with pytest.raises(dc.BudgetSpent):
        check.time_steps(step, warmup=1, reps=50)


def test_the_tests_stage_is_skipped_when_its_time_is_spent(dc, tmp_path, monkeypatch):
    clock = FakeClock()
    check = make_check(dc, tmp_path, clock, "--stages", "tests", "--budget-minutes", "1", "--reserve-s", "0")
    check.budget.begin("tests")
    clock.now += 50.0
    monkeypatch.setattr(dc.subprocess, "run", lambda *a, **k: pytest.fail("pytest must not start"))
    dc.stage_tests(check)
    assert check.result["skipped"][0]["what"] == "pytest -m cuda" and "10 s left" in check.result["skipped"][0]["reason"]


def test_a_spent_budget_skips_the_rest_cleanly_and_records_it(dc, tmp_path, monkeypatch):
    """The clock jumps past the deadline once the first measurement is saved: the run still ends
    'done', and every planned measurement is either a row or a skipped entry."""
    clock = FakeClock()
    save = dc.write_summary

    def save_then_jump(result, out):
        if result["train"]:
            clock.now += 10_000.0
        save(result, out)

    monkeypatch.setattr(dc, "write_summary", save_then_jump)
    out = tmp_path / "out"
    assert dc.main([str(out), "--device", "cpu", "--quick", "--stages", "train,eval", "--shapes", "micro",
                    "--contenders", "txl-eager,txl-fast"], clock=clock) == 0
    result = read_json(out / "device_check.json", what="summary")
    assert result["status"] == "done" and result["errors"] == []
    assert [(r["precision"], r["contender"]) for r in result["train"]] == [("bf16", "txl-eager")]
    assert result["eval"] == []
    assert [s["what"] for s in result["skipped"]] == [
        "micro fp32 txl-eager", "micro bf16,fp32 txl-fast", "micro mem 16 bf16,fp32 txl-eager",
        "micro mem 16 bf16,fp32 txl-fast"]
    assert all(s["reason"].startswith("time budget: needs ~") for s in result["skipped"])
    assert "## Skipped" in read_text(out / "device_check.md", what="summary", limit=CONFIG_LIMIT)


# ---------------------------------------------------------------------------------------------
# Contenders that are not there


def test_an_impl_the_registry_lacks_is_skipped_as_not_available(dc, tmp_path, monkeypatch):
    from txl.nn.attention import registry

    registry.load_builtin_kernels()
    monkeypatch.delitem(registry.KERNELS, ("full", "flex"), raising=False)
    check = make_check(dc, tmp_path, FakeClock())
    assert dc.contenders(check, "train") == ["txl-eager", "txl-fast", "txl-sdpa"] + (["hf"] if hf_available() else [])
    skipped = {s["what"]: s["reason"] for s in check.result["skipped"]}
    assert skipped["txl-flex"] == ("not available: attention_impl='flex' is not registered for attention='full' "
                                   "(txl.nn.attention.registry)")


def test_a_refusal_is_a_skip_and_a_failure_an_error_row(dc, tmp_path):
    from txl.errors import UsageError

    check = make_check(dc, tmp_path, FakeClock())

    def refuse():
        raise UsageError("attention_impl='flex' has no backward on the CPU")

    def fail():
        raise RuntimeError("CUDA error: an illegal memory access")

    assert not dc.measure(check, "train", "micro bf16 txl-flex", {"contender": "txl-flex"}, refuse)
    assert not dc.measure(check, "train", "micro fp32 txl-flex", {"contender": "txl-flex"}, fail)
    assert check.result["skipped"][0]["reason"] == "not available: attention_impl='flex' has no backward on the CPU"
    assert check.result["train"] == [{"contender": "txl-flex", "error": "RuntimeError: CUDA error: an illegal memory access"}]
    assert [e["what"] for e in check.result["errors"]] == ["micro fp32 txl-flex"]


def test_the_checkpointing_switch_is_found_or_its_absence_said(dc):
    import torch

    class Switched(torch.nn.Module):
        checkpoint_blocks = False  # what train.activation_checkpointing="blocks" sets on the model

    model = Switched()
    switch = dc.checkpointing_switch(model)
    switch(True)
    assert model.checkpoint_blocks is True
    switch(False)
    assert model.checkpoint_blocks is False
    assert "Linear has no activation-checkpointing switch" in dc.checkpointing_switch(torch.nn.Linear(2, 2))


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
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TXL_WHEELS": str(tmp_path / "no-wheels"),
           "TXL_DEVICE_SITE": str(tmp_path / "site")}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), str(tmp_path / "out"), "--device", "cpu",
                           "--quick"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    result = read_json(out / "device_check.json", what="summary")
    assert result["status"] == "done" and result["errors"] == [], result["errors"]
    hf = hf_available() is not None
    runs = ["txl-eager", "txl-fast", "txl-sdpa"] + (["hf"] if hf else [])  # flex has no backward on the CPU
    assert [(r["shape"], r["precision"], r["contender"]) for r in result["train"]] == [
        (s, p, c) for s in ("micro", "micro-adaptive") for c in runs for p in ("bf16", "fp32")]
    assert all(row["tokens_per_s"] > 0 and row["mfu"] > 0 and row["reps"] >= 1 for row in result["train"])
    skipped = {(s["stage"], s["what"]): s["reason"] for s in result["skipped"]}
    assert all(skipped["train", f"{s} {p} txl-flex"].startswith("not available: ")
               for s in ("micro", "micro-adaptive") for p in ("bf16", "fp32"))
    assert hf or skipped["train", "hf"].startswith("not available: transformers")
    assert {r["contender"] for r in result["eval"]} == {*runs, "txl-flex"}  # flex evaluates on the CPU (no grad)
    assert all(row["tokens_per_s"] > 0 for row in result["eval"])
    assert {r["contender"] for r in result["generate"]} == {"txl-eager", "txl-fast", "txl-sdpa"}
    assert len(result["generate"]) == 3 * 2 * 2  # three impls, two precisions, reuse and re-run
    compiled = [r for r in result["compile"] if r["contender"] == "txl-fast compiled"]
    assert len(compiled) == 1 and compiled[0]["backend"] == "eager" and compiled[0]["x_uncompiled"] > 0
    if result["checkpointing"]:  # once the model has its switch (train.activation_checkpointing)
        assert [r["checkpointing"] for r in result["checkpointing"]] == ["none", "blocks"] * 2
        assert all(r["tokens_per_s"] > 0 for r in result["checkpointing"])
    else:
        assert skipped["checkpointing", "txl-fast"].startswith("not available: ")
    assert {"bf16", "fp32"} <= result["peak"].keys()
    assert set(result["budget"]["stages"]) == set(dc_stages()) and all(
        "used_s" in s for s in result["budget"]["stages"].values())
    log = read_text(out / "device_check.log", what="log", limit=CONFIG_LIMIT)
    assert "no wheels" in log and "stage generate" in log and "device check done" in log
    assert re.search(r"^\[\d\d:\d\d:\d\d \+\d+:\d\d\] stage train: \d+ s for it", log, re.M)
    text = read_text(out / "device_check.md", what="summary", limit=CONFIG_LIMIT)
    assert "## Training throughput" in text and "micro-adaptive" in text and "## Skipped" in text
    assert "## torch.compile of the whole model" in text
    fused = text.split("## Fused attention: sdpa against flex")[1].split("\n## ")[0]
    assert "| eval | micro | 16 | bf16 |" in fused and "| train |" not in fused  # no flex training on the CPU
    assert json.loads(json.dumps(result))  # plain JSON throughout


def dc_stages() -> tuple[str, ...]:
    return ("env", "tests", "train", "checkpointing", "compile", "eval", "generate")
