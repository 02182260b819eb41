"""train.optimizer = "muon": Muon on the hidden matrices, AdamW on the rest (txl.train.optim.MuonAdam)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

import helpers
from helpers import finish, train_losses, txl, write_config
from txl import TransformerXL, TransformerXLConfig
from txl.models.pretrained import load_tensors
from txl.train import LAST
from txl.train.optim import (
    MuonAdam,
    build_optimizer,
    hidden_matrices,
    optimizer_state_join,
    optimizer_state_split,
    set_lr,
)

corpus, cache_dir = helpers.corpus, helpers.cache_dir  # fixtures


def tiny_model(seed: int = 0, **kw) -> TransformerXL:
    torch.manual_seed(seed)
    config = dict(vocab_size=300, n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, mem_len=8, dropout=0.0,
                  cutoffs=[100], tie_weight=True)
    return TransformerXL(TransformerXLConfig(**{**config, **kw}))


def loss_step(model: TransformerXL, optimizer, lr: float, seed: int) -> float:
    ids = torch.randint(0, 300, (2, 13), generator=torch.Generator().manual_seed(seed))
    loss = model(ids[:, :-1], labels=ids[:, 1:]).loss
    loss.backward()
    set_lr(optimizer, lr)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def test_hidden_matrices_are_the_linear_layers_only():
    model = tiny_model()
    names = {id(p): n for n, p in model.named_parameters()}
    chosen = sorted(names[id(p)] for p in hidden_matrices(model))
    expected = [f"pos.r_proj.{i}.weight" for i in range(2)] + [
        f"blocks.{i}.{part}.weight" for i in range(2)
        for part in ("attn.q_proj", "attn.kv_proj", "attn.o_proj", "ff.fc1", "ff.fc2")]
    assert chosen == sorted(expected)  # not the embedding, the adaptive head, LayerNorm, biases or u, v

    class Tied(nn.Module):  # a softmax layer tied to the embedding is the embedding: not a hidden matrix
        def __init__(self):
            super().__init__()
            self.emb, self.hidden, self.out = nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10)
            self.out.weight = self.emb.weight

    tied = Tied()
    assert [id(p) for p in hidden_matrices(tied)] == [id(tied.hidden.weight)]


def test_muon_adam_is_torch_muon_on_the_matrices_and_adamw_on_the_rest():
    model = tiny_model()
    twin = copy.deepcopy(model)
    ours = build_optimizer("muon", model, lr=1e-3, weight_decay=0.01, betas=(0.9, 0.98), eps=1e-9)
    assert isinstance(ours, MuonAdam)
    matrices = hidden_matrices(twin)
    rest = [p for p in twin.parameters() if all(p is not m for m in matrices)]
    muon = torch.optim.Muon(matrices, lr=1e-3, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(rest, lr=1e-3, weight_decay=0.01, betas=(0.9, 0.98), eps=1e-9, fused=True)
    for step, lr in enumerate([1e-3, 5e-4, 2e-3]):  # set_lr reaches both halves
        a = loss_step(model, ours, lr, seed=step)
        ids = torch.randint(0, 300, (2, 13), generator=torch.Generator().manual_seed(step))
        b = twin(ids[:, :-1], labels=ids[:, 1:]).loss
        b.backward()
        for opt in (muon, adamw):
            set_lr(opt, lr)
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert a == b.item()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name
    assert {len(g["params"]) for g in ours.param_groups if g["muon"]} == {len(matrices)}
    # (the twin comparison is what shows the matrices moved as Muon moves them); Muon keeps only a momentum
    assert all(set(ours.state[p]) == {"momentum_buffer"} for p in hidden_matrices(model))
    assert copy.deepcopy(ours).step() is None  # a copy keeps both halves


def test_muon_state_survives_the_json_and_safetensors_split_bit_exactly():
    model = tiny_model()
    optimizer = build_optimizer("muon", model, lr=1e-3, weight_decay=0.0)
    for step in range(3):
        loss_step(model, optimizer, 1e-3, seed=step)
    tensors, plain = optimizer_state_split(optimizer)
    tensors = {k: v.clone() for k, v in tensors.items()}  # as read back from optimizer.safetensors
    plain = json.loads(json.dumps(plain))  # what optimizer.json holds
    resumed_model = copy.deepcopy(model)
    resumed = build_optimizer("muon", resumed_model, lr=5.0, weight_decay=0.5, betas=(0.1, 0.2))
    resumed.load_state_dict(optimizer_state_join(tensors, plain))  # hyperparameters come from the checkpoint
    for group, saved in zip(resumed.param_groups, optimizer.param_groups, strict=True):
        assert {k: v for k, v in group.items() if k != "params"} == {k: v for k, v in saved.items() if k != "params"}
    assert isinstance(resumed.param_groups[0]["ns_coefficients"], tuple)
    assert isinstance(resumed.param_groups[1]["betas"], tuple)
    for step in range(3, 6):
        assert loss_step(model, optimizer, 1e-3, seed=step) == loss_step(resumed_model, resumed, 1e-3, seed=step)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed_model.parameters()))


def test_muon_needs_the_model_to_find_its_matrices():
    with pytest.raises(TypeError, match="needs the model"):
        build_optimizer("muon", tiny_model().parameters(), lr=1e-3, weight_decay=0.0)
    optimizer = build_optimizer("muon", tiny_model(), lr=1e-3, weight_decay=0.0)
    with pytest.raises(ValueError, match="muon=True"):
        optimizer.add_param_group({"params": [torch.zeros(3, requires_grad=True)]})


def test_vectors_stored_as_matrices_are_not_hidden_matrices():
    model = tiny_model(universal=True, n_layer=3)  # the halting unit is a Linear(d_model, 1)
    names = {id(p): n for n, p in model.named_parameters()}
    chosen = [names[id(p)] for p in hidden_matrices(model)]
    assert chosen and all(min(p.shape) > 1 for p in hidden_matrices(model))
    assert not any("halt" in n for n in chosen) and any("halt" in n for n in names.values())


@pytest.mark.slow
def test_muon_run_resumes_bit_exactly_and_learns(tmp_path, corpus):
    config = write_config(tmp_path, corpus, steps=12)
    sets = ["--set", "optimizer=muon", "--set", "schedule=constant", "--quiet"]
    code, log = finish(txl("train", "--config", str(config), "--out", str(tmp_path / "a"), *sets))
    assert code == 0, log
    code, log = finish(txl("train", "--config", str(config), "--out", str(tmp_path / "b"), "--max-steps", "5", *sets))
    assert code == 0, log
    code, log = finish(txl("train", "--resume", str(tmp_path / "b"), "--max-steps", "12", "--quiet"))
    assert code == 0, log
    a, b = train_losses(tmp_path / "a"), train_losses(tmp_path / "b")
    assert sorted(a) == sorted(b) == list(range(1, 13))
    assert all(a[s] == b[s] for s in a), [(s, a[s], b[s]) for s in a if a[s] != b[s]][:3]
    assert a[12] < a[1] - 0.5  # it learns
    wa, _ = load_tensors(tmp_path / "a" / LAST / "model.safetensors")
    wb, _ = load_tensors(tmp_path / "b" / LAST / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    groups = json.loads((tmp_path / "a" / LAST / "optimizer.json").read_text())["param_groups"]
    assert [g["muon"] for g in groups] == [True, False]


def test_a_checkpoint_cannot_switch_a_group_between_muon_and_adam(tmp_path):
    from txl.train.state import _check_param_groups

    fresh = build_optimizer("muon", tiny_model(), lr=1e-3, weight_decay=0.0).state_dict()["param_groups"]
    saved = [dict(g, muon=not g["muon"]) for g in fresh]
    with pytest.raises(ValueError, match="muon"):
        _check_param_groups(fresh, saved)


@pytest.mark.parametrize("arch", ["lstm", "sha-rnn"])
@pytest.mark.slow
def test_muon_is_refused_for_the_recurrent_lms_in_one_line(tmp_path, corpus, arch):
    config = tmp_path / "rnn.toml"
    config.write_text(f'[model]\narch = "{arch}"\nn_layer = 1\nd_model = 16\nd_inner = 16\n'
                      f'[train]\ndata = "text:{corpus}?tokenizer=bytes"\nmax_steps = 2\noptimizer = "muon"\n')
    code, log = finish(txl("train", "--config", str(config), "--out", str(tmp_path / "run"), "--quiet"))
    assert code == 2, log
    assert "train.optimizer='muon' is for the Transformer-XL decoder" in log and len(log.strip().splitlines()) == 1
    assert not (tmp_path / "run" / LAST).exists()
