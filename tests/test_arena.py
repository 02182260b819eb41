"""The long-text arena: sliding window / Longformer, sparse strided, Performer, Linformer, compressive
memory and the bidirectional encoder, each pinned against a reference (docs/guide/models.md, "The arena")."""

from __future__ import annotations

import itertools

import pytest
import torch

import txl.nn.attention.performer as performer_module
from txl import ConfigError, TransformerXLConfig, UsageError
from txl.data.masking import mask_tokens
from txl.models.transformer_xl.model import TransformerXL
from txl.nn.attention.eager import eager_attention
from txl.nn.attention.masks import CAUSAL, AttentionMask
from txl.nn.attention.performer import (
    PerformerAttention,
    causal_linear_attention,
    feature_logits,
    key_features,
    orthogonal_gaussian,
    quadratic_linear_attention,
    query_features,
    redraw_features,
)
from txl.nn.attention.sliding import banded_attention, sliding_reference
from txl.nn.memory import Memory
from txl.nn.positional import build_positional

POSITIONS = ["xl", "shaw", "rope", "alibi", "sinusoidal"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def tiny(**overrides) -> TransformerXLConfig:
    base = dict(vocab_size=61, n_layer=2, d_model=32, n_head=4, d_head=8, d_inner=48, mem_len=16,
                dropout=0.0, dropatt=0.0)
    return TransformerXLConfig(**{**base, **overrides})


def build(seed=0, **overrides) -> TransformerXL:
    torch.manual_seed(seed)
    model = TransformerXL(tiny(**overrides)).eval()
    with torch.no_grad():  # non-trivial biases and position tables so every term matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def layer_inputs(pos: str, *, n: int, i: int, heads: int = 4, d: int = 8, seed: int = 0, shaw_values: bool = False,
                 **extra):
    """q (2, h, i, d), k, v (2, h, n, d) and the LayerPositions of a random positional encoding."""
    shaw = {"position_options": {"max_distance": 7, "values": shaw_values}} if pos == "shaw" else {}
    config = tiny(pos_encoding=pos, n_head=heads, d_head=d, **shaw, **extra)
    torch.manual_seed(seed)
    encoding = build_positional(config)
    with torch.no_grad():
        for p in encoding.parameters():
            p.normal_(0, 0.3)
    state = encoding.prepare(k_len=n, clamp_len=0, device=torch.device("cpu"), dtype=torch.float32)
    q, k, v = torch.randn(2, heads, i, d), torch.randn(2, heads, n, d), torch.randn(2, heads, n, d)
    return q, k, v, encoding.layer(0, state)


def run_banded(q, k, v, positions, head_windows, *, global_tokens=0, horizon=None, block_size=None, fast=True):
    kernel = banded_attention if fast else sliding_reference
    extra = {"block_size": block_size} if fast else {}
    return kernel(q, k, v, positions=positions, head_windows=head_windows, global_tokens=global_tokens,
                  horizon=horizon, dropatt=0.0, training=False, **extra)


# ---------------------------------------------------------------------------------------------
# Sliding window (Longformer) and sparse strided (Child et al.)


