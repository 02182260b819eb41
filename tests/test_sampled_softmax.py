"""Sampled softmax (config.sample_softmax; txl.models.transformer_xl.sampled): the reference code's
`sample_logits` in training, the full softmax everywhere else.

Pinned: the log-uniform candidates and their expected-count correction against the formulas (and against
counting), the sampled loss against a row-by-row reference with accidental hits removed, the model's training
loss is that loss and its evaluation the full softmax, the sampled gradient approaching the full-softmax
gradient as the number of samples grows (three sizes, then every id drawn), the config's refusals and a
three-step `txl train` run.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers import make_corpus
from txl.cli.main import main
from txl.errors import ConfigError
from txl.models.registry import build_model
from txl.models.transformer_xl.config import TransformerXLConfig
from txl.models.transformer_xl.sampled import (
    log_expected_count,
    log_uniform_candidates,
    log_uniform_draws,
    sampled_nll,
)

V = 500


def config(**kw) -> TransformerXLConfig:
    base = dict(vocab_size=V, n_layer=1, d_model=16, n_head=2, d_head=8, d_inner=32, mem_len=0,
                dropout=0.0, dropatt=0.0, sample_softmax=8)
    return TransformerXLConfig(**{**base, **kw})


def zipf_ids(shape, seed=0):
    torch.manual_seed(seed)
    return log_uniform_draws(V, shape)


def log_uniform(vocab: int) -> torch.Tensor:
    """P(k) = (log(k + 2) - log(k + 1)) / log(V + 1), float64 (the reference's LogUniformSampler.dist)."""
    k = torch.arange(vocab, dtype=torch.float64)
    return (torch.log(k + 2) - torch.log(k + 1)) / math.log(vocab + 1)


# ---------------------------------------------------------------------------------------------
# The candidates and their correction


def test_log_uniform_draws_follow_the_zipfian_distribution():
    vocab, draws = 50, 200_000
    torch.manual_seed(1)
    ids = log_uniform_draws(vocab, draws)
    assert ids.dtype == torch.int64 and int(ids.min()) >= 0 and int(ids.max()) < vocab
    freq = torch.bincount(ids, minlength=vocab).double() / draws
    p = log_uniform(vocab)
    # the largest P is 0.18: one standard error is <= sqrt(0.18 * 0.82 / 2e5) = 8.6e-4; 6 of them allowed
    assert (freq - p).abs().max() < 5e-3
    assert torch.allclose(p.sum(), torch.tensor(1.0, dtype=torch.float64))


def test_candidates_are_distinct_sorted_and_at_most_the_tries():
    torch.manual_seed(2)
    ids = log_uniform_candidates(V, 64)
    assert ids.numel() <= 64 and ids.numel() == ids.unique().numel()
    assert torch.equal(ids, ids.sort().values)


def test_expected_count_is_the_probability_of_being_drawn():
    vocab, tries = 40, 16
    ids = torch.arange(vocab)
    # the formula as written in the reference (log(1 - (1 - p)^tries), float64)
    reference = torch.log(1 - (1 - log_uniform(vocab)) ** tries)
    torch.testing.assert_close(log_expected_count(ids, vocab, tries), reference.float(), atol=1e-6, rtol=1e-6)
    # and counted: in how many of 20,000 steps of `tries` draws each id appears
    torch.manual_seed(3)
    steps = 20_000
    draws = log_uniform_draws(vocab, (steps, tries))
    seen = torch.zeros(steps, vocab).scatter_(1, draws, 1.0).mean(0).double()
    assert (seen - reference.exp()).abs().max() < 0.015  # std <= sqrt(0.25 / 2e4) = 3.5e-3


# ---------------------------------------------------------------------------------------------
# The sampled loss


def sampled_nll_reference(hidden, weight, bias, labels, negatives, vocab, tries):
    """Row by row: [target ; negatives other than the target], each logit minus its log expected count."""
    log_q = torch.log(1 - (1 - log_uniform(vocab)) ** tries).float()
    rows = []
    for h, y in zip(hidden, labels.tolist()):
        if y == -100:
            rows.append(h.sum() * 0)
            continue
        kept = [k for k in negatives.tolist() if k != y]
        ids = torch.tensor([y, *kept])
        logits = weight[ids] @ h + bias[ids] - log_q[ids]
        rows.append(torch.logsumexp(logits, 0) - logits[0])
    return torch.stack(rows)


def test_sampled_nll_matches_the_formula_with_accidental_hits_removed():
    torch.manual_seed(4)
    n, d, tries = 6, 8, 20
    hidden = torch.randn(n, d, dtype=torch.float32, requires_grad=True)
    weight = torch.randn(V, d, requires_grad=True)
    bias = torch.randn(V, requires_grad=True)
    labels = torch.tensor([0, 3, 7, -100, 3, 120])
    negatives = torch.tensor([0, 1, 3, 9, 57, 300])  # rows 0, 1 and 4 meet their target among them
    got = sampled_nll(hidden, weight, bias, labels, negatives, vocab_size=V, num_tries=tries)
    want = sampled_nll_reference(hidden, weight, bias, labels, negatives, V, tries)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got[3] == 0  # an ignored label scores nothing
    grads = torch.autograd.grad(got.sum(), [hidden, weight, bias])
    want_grads = torch.autograd.grad(want.sum(), [hidden, weight, bias])
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert torch.all(grads[0][3] == 0)


@pytest.mark.parametrize("extra", [{}, {"d_embed": 12, "tie_weight": False}],
                         ids=["tied", "untied-projected"])
def test_the_training_loss_is_the_sampled_loss(extra):
    model = build_model(config(**extra)).train()
    x, y = zipf_ids((3, 10), seed=5), zipf_ids((3, 10), seed=6)
    y[0, :2] = -100
    torch.manual_seed(7)
    out = model(x, labels=y)
    # the same draw again, and the head's parameters by hand
    torch.manual_seed(7)
    negatives = log_uniform_candidates(V, 2 * model.config.sample_softmax)
    head = model.head
    hidden = out.hidden.reshape(-1, model.config.d_model)
    if head.proj(0) is not None:
        hidden = hidden @ head.proj(0)  # (n, d_model) @ (d_model, d_embed)
    want = sampled_nll_reference(hidden, head.weight(0), head.bias, y.reshape(-1), negatives, V,
                                 2 * model.config.sample_softmax)
    torch.testing.assert_close(out.nll.reshape(-1), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss, want.sum() / (y != -100).sum(), atol=1e-5, rtol=1e-5)


def test_the_fast_backend_gives_the_reference_backends_sampled_loss():
    reference = build_model(config(backend="reference")).train()
    fast = build_model(config(backend="auto")).train()
    fast.load_state_dict(reference.state_dict())
    x = zipf_ids((4, 16), seed=13)
    losses, grads = [], []
    for model in (reference, fast):
        torch.manual_seed(14)  # the same negatives
        loss = model(x, labels=x).loss
        losses.append(loss)
        grads.append(torch.autograd.grad(loss, model.head.bias))
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-4, rtol=1e-4)


