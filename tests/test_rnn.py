"""The recurrent LMs (issue 19): AWD-LSTM (`arch = "lstm"`) and SHA-RNN (`arch = "sha-rnn"`) on
TransformerXL's contract — state carried across segments, stop-gradient, save/load, generation,
the regularisers, the config, and the CLI journey."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import make_corpus, train_losses
from txl import EncoderDecoderConfig, RecurrentConfig, TransformerXLConfig
from txl.cli.main import main
from txl.errors import CheckpointError, ConfigError, UsageError
from txl.models.pretrained import load_tensors
from txl.models.registry import build_model, load_model
from txl.models.rnn.model import (
    DropConnectLSTM,
    RecurrentLM,
    RecurrentMemory,
    embedding_dropout,
    locked_dropout,
)

ARCHS = ["lstm", "sha-rnn"]


def rnn_config(arch: str, **overrides) -> RecurrentConfig:
    base = dict(arch=arch, vocab_size=53, n_layer=3, d_model=16, d_inner=24 if arch == "lstm" else 64, mem_len=64,
                dropout=0.0)
    return RecurrentConfig(**{**base, **overrides})


def build(arch: str, seed: int = 0, **overrides) -> RecurrentLM:
    torch.manual_seed(seed)
    model = build_model(rnn_config(arch, **overrides)).eval()
    with torch.no_grad():  # non-trivial gates, LayerNorms and biases so every path matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def ids(model, batch=2, length=16, seed=3) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# The contract


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_contract(arch):
    model = build(arch)
    x = ids(model)
    labels = x.roll(-1, dims=1)
    labels[0, :5] = -100
    out = model(x, labels=labels)
    assert out.logits.shape == (2, 16, 53) and out.hidden.shape == (2, 16, 16)
    assert out.nll.shape == (2, 16) and out.nll.dtype == torch.float32
    assert (out.nll[0, :5] == 0).all() and (out.nll[0, 5:] > 0).all()
    reference = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 53), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, reference)
    assert isinstance(out.memory, RecurrentMemory) and len(out.memory.states) == 2 * 3
    assert out.memory.length == (16 if arch == "sha-rnn" else 0)
    assert model(x, mem_len=0).memory is None  # mem_len 0 carries nothing


@pytest.mark.parametrize("arch", ARCHS)
def test_carried_state_equals_one_pass(arch):
    """Two (and four) segments with the carried state give the logits of one pass over their concatenation."""
    model = build(arch)
    x = ids(model, length=24)
    with torch.no_grad():
        full = model(x, mem_len=64).logits
        memory, parts = None, []
        for chunk in x.split(6, dim=1):
            out = model(chunk, memory=memory, mem_len=64)
            memory, parts = out.memory, parts + [out.logits]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # and the state matters: starting fresh differs
        fresh = model(x[:, 6:12], mem_len=64).logits
    assert (fresh - full[:, 6:12]).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ARCHS)
def test_evaluation_in_row_groups_keeps_the_state(arch, monkeypatch):
    """`evaluate` runs wide batches in row groups and joins their memories: the recurrent kind survives."""
    import numpy as np

    from txl.eval import segments as ev

    model = build(arch)
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, 400)
    whole = ev.evaluate(model, tokens, metric="bpc", batch_size=4, tgt_len=10, mem_len=20)
    monkeypatch.setattr(ev, "EVAL_GROUP_ELEMENTS", 30 * 16)  # one row per group
    grouped = ev.evaluate(model, tokens, metric="bpc", batch_size=4, tgt_len=10, mem_len=20)
    assert grouped.loss == pytest.approx(whole.loss, abs=1e-6) and grouped.tokens == whole.tokens


def test_sha_rnn_memory_keeps_exactly_mem_len():
    model = build("sha-rnn")
    x = ids(model, length=30)
    with torch.no_grad():
        first = model(x[:, :20], mem_len=8)
        assert first.memory.length == 8
        short = model(x[:, :4], mem_len=8)
        assert short.memory.length == 4  # fewer states than mem_len so far
        second = model(x[:, 20:], memory=first.memory, mem_len=8)
        assert second.memory.length == 8
        # the memory is the last 8 attended states: one pass over x[:, 12:20] from the same LSTM state
        # would differ, but the attention memory equals the tail of the long pass's memory
        long = model(x, mem_len=30)
        torch.testing.assert_close(second.memory.hidden[0], long.memory.hidden[0][:, -8:], atol=1e-5, rtol=1e-5)
        # truncation changes the result: with a longer memory the second segment sees more
        wide = model(x[:, 20:], memory=model(x[:, :20], mem_len=20).memory, mem_len=20)
    assert (wide.logits - second.logits).abs().max() > 1e-4
    assert model(x[:, :20], mem_len=8).memory.truncate(3).length == 3


@pytest.mark.parametrize("arch", ARCHS)
def test_stop_gradient_across_segments(arch):
    """Segment 2's loss sends no gradient into segment 1: its tokens (ids below 25) get no embedding
    gradient, though segment 2 reads segment 1's state; the same state passed without the stop-gradient
    does send one (so the check can fail)."""
    model = build(arch, tie_weight=False)
    model.train()  # (no dropout is set: training mode, deterministic)
    first_ids = torch.randint(0, 25, (2, 8), generator=torch.Generator().manual_seed(0))
    second_ids = torch.randint(25, 53, (2, 8), generator=torch.Generator().manual_seed(1))
    first = model(first_ids, labels=first_ids)
    assert all(not s.requires_grad for s in (*first.memory.states, *first.memory.hidden))
    second = model(second_ids, memory=first.memory, labels=second_ids)
    second.loss.backward()
    grad = model.embed.weight.grad
    assert grad[:25].abs().max() == 0 and grad[25:].abs().max() > 0
    reads_state = model(second_ids, labels=second_ids).loss  # segment 2 without the state differs
    assert (reads_state - second.loss).abs() > 1e-5

    model.zero_grad()  # the control: a state still attached to segment 1's graph
    captured = []
    hook = DropConnectLSTM.forward
    try:
        def keep(self, x, state):
            out, new = hook(self, x, state)
            captured.append(new)
            return out, new
        DropConnectLSTM.forward = keep
        first = model(first_ids, labels=first_ids)
    finally:
        DropConnectLSTM.forward = hook
    attached = RecurrentMemory(first.memory.hidden, states=tuple(t for pair in captured for t in pair))
    model(second_ids, memory=attached, labels=second_ids).loss.backward()
    assert model.embed.weight.grad[:25].abs().max() > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_save_load_round_trip(arch, tmp_path):
    model = build(arch, dropout_embed=0.1, weight_drop=0.2)
    model.save_pretrained(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]
    loaded = RecurrentLM.from_pretrained(tmp_path / "ckpt")
    assert isinstance(loaded, RecurrentLM) and loaded.config == model.config and not loaded.training
    x = ids(model)
    with torch.no_grad():
        a, b = model(x), loaded(x)
    torch.testing.assert_close(a.logits, b.logits, atol=0, rtol=0)
    assert "head_weight" not in loaded.state_dict()  # tied: the softmax reads the embedding matrix


@pytest.mark.parametrize("arch", ARCHS)
def test_load_refuses_mismatched_weights(arch, tmp_path):
    model = build(arch)
    model.save_pretrained(tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["d_inner"] = 32 if arch == "lstm" else 48  # other LSTM / Boom widths than the weights
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="disagree|do not match"):
        load_model(tmp_path / "ckpt")
    other = "sha-rnn" if arch == "lstm" else "lstm"  # the other arch's config over these weights
    config = rnn_config(other).to_dict()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError):
        load_model(tmp_path / "ckpt")


@pytest.mark.parametrize("arch", ARCHS)
def test_generation_with_state_equals_rerun(arch):
    """Greedy generation carrying the state = re-running the whole context at every step."""
    model = build(arch)
    prompt = ids(model, batch=1, length=5)
    generated = model.generate(prompt, 12, temperature=0)
    assert generated.shape == (1, 17) and torch.equal(generated[:, :5], prompt)
    context = prompt
    with torch.no_grad():
        for _ in range(12):
            logits = model(context, mem_len=64).logits[:, -1]
            context = torch.cat([context, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, context)
    with torch.no_grad():  # and the logits of the carried run are the re-run's
        memory, steps = None, []
        for t in range(generated.shape[1] - 1):
            out = model(generated[:, t:t + 1], memory=memory, mem_len=64)
            memory, steps = out.memory, steps + [out.logits[:, -1]]
        full = model(generated[:, :-1], mem_len=64).logits
    torch.testing.assert_close(torch.stack(steps, dim=1), full, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# The regularisers


def test_embedding_dropout_drops_whole_words_in_training_only():
    torch.manual_seed(0)
    weight = torch.randn(200, 8)
    dropped = embedding_dropout(weight, 0.5, training=True)
    zero_rows = (dropped == 0).all(dim=1)
    assert 50 < int(zero_rows.sum()) < 150  # whole rows dropped ...
    torch.testing.assert_close(dropped[~zero_rows], weight[~zero_rows] * 2)  # ... the rest scaled
    assert embedding_dropout(weight, 0.5, training=False) is weight


def test_locked_dropout_shares_one_mask_over_time():
    torch.manual_seed(0)
    x = torch.ones(4, 10, 32)
    y = locked_dropout(x, 0.5, training=True)
    assert ((y == 0) | (y == 2)).all() and (y == 0).any()
    assert (y == y[:, :1]).all()  # every time step has the mask of step 0
    assert not (y[0] == y[1]).all()  # but each sequence its own
    assert locked_dropout(x, 0.5, training=False) is x


def test_weight_drop_changes_only_the_hidden_to_hidden_matrix_in_training():
    torch.manual_seed(0)
    layer = DropConnectLSTM(6, 10, weight_drop=0.5)
    w_ih, w_hh, b_ih, b_hh = layer.weights()
    assert w_ih is layer.lstm.weight_ih_l0 and b_ih is layer.lstm.bias_ih_l0 and b_hh is layer.lstm.bias_hh_l0
    assert (w_hh == 0).float().mean() > 0.3  # DropConnect zeroes hidden-to-hidden entries
    kept = w_hh != 0
    torch.testing.assert_close(w_hh[kept], layer.lstm.weight_hh_l0[kept] * 2)
    assert torch.equal(layer.lstm.weight_hh_l0 != 0, torch.ones_like(kept))  # the parameter itself is untouched
    layer.eval()
    assert layer.weights()[1] is layer.lstm.weight_hh_l0  # identity in eval
    x = torch.randn(2, 5, 6)  # and the fused run equals nn.LSTM's with the same weights
    out, (h, c) = layer(x, None)
    ref, (h_ref, c_ref) = layer.lstm(x)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(h, h_ref[0])


DROPOUTS = [(arch, field) for arch in ARCHS
            for field in ["dropout_embed", "dropout_input", "dropout_hidden", "weight_drop", "dropout"]]


@pytest.mark.parametrize(("arch", "field"), [*DROPOUTS, ("sha-rnn", "dropatt")])
def test_each_dropout_is_active_in_training_and_identity_in_eval(arch, field):
    model = build(arch, **{field: 0.5})
    plain = build(arch)  # the same weights (same seed), no dropout
    x = ids(model)
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, plain(x).logits, atol=0, rtol=0)  # eval: identity
        model.train()
        torch.manual_seed(1)
        a = model(x).logits
        torch.manual_seed(2)
        b = model(x).logits
    assert (a - b).abs().max() > 1e-4  # training: random, so two draws differ
    assert (a - plain(x).logits).abs().max() > 1e-4


# ---------------------------------------------------------------------------------------------
# The config


@pytest.mark.parametrize("arch", ARCHS)
def test_parameter_estimate_is_exact(arch):
    for overrides in ({}, {"n_layer": 1}, {"d_inner": 32 if arch == "sha-rnn" else 40, "tie_weight": False},
                      *([{"rnn_attention": "all"}] if arch == "sha-rnn" else [])):
        config = rnn_config(arch, **overrides)
        model = build_model(config)
        assert config.num_parameters_estimate() == model.num_parameters(exclude_embeddings=True), overrides


@pytest.mark.parametrize(("arch", "field", "value"), [
    ("lstm", "n_head", 4), ("lstm", "pos_encoding", "rope"), ("lstm", "attention", "sliding"),
    ("lstm", "cutoffs", (10,)), ("lstm", "backend", "reference"), ("lstm", "dropatt", 0.1),
    ("lstm", "rnn_attention", "all"), ("sha-rnn", "same_length", True), ("sha-rnn", "clamp_len", 8),
    ("sha-rnn", "pre_lnorm", True), ("sha-rnn", "attention_impl", "eager"), ("lstm", "init_std", 0.05),
])
def test_transformer_settings_are_refused_for_rnn_archs(arch, field, value):
    with pytest.raises(ConfigError, match=f"config.{field} does not apply to arch='{arch}'"):
        rnn_config(arch, **{field: value})


@pytest.mark.parametrize("field", ["dropout_embed", "dropout_input", "dropout_hidden", "weight_drop"])
def test_rnn_fields_are_checked(field):
    if field in ("dropout_embed", "dropout_input"):  # the decoder reads them too (tests/test_regularization.py)
        with pytest.raises(ConfigError, match=f"config.{field} only applies to arch='decoder', 'lstm' or 'sha-rnn'"):
            EncoderDecoderConfig(**{field: 0.1})
    else:
        with pytest.raises(ConfigError, match=f"config.{field} only applies to arch='lstm' or 'sha-rnn'"):
            TransformerXLConfig(**{field: 0.1})
    with pytest.raises(ConfigError, match=rf"config.{field} must be in \[0, 1\)"):
        rnn_config("lstm", **{field: 1.0})
    with pytest.raises(ConfigError, match="rnn_attention only applies"):
        TransformerXLConfig(rnn_attention="all")
    with pytest.raises(ConfigError, match="d_inner must be a multiple of d_model"):
        rnn_config("sha-rnn", d_inner=40)


def test_switching_a_preset_to_an_rnn_arch():
    """--set model.arch=lstm over a Transformer preset drops the preset's heads etc.; the same --set
    group asking for heads is refused by name."""
    from txl.train.config import build_run_config

    run = build_run_config(preset="tiny", sets=["model.arch=lstm"])
    config = run.model_config(vocab_size=50)
    assert config.arch == "lstm" and config.d_model == 128 and "n_head" not in config.to_dict()
    with pytest.raises(ConfigError, match="config.n_head does not apply to arch='lstm'"):
        build_run_config(preset="tiny", sets=["model.arch=lstm", "model.n_head=2"])


@pytest.mark.parametrize("arch", ARCHS)
def test_transformer_runtime_options_end_in_one_line(arch):
    model = build(arch)
    x = ids(model)
    for kwargs in ({"clamp_len": 4}, {"same_length": True}, {"output_attentions": True},
                   {"global_mask": torch.ones_like(x)}):
        with pytest.raises(UsageError, match="is a Transformer setting"):
            model(x, **kwargs)
    model(x, clamp_len=0, same_length=False)  # the neutral values evaluation passes are fine
    padded = torch.ones_like(x)
    padded[0, 0] = 0
    with pytest.raises(UsageError, match="padding"):
        model(x, attention_mask=padded)
    with pytest.raises(UsageError, match="RecurrentMemory"):
        from txl.nn.memory import Memory

        model(x, memory=Memory((torch.zeros(2, 3, 16),)))
    other = build(arch, n_layer=2)(x).memory
    with pytest.raises(UsageError, match="another model's memory"):
        model(x, memory=other)
    with pytest.raises(UsageError, match="memory holds batch 2"):
        model(x[:1], memory=model(x).memory)


# ---------------------------------------------------------------------------------------------
# The CLI journey: train -> eval -> generate -> recl on both archs


def cli(capsys, *args) -> tuple[int, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out + err


def rnn_sets(arch: str) -> list[str]:
    width = ["model.d_inner=24"] if arch == "lstm" else ["model.d_inner=64", "model.dropatt=0.1"]
    sets = [f"model.arch={arch}", "model.n_layer=2", "model.d_model=16", "model.mem_len=12", "model.dropout_input=0.1",
            "model.dropout_embed=0.1", "model.weight_drop=0.2", "model.dropout_hidden=0.1", *width,
            "train.tgt_len=12", "train.batch_size=4", "train.eval_interval=1000", "train.eval_max_tokens=400",
            "train.log_interval=1", "train.sample_tokens=8", "train.schedule=constant"]
    return [arg for item in sets for arg in ("--set", item)]


@pytest.fixture(scope="module")
def chars(tmp_path_factory):
    path = make_corpus(tmp_path_factory.mktemp("rnn-corpus") / "corpus.txt", lines=400)
    return f"text:{path}?tokenizer=chars"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.slow
def test_cli_journey(arch, chars, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    # over the default preset (tiny, a Transformer): its heads etc. are dropped by the arch switch
    code, out = cli(capsys, "train", "--data", chars, "--out", run, "--max-steps", 4, *rnn_sets(arch))
    assert code == 0, out
    assert load_model(run).config.arch == arch
    code, out = cli(capsys, "eval", run, "--max-tokens", 300, "--per-token", tmp_path / "nll.npy")
    assert code == 0 and "bpc" in out, out
    code, out = cli(capsys, "eval", run, "--max-tokens", 300, "--mem-len", 4, "--json")
    assert code == 0 and json.loads(out)["mem_len"] == 4, out
    code, out = cli(capsys, "eval", run, "--max-tokens", 200, "--sweep-mem", "0,4,12", "--sweep-out", tmp_path / "sweep")
    assert code == 0, out
    header = (tmp_path / "sweep.md").read_text().split("|")[0]  # names the recurrent model, not a Transformer's
    assert {"lstm": "AWD-LSTM", "sha-rnn": "SHA-RNN"}[arch] in header and "d_model" not in header
    code, out = cli(capsys, "generate", run, "--prompt", "the ", "--max-new-tokens", 10, "--seed", 0)
    assert code == 0 and out.startswith("the "), out
    code, out = cli(capsys, "recl", run, "--mode", "window", "--contexts", "4,8", "--max-tokens", 150,
                    "--out", tmp_path / "recl")
    assert code == 0 and "4→8" in out, out
    code, out = cli(capsys, "eval", run, "--vanilla", "--attn-len", 8, "--max-tokens", 100, "--json")
    assert code == 0 and json.loads(out)["attn_len"] == 8, out  # fresh windows: as defined for an RNN as for a Transformer
    code, out = cli(capsys, "generate", run, "--prompt", "the ", "--max-new-tokens", 5, "--mem-len", 0, "--greedy")
    assert code == 0 and out.startswith("the "), out
    code, out = cli(capsys, "recl", run, "--mode", "memory", "--contexts", "4,8", "--max-tokens", 150)
    assert code != 0 and "use --mode window" in out and "Traceback" not in out, out
    for option in (["--clamp-len", "4"], ["--same-length"]):  # Transformer-only options: one line, exit != 0
        code, out = cli(capsys, "eval", run, "--max-tokens", 100, *option)
        assert code != 0 and "is a Transformer setting" in out and "Traceback" not in out, (option, out)
        assert out.strip().splitlines()[-1].startswith("txl eval: error:")
    from serve_helpers import request, running
    from txl.serve.app import create_app
    from txl.serve.engine import open_run

    with running(create_app([open_run(run)])) as url:
        status, body, _ = request(url, "POST", "/api/score", {"text": "the memory of the"})
        assert status == 200 and len(body["nll"]) == 16, body
        status, body, _ = request(url, "POST", "/api/score",
                                  {"text": "the memory", "attention": {"token": 3, "layer": 0, "head": 0}})
        assert status == 422 and "attention views are for Transformer runs" in body["error"], body
        status, body, _ = request(url, "POST", "/api/generate", {"prompt": "the ", "max_new_tokens": 4})
        assert status == 200 and "event: done" in body, body


@pytest.mark.parametrize("arch", ARCHS)
def test_resume_is_exact_with_the_carried_state(arch, chars, tmp_path, capsys):
    """4 + 4 steps with --resume = 8 steps: the LSTM states and attention memory are saved and restored."""
    code, out = cli(capsys, "train", "--data", chars, "--out", tmp_path / "a", "--max-steps", 8, "--quiet",
                    *rnn_sets(arch))
    assert code == 0, out
    code, out = cli(capsys, "train", "--data", chars, "--out", tmp_path / "b", "--max-steps", 4, "--quiet",
                    *rnn_sets(arch))
    assert code == 0, out
    saved, _ = load_tensors(tmp_path / "b" / "last" / "trainer.safetensors")
    assert sum(name.startswith("memory.") and ".state" in name for name in saved) == 4  # h, c of 2 layers
    code, out = cli(capsys, "train", "--resume", tmp_path / "b", "--max-steps", 8, "--quiet")
    assert code == 0, out
    assert train_losses(tmp_path / "a") == train_losses(tmp_path / "b")
