"""Activation checkpointing (`train.activation_checkpointing = "blocks"`, issue 46 item 2): each block
recomputed in the backward gives the gradients of the plain run, with memory over segments, on both
backends (eager reference and the fast kernels with their scratch workspaces), dropout on (the recompute
replays the same masks) and off, pre- and post-LN, the universal (shared-block, ACT) model, compressive
memory and ERNIE-Doc's same-layer memory; the memory a checkpointed forward returns is the plain one,
and the recompute never writes into it. Through the trainer: the same losses step by step.

Tolerance: 1e-6 on every gradient and loss (the recompute runs the same operations on the same inputs,
so the results are expected bit-equal; 1e-6 leaves room for nothing but float noise)."""

from __future__ import annotations

import pytest
import torch

import helpers
from helpers import train_losses, write_config
from tiny_models import tiny
from txl.errors import ConfigError
from txl.models.transformer_xl.model import TransformerXL
from txl.nn.memory import MemoryUpdate

corpus, cache_dir = helpers.corpus, helpers.cache_dir  # fixtures

TOL = 1e-6
BACKENDS = {"eager": dict(backend="reference", attention_impl="eager"), "fast": dict(backend="auto", attention_impl="fast")}
VARIANTS = {
    "post-ln": {},
    "pre-ln": dict(pre_lnorm=True),
    "universal": dict(universal=True, n_layer=3, ponder_cost=0.01),
    "compressive": dict(cmem_len=8, cmem_ratio=2, cmem_fn="conv", mem_len=8),
    "same-layer": dict(memory_source="same-layer"),
}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(overrides: dict, *, checkpoint: bool, segments: int = 3, seed: int = 7, bf16: bool = False):
    """Gradients, losses and final memory of `segments` training segments with memory (one backward per
    segment, as the trainer), from the same weights and the same RNG state."""
    torch.manual_seed(0)
    model = TransformerXL(tiny(**overrides)).train()
    model.checkpoint_blocks = checkpoint
    data = torch.randint(0, model.config.vocab_size, (2, 8 * segments + 1), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(seed)
    memory, losses = None, []
    for s in range(segments):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(data[:, 8 * s : 8 * s + 8], memory=memory, labels=data[:, 8 * s + 1 : 8 * s + 9])
        loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss
        loss.backward()
        losses.append(loss.item())
        memory = out.memory
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return grads, losses, memory, torch.get_rng_state()


def _compare(overrides: dict, *, bf16: bool = False) -> None:
    plain_grads, plain_losses, plain_memory, plain_rng = _run(overrides, checkpoint=False, bf16=bf16)
    grads, losses, memory, rng = _run(overrides, checkpoint=True, bf16=bf16)
    assert losses == pytest.approx(plain_losses, abs=TOL)
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        assert (grad - plain_grads[name]).abs().max().item() <= TOL, name
    assert (memory is None) == (plain_memory is None)
    if memory is not None:
        for a, b in zip(memory.tensors(), plain_memory.tensors(), strict=True):
            assert a.shape == b.shape and (a - b).abs().max().item() <= TOL
    assert torch.equal(rng, plain_rng)  # the recompute draws its dropout masks from a restored RNG state


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_checkpointed_gradients_equal_the_plain_run_dropout_off(backend, variant):
    _compare({**BACKENDS[backend], **VARIANTS[variant]})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["post-ln", "pre-ln", "universal"])
def test_checkpointed_gradients_equal_the_plain_run_with_dropout(backend, variant):
    """Dropout and attention dropout on: the recompute replays the forward's masks (the RNG state is
    preserved), so the gradients are still the plain run's."""
    _compare({**BACKENDS[backend], **VARIANTS[variant], "dropout": 0.2, "dropatt": 0.1})


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpointed_gradients_equal_the_plain_run_under_bf16_autocast(backend):
    """The recompute runs under the forward's autocast state (torch.utils.checkpoint keeps it)."""
    _compare({**BACKENDS[backend], "dropout": 0.1}, bf16=True)


