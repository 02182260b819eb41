"""Dynamic evaluation (txl.eval.dynamic, `txl eval --dynamic-lr`): pinned against static evaluation,
causal in the text, adapting where text repeats, and leaving the model as it found it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import make_corpus
from tiny_models import build
from txl.cli.main import main
from txl.errors import UsageError
from txl.eval.dynamic import evaluate_dynamic
from txl.eval.segments import evaluate


def static_per_token(model, tokens, **kwargs):
    per = np.zeros(len(tokens) - 1, dtype=np.float32)
    result = evaluate(model, tokens, metric="ppl", batch_size=1, warm_memory=False, per_token=per, **kwargs)
    return result, per


def dynamic_per_token(model, tokens, **kwargs):
    per = np.zeros(len(tokens) - 1, dtype=np.float32)
    return evaluate_dynamic(model, tokens, metric="ppl", per_token=per, **kwargs), per


@pytest.fixture
def tokens():
    rng = np.random.default_rng(0)
    return rng.integers(0, 61, size=181)


@pytest.mark.parametrize("decay", [0.0, 0.3])
def test_no_step_is_static_evaluation(decay, tokens):
    """η = 0: the weights never move (the decay pulls toward where they are), the static scores."""
    model = build()
    static, want = static_per_token(model, tokens, tgt_len=12, mem_len=16)
    dynamic, got = dynamic_per_token(model, tokens, lr=0.0, decay=decay, tgt_len=12, mem_len=16)
    assert np.abs(got - want).max() < 1e-5 and dynamic.tokens == static.tokens == len(tokens) - 1
    assert abs(dynamic.loss - static.loss) < 1e-6 and dynamic.mode == "dynamic"


def test_each_step_is_krauses_update(tokens):
    """Three segments by hand: θ_i = θ_{i-1} − η ∇L_i + λ (θ0 − θ_{i-1}), the gradient of each
    segment's mean loss at the weights that scored it; the third segment's scores must agree."""
    eta, lam, t = 0.3, 0.25, 12
    model, reference = build(), build()
    _, got = dynamic_per_token(model, tokens[: 3 * t + 1], lr=eta, decay=lam, tgt_len=t, mem_len=16)
    theta0 = [p.detach().clone() for p in reference.parameters()]
    ids = torch.as_tensor(tokens[: 3 * t + 1], dtype=torch.long)[None]
    memory, scores = None, []
    for i in range(3):
        out = reference(ids[:, i * t: (i + 1) * t], memory=memory, labels=ids[:, i * t + 1: (i + 1) * t + 1], mem_len=16)
        scores.append(out.nll.detach()[0])
        grads = torch.autograd.grad(out.nll.mean(), list(reference.parameters()), allow_unused=True)
        with torch.no_grad():
            for p, g, p0 in zip(reference.parameters(), grads, theta0, strict=True):
                p.copy_(p - eta * (g if g is not None else 0) + lam * (p0 - p))
        memory = out.memory
    assert np.abs(got - torch.cat(scores).numpy()).max() < 1e-5


def test_a_token_is_never_scored_by_weights_that_saw_it_or_later_text(tokens):
    model = build()
    _, before = dynamic_per_token(model, tokens, lr=0.3, tgt_len=12, mem_len=16)
    changed = tokens.copy()
    changed[100:] = (changed[100:] + 7) % 61  # rewrite the text from target 100 on
    _, after = dynamic_per_token(model, changed, lr=0.3, tgt_len=12, mem_len=16)
    assert np.array_equal(before[:99], after[:99])  # targets 1..99 are read before anything changed
    assert not np.allclose(before[99:], after[99:])


def test_it_adapts_to_repeated_text_and_restores_the_weights():
    rng = np.random.default_rng(1)
    phrase = rng.integers(0, 61, size=48)
    tokens = np.concatenate([phrase] * 5)
    model = build()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    static, _ = static_per_token(model, tokens, tgt_len=16, mem_len=0)  # no memory: only the weights can learn
    dynamic, per = dynamic_per_token(model, tokens, lr=0.5, tgt_len=16, mem_len=0)
    assert dynamic.loss < static.loss - 0.5  # it learned the phrase while reading it
    assert per[-48:].mean() < per[:47].mean()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # θ0 restored
    assert not model.training


def test_fast_backend_steps_like_the_reference(tokens):
    fast = build()
    reference = build(attention_impl="eager", backend="reference")
    reference.load_state_dict(fast.state_dict())
    a, got = dynamic_per_token(fast, tokens, lr=0.2, decay=0.1, tgt_len=12, mem_len=16)
    b, want = dynamic_per_token(reference, tokens, lr=0.2, decay=0.1, tgt_len=12, mem_len=16)
    assert np.abs(got - want).max() < 1e-4


def test_bad_settings_are_one_line_errors(tokens):
    model = build()
    for lr, decay in ((-1.0, 0.0), (float("nan"), 0.0), (0.1, 1.5)):
        with pytest.raises(UsageError, match="dynamic-evaluation"):
            evaluate_dynamic(model, tokens, metric="ppl", lr=lr, decay=decay)
    with pytest.raises(UsageError, match="same_length needs mem_len >= 1"):  # the static evaluator's checks
        evaluate_dynamic(model, tokens, metric="ppl", lr=0.1, mem_len=0, same_length=True)


def test_cli(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    corpus = make_corpus(tmp_path / "corpus.txt", lines=600)
    run = tmp_path / "run"
    sets = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.d_head=16", "model.d_inner=64",
            "model.mem_len=16", "tgt_len=16", "batch_size=4", "eval_tgt_len=16", "sample_tokens=0"]
    argv = ["train", "--data", f"text:{corpus}?tokenizer=bytes", "--out", str(run), "--max-steps", "5", "--quiet"]
    assert main([*argv, *[x for s in sets for x in ("--set", s)]]) == 0
    capsys.readouterr()
    assert main(["eval", str(run), "--max-tokens", "400", "--dynamic-lr", "0.01", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "dynamic" and out["dynamic_lr"] == 0.01 and out["batch_size"] == 1 and out["tokens"] == 400
    assert main(["eval", str(run), "--max-tokens", "400", "--dynamic-lr", "0.01", "--quiet"]) == 0
    assert "dynamic evaluation (Krause et al. 2018)" in capsys.readouterr().out
    for bad, message in ((["--batch-size", "4"], "one stream"), (["--vanilla"], "does not combine"),
                         (["--dynamic-lr", "-1"], "finite number >= 0")):
        argv = ["eval", str(run), "--dynamic-lr", "0.01", *bad]
        assert main(argv) == 2 and message in capsys.readouterr().err
    assert main(["eval", str(run), "--dynamic-decay", "0.1"]) == 2
    assert "needs --dynamic-lr" in capsys.readouterr().err
