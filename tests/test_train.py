"""The trainer: exact resume after SIGKILL, DDP = one process, atomic checkpoints, faults, config errors."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import helpers
from helpers import finish, saved_step, train_losses, txl, write_config
from txl.errors import ConfigError, TrainingError, UsageError
from txl.models.pretrained import load_tensors
from txl.train import LAST, Trainer
from txl.train.config import RunConfig, build_run_config, load_preset, preset_names
from txl.train.optim import lr_at

pytestmark = pytest.mark.slow
corpus, cache_dir = helpers.corpus, helpers.cache_dir  # fixtures


def test_sigkill_then_resume_matches_an_uninterrupted_run_bitwise(tmp_path, corpus):
    config = write_config(tmp_path, corpus, steps=200)  # the kill lands in steps 12..200: a poller descheduled for 188 steps is no race
    code, log = finish(txl("train", "--config", str(config), "--out", str(tmp_path / "a"), "--quiet"))
    assert code == 0, log
    proc = txl("train", "--config", str(config), "--out", str(tmp_path / "b"), "--quiet")
    deadline = time.time() + 120
    while saved_step(tmp_path / "b") < 12 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    assert proc.poll() is None, "the run finished before it could be killed; make it longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = saved_step(tmp_path / "b")
    assert 12 <= killed_at < 200
    code, log = finish(txl("train", "--resume", str(tmp_path / "b"), "--quiet"))
    assert code == 0, log
    a, b = train_losses(tmp_path / "a"), train_losses(tmp_path / "b")
    assert sorted(a) == sorted(b) == list(range(1, 201))
    assert all(a[s] == b[s] for s in a), [(s, a[s], b[s]) for s in a if a[s] != b[s]][:3]
    wa, _ = load_tensors(tmp_path / "a" / LAST / "model.safetensors")
    wb, _ = load_tensors(tmp_path / "b" / LAST / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_ddp_two_gloo_processes_equal_one_process(tmp_path, corpus):
    config = write_config(tmp_path, corpus, steps=6, dropout=0.0, varlen="false")
    code, log = finish(txl("train", "--config", str(config), "--out", str(tmp_path / "one"), "--quiet"))
    assert code == 0, log
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "txl",
         "train", "--config", str(config), "--out", str(tmp_path / "two"), "--quiet"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    one, two = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert sorted(one) == sorted(two) == list(range(1, 7))
    for step in one:
        assert abs(one[step] - two[step]) < 1e-5, (step, one[step], two[step])
    state = json.loads((tmp_path / "two" / LAST / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["step"] == 6
    # exactly one checkpoint directory per kind, no temporary leftovers from the other rank
    assert sorted(p.name for p in (tmp_path / "two").iterdir() if p.is_dir()) == ["best", "last"]


def test_ddp_ranks_share_one_clock_for_the_minutes_budget(tmp_path, corpus):
    """max_minutes under DDP: the ranks stop at the same step (their mean clock decides), so nobody
    waits forever in the next all-reduce, and the cosine follows that shared clock. Each rank runs on a
    fake clock of its own (rank 0: one second per reading, rank 1: three), so the step the run stops at
    and its learning rates do not depend on this machine's speed or load (a real 0.1-minute budget did)."""
    config = write_config(tmp_path, corpus, steps=10**6, dropout=0.0, varlen="false")
    launcher = tmp_path / "fake_clock_txl.py"
    launcher.write_text(
        "import itertools, os, sys\n"
        "import txl.train.loop as loop\n"
        "ticks, pace = itertools.count(), 1.0 + 2.0 * int(os.environ['RANK'])\n"
        "loop.clock = lambda: pace * next(ticks)\n"
        "from txl.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(launcher),
         "train", "--config", str(config), "--out", str(tmp_path / "two"), "--quiet", "--set", "max_minutes=1",
         "--set", "schedule=cosine", "--set", "warmup_steps=0", "--set", "save_interval=0"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "two" / "result.json").read_text())
    # two readings a step after the session's start (the all-reduced clock, the log record): at step k the
    # mean clock says 2·(2k - 1) s, so the 60 s budget ends the run at step 16; rank 0's own clock would have
    # run to step 31, rank 1's to step 11
    assert result["stopped_by"] == "max_minutes" and result["steps"] == 16
    lrs = [r["lr"] for r in map(json.loads, (tmp_path / "two" / "metrics.jsonl").read_text().splitlines())
           if r.get("split") == "train"]
    peak = json.loads((tmp_path / "two" / "run.json").read_text())["config"]["train"]["lr"]
    # down the cosine of the minutes although max_steps is a million, to (almost) eta_min at the end
    assert len(lrs) == 16 and lrs[0] == peak and lrs[-1] < 0.05 * peak
    assert all(b < a for a, b in zip(lrs, lrs[1:], strict=False))


