"""The weight average (`train.ema`): its arithmetic, its place in validation and `best`, and resume."""

from __future__ import annotations

import json

import pytest
import torch

import helpers
from helpers import finish, txl, write_config
from txl.errors import CheckpointError, ConfigError
from txl.models.pretrained import load_tensors, save_tensors
from txl.train import LAST, Trainer
from txl.train.averaging import PREFIX, WeightAverage
from txl.train.config import build_run_config
from txl.train.finish import finish as finish_run

corpus, cache_dir = helpers.corpus, helpers.cache_dir  # fixtures


def test_the_average_is_an_ema_with_a_short_start_and_applied_gives_the_weights_back():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    average = WeightAverage(model, 0.9)
    expected = [p.detach().clone() for p in model.parameters()]
    for step in range(1, 30):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        decay = min(0.9, step / (9 + step))  # (1 + n) / (10 + n) with n = updates before this one
        expected = [decay * e + (1 - decay) * p.detach() for e, p in zip(expected, model.parameters())]
        average.update()
    assert all(torch.allclose(s, e, atol=1e-6) for s, e in zip(average.shadow, expected))
    live = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="inside"), average.applied():
        assert all(torch.equal(p, s) for p, s in zip(model.parameters(), average.shadow))
        raise RuntimeError("inside")
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), live))  # restored even after an error


@pytest.mark.parametrize("value", ["1.0", "-0.1", "1.5"])
def test_a_decay_outside_zero_to_one_names_the_key(tmp_path, corpus, value):
    config = write_config(tmp_path, corpus, steps=2)
    with pytest.raises(ConfigError, match=r"train\.ema must be in \[0, 1\)"):
        build_run_config(config_file=config, sets=[f"ema={value}"])


def test_best_holds_the_average_when_it_scores_better_on_valid(tmp_path, corpus):
    """Validation scores the live weights ("valid") and the average ("valid_ema"); here the stubbed
    score prefers the average, so `best` must hold exactly the average and say so."""
    config = write_config(tmp_path, corpus, steps=6, eval_interval=3)
    run = build_run_config(config_file=config, sets=["ema=0.5", "final_splits=[\"valid\"]"])
    trainer = Trainer(run, tmp_path / "r", quiet=True)
    real = trainer.evaluate_split

    def prefer_the_average(split, **kwargs):
        result = real(split, **kwargs)
        first = next(p for p in trainer.model.parameters() if p.requires_grad)
        holds_average = torch.equal(first.detach(), trainer.average.shadow[0])
        result.loss += -1.0 if holds_average else 0.0
        return result

    trainer.evaluate_split = prefer_the_average
    finish_run(trainer, trainer.fit())
    out = tmp_path / "r"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "valid"] == [3, 6]
    assert [r["step"] for r in records if r["split"] == "valid_ema"] == [3, 6]
    state = json.loads((out / "best" / "trainer_state.json").read_text())
    assert state["weights"] == "average" and state["step"] == 6
    best, _ = load_tensors(out / "best" / "model.safetensors")
    saved, _ = load_tensors(out / LAST / "trainer.safetensors")  # `last` was written at step 6 too
    averaged = {k[len(PREFIX):]: v for k, v in saved.items() if k.startswith(PREFIX)}
    assert averaged and all(torch.equal(best[k], v) for k, v in averaged.items())
    live, _ = load_tensors(out / LAST / "model.safetensors")
    assert any(not torch.equal(live[k], v) for k, v in averaged.items())  # the two weights differ
    result = json.loads((out / "result.json").read_text())
    assert result["best_weights"] == "average"
    # the last step's live weights are scored beside them (the stub adds 1 nat to them)
    assert result["final_live"]["valid"]["loss"] == pytest.approx(result["final"]["valid"]["loss"] + 1.0, abs=0.5)


def test_without_ema_nothing_changes(tmp_path, corpus):
    config = write_config(tmp_path, corpus, steps=2, eval_interval=2)
    trainer = Trainer(build_run_config(config_file=config), tmp_path / "r", quiet=True)
    assert trainer.average is None
    finish_run(trainer, trainer.fit())
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert {r["split"] for r in records} == {"train", "valid"}
    saved, _ = load_tensors(tmp_path / "r" / LAST / "trainer.safetensors")
    assert not any(k.startswith(PREFIX) for k in saved)
    result = json.loads((tmp_path / "r" / "result.json").read_text())
    assert "best_weights" not in result and "final_live" not in result


@pytest.mark.slow
def test_a_resumed_run_carries_the_average_on_bitwise(tmp_path, corpus):
    config = write_config(tmp_path, corpus, steps=10)
    sets = ["--set", "ema=0.8", "--set", "schedule=constant"]  # a constant lr: the horizon may change
    code, log = finish(txl("train", "--config", str(config), *sets, "--out", str(tmp_path / "a"), "--quiet"))
    assert code == 0, log
    code, log = finish(txl("train", "--config", str(config), *sets, "--max-steps", "4", "--out",
                           str(tmp_path / "b"), "--quiet"))
    assert code == 0, log
    code, log = finish(txl("train", "--resume", str(tmp_path / "b"), "--max-steps", "10", "--quiet"))
    assert code == 0, log
    a, _ = load_tensors(tmp_path / "a" / LAST / "trainer.safetensors")
    b, _ = load_tensors(tmp_path / "b" / LAST / "trainer.safetensors")
    names = [k for k in a if k.startswith(PREFIX)]
    assert names and all(torch.equal(a[k], b[k]) for k in names)
    for run in ("a", "b"):
        assert json.loads((tmp_path / run / LAST / "trainer_state.json").read_text())["ema_updates"] == 10


def test_a_checkpoint_without_its_average_is_refused_in_one_line(tmp_path, corpus):
    config = write_config(tmp_path, corpus, steps=2)
    run = build_run_config(config_file=config, sets=["ema=0.9"])
    finish_run(trainer := Trainer(run, tmp_path / "r", quiet=True), trainer.fit())
    trainer.close()
    path = tmp_path / "r" / LAST / "trainer.safetensors"
    tensors, metadata = load_tensors(path)
    save_tensors(path, {k: v for k, v in tensors.items() if not k.startswith(PREFIX)}, metadata)
    with pytest.raises(CheckpointError, match="weight average of .* is missing"):
        Trainer(run, tmp_path / "r", quiet=True, resume=True)


def test_eval_live_false_validates_the_average_alone_until_the_last_validation(tmp_path, corpus):
    """train.eval_live=false: every validation scores the average, the live weights only at the last,
    so `best` can still take them there; without an average the key is refused in one line."""
    config = write_config(tmp_path, corpus, steps=6, eval_interval=2)
    run = build_run_config(config_file=config, sets=["ema=0.5", "eval_live=false", "final_splits=[\"valid\"]"])
    trainer = Trainer(run, tmp_path / "r", quiet=True)
    finish_run(trainer, trainer.fit())
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "valid_ema"] == [2, 4, 6]
    assert [r["step"] for r in records if r["split"] == "valid"] == [6]
    result = json.loads((tmp_path / "r" / "result.json").read_text())
    assert result["best_weights"] in ("average", "live") and "valid" in result["final"]
    with pytest.raises(ConfigError, match=r"train\.eval_live=false .* train\.ema is 0"):
        build_run_config(config_file=config, sets=["eval_live=false"])