def test_evaluation_uses_the_full_softmax():
    sampled = build_model(config(sample_softmax=8))
    full = build_model(config(sample_softmax=0))
    full.load_state_dict(sampled.state_dict())
    x, y = zipf_ids((2, 12), seed=8), zipf_ids((2, 12), seed=9)
    sampled.eval(), full.eval()
    a, b = sampled(x, labels=y), full(x, labels=y)
    torch.testing.assert_close(a.loss, b.loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
    # training mode (dropout off): the loss is the sampled one; full logits only when asked for
    sampled.train()
    assert sampled(x, labels=y).logits is None
    c = sampled(x, labels=y, return_logits=True)
    torch.testing.assert_close(c.logits, b.logits, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(c.loss, b.loss, atol=1e-3)
    assert sampled(x, labels=y, return_logits=False).logits is None


# ---------------------------------------------------------------------------------------------
# The gradient approaches the full softmax's


def gradient(model, x, y) -> torch.Tensor:
    model.zero_grad()
    model(x, labels=y).loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_the_sampled_gradient_approaches_the_full_softmax_gradient():
    """Relative error ||g_sampled - g_full|| / ||g_full|| over every parameter, averaged over 6 draws, for
    n = 8, 128, 2048 sampled negatives (V = 500, Zipfian labels): measured 0.74, 0.20, 0.029 here; each size
    must at least halve the previous one's error. With every id drawn (n = 16384: Q = 1 to float32) the
    sampled loss is the full softmax and the gradients agree to 1e-4."""
    base = build_model(config(sample_softmax=0))
    x, y = zipf_ids((4, 16), seed=10), zipf_ids((4, 16), seed=11)
    full = gradient(base.eval(), x, y)
    errors = []
    for n in (8, 128, 2048):
        model = build_model(config(sample_softmax=n)).train()
        model.load_state_dict(base.state_dict())
        torch.manual_seed(12)
        draws = [((gradient(model, x, y) - full).norm() / full.norm()).item() for _ in range(6)]
        errors.append(sum(draws) / len(draws))
    assert errors[1] < errors[0] / 2 and errors[2] < errors[1] / 2, errors
    assert errors[2] < 0.1, errors
    model = build_model(config(sample_softmax=16384)).train()
    model.load_state_dict(base.state_dict())
    torch.testing.assert_close(gradient(model, x, y), full, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# Config and a training run


def test_config_refuses_negative_counts_and_the_adaptive_softmax():
    with pytest.raises(ConfigError, match="sample_softmax must be 0"):
        config(sample_softmax=-1)
    with pytest.raises(ConfigError, match="sample_softmax.*cutoffs"):
        config(sample_softmax=8, cutoffs=(100,))
    assert config(sample_softmax=0, cutoffs=(100,)).adaptive  # each alone is fine
    saved = config(sample_softmax=0).to_dict()
    del saved["sample_softmax"]  # a config saved before the field existed loads with the full softmax
    assert TransformerXLConfig.from_dict(saved).sample_softmax == 0


def test_three_training_steps_with_sampled_softmax(tmp_path):
    corpus = make_corpus(tmp_path / "corpus.txt", lines=300)
    toml = tmp_path / "run.toml"
    toml.write_text(f"""
[model]
n_layer = 1
d_model = 16
n_head = 2
d_head = 8
d_inner = 32
mem_len = 8
dropout = 0.0
sample_softmax = 16

[train]
data = "text:{corpus}?tokenizer=bytes"
tgt_len = 8
batch_size = 2
max_steps = 3
log_interval = 1
eval_interval = 3
save_interval = 1000
eval_max_tokens = 200
eval_batch_size = 2
final_splits = []
""")
    out = tmp_path / "run"
    assert main(["train", "--config", str(toml), "--out", str(out), "--quiet", "--threads", "1"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train_losses = [r["loss"] for r in rows if r["split"] == "train"]
    assert len(train_losses) == 3 and all(math.isfinite(v) for v in train_losses)
    assert [r["step"] for r in rows if r["split"] == "valid"] == [3]  # scored with the full softmax
    assert json.loads((out / "best" / "config.json").read_text())["sample_softmax"] == 16