def test_the_all_reduced_clock_decides_the_stop_and_the_schedule(tmp_path, corpus):
    """The ranks' mean clock from the per-step all-reduce, not this process's own, decides: a
    reduced clock past the budget stops the run at that step on every rank alike."""
    config = write_config(tmp_path, corpus, steps=10**6, varlen="false")
    run = build_run_config(config_file=config, sets=["max_minutes=10", "schedule_clock=minutes", "save_interval=0"])
    trainer = Trainer(run, tmp_path / "run", quiet=True)
    calls = []
    plain = trainer.dist.all_sum

    def skewed(values):  # the other rank's clock is far ahead from the third step on
        calls.append(values)
        out = plain(values)
        return [*out[:-1], 10 * 60 * 2] if len(calls) >= 3 else out

    trainer.dist.all_sum = skewed
    result = trainer.fit()
    assert result["stopped_by"] == "max_minutes" and result["steps"] == 3  # this process's clock says seconds


def test_resuming_with_a_new_time_budget_states_the_schedule_or_refuses_a_spent_one(tmp_path, corpus):
    from txl.cli.train import schedule_note

    before = build_run_config(config_file=write_config(tmp_path, corpus), sets=[
        "max_minutes=10", "schedule_clock=minutes", "max_steps=100000", "warmup_steps=0"]).train
    after = build_run_config(config_file=write_config(tmp_path, corpus), sets=[
        "max_minutes=20", "schedule_clock=minutes", "max_steps=100000", "warmup_steps=0"]).train
    note = schedule_note(before, after, step=50, elapsed=600.0)  # the first budget was spent: lr at eta_min
    assert "max_minutes 10 -> 20" in note and "decays more slowly" in note
    with pytest.raises(UsageError, match="--max-minutes 10 is not beyond the run's 15.0 minutes"):
        schedule_note(after, before, step=50, elapsed=900.0)
    # (schedule_clock=steps: the default follows the minutes since issue 45)
    steps_clock = build_run_config(config_file=write_config(tmp_path, corpus),
                                   sets=["max_minutes=20", "schedule_clock=steps"]).train
    plain = build_run_config(config_file=write_config(tmp_path, corpus),
                             sets=["max_minutes=10", "schedule_clock=steps"]).train
    assert "does not depend on it" in schedule_note(plain, steps_clock, step=5, elapsed=60.0)


def test_sigterm_saves_and_exits_zero(tmp_path, corpus):
    config = write_config(tmp_path, corpus, steps=5000)
    run = tmp_path / "run"
    proc = txl("train", "--config", str(config), "--out", str(run), "--quiet")
    while saved_step(run) < 3 and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    code, log = finish(proc)
    assert code == 0, log
    assert "stopped by signal" in log and "--resume" in log
    state = json.loads((run / LAST / "trainer_state.json").read_text())
    assert state["step"] == max(train_losses(run))