@pytest.mark.parametrize("pos", POSITIONS)
@pytest.mark.parametrize(("n", "i"), [(24, 24), (40, 24), (9, 1)])  # no memory, memory, one query
def test_sliding_window_covering_everything_equals_full_causal_attention(pos, n, i):
    q, k, v, positions = layer_inputs(pos, n=n, i=i)
    full, _ = eager_attention(q, k, v, positions=positions, mask=CAUSAL, dropatt=0.0, training=False)
    sliding = run_banded(q, k, v, positions, [(n, 1)] * 4)
    torch.testing.assert_close(sliding, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pos", POSITIONS)
@pytest.mark.parametrize("window", [1, 3, 8])
def test_dilation_one_equals_plain_sliding_window(pos, window):
    # eager_attention's `window` is the plain window (the `window` most recent keys, itself included).
    q, k, v, positions = layer_inputs(pos, n=45, i=29, shaw_values=pos == "shaw")
    plain, _ = eager_attention(q, k, v, positions=positions, mask=AttentionMask(window=window), dropatt=0.0,
                                training=False)
    for block_size in (None, 4):
        banded = run_banded(q, k, v, positions, [(window, 1)] * 4, block_size=block_size)
        torch.testing.assert_close(banded, plain, atol=1e-5, rtol=1e-5)


PATTERNS = {
    "dilated": [(5, 2)] * 4,
    "mixed": [(3, 1), (3, 1), (4, 3), (4, 3)],
    "sparse-like": [(4, 1), (4, 1), (2**31, 5), (2**31, 5)],
}


@pytest.mark.parametrize("pos", POSITIONS)
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_banded_kernel_equals_dense_reference(pos, pattern):
    """Dilation, mixed heads, global tokens, same_length horizon and memory: O(n·w) = dense mask."""
    for (n, i), g, horizon in itertools.product([(40, 24), (57, 13), (24, 24)], [0, 3], [None, 11]):
        q, k, v, positions = layer_inputs(pos, n=n, i=i)
        fast = run_banded(q, k, v, positions, PATTERNS[pattern], global_tokens=g, horizon=horizon, block_size=4)
        ref = run_banded(q, k, v, positions, PATTERNS[pattern], global_tokens=g, horizon=horizon, fast=False)
        torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


def test_banded_kernel_gradients_equal_dense_reference():
    q, k, v, positions = layer_inputs("xl", n=40, i=24)
    grads = []
    for fast in (True, False):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = run_banded(*inputs, positions, PATTERNS["mixed"], global_tokens=2, block_size=4, fast=fast)
        grads.append(torch.autograd.grad(out.square().sum(), inputs))
    for a, b in zip(*grads):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_global_tokens_see_and_are_seen_by_all():
    n, i, g = 40, 24, 2  # 16 memory positions; global tokens at key positions 16, 17
    q, k, v, positions = layer_inputs("xl", n=n, i=i)

    def out(k_, v_):
        return run_banded(q, k_, v_, positions, [(3, 1)] * 4, global_tokens=g, block_size=4)

    def poke(position):
        k2, v2 = k.clone(), v.clone()
        k2[:, :, position] += 1.0
        v2[:, :, position] += 1.0
        return out(k2, v2)

    base = out(k, v)
    # Seen by all: the last query (distance 22 >> window 3) changes when a global key changes ...
    assert not torch.allclose(poke(16)[:, :, -1], base[:, :, -1])
    # ... but not when an ordinary key that far away changes.
    assert torch.equal(poke(20)[:, :, -1], base[:, :, -1])
    # Sees all: the second global query depends on the oldest memory key; a local query does not.
    poked = poke(0)
    assert not torch.allclose(poked[:, :, 1], base[:, :, 1])
    assert torch.equal(poked[:, :, 5], base[:, :, 5])


@pytest.mark.parametrize(
    "variant",
    [
        {"attention": "sliding", "attention_options": {"window": 7}},
        {"attention": "sliding", "attention_options": {"window": 3, "dilation": (1, 2, 2, 3)}},
        {"attention": "sparse", "attention_options": {"stride": 3}},
    ],
    ids=["sliding", "dilated", "sparse"],
)
@pytest.mark.parametrize("pos", ["xl", "rope", "alibi"])
def test_windowed_models_are_segment_invariant_and_match_their_reference(variant, pos):
    model = build(pos_encoding=pos, **variant)
    reference = build(pos_encoding=pos, attention_impl="eager", **variant)
    reference.load_state_dict(model.state_dict())
    x = torch.randint(0, 61, (2, 16))
    with torch.no_grad():
        full = model(x, mem_len=16).logits
        first = model(x[:, :8], mem_len=16)
        second = model(x[:, 8:], memory=first.memory, mem_len=16).logits
        torch.testing.assert_close(second, full[:, 8:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(reference(x, mem_len=16).logits, full, atol=1e-5, rtol=1e-5)


def test_sliding_model_with_window_covering_everything_equals_full_model():
    full = build()
    sliding = build(attention="sliding", attention_options={"window": 64})
    sliding.load_state_dict(full.state_dict())
    x = torch.randint(0, 61, (2, 24))
    with torch.no_grad():
        memory_full = full(x[:, :12]).memory
        memory_sliding = sliding(x[:, :12]).memory
        torch.testing.assert_close(sliding(x[:, 12:], memory=memory_sliding).logits,
                                   full(x[:, 12:], memory=memory_full).logits, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Performer (FAVOR+)


def softmax_attention(q, k, v, *, causal=True):
    i, n = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(~torch.ones(i, n, dtype=torch.bool).tril(n - i), float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("causal", [True, False])
def test_performer_approximates_softmax_better_with_more_features(causal):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 24, 16) * 0.6, torch.randn(2, 2, 40, 16) * 0.6, torch.randn(2, 2, 40, 16)
    exact = softmax_attention(q, k, v, causal=causal)
    errors = []
    for m in (8, 64, 512, 4096):
        trials = []
        for seed in range(4):
            features = orthogonal_gaussian(m, 16, generator=torch.Generator().manual_seed(seed))
            phi_k, scale = key_features(k, features)
            approx = quadratic_linear_attention(query_features(q, features), phi_k, scale, v, causal=causal)
            trials.append((approx - exact).abs().mean())
        errors.append(torch.stack(trials).mean().item())
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.25 * errors[0], errors


@pytest.mark.parametrize("group_elements", [1 << 20, 1, 2 * 6 * 8 * 8])  # all chunks at once, 1, 2 per group
@pytest.mark.parametrize(("n", "i", "chunk"), [(30, 30, 7), (50, 30, 8), (50, 30, 64), (9, 1, 4)])
def test_performer_prefix_sums_equal_masked_quadratic_kernel(n, i, chunk, group_elements, monkeypatch):
    monkeypatch.setattr(performer_module, "GROUP_ELEMENTS", group_elements)
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 3, i, 16), torch.randn(2, 3, n, 16) * 2, torch.randn(2, 3, n, 16)
    features = orthogonal_gaussian(32, 16)
    phi_q, (phi_k, scale) = query_features(q, features), key_features(k, features)
    prefix = causal_linear_attention(phi_q, phi_k, scale, v, chunk_size=chunk)
    quadratic = quadratic_linear_attention(phi_q, phi_k, scale, v, causal=True)
    torch.testing.assert_close(prefix, quadratic, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("group_elements", [1 << 20, 1])  # one group of chunks, one chunk per group
def test_performer_gradients_equal_an_unstabilised_float64_computation(group_elements, monkeypatch):
    """Stabilisers are detached (they cancel): gradients must still be those of the plain estimator."""
    monkeypatch.setattr(performer_module, "GROUP_ELEMENTS", group_elements)
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 2, 20, 8) * 0.7, torch.randn(1, 2, 30, 8) * 0.7, torch.randn(1, 2, 30, 8)
    features = orthogonal_gaussian(16, 8)
    grads = []
    for fast in (True, False):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        if fast:
            phi_k, scale = key_features(inputs[1], features)
            out = causal_linear_attention(query_features(inputs[0], features), phi_k, scale, inputs[2], chunk_size=8)
        else:  # φ(x) = exp(ω·x' - |x'|²/2) as written, in float64, masked quadratic
            phi_q, phi_k = (feature_logits(t.double(), features.double()).exp() for t in inputs[:2])
            weights = (phi_q @ phi_k.transpose(-1, -2)) * torch.ones(20, 30, dtype=torch.bool).tril(10)
            out = (weights @ inputs[2].double()) / weights.sum(-1, keepdim=True)
        grads.append(torch.autograd.grad((out * torch.linspace(-1, 1, 8)).sum(), inputs))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b.float(), atol=1e-4, rtol=1e-3)


def test_performer_is_strictly_causal_and_stable_in_low_precision():
    torch.manual_seed(2)
    d = 256  # |ω|²/2 ≈ 128: exp(ω·k - |k|²/2) overflows float32 for a key aligned with ω
    features = orthogonal_gaussian(64, d)
    k = torch.randn(1, 1, 40, d)
    k[0, 0, 30] = features[0] * d**0.25  # the worst key: its logit for feature 0 is |ω_0|²/2
    assert feature_logits(k, features).max() > 100  # exp() of this is inf in float32
    q, v = torch.randn(1, 1, 40, d), torch.randn(1, 1, 40, d)
    kernel = PerformerAttention(tiny(attention="performer", pos_encoding="rope", d_head=d, attention_options={"features": 64}))
    kernel.features.copy_(features)
    positions = build_positional(tiny(pos_encoding="sinusoidal")).layer(0, {})
    outs = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        outs[dtype], _ = kernel(q.to(dtype), k.to(dtype), v.to(dtype), positions=positions, mask=CAUSAL,
                                dropatt=0.0, training=False)
        assert outs[dtype].dtype == dtype and torch.isfinite(outs[dtype]).all()
    torch.testing.assert_close(outs[torch.bfloat16].float(), outs[torch.float32], atol=0.1, rtol=0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the trainer's mixed precision: still float32 inside
        autocast_out, _ = kernel(q, k, v, positions=positions, mask=CAUSAL, dropatt=0.0, training=False)
    torch.testing.assert_close(autocast_out, outs[torch.float32], atol=1e-5, rtol=1e-5)
    # A huge future key changes nothing before it (per-key stabilisers, no global max).
    k_future = k.clone()
    k_future[0, 0, 35] = features[1] * d**0.25 * 1.5
    after, _ = kernel(q, k_future, v, positions=positions, mask=CAUSAL, dropatt=0.0, training=False)
    assert torch.equal(after[:, :, :35], outs[torch.float32][:, :, :35])


def test_performer_redraws_features_every_interval_in_training_only():
    model = build(attention="performer", pos_encoding="rope", attention_options={"redraw_interval": 2})
    kernel = model.blocks[0].attn.kernel
    x = torch.randint(0, 61, (1, 8))
    start = kernel.features.clone()
    with torch.no_grad():
        model.eval()
        for _ in range(3):
            model(x)
        assert torch.equal(kernel.features, start)  # never in eval
        model.train()
        model(x)
        model(x)
        assert torch.equal(kernel.features, start)  # drawn at forward 0, used for forwards 0 and 1
        model(x)
        assert not torch.equal(kernel.features, start)
    assert redraw_features(model) == 2


def test_performer_model_is_segment_invariant():
    model = build(attention="performer", pos_encoding="rope")
    x = torch.randint(0, 61, (2, 16))
    with torch.no_grad():
        full = model(x, mem_len=16).logits
        first = model(x[:, :8], mem_len=16)
        second = model(x[:, 8:], memory=first.memory, mem_len=16).logits
    torch.testing.assert_close(second, full[:, 8:], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Linformer and the bidirectional encoder


def test_linformer_used_causally_raises_one_clear_error():
    with pytest.raises(ConfigError, match="linformer.*cannot be causal.*future positions"):
        TransformerXLConfig(attention="linformer")


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"attention": "performer", "pos_encoding": "xl"}, "pos_encoding"),
        ({"attention": "performer", "pos_encoding": "rope", "dropatt": 0.1}, "dropatt"),
        ({"attention": "linformer", "causal": False, "mem_len": 0, "pos_encoding": "alibi"}, "pos_encoding"),
        ({"causal": False, "pos_encoding": "rope"}, "mem_len"),
        ({"attention": "sparse", "causal": False, "mem_len": 0, "pos_encoding": "rope"}, "causal"),
        ({"attention": "sliding", "causal": False, "mem_len": 0, "pos_encoding": "shaw"}, "pos_encoding"),
        ({"attention_options": {"global_tokens": 2}}, "attention_options.global_tokens"),
        ({"attention": "sliding", "attention_options": {"dilation": (1, 2)}}, "attention_options.dilation"),
        ({"attention": "sliding", "attention_options": {"window": 0}}, "attention_options.window"),
        ({"attention": "sparse", "n_head": 1}, "attention"),
        ({"cmem_len": 8, "mem_len": 0}, "cmem_len"),
        ({"cmem_len": 8, "cmem_ratio": 0}, "cmem_ratio"),
        ({"cmem_fn": "median"}, "cmem_fn"),
    ],
)
def test_impossible_arena_combinations_are_rejected_by_name(overrides, field):
    with pytest.raises(ConfigError, match=f"config.{field}"):
        TransformerXLConfig(**overrides)


