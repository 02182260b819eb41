"""The first hour (issue 45): the demo's budgets, threads and end of run, without waiting on a clock.

Every minutes budget here runs on a fake clock (`txl.train.loop.clock`, one second per reading), so what
the tests pin does not depend on this machine's speed or load."""

from __future__ import annotations

import itertools
import json
import time

import pytest
import torch

import helpers
from helpers import write_config
from txl.train import Trainer
from txl.train.config import TrainConfig, build_run_config, load_preset
from txl.train.finish import finish

corpus, cache_dir = helpers.corpus, helpers.cache_dir  # fixtures


def fake_clock(monkeypatch, seconds_per_reading: float = 1.0):
    """The trainer's clock advances `seconds_per_reading` at every reading, whatever the machine's speed."""
    import txl.train.loop as loop

    ticks = itertools.count()
    monkeypatch.setattr(loop, "clock", lambda: seconds_per_reading * next(ticks))


def train_records(run_dir, split="train") -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


def test_the_cosine_follows_the_minutes_budget_by_default(tmp_path, corpus, monkeypatch):
    """A run cut by max_minutes ends its cosine at eta_min without any other setting (issue 45: the default
    followed the steps alone, and a 1-minute run stopped at 95% of its peak rate)."""
    assert TrainConfig().schedule_clock == "minutes"
    fake_clock(monkeypatch)
    config = write_config(tmp_path, corpus, steps=10**6, varlen="false")
    run = build_run_config(config_file=config, sets=["max_minutes=0.5", "warmup_steps=0", "eta_min=0",
                                                     "schedule=cosine", "save_interval=0"])
    result = Trainer(run, tmp_path / "run", quiet=True).fit()
    assert result["stopped_by"] == "max_minutes" and 5 < result["steps"] < 100
    lrs = [r["lr"] for r in train_records(tmp_path / "run")]
    assert lrs[0] > 0.9 * 2e-3 and lrs[-1] < 0.02 * 2e-3


def test_the_demo_preset_ends_by_whichever_budget_binds():
    """The demo has both budgets, validates on a slice sized for its minutes, and keeps the default
    (time-following) schedule: on a slow machine its minutes end the cosine, on a fast one its steps."""
    train = load_preset("tiny")["train"]
    assert train["max_minutes"] <= 3 and train["max_steps"] == 1500 and "schedule_clock" not in train
    assert train["eval_max_tokens"] <= 50_000 and train["max_steps"] // train["eval_interval"] <= 3


def test_warm_up_over_half_the_steps_is_warned_at_the_start(tmp_path, corpus, capsys):
    config = write_config(tmp_path, corpus, steps=6)
    run = build_run_config(config_file=config, sets=["warmup_steps=4", "eval_interval=1000"])
    Trainer(run, tmp_path / "run", quiet=True).fit()
    err = capsys.readouterr().err
    assert "warning: train.warmup_steps=4 is 67% of max_steps=6" in err and "--set warmup_steps=1" in err
    run = build_run_config(config_file=config, sets=["warmup_steps=2", "eval_interval=1000"])
    Trainer(run, tmp_path / "quiet", quiet=True).fit()
    assert "warning" not in capsys.readouterr().err


def test_a_minutes_budget_that_ends_inside_warm_up_is_warned_once_the_pace_is_known(tmp_path, corpus, capsys,
                                                                                    monkeypatch):
    """The demo stopped inside its warm-up on a busy machine (issue 45): once the step rate is known, a
    minutes budget that will end the run before twice its warm-up is named, with the step it will stop at."""
    fake_clock(monkeypatch)  # ~3 readings a step: 0.5 minutes is ~10 steps
    config = write_config(tmp_path, corpus, steps=10**6, varlen="false")
    run = build_run_config(config_file=config, sets=["max_minutes=0.5", "warmup_steps=200", "save_interval=0",
                                                     "log_interval=3"])
    result = Trainer(run, tmp_path / "run", quiet=True).fit()
    err = capsys.readouterr().err
    assert result["stopped_by"] == "max_minutes"
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, err
    assert "max_minutes=0.5 will end the run near step" in warnings[0] and "inside its warm-up of 200" in warnings[0]
    assert "--max-minutes" in warnings[0]