def test_non_finite_losses_skip_updates_then_stop_with_checkpoint_intact(tmp_path, corpus, monkeypatch):
    config = write_config(tmp_path, corpus, steps=50, eval_interval=1000)
    run = build_run_config(config_file=config, sets=["max_nonfinite=3", "save_interval=2"])
    trainer = Trainer(run, tmp_path / "run", quiet=True)
    real_forward = trainer.forward

    def poisoned(*args, **kwargs):
        out = real_forward(*args, **kwargs)
        if trainer.step >= 4:  # from the 5th step on, every loss is NaN
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(trainer, "forward", poisoned)
    with pytest.raises(TrainingError, match="not finite for 3 steps"):
        trainer.fit()
    assert saved_step(tmp_path / "run") == 4  # the last good checkpoint, not overwritten by bad steps
    weights, _ = load_tensors(tmp_path / "run" / LAST / "model.safetensors")
    current = trainer.model.state_dict()
    assert all(torch.equal(weights[k], current[k]) for k in weights)  # skipped steps changed nothing
    assert all(math.isfinite(v) for v in weights["blocks.0.ff.fc1.weight"].flatten().tolist())


def test_grad_accumulation_matches_full_batch(tmp_path, corpus):
    losses = {}
    for accum in (1, 2):
        config = write_config(tmp_path, corpus, steps=4, dropout=0.0, varlen="false")
        run = build_run_config(config_file=config, sets=[f"grad_accum={accum}"])
        trainer = Trainer(run, tmp_path / f"accum{accum}", quiet=True)
        trainer.fit()
        losses[accum] = train_losses(tmp_path / f"accum{accum}")
    for step in losses[1]:
        assert abs(losses[1][step] - losses[2][step]) < 1e-5


def test_resume_refuses_a_directory_that_is_not_a_run(tmp_path):
    code, log = finish(txl("train", "--resume", str(tmp_path)))
    assert code == 2 and "not a txl training run" in log and "Traceback" not in log


def test_existing_run_is_not_overwritten(tmp_path, corpus):
    config = write_config(tmp_path, corpus, steps=2)
    assert finish(txl("train", "--config", str(config), "--out", str(tmp_path / "r"), "--quiet"))[0] == 0
    code, log = finish(txl("train", "--config", str(config), "--out", str(tmp_path / "r"), "--quiet"))
    assert code == 2 and "already holds a run" in log


# -- configuration --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_builds(name):
    run = RunConfig.from_dict(load_preset(name), name)
    config = run.model_config(vocab_size=max([256, *run.model.get("cutoffs", [])]) + 1000)
    assert config.n_layer >= 1


def test_paper_presets_match_the_design_table():
    run = RunConfig.from_dict(load_preset("enwik8-base"))
    assert (run.model["n_layer"], run.model["d_model"], run.model["d_inner"], run.train.tgt_len,
            run.train.batch_size, run.train.lr, run.train.clip) == (12, 512, 2048, 512, 22, 2.5e-4, 0.25)
    wt = RunConfig.from_dict(load_preset("wt103-large"))
    assert wt.model["cutoffs"] == [20000, 40000, 200000] and wt.model["div_val"] == 4
    assert wt.train.warmup_steps == 16000 and wt.train.batch_size == 128


@pytest.mark.parametrize(
    ("sets", "named"),
    [(["n_layers=3"], "n_layers"), (["model.colour=red"], "colour"), (["lr=-1"], "lr"),
     (["precision=fp8"], "precision"), (["batch_size=0"], "batch_size"), (["tgt_len=0"], "tgt_len"),
     (["mem_len=-1"], "mem_len"), (["clamp_len=-1"], "clamp_len"), (["nonsense"], "key=value"),
     (["batch_size=6", "grad_accum=4"], "divisible")],
)
def test_bad_settings_name_the_key(sets, named):
    with pytest.raises(ConfigError, match=named):
        build_run_config(preset="tiny", sets=sets)


def test_unknown_preset_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="unknown preset"):
        build_run_config(preset="gigantic")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nn_layer = 2\n[optimizer]\nlr = 1\n")
    with pytest.raises(ConfigError, match="optimizer"):
        build_run_config(config_file=bad)
    bad.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        build_run_config(config_file=bad)