ENCODERS = {
    "full": {"attention": "full", "pos_encoding": "rope"},
    "linformer": {"attention": "linformer", "pos_encoding": "learned", "attention_options": {"k": 8, "max_len": 16}},
    "performer": {"attention": "performer", "pos_encoding": "sinusoidal"},
}


@pytest.mark.parametrize("name", list(ENCODERS))
def test_bidirectional_encoder_sees_both_directions_and_takes_no_memory(name):
    model = build(causal=False, mem_len=0, **ENCODERS[name])
    x = torch.randint(0, 61, (1, 12))
    y = x.clone()
    y[0, 9] = (y[0, 9] + 1) % 61
    with torch.no_grad():
        out = model(x)
        assert out.memory is None
        assert not torch.allclose(out.logits[:, :9], model(y).logits[:, :9])  # earlier positions see t=9
    with pytest.raises(UsageError, match="no memory"):
        model(x, mem_len=4)


def test_linformer_rejects_inputs_longer_than_its_projection():
    model = build(causal=False, mem_len=0, **ENCODERS["linformer"])
    with pytest.raises(UsageError, match="attention_options.max_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_mask_tokens_follows_bert_recipe():
    x = torch.randint(0, 50, (64, 128))
    inputs, labels = mask_tokens(x, mask_id=50, vocab_size=51, generator=torch.Generator().manual_seed(0))
    picked = labels != -100
    assert 0.13 < picked.float().mean() < 0.17 and picked.any(1).all()
    assert torch.equal(labels[picked], x[picked]) and torch.equal(inputs[~picked], x[~picked])
    masked = (inputs == 50)
    assert not (masked & ~picked).any() and 0.75 < masked[picked].float().mean() < 0.85
    assert inputs.max() <= 50


# ---------------------------------------------------------------------------------------------
# Compressive memory (Rae et al. 2020)


@pytest.mark.parametrize("fn", ["mean", "max"])
def test_compressive_memory_at_rate_one_reduces_to_plain_memory(fn):
    compressive = build(mem_len=6, cmem_len=10, cmem_ratio=1, cmem_fn=fn)
    plain = build(mem_len=16)
    plain.load_state_dict(compressive.state_dict())
    x = torch.randint(0, 61, (2, 40))
    memory_c = memory_p = None
    with torch.no_grad():
        for segment in x.split(5, dim=1):
            out_c, out_p = compressive(segment, memory=memory_c), plain(segment, memory=memory_p)
            assert torch.equal(out_c.logits, out_p.logits)
            assert out_c.aux_loss is None
            memory_c, memory_p = out_c.memory, out_p.memory
    assert (memory_c.length, memory_c.compressed_length) == (6, 10)


def test_compressive_memory_lengths_and_reconstruction_loss_trains_only_the_compression():
    model = build(mem_len=6, cmem_len=4, cmem_ratio=3, cmem_fn="conv").train()
    x = torch.randint(0, 61, (2, 20))
    memory = None
    lengths = []
    for segment in x.split(5, dim=1):
        out = model(segment, memory=memory, labels=segment)
        memory = out.memory
        lengths.append((memory.length, memory.compressed_length))
    # 5 -> 10 states: 3 leave (one group of 3) -> 7 kept; 12: 6 leave -> 6 kept; compressed capped at 4.
    assert lengths == [(5, 0), (7, 1), (6, 3), (8, 4)]
    assert out.aux_loss is not None and out.aux_loss.requires_grad
    out.aux_loss.backward()
    with_grad = {name for name, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert with_grad and all(name.startswith("compressor.convs.") for name in with_grad)
    state = memory.state_dict()
    restored = Memory.from_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(restored.compressed + restored.hidden, memory.compressed + memory.hidden))


# ---------------------------------------------------------------------------------------------
# Every variant learns, and survives a checkpoint


VARIANTS = {
    "sliding": {"attention": "sliding", "attention_options": {"window": 5, "dilation": (1, 1, 2, 2), "global_tokens": 1}},
    "sparse": {"attention": "sparse", "attention_options": {"stride": 3}},
    "performer": {"attention": "performer", "pos_encoding": "rope", "attention_options": {"redraw_interval": 5}},
    "compressive": {"cmem_len": 8, "cmem_ratio": 2},
    "linformer-mlm": {"causal": False, "mem_len": 0, **ENCODERS["linformer"]},
    "performer-mlm": {"causal": False, "mem_len": 0, **ENCODERS["performer"]},
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_variant_trains_on_a_tiny_task_and_round_trips(name, tmp_path):
    torch.manual_seed(0)
    model = TransformerXL(tiny(**VARIANTS[name])).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    stream = torch.arange(17 * 200).remainder(17).view(4, -1)  # a periodic sequence: easy to learn
    memory, losses = None, []
    for step in range(40):
        segment = stream[:, (step % 10) * 16 : (step % 10) * 16 + 17]
        inputs, labels = segment[:, :-1], segment[:, 1:]
        if not model.config.causal:
            inputs, labels = mask_tokens(inputs, mask_id=60, vocab_size=61, generator=torch.Generator().manual_seed(step))
        out = model(inputs, memory=memory, labels=labels)
        loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        memory = out.memory
        losses.append(out.loss.item())
    assert sum(losses[-5:]) / 5 < 0.75 * losses[0], losses
    model.eval().save_pretrained(tmp_path / "ckpt")
    loaded = TransformerXL.from_pretrained(tmp_path / "ckpt")
    x = stream[:1, :16]
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