def test_the_progress_total_is_the_step_the_binding_budget_ends_at(tmp_path, corpus, monkeypatch):
    """The bar's total (and so its ETA) is the step the run will likely end at: max_steps, or where the
    minutes run out at this session's pace."""
    from txl.train.progress import Progress

    totals = []
    monkeypatch.setattr(Progress, "advance", lambda self, step, total=None: totals.append((step, total)))
    fake_clock(monkeypatch)
    config = write_config(tmp_path, corpus, steps=10**6, varlen="false")
    run = build_run_config(config_file=config, sets=["max_minutes=0.5", "save_interval=0"])
    result = Trainer(run, tmp_path / "run", quiet=True).fit()
    last_step, last_total = totals[-1]
    assert last_step == result["steps"] and all(total < 10**6 for _, total in totals)
    assert abs(last_total - result["steps"]) <= 1  # the projection ends where the run ended
    steps = build_run_config(config_file=config, sets=["max_steps=5"])
    trainer = Trainer(steps, tmp_path / "steps", quiet=True)
    assert trainer.projected_steps(10.0, 2) == 5  # no minutes budget: max_steps


def test_the_final_score_reuses_the_last_validation_of_the_same_weights(tmp_path, corpus, monkeypatch, capsys):
    """The demo scored the same 200,000 tokens twice with the same weights (issue 45): when `best` is the
    last validation's weights and the final cap is the validation's, the end of the run reuses its score."""
    config = write_config(tmp_path, corpus, steps=4, eval_interval=2)
    run = build_run_config(config_file=config, sets=["final_splits=[\"valid\"]", "sample_tokens=0"])
    trainer = Trainer(run, tmp_path / "run", quiet=True)
    summary = trainer.fit()
    validated = train_records(tmp_path / "run", "valid")
    scored = []
    plain = trainer.evaluate_split
    monkeypatch.setattr(trainer, "evaluate_split", lambda split, **kw: scored.append(split) or plain(split, **kw))
    summary = finish(trainer, summary)
    assert scored == []  # nothing scored again
    best = min(validated, key=lambda r: r["loss"])
    assert summary["final"]["valid"]["loss"] == best["loss"] and summary["final_from_validation"] == {"valid": best["step"]}
    assert f"valid: the score of the validation at step {best['step']}" in capsys.readouterr().out
    # another cap than the validation's: scored, as before
    run = build_run_config(config_file=config, sets=["final_splits=[\"valid\"]", "sample_tokens=0",
                                                     "final_max_tokens=1000"])
    trainer = Trainer(run, tmp_path / "other", quiet=True)
    summary = trainer.fit()
    plain = trainer.evaluate_split
    monkeypatch.setattr(trainer, "evaluate_split", lambda split, **kw: scored.append(split) or plain(split, **kw))
    summary = finish(trainer, summary)
    assert scored == ["valid"] and summary["final"]["valid"]["tokens"] <= 1000 and "final_from_validation" not in summary


def test_resuming_a_finished_run_says_so_in_one_line_without_scoring(tmp_path, corpus, capsys):
    from txl.cli.main import main

    config = write_config(tmp_path, corpus, steps=3)
    out = tmp_path / "run"
    assert main(["train", "--config", str(config), "--out", str(out), "--quiet", "--set", "final_splits=[\"valid\"]",
                 "--threads", "1"]) == 0
    capsys.readouterr()
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()}
    assert main(["train", "--resume", str(out)]) == 0
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and captured.out == "", captured
    valid = json.loads((out / "result.json").read_text())["final"]["valid"]["bpc"]
    assert lines[0].startswith(f"txl train: {out} is finished: step 3, max_steps 3, valid bpc {valid:.4f}")
    assert f"txl train --resume {out} --max-steps 6" in lines[0]
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()} == before  # nothing written
    # a larger budget trains on, as before
    assert main(["train", "--resume", str(out), "--max-steps", "4", "--quiet"]) == 0
    assert json.loads((out / "result.json").read_text())["steps"] == 4