def test_learning_rate_schedules_follow_the_reference():
    cos = dict(schedule="cosine", lr=1.0, warmup_steps=10, max_steps=100, eta_min=0.0)
    assert lr_at(0, **cos) == 0.0 and lr_at(5, **cos) == 0.5
    assert lr_at(50, **cos) == pytest.approx((1 + math.cos(math.pi * 0.5)) / 2)
    assert lr_at(100, **cos) == pytest.approx(0.0)
    inv = dict(schedule="inv_sqrt", lr=1.0, warmup_steps=16, max_steps=100, eta_min=0.0)
    assert lr_at(8, **inv) == pytest.approx(8 / 16**1.5) and lr_at(64, **inv) == pytest.approx(1 / 8)


def test_cosine_follows_the_wall_clock_budget_when_it_is_further_along():
    cos = dict(schedule="cosine", lr=1.0, warmup_steps=10, max_steps=1000, eta_min=0.1)
    assert lr_at(500, **cos, time_fraction=0.0) == lr_at(500, **cos)  # steps only: the reference's schedule
    assert lr_at(20, **cos, time_fraction=0.5) == pytest.approx(lr_at(500, **cos))  # half the minutes spent
    assert lr_at(700, **cos, time_fraction=0.5) == lr_at(700, **cos)  # the step budget is further along
    assert lr_at(20, **cos, time_fraction=1.7) == pytest.approx(0.1)  # past the budget: eta_min
    assert lr_at(5, **cos, time_fraction=0.9) == lr_at(5, **cos)  # warm-up stays in steps
    constant = dict(cos, schedule="constant")
    assert lr_at(20, **constant, time_fraction=0.9) == 1.0


def test_a_run_cut_by_its_minutes_ends_its_cosine_at_eta_min(tmp_path, corpus, monkeypatch):
    """max_minutes with a step budget it cannot reach: with schedule_clock = minutes the schedule
    follows the clock (a fake one, one second per reading) and reaches eta_min when the minutes are
    spent; with the default (steps) it does not depend on the clock."""
    import txl.train.loop as loop

    config = write_config(tmp_path, corpus, steps=10**6, varlen="false")
    for clock in ("minutes", "steps"):
        clock_iter = iter(range(10**6))
        monkeypatch.setattr(loop.time, "perf_counter", lambda it=clock_iter: float(next(it)))
        run = build_run_config(config_file=config, sets=["max_minutes=0.5", "warmup_steps=0", "eta_min=0",
                                                         "schedule=cosine", "save_interval=0",
                                                         f"schedule_clock={clock}"])
        result = Trainer(run, tmp_path / clock, quiet=True).fit()
        assert result["stopped_by"] == "max_minutes" and result["steps"] < 100
        lrs = [json.loads(line)["lr"] for line in (tmp_path / clock / "metrics.jsonl").read_text().splitlines()
               if json.loads(line).get("split") == "train"]
        if clock == "minutes":
            assert lrs[0] > 0.9 * 2e-3 and lrs[-1] < 0.02 * 2e-3  # from the full rate to (almost) eta_min
            assert all(b <= a for a, b in zip(lrs, lrs[1:], strict=False))
        else:  # the reference's schedule: a million-step cosine has barely moved
            assert min(lrs) > 0.999 * 2e-3


@pytest.mark.parametrize("fast", [True, False])
def test_precision_auto_is_bf16_only_where_the_device_has_fast_bf16(fast, tmp_path, corpus, monkeypatch):
    import txl.eval.precision as evaluate

    monkeypatch.setattr(evaluate, "fast_bf16", lambda device: fast)
    cpu = torch.device("cpu")
    assert evaluate.resolve_precision("auto", cpu) == ("bf16" if fast else "fp32")
    assert evaluate.resolve_precision("fp32", cpu) == "fp32" and evaluate.resolve_precision("bf16", cpu) == "bf16"
    with evaluate.autocast(cpu, "auto"):
        assert torch.is_autocast_enabled("cpu") == fast
    config = write_config(tmp_path, corpus, steps=2)
    Trainer(build_run_config(config_file=config, sets=["precision=auto"]), tmp_path / "run", quiet=True).fit()
    run_file = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run_file["config"]["train"]["precision"] == "auto" and run_file["precision"] == ("bf16" if fast else "fp32")