def test_the_recompute_reads_the_memory_without_writing_it(monkeypatch):
    """Each layer hands its context to the forward's memory pass once: the recompute in the backward goes
    to a replay copy (MemoryUpdate.replay), so the pass that built the next memory is never written again."""
    calls: list[MemoryUpdate] = []
    original = MemoryUpdate.keys_values

    def recording(self, layer, fresh, project):
        calls.append(self)
        return original(self, layer, fresh, project)

    monkeypatch.setattr(MemoryUpdate, "keys_values", recording)
    torch.manual_seed(0)
    model = TransformerXL(tiny(**BACKENDS["eager"])).train()
    model.checkpoint_blocks = True
    x = torch.randint(0, 61, (2, 8))
    first = model(x, labels=x)
    first.loss.backward()
    calls.clear()
    out = model(x, memory=first.memory, labels=x)
    n_layer = model.config.n_layer
    forward_pass = calls[0]
    assert calls == [forward_pass] * n_layer
    before = [t.clone() for t in out.memory.tensors()]
    out.loss.backward()
    replays = calls[n_layer:]
    assert len(replays) == n_layer and all(r is not forward_pass and len(r.contexts) == 1 for r in replays)
    assert len(forward_pass.contexts) == n_layer
    assert all(torch.equal(a, b) for a, b in zip(before, out.memory.tensors(), strict=True))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_block_is_recomputed_through_a_replay(monkeypatch, backend, variant):
    """The switch is really on (the equal gradients above are not those of a plain run twice): the
    backward re-runs every block (every universal step) of every segment, each through a replay pass."""
    replays = []
    original = MemoryUpdate.replay

    def counting(self):
        replays.append(self)
        return original(self)

    monkeypatch.setattr(MemoryUpdate, "replay", counting)
    overrides = {**BACKENDS[backend], **VARIANTS[variant]}
    _run(overrides, checkpoint=True, segments=2)
    assert len(replays) == 2 * tiny(**overrides).n_layer


def test_no_checkpoint_without_autograd():
    """Evaluation (no gradient) runs the blocks as usual: the switch changes nothing there."""
    torch.manual_seed(0)
    model = TransformerXL(tiny(**BACKENDS["fast"])).eval()
    x = torch.randint(0, 61, (2, 8))
    with torch.no_grad():
        plain = model(x).logits
        model.checkpoint_blocks = True
        assert torch.equal(model(x).logits, plain)


def test_three_trainer_steps_with_blocks_checkpointed_give_the_same_losses(tmp_path, corpus):
    """`--set activation_checkpointing=blocks`: three steps with dropout, the same losses as without."""
    from txl.train import Trainer
    from txl.train.config import build_run_config

    config = write_config(tmp_path, corpus, steps=3, dropout=0.1)
    losses = {}
    for setting in ("none", "blocks"):
        sets = ["save_interval=0"] + ([f"activation_checkpointing={setting}"] if setting != "none" else [])
        run = build_run_config(config_file=config, sets=sets)
        trainer = Trainer(run, tmp_path / setting, quiet=True)
        assert trainer.model.checkpoint_blocks is (setting == "blocks")
        trainer.fit()
        trainer.close()
        losses[setting] = train_losses(tmp_path / setting)
    assert losses["blocks"].keys() == losses["none"].keys() == {1, 2, 3}
    for step, loss in losses["none"].items():
        assert losses["blocks"][step] == pytest.approx(loss, abs=TOL)


def test_other_architectures_refuse_in_one_line(tmp_path, corpus):
    from txl.train import Trainer
    from txl.train.config import build_run_config

    config = write_config(tmp_path, corpus, steps=1)
    run = build_run_config(config_file=config, sets=["activation_checkpointing=blocks", "model.arch=lstm"])
    with pytest.raises(ConfigError, match="activation_checkpointing='blocks' is for the Transformer-XL"):
        Trainer(run, tmp_path / "run", quiet=True)


def test_bench_train_runs_each_txl_contender_also_checkpointed():
    """`txl bench train --activation-checkpointing`: txl-<impl> and txl-<impl>+ckpt side by side (a
    training step each; the peak-RSS figures come from the same contender names)."""
    from txl.bench.common import shape_named
    from txl.bench.train import make_step

    shape = shape_named("tiny")
    step = make_step("txl-fast+ckpt", shape, "fp32")
    assert step() > 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_model_with_blocks_checkpointed_trains_like_the_plain_run(backend):
    """torch.compile with checkpoint_blocks (train.compile + activation_checkpointing): the compiled
    graph recomputes the tagged regions itself; losses and gradients over 3 segments with memory are the
    plain eager run's (losses within 1e-6, gradients within 1e-6: compiled kernels may round differently)."""
    def run(checkpoint: bool, compiled: bool):
        torch.manual_seed(0)
        model = TransformerXL(tiny(**BACKENDS[backend])).train()
        model.checkpoint_blocks = checkpoint
        forward = torch.compile(model) if compiled else model
        data = torch.randint(0, 61, (2, 25), generator=torch.Generator().manual_seed(1))
        memory, losses = None, []
        for s in range(3):
            out = forward(data[:, 8 * s : 8 * s + 8], memory=memory, labels=data[:, 8 * s + 1 : 8 * s + 9])
            out.loss.backward()
            losses.append(out.loss.item())
            memory = out.memory
        return losses, {name: p.grad for name, p in model.named_parameters()}

    plain_losses, plain_grads = run(False, False)
    losses, grads = run(True, True)
    assert losses == pytest.approx(plain_losses, abs=TOL)
    for name, grad in plain_grads.items():
        assert (grads[name] - grad).abs().max().item() <= TOL, name
