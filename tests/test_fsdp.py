"""Sharded training (`train.parallelism = "fsdp"`, FSDP2 `fully_shard` per block then the root; issue 46
item 3), on the CPU with 2 gloo processes (FSDP2's all-gather and reduce-scatter run on gloo in torch 2.13):
the same losses as one process and as DDP on the same global batch (within 1e-5), checkpoints in the files
of one process (safetensors + JSON, the same tensors), an exact resume, and together with activation
checkpointing and with micro-batches (grad_accum). The combinations it does not run are one-line ConfigErrors; one process is a plain run.

Dropout off for the comparisons (each rank draws its own dropout stream), schedule constant for the resume
(a cosine over max_steps would change with the interrupted run's shorter budget)."""

from __future__ import annotations

import pytest
import torch

import helpers
from helpers import finish, train_losses, txl, write_config
from txl.errors import ConfigError
from txl.models.pretrained import load_tensors
from txl.train import LAST, Trainer
from txl.train.config import build_run_config

corpus, cache_dir = helpers.corpus, helpers.cache_dir  # fixtures

TOL = 1e-5


def _train(config, out, *extra, nproc: int = 0):
    args = ["train", "--config", str(config), "--out", str(out), "--quiet", *extra]
    if nproc:
        args += ["--nproc", str(nproc)]
    code, log = finish(txl(*args))
    assert code == 0, log
    return train_losses(out), log


def _tensors(run, name):
    return load_tensors(run / LAST / name, "test", require_digest=True, follow_links=False)[0]


@pytest.mark.slow
def test_fsdp_two_gloo_processes_equal_one_process_and_ddp(tmp_path, corpus):
    config = write_config(tmp_path, corpus, steps=4, dropout=0.0, varlen="false", eval_interval=2)
    one, note = _train(config, tmp_path / "one", "--set", "parallelism=fsdp")
    assert "nothing to shard, a plain run" in note
    ddp, _ = _train(config, tmp_path / "ddp", nproc=2)
    ddp_recompute, _ = _train(config, tmp_path / "ddp-ckpt", "--set", "activation_checkpointing=blocks", nproc=2)
    fsdp, _ = _train(config, tmp_path / "fsdp", "--set", "parallelism=fsdp", nproc=2)
    recompute, _ = _train(config, tmp_path / "fsdp-ckpt", "--set", "parallelism=fsdp", "--set",
                          "activation_checkpointing=blocks", nproc=2)
    # micro-batches: gradients reduce-scattered on the last one only (set_requires_gradient_sync)
    accumulated, _ = _train(config, tmp_path / "fsdp-accum", "--set", "parallelism=fsdp", "--set", "grad_accum=2",
                            nproc=2)
    assert sorted(one) == sorted(ddp) == sorted(fsdp) == sorted(recompute) == sorted(accumulated) == [1, 2, 3, 4]
    for step in one:
        assert abs(fsdp[step] - one[step]) < TOL and abs(fsdp[step] - ddp[step]) < TOL, step
        assert abs(recompute[step] - fsdp[step]) < 1e-6 and abs(ddp_recompute[step] - ddp[step]) < 1e-6, step
        assert abs(accumulated[step] - one[step]) < TOL, step
    # the files of one process: the same tensors (names, shapes, dtypes), gathered whole
    for name in ("model.safetensors", "optimizer.safetensors"):
        mine, theirs = _tensors(tmp_path / "fsdp", name), _tensors(tmp_path / "one", name)
        assert mine.keys() == theirs.keys(), name
        for key, value in theirs.items():
            assert mine[key].shape == value.shape and mine[key].dtype == value.dtype, key
            assert (mine[key].double() - value.double()).abs().max().item() < TOL, key
    assert (tmp_path / "fsdp" / "best" / "model.safetensors").is_file()
    assert (tmp_path / "fsdp" / "result.json").is_file()  # the run's end (final scores) ran on the unsharded model


@pytest.mark.slow
def test_fsdp_resume_is_exact(tmp_path, corpus):
    """Interrupted after 2 steps and resumed to 4 = 4 steps at once: the same losses and the same files."""
    config = write_config(tmp_path, corpus, steps=4, dropout=0.0, varlen="false")
    sets = ["--set", "parallelism=fsdp", "--set", "schedule=constant"]
    whole, _ = _train(config, tmp_path / "whole", *sets, nproc=2)
    _train(config, tmp_path / "split", *sets, "--max-steps", "2", nproc=2)
    code, log = finish(txl("train", "--resume", str(tmp_path / "split"), "--max-steps", "4", "--quiet", "--nproc", "2"))
    assert code == 0, log
    assert train_losses(tmp_path / "split") == whole
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = _tensors(tmp_path / "whole", name), _tensors(tmp_path / "split", name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.parametrize("sets, message", [
    (["compile=true"], "unset train.compile"),
    (["ema=0.99"], "set train.ema=0"),
    (["optimizer=lamb"], "adam or adamw, not 'lamb'"),
    (["objective=mlm"], "the language-modelling objective"),
    (["model.arch=lstm"], "model.arch='decoder'"),
])
def test_combinations_fsdp_does_not_run_are_refused_in_one_line(tmp_path, corpus, sets, message):
    """Refused with any world size, so a configuration tried on one process does not fail on many."""
    config = write_config(tmp_path, corpus, steps=1)
    run = build_run_config(config_file=config, sets=["parallelism=fsdp", *sets])
    with pytest.raises(ConfigError, match="train.parallelism='fsdp' is for") as err:
        Trainer(run, tmp_path / "run", quiet=True)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_fsdp_with_one_process_is_a_plain_run_with_a_note(tmp_path, corpus, capsys):
    config = write_config(tmp_path, corpus, steps=1)
    run = build_run_config(config_file=config, sets=["parallelism=fsdp"])
    trainer = Trainer(run, tmp_path / "run", quiet=True)
    try:
        assert not trainer.sharded
        assert "nothing to shard, a plain run" in capsys.readouterr().err
    finally:
        trainer.close()