@pytest.mark.parametrize("fp32_seconds, bf16_seconds, chosen", [(2.0, 1.0, True), (1.0, 2.0, False), (1.2, 1.0, False)])
def test_cpu_bf16_is_chosen_only_when_the_probe_finds_it_faster(fp32_seconds, bf16_seconds, chosen, monkeypatch):
    """bf16 instructions are not enough on a CPU (AVX512-BF16 without AMX ran bf16 products at 0.5x fp32
    here): `auto` times both once per process and takes bf16 only when it is >= 1.25x faster."""
    import txl.eval.precision as evaluate

    calls = []
    monkeypatch.setattr(evaluate, "bf16_instructions", lambda device: True)
    monkeypatch.setattr(evaluate, "matmul_seconds", lambda dtypes: calls.append(dtypes) or [fp32_seconds, bf16_seconds])
    monkeypatch.setattr(evaluate, "_CPU_BF16_VERDICT", [])
    cpu = torch.device("cpu")
    assert [evaluate.fast_bf16(cpu) for _ in range(3)] == [chosen] * 3
    assert calls == [(torch.float32, torch.bfloat16)]  # probed once
    assert evaluate.resolve_precision("auto", cpu) == ("bf16" if chosen else "fp32")
    monkeypatch.setattr(evaluate, "bf16_instructions", lambda device: False)
    monkeypatch.setattr(evaluate, "_CPU_BF16_VERDICT", [])
    assert not evaluate.fast_bf16(cpu) and calls == [(torch.float32, torch.bfloat16)]  # no instructions: no probe


def test_auto_precision_is_one_decision_across_ranks():
    from types import SimpleNamespace

    from txl.train.distributed import shared_precision

    def ranks(other):  # this rank's votes (bf16, fp16) plus the other rank's choice, as the all-reduce returns them
        votes = (float(other == "bf16"), float(other == "fp16"))
        return SimpleNamespace(world=2, all_sum=lambda values: [v + o for v, o in zip(values, votes)])

    assert shared_precision("bf16", ranks("bf16")) == "bf16"
    assert shared_precision("bf16", ranks("fp32")) == "fp32" and shared_precision("fp32", ranks("bf16")) == "fp32"
    assert shared_precision("fp16", ranks("fp16")) == "fp16"  # CUDA GPUs before compute capability 8
    assert shared_precision("bf16", ranks("fp16")) == "fp32"  # mixed GPUs: the precision all of them run
    assert shared_precision("bf16", SimpleNamespace(world=1)) == "bf16"


def test_matmul_probe_times_each_dtype_and_restores_the_threads():
    import txl.eval.precision as evaluate

    threads = torch.get_num_threads()
    seconds = evaluate.matmul_seconds((torch.float32, torch.bfloat16), size=64, repeats=2)
    assert len(seconds) == 2 and all(math.isfinite(s) and s > 0 for s in seconds)  # no wall-clock bound
    assert torch.get_num_threads() == threads


def test_final_splits_are_scored_whole_with_final_max_tokens_zero(tmp_path, corpus):
    """Validation during training on a slice (eval_max_tokens), the final score on the whole split."""
    from txl.train.finish import finish as finish_run

    config = write_config(tmp_path, corpus, steps=2)
    scored = {}
    for name, extra in (("capped", []), ("whole", ["final_max_tokens=0"])):
        run = build_run_config(config_file=config, sets=["eval_max_tokens=100", "final_splits=[\"valid\"]", *extra])
        trainer = Trainer(run, tmp_path / name, quiet=True)
        finish_run(trainer, trainer.fit())
        scored[name] = json.loads((tmp_path / name / "result.json").read_text())["final"]["valid"]["tokens"]
    assert scored["capped"] <= 100 < scored["whole"]


def test_plot_writes_png(tmp_path, corpus):
    from txl.cli.plot import plot_runs

    config = write_config(tmp_path, corpus, steps=4, eval_interval=2)
    Trainer(build_run_config(config_file=config), tmp_path / "r", quiet=True).fit()
    png = plot_runs([tmp_path / "r"], tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