def test_resuming_a_run_whose_minutes_are_spent_names_the_minutes(tmp_path):
    from txl.cli.train import finished_line

    cfg = TrainConfig(max_steps=1000, max_minutes=3)
    (tmp_path / "result.json").write_text(json.dumps({"metric": "bpc", "final": {"valid": {"bpc": 2.5}}}))
    line = finished_line(tmp_path, cfg, step=400, elapsed=181.0)
    assert "is finished: step 400, max_minutes 3 (3.0 minutes trained), valid bpc 2.5000" in line
    assert line.endswith(f"txl train --resume {tmp_path} --max-minutes 7")
    assert finished_line(tmp_path, cfg, step=400, elapsed=100.0) == ""  # budget left: it trains on
    (tmp_path / "result.json").unlink()  # stopped after its last checkpoint, before its result: finish it
    assert finished_line(tmp_path, cfg, step=1000, elapsed=100.0) == ""


# -- threads ---------------------------------------------------------------------------------------------


def test_threads_default_to_the_idle_physical_cores(monkeypatch):
    from txl.cli import arguments

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(arguments, "physical_cores", lambda cpus: 2)
    monkeypatch.setattr(arguments, "busy_cores", lambda cpus, seconds: 0)
    assert arguments.default_threads() == 2  # a quiet machine: every core
    monkeypatch.setattr(arguments, "busy_cores", lambda cpus, seconds: 1)
    assert arguments.default_threads() == 1  # one core busy elsewhere: the one left
    monkeypatch.setattr(arguments, "busy_cores", lambda cpus, seconds: 5)
    assert arguments.default_threads() == 1  # at least one
    monkeypatch.setattr(arguments, "physical_cores", lambda cpus: 1)
    assert arguments.default_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert arguments.default_threads() == 0  # the environment decides


def test_busy_cores_reads_the_other_processes_load(monkeypatch):
    from txl.cli import arguments

    readings = iter([{0: (100, 200), 1: (100, 200)}, {0: (200, 300), 1: (110, 300)}])  # cpu0 idle, cpu1 90% busy
    monkeypatch.setattr(arguments, "_cpu_times", lambda cpus: next(readings))
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    assert arguments.busy_cores([0, 1], 0.0) == 1
    monkeypatch.setattr(arguments, "_cpu_times", lambda cpus: {})
    assert arguments.busy_cores([0, 1], 0.0) == 0  # no /proc/stat: nothing known to be busy


def test_apply_threads_sets_torch(monkeypatch):
    from txl.cli.arguments import apply_threads

    before = torch.get_num_threads()
    try:
        assert apply_threads(1) == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert apply_threads(0) == torch.get_num_threads()  # the environment's choice stands
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("command", [["train"], ["generate", "RUN"], ["eval", "RUN"], ["serve", "RUN"],
                                     ["bench", "train"]])
def test_every_computing_command_takes_threads_and_main_applies_them(command, monkeypatch):
    """`--threads N` on every command that computes, applied once by txl.cli.main before the command runs."""
    from txl.cli import arguments
    from txl.cli import main as cli_main

    applied = []
    monkeypatch.setattr(arguments, "apply_threads", lambda n: applied.append(n) or n)

    def stop(args):
        raise SystemExit(0)

    monkeypatch.setattr(cli_main, "_load", lambda name, fn, real=cli_main._load: stop if fn == "run" else real(name, fn))
    with pytest.raises(SystemExit):
        cli_main.main([*command, "--threads", "3"])
    assert applied == [3]


def test_a_resumed_run_keeps_the_schedule_clock_it_was_saved_with(tmp_path, corpus):
    """Runs saved while "steps" was the default recorded it, and resume with it; runs saved before the key
    existed followed the minutes (its behaviour then), which the new default gives them."""
    from txl.train import LAST
    from txl.train.state import STATE_FILE, resume_config

    config = write_config(tmp_path, corpus, steps=2)
    run = build_run_config(config_file=config, sets=["schedule_clock=steps", "max_minutes=5"])
    Trainer(run, tmp_path / "run", quiet=True).fit()
    assert resume_config(tmp_path / "run").train.schedule_clock == "steps"
    state_file = tmp_path / "run" / LAST / STATE_FILE
    state = json.loads(state_file.read_text())
    del state["run"]["train"]["schedule_clock"]
    state_file.write_text(json.dumps(state))
    assert resume_config(tmp_path / "run").train.schedule_clock == "minutes"
