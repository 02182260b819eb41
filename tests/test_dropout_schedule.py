"""The dropout schedule (`train.dropout_start`, `train.dropout_ramp`): its arithmetic, its checks, and the
trainer moving every model.dropout layer (the fast backend's included) while dropatt stays put."""

from __future__ import annotations

import json
import math

import pytest
import torch

import helpers
from helpers import write_config
from txl.errors import ConfigError
from txl.train import Trainer
from txl.train.config import build_run_config
from txl.train.optim import dropout_at

corpus, cache_dir = helpers.corpus, helpers.cache_dir  # fixtures


def test_the_rate_moves_linearly_from_start_to_end_over_the_ramp_then_holds():
    at = lambda step, **kw: dropout_at(step, start=0.1, end=0.3, max_steps=100, **kw)  # noqa: E731
    assert at(0, ramp=1.0) == pytest.approx(0.1)
    assert at(50, ramp=1.0) == pytest.approx(0.2)
    assert at(100, ramp=1.0) == pytest.approx(0.3)
    assert at(25, ramp=0.5) == pytest.approx(0.2)
    assert at(50, ramp=0.5) == pytest.approx(0.3) and at(90, ramp=0.5) == pytest.approx(0.3)
    assert at(10_000, ramp=1.0) == pytest.approx(0.3)  # past max_steps: the end rate
    # a wall-clock budget further along than the steps leads, as it does for the cosine
    assert at(10, ramp=1.0, time_fraction=0.5) == pytest.approx(0.2)
    assert at(10, ramp=1.0, time_fraction=7.0) == pytest.approx(0.3)
    # downwards too (early dropout: start high, end at model.dropout)
    assert dropout_at(50, start=0.4, end=0.0, ramp=1.0, max_steps=100) == pytest.approx(0.2)


@pytest.mark.parametrize("key, value, message", [
    ("dropout_start", "1.0", r"train\.dropout_start must be in \[0, 1\)"),
    ("dropout_start", "-0.1", r"train\.dropout_start must be in \[0, 1\)"),
    ("dropout_start", "nan", r"dropout_start must be float or null, got 'nan'"),  # (--set reads nan as text)
    ("dropout_ramp", "0", r"train\.dropout_ramp must be in \(0, 1\]"),
    ("dropout_ramp", "1.5", r"train\.dropout_ramp must be in \(0, 1\]"),
])
def test_a_rate_or_ramp_out_of_range_names_the_key(tmp_path, corpus, key, value, message):
    config = write_config(tmp_path, corpus, steps=2)
    with pytest.raises(ConfigError, match=message):
        build_run_config(config_file=config, sets=[f"{key}={value}"])


def test_with_torch_compile_it_is_refused_before_anything_runs(tmp_path, corpus):
    config = write_config(tmp_path, corpus, steps=2)
    with pytest.raises(ConfigError, match="recompile every step"):
        build_run_config(config_file=config, sets=["dropout_start=0.1", "compile=true"])


@pytest.mark.parametrize("arch", ["lstm", "sha-rnn"])
def test_a_recurrent_model_is_refused_with_the_reason(tmp_path, corpus, arch):
    config = write_config(tmp_path, corpus, steps=2)
    run = build_run_config(config_file=config, sets=[f"model.arch={arch}", "dropout_start=0.1"])
    with pytest.raises(ConfigError, match=f"model.arch='{arch}' applies its dropouts as functions"):
        Trainer(run, tmp_path / "r", quiet=True)
    assert not (tmp_path / "r").exists()  # nothing written


def test_the_trainer_moves_every_dropout_layer_and_logs_the_rate(tmp_path, corpus):
    steps, end = 8, 0.2
    config = write_config(tmp_path, corpus, steps=steps, dropout=end)
    run = build_run_config(config_file=config, sets=["dropout_start=0", "dropout_ramp=0.5", "log_interval=1",
                                                     "model.dropatt=0.1"])
    trainer = Trainer(run, tmp_path / "r", quiet=True)
    layers = [m for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert layers and trainer.scheduled_dropouts == layers  # the tiny model's dropouts are all model.dropout's
    seen: list[list[float]] = []
    real_step = trainer.train_step

    def record_then_step(batch):
        seen.append(sorted({m.p for m in layers}))
        return real_step(batch)

    trainer.train_step = record_then_step
    trainer.fit()
    trainer.close()
    expected = [dropout_at(s, start=0.0, end=end, ramp=0.5, max_steps=steps) for s in range(steps)]
    assert [rates for rates in seen] == [[pytest.approx(e)] for e in expected]  # one rate in every layer
    assert expected[0] == 0 and expected[-1] == pytest.approx(end) and expected[2] == pytest.approx(end / 2)
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    logged = [r["dropout"] for r in records if r["split"] == "train"]
    assert logged == pytest.approx(expected)
    assert trainer.model_config.dropout == end and trainer.model_config.dropatt == 0.1  # the saved config: the end
    saved = json.loads((tmp_path / "r" / "last" / "config.json").read_text())
    assert saved["dropout"] == end


def test_at_rate_zero_the_training_forward_is_the_evaluation_forward(tmp_path, corpus):
    """The rate really reaches the layers: at 0 (the schedule's first step) training mode draws nothing."""
    config = write_config(tmp_path, corpus, steps=4, dropout=0.3)
    run = build_run_config(config_file=config, sets=["dropout_start=0"])
    trainer = Trainer(run, tmp_path / "r", quiet=True)
    for module in trainer.scheduled_dropouts:
        module.p = 0.0
    tokens = torch.randint(0, trainer.model_config.vocab_size, (2, 9))
    torch.manual_seed(0)
    trained = trainer.model.train()(tokens[:, :-1], labels=tokens[:, 1:]).loss
    evaluated = trainer.model.eval()(tokens[:, :-1], labels=tokens[:, 1:]).loss
    assert math.isfinite(trained.item()) and torch.equal(trained, evaluated)
    for module in trainer.scheduled_dropouts:
        module.p = 0.3
    assert not torch.equal(trainer.model.train()(tokens[:, :-1], labels=tokens[:, 1:]).loss, evaluated)
    trainer.close()


def test_without_a_schedule_nothing_is_collected_and_no_rate_is_logged(tmp_path, corpus):
    config = write_config(tmp_path, corpus, steps=2, dropout=0.2)
    run = build_run_config(config_file=config, sets=["log_interval=1"])
    trainer = Trainer(run, tmp_path / "r", quiet=True)
    assert trainer.scheduled_dropouts == []
    trainer.fit()
    trainer.close()
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert all("dropout" not in r for r in records)
    assert all(m.p == 0.2 for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout))
