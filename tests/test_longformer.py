"""Longformer as published (issue 48; Beltagy, Peters & Cohan 2020, arXiv 2004.05150) on attention='sliding':
per-layer window sizes and dilation, separate global projections Q_g, K_g, V_g, and position terms on global
pairs outside the window. Each against a dense reference written here (masked softmax formulas), with
causality, segment invariance with memory, migration of older configs and a three-step training run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from txl import ConfigError, TransformerXLConfig
from txl.models.migration import migrate
from txl.models.registry import config_from_dict
from txl.models.transformer_xl.model import TransformerXL
from txl.nn.attention.eager import eager_attention
from txl.nn.attention.layer import layer_config
from txl.nn.attention.masks import AttentionMask
from txl.nn.attention.registry import KERNELS
from txl.nn.attention.sliding import SlidingOptions, pair_terms
from txl.nn.positional import LayerPositions, PositionalEncoding

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(vocab_size=41, n_layer=3, d_model=32, n_head=4, d_head=8, d_inner=48, mem_len=24, dropout=0.0, dropatt=0.0)
SCORE_TERMS = ["xl", "shaw", "alibi", "t5"]


def config(impl: str = "fast", pos: str = "xl", **options) -> TransformerXLConfig:
    extra = {k: options.pop(k) for k in list(options) if k in TransformerXLConfig.field_names()}
    return TransformerXLConfig(**{**BASE, **extra, "attention": "sliding", "attention_impl": impl, "pos_encoding": pos,
                                  "attention_options": options})


def build(cfg: TransformerXLConfig, seed: int = 0) -> TransformerXL:
    torch.manual_seed(seed)
    model = TransformerXL(cfg).eval()
    with torch.no_grad():  # every parameter non-trivial (u, v, position tables, the global projections)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def twins(pos: str = "xl", **options) -> tuple[TransformerXL, TransformerXL]:
    """The fast model and the eager (dense reference) model with the same weights."""
    fast = build(config("fast", pos, **options))
    eager = TransformerXL(config("eager", pos, **options)).eval()
    eager.load_state_dict(fast.state_dict())
    return fast, eager


def ids(length: int, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, BASE["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def positions_of(model: TransformerXL, layer: int, k_len: int) -> LayerPositions:
    return model.pos.layer(layer, model.pos.prepare(k_len=k_len, clamp_len=0, device=torch.device("cpu"),
                                                    dtype=torch.float32))


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def dense(q, k, v, visible, *, positions=None, scored=None):
    """The formula: softmax((q_c·k_c + term where `scored`) / sqrt(d), over `visible`) · v; q_c, k_c and the
    term from the encoding (`positions`) as the eager kernel forms them."""
    q_c, k_c = (q, k) if positions is None else positions.content(q, k)
    scores = q_c @ k_c.transpose(-1, -2)
    bias = None if positions is None else positions.score_bias(q, k_len=k.shape[-2])
    if bias is not None:
        scores = scores + torch.where(visible if scored is None else scored, bias, torch.zeros(()))
    scores = scores / math.sqrt(q.shape[-1])
    return scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v


def band(i: int, n: int, window: int, dilation: int) -> torch.Tensor:
    dist = torch.arange(i)[:, None] + (n - i) - torch.arange(n)[None, :]
    return (dist >= 0) & (dist % dilation == 0) & (dist < window * dilation)


# ---------------------------------------------------------------------------------------------------------
# Per-layer windows and dilation


def test_per_layer_options_give_each_layer_its_own_window_and_dilation():
    cfg = config(window=[2, 4, 8], dilation=[[1], [1, 1, 2, 2], [4]])
    model = TransformerXL(cfg)
    assert [block.attn.kernel.head_windows for block in model.blocks] == [
        [(2, 1)] * 4, [(4, 1), (4, 1), (4, 2), (4, 2)], [(8, 4)] * 4]
    options = cfg.attention_options
    assert options.for_layer(1) == SlidingOptions(window=4, dilation=(1, 1, 2, 2))
    assert layer_config(cfg, 2).attention_options.window == 8
    assert options.reach(cfg.n_head) == (8 - 1) * 4 + 1  # the largest band: the memory a layer's band can use
    assert SlidingOptions(window=5, dilation=(1, 3)).reach(2) == 13
    again = json.loads(json.dumps(cfg.to_dict()))  # config.json round trip: lists of lists
    assert again["attention_options"]["dilation"] == [[1], [1, 1, 2, 2], [4]]
    assert config_from_dict(again) == cfg
    with pytest.raises(ValueError, match="one layer's options"):  # a kernel is built per layer, never from all
        KERNELS[("sliding", "fast")](cfg)


@pytest.mark.parametrize(("changes", "message"), [
    (dict(window=[4, 4]), r"one entry per layer \(n_layer=3\), got 2"),
    (dict(window=[4, 4, 4], dilation=[[1], [2]]), r"different numbers of layers \(\[2, 3\]\)"),
    (dict(dilation=[[1], [1, 2], [1]]), r"one value >= 1 for all heads or one per head \(n_head=4\), got \[1, 2\]"),
    (dict(dilation=[[1], [0], [1]]), r"dilation per layer needs .* values >= 1"),
    (dict(window=[4, 0, 4]), r"window must be >= 1"),
    (dict(window=[]), r"window must be one value or a list"),
    (dict(window=[4, 4, 4], universal=True), r"universal=true applies one block"),
])
def test_bad_per_layer_options_are_one_line_config_errors(changes, message):
    with pytest.raises(ConfigError, match=message) as error:
        config(**changes)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(("windows", "dilations"), [([1, 2, 3], None), ([2, 1, 3], [[1], [1], [3]]),
                                                     ([2, 3, 2], [[2], [1], [1]])])
def test_the_receptive_field_is_the_sum_of_the_layers_reaches(windows, dilations):
    """No memory: the output at t depends on exactly the inputs t - Σ (w_l - 1)·s_l … t (all heads of a layer
    dilated alike), the composition of the per-layer bands."""
    options = dict(window=windows) if dilations is None else dict(window=windows, dilation=dilations)
    model = build(config(**options))
    x = torch.randn(1, 24, BASE["d_model"], requires_grad=True)
    state = model.pos.prepare(k_len=24, clamp_len=0, device=x.device, dtype=x.dtype)
    hidden = x
    for layer, block in enumerate(model.blocks):  # the blocks alone: the composition of the per-layer bands
        hidden, _ = block(hidden, memory=None, positions=model.pos.layer(layer, state), mask=AttentionMask())
    reach = sum((w - 1) * (d[0] if dilations else 1) for w, d in zip(windows, dilations or [[1]] * 3))
    t = 20
    hidden[0, t].sum().backward()
    depends = x.grad[0].abs().sum(-1) > 0
    # dilated layers reach only the multiples of their dilation; the outer bounds are exact
    assert depends[t] and depends[t - reach] and not depends[: t - reach].any() and not depends[t + 1:].any()


@pytest.mark.parametrize("pos", ["xl", "shaw", "alibi", "t5", "rope"])
def test_per_layer_windows_fast_equals_dense_causal_and_segment_invariant(pos):
    """Per-layer windows and mixed dilation: fast = the dense reference (logits 1e-5, gradients 1e-4); later
    tokens never change earlier logits; two segments with memory give the logits of one pass (memory ≥ history)."""
    fast, eager = twins(pos, window=[2, 5, 3], dilation=[[1], [1, 2, 1, 3], [2]])
    tokens = ids(20)
    logits = {}
    for name, model in (("fast", fast), ("eager", eager)):
        model.zero_grad()
        out = model(tokens, labels=tokens)
        out.loss.backward()
        logits[name] = out.logits
        logits[name + "_grad"] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    torch.testing.assert_close(logits["fast"], logits["eager"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits["fast_grad"], logits["eager_grad"], atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        changed = tokens.clone()
        changed[:, 12:] = (changed[:, 12:] + 1) % BASE["vocab_size"]
        torch.testing.assert_close(fast(changed).logits[:, :12], logits["fast"][:, :12].detach(), atol=1e-5, rtol=1e-5)
        whole = fast(tokens, mem_len=24).logits
        first = fast(tokens[:, :9], mem_len=24)
        second = fast(tokens[:, 9:], memory=first.memory, mem_len=24)
        torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), whole, atol=1e-5, rtol=1e-5)


def test_a_layer_kernel_is_the_dense_band_of_its_own_window():
    """Kernel level, layer by layer: each layer's fast kernel is softmax over its own band (the formula)."""
    cfg = config(window=[2, 6, 3], dilation=[[1], [1, 1, 2, 3], [1]])
    q, k, v = rand(2, 4, 13, 8, seed=0), rand(2, 4, 19, 8, seed=1), rand(2, 4, 19, 8, seed=2)
    for layer, (window, dilations) in enumerate([(2, [1] * 4), (6, [1, 1, 2, 3]), (3, [1] * 4)]):
        kernel = KERNELS[("sliding", "fast")](layer_config(cfg, layer))
        got, _ = kernel(q, k, v, positions=LayerPositions(PositionalEncoding(), 0, {}), mask=AttentionMask(),
                        dropatt=0.0, training=False)
        visible = torch.stack([band(13, 19, window, s) for s in dilations])[None]
        torch.testing.assert_close(got, dense(q, k, v, visible), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# Separate global projections


def test_global_projections_exist_by_default_with_global_tokens_and_on_request():
    with_tokens = TransformerXL(config(window=4, global_tokens=2))
    assert all(block.attn.global_q_proj is not None and block.attn.global_kv_proj is not None
               for block in with_tokens.blocks)
    assert not any(hasattr(block.attn, "unused_query_projection") for block in with_tokens.blocks)
    plain = TransformerXL(config(window=4))
    assert plain.blocks[0].attn.global_q_proj is None and plain.num_parameters() < with_tokens.num_parameters()
    asked = TransformerXL(config(window=4, global_projections=True))  # for a global_mask given per call
    assert asked.blocks[0].attn.global_q_proj is not None
    assert asked.blocks[0].attn.unused_query_projection  # a call without a mask leaves q_g unused: DDP must know
    shared = TransformerXL(config(window=4, global_tokens=2, global_projections=False))
    assert shared.blocks[0].attn.global_q_proj is None
    extra = 3 * BASE["d_model"] * BASE["n_head"] * BASE["d_head"] * BASE["n_layer"]
    assert with_tokens.num_parameters() - shared.num_parameters() == extra


@pytest.mark.parametrize("impl", ["fast", "eager"])
@pytest.mark.parametrize("pos", ["xl", "shaw", "t5", "rope"])
@pytest.mark.parametrize("kind", ["global_tokens", "global_mask"])
@pytest.mark.parametrize("tokens", [0, 2])
def test_global_rows_come_from_the_global_projections(impl, pos, kind, tokens):
    """Kernel level, against the formula: a global query's row is softmax over every key it may see of
    (Q_g x)·(K_g x) with all position terms, times V_g x (Longformer §3.1), and the learned memory tokens
    (content score); every other row is the kernel without global projections (its band and the global
    columns use q, k, v)."""
    global_tokens = 3 if kind == "global_tokens" else 0
    cfg = config(impl, pos, window=3, global_tokens=global_tokens, global_projections=True)
    kernel = KERNELS[("sliding", impl)](layer_config(cfg, 0))
    positions = positions_of(build(cfg), 0, 21)
    i, n = 14, 21
    q, k, v = rand(2, 4, i, 8, seed=0), rand(2, 4, tokens + n, 8, seed=1), rand(2, 4, tokens + n, 8, seed=2)
    q_g, k_g, v_g = rand(2, 4, i, 8, seed=3), rand(2, 4, n, 8, seed=4), rand(2, 4, n, 8, seed=5)
    chosen = None
    if kind == "global_mask":
        chosen = torch.zeros(2, i, dtype=torch.bool)
        chosen[0, [0, 6]] = True
        chosen[1, [2, 3, 11]] = True
    mask = AttentionMask(global_mask=chosen, memory_tokens=tokens)
    got, _ = kernel.forward_global(q, k, v, (q_g, k_g, v_g), positions=positions, mask=mask, dropatt=0.0,
                                   training=False)
    without, _ = kernel(q, k, v, positions=positions, mask=mask, dropatt=0.0, training=False)
    k_all, v_all = torch.cat([k[:, :, :tokens], k_g], 2), torch.cat([v[:, :, :tokens], v_g], 2)
    every, _ = eager_attention(q_g, k_all, v_all, positions=positions, mask=AttentionMask(memory_tokens=tokens),
                               dropatt=0.0, training=False)
    rows = torch.zeros(2, i, dtype=torch.bool)
    rows[:, :global_tokens] = True
    rows = rows if chosen is None else chosen
    expected = torch.where(rows[:, None, :, None], every, without)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, without, atol=1e-3)  # the global rows did change


@pytest.mark.parametrize("impl", ["fast", "eager"])
@pytest.mark.parametrize("tokens", [0, 2])
def test_bidirectional_global_rows_come_from_the_global_projections(impl, tokens):
    """causal=false (the masked-LM encoder, RoPE): a global query's row is full bidirectional attention of
    q_g over k_g (and the memory tokens, content score), times v_g; the other rows see their two-sided band
    and the global keys through q, k, v."""
    cfg = config(impl, "rope", window=2, global_tokens=2, causal=False, mem_len=0)
    kernel = KERNELS[("sliding", impl)](layer_config(cfg, 0))
    positions = positions_of(build(cfg), 0, 12 + tokens)
    q, k, v = rand(2, 4, 12, 8, seed=0), rand(2, 4, 12 + tokens, 8, seed=1), rand(2, 4, 12 + tokens, 8, seed=2)
    q_g, k_g, v_g = rand(2, 4, 12, 8, seed=3), rand(2, 4, 12, 8, seed=4), rand(2, 4, 12, 8, seed=5)
    mask = AttentionMask(causal=False, memory_tokens=tokens)
    got, _ = kernel.forward_global(q, k, v, (q_g, k_g, v_g), positions=positions, mask=mask, dropatt=0.0,
                                   training=False)
    without, _ = kernel(q, k, v, positions=positions, mask=mask, dropatt=0.0, training=False)
    k_all = torch.cat([k[:, :, :tokens], k_g], 2)
    v_all = torch.cat([v[:, :, :tokens], v_g], 2)
    every, _ = eager_attention(q_g, k_all, v_all, positions=positions, mask=mask, dropatt=0.0, training=False)
    torch.testing.assert_close(got[:, :, :2], every[:, :, :2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[:, :, 2:], without[:, :, 2:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_global_projections_equal_to_the_local_ones_give_the_shared_behaviour(causal):
    """Longformer initialises Q_g, K_g, V_g to Q_s, K_s, V_s; with equal weights the model is the one that
    shares them (global_projections=false), with memory and memory tokens too, fast and eager."""
    extra = dict(memory_tokens=2) if causal else dict(causal=False, mem_len=0)
    pos = "xl" if causal else "rope"
    separate = build(config("fast", pos, window=3, global_tokens=2, **extra))
    shared = TransformerXL(config("fast", pos, window=3, global_tokens=2, global_projections=False, **extra)).eval()
    shared.load_state_dict(separate.state_dict(), strict=False)
    assert not torch.allclose(separate(ids(16)[:, :8]).logits, shared(ids(16)[:, :8]).logits, atol=1e-4)
    for block in separate.blocks:
        block.attn.match_global_projections()
    tokens = ids(16)
    first, first_shared = separate(tokens[:, :8]), shared(tokens[:, :8])
    torch.testing.assert_close(first.logits, first_shared.logits, atol=1e-5, rtol=1e-5)
    if causal:
        second = separate(tokens[:, 8:], memory=first.memory)
        second_shared = shared(tokens[:, 8:], memory=first_shared.memory)
        torch.testing.assert_close(second.logits, second_shared.logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pos", ["xl", "alibi", "rope"])
def test_global_model_fast_equals_dense_with_memory_and_a_global_mask(pos):
    """The whole model with separate global projections (global_mask per call, memory, two segments, GQA
    heads): fast = the dense reference, logits 1e-5 and gradients 1e-4; later tokens never change earlier
    logits."""
    fast, eager = twins(pos, window=[2, 4, 3], global_projections=True, n_kv_head=2)
    tokens = ids(20)
    chosen = torch.zeros(2, 10, dtype=torch.bool)
    chosen[0, 1] = True
    chosen[1, [4, 7]] = True
    outs, grads = [], []
    for model in (fast, eager):
        model.zero_grad()
        first = model(tokens[:, :10], labels=tokens[:, :10], global_mask=chosen)
        second = model(tokens[:, 10:], memory=first.memory, labels=tokens[:, 10:], global_mask=chosen)
        (first.loss + second.loss).backward()
        outs.append(torch.cat([first.logits, second.logits], 1))
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    assert grads[0].keys() == grads[1].keys() and "blocks.0.attn.global_q_proj.weight" in grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-4, rtol=1e-4, msg=name)
    with torch.no_grad():
        changed = tokens[:, :10].clone()
        changed[:, 6:] = (changed[:, 6:] + 1) % BASE["vocab_size"]
        later = chosen.clone()
        torch.testing.assert_close(fast(changed, global_mask=later).logits[:, :6], outs[0][:, :6].detach(),
                                   atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# Position terms on global pairs


@pytest.mark.parametrize("pos", SCORE_TERMS)
@pytest.mark.parametrize("kind", ["global_tokens", "global_mask"])
@pytest.mark.parametrize("impl", ["fast", "eager"])
def test_global_pairs_outside_the_window_get_the_position_term(pos, kind, impl):
    """Causal, against the formula: every visible pair (band, global columns, global rows) carries the
    encoding's score term; with global_positions=false the global columns outside the band keep the
    content score alone (txl before issue 48)."""
    i, n, window, g = 15, 22, 3, 2
    q, k, v = rand(2, 4, i, 8, seed=0), rand(2, 4, n, 8, seed=1), rand(2, 4, n, 8, seed=2)
    chosen = torch.zeros(2, i, dtype=torch.bool)
    if kind == "global_tokens":
        chosen[:, :g] = True
    else:
        chosen[0, [1, 5]] = True
        chosen[1, [3]] = True
    causal = band(i, n, n, 1)  # every key at or before the query
    key_global = torch.nn.functional.pad(chosen, (n - i, 0))  # (b, n)
    local = band(i, n, window, 1)
    visible = (local | chosen[:, :, None] & causal | key_global[:, None, :] & causal)[:, None]
    positioned = (local | chosen[:, :, None] & causal)[:, None]
    results = []
    for on in (True, False):
        cfg = config(impl, pos, window=window, global_tokens=g if kind == "global_tokens" else 0, global_positions=on)
        kernel = KERNELS[("sliding", impl)](layer_config(cfg, 0))
        positions = positions_of(build(cfg), 0, n)
        mask = AttentionMask(global_mask=chosen if kind == "global_mask" else None)
        got, _ = kernel(q, k, v, positions=positions, mask=mask, dropatt=0.0, training=False)
        expected = dense(q, k, v, visible, positions=positions, scored=visible if on else positioned)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=f"global_positions={on}")
        results.append(got)
    far = ~chosen[0] & (torch.arange(i) >= 8)  # rows whose window leaves the global keys out
    assert not torch.allclose(results[0][0, :, far], results[1][0, :, far], atol=1e-4)
    near = ~chosen[0] & (torch.arange(i) < 1)
    torch.testing.assert_close(results[0][0, :, near], results[1][0, :, near])  # in the band: the same


@pytest.mark.parametrize("pos", SCORE_TERMS)
def test_pair_terms_are_the_dense_term_at_those_pairs(pos):
    """`pair_terms` (xl gathered, the others read off a basis of one-row calls) = the dense by-key term of the
    positional API at the same (query, key) pairs, 1e-5, batch-shared or per-sequence keys."""
    cfg = config("fast", pos, window=3)
    model = build(cfg)
    i, n = 12, 20
    positions = positions_of(model, 1, n)
    q = rand(2, 4, i, 8, seed=0)
    dense_term = positions.score_bias(q, k_len=n)  # (b or 1, h, i, n)
    for keys in (torch.tensor([[8, 9, 0]]).expand(1, i, 3), torch.randint(0, n - i, (2, i, 4))):
        got = pair_terms(positions, q, keys, k_len=n)
        expected = dense_term.expand(2, -1, -1, -1).gather(-1, keys.expand(2, i, -1)[:, None].expand(2, 4, i, -1))
        causal = (keys <= torch.arange(i)[:, None] + n - i)[:, None]  # later keys: garbage, masked by callers
        torch.testing.assert_close(torch.where(causal, got.expand_as(expected), 0.0), torch.where(causal, expected, 0.0),
                                   atol=1e-5, rtol=1e-5)


class _Squared(PositionalEncoding):
    """A score term that is not affine in q: pair_terms must notice and take the dense term."""

    score_terms = True

    def score_bias(self, layer, state, q, *, k_len, rel_shift, stride=1):
        dist = torch.arange(q.shape[-2])[:, None] + (k_len - q.shape[-2]) - torch.arange(k_len)[None, :]
        return q.square().sum(-1, keepdim=True) * dist.float()


def test_pair_terms_of_an_encoding_not_affine_in_q_take_the_dense_term():
    positions = LayerPositions(_Squared(), 0, {})
    q = rand(2, 4, 6, 8, seed=0)
    keys = torch.tensor([[0, 2]]).expand(1, 6, 2)
    expected = positions.score_bias(q, k_len=9).gather(-1, keys[:, None].expand(2, 4, 6, 2))
    torch.testing.assert_close(pair_terms(positions, q, keys, k_len=9), expected)


# ---------------------------------------------------------------------------------------------------------
# Older configs, training


def test_a_config_written_before_issue_48_keeps_the_shared_projections_and_content_scores():
    """A complete dump (config.json, run.json) without the new options: both off, so its weights load and it
    computes what it did; a partial dict (preset, TOML, --set) gets the new defaults."""
    cfg = config(window=3, global_tokens=2)
    old = cfg.to_dict()
    for key in ("global_projections", "global_positions"):
        del old["attention_options"][key]
    migrated = config_from_dict(old)
    assert migrated.attention_options.global_projections is False
    assert migrated.attention_options.global_positions is False
    assert migrate(cfg.to_dict()) == cfg.to_dict()  # a new dump is left as it is
    partial = {"attention": "sliding", "attention_options": {"window": 3, "global_tokens": 2}}
    assert migrate(partial) == partial
    assert config_from_dict({**BASE, **partial}).attention_options.global_projections is None


def test_three_training_steps_with_per_layer_windows_and_global_projections():
    model = build(config(window=[2, 4, 3], dilation=[[1], [1, 2, 1, 2], [1]], global_tokens=2, dropout=0.1))
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    tokens, memory, losses = ids(30, batch=3), None, []
    before = model.blocks[1].attn.global_q_proj.weight.detach().clone()
    for step in range(3):
        chunk = tokens[:, step * 10:(step + 1) * 10]
        out = model(chunk, labels=chunk, memory=memory)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        memory, losses = out.memory, losses + [out.loss.item()]
    assert all(math.isfinite(loss) for loss in losses)
    assert not torch.equal(before, model.blocks[1].attn.global_q_proj.weight)  # the global projections learn


def test_output_attentions_with_global_projections_is_the_dense_reference():
    """output_attentions runs the dense reference (the probabilities over every key): same logits as the fast
    kernel; a global row's probabilities come from q_g·k_g and spread over every earlier key."""
    model = build(config(window=[2, 4, 3], global_tokens=2))
    tokens = ids(12)
    out = model(tokens, output_attentions=True)
    torch.testing.assert_close(out.logits, model(tokens).logits, atol=1e-5, rtol=1e-5)
    probs = out.attentions[1]  # (b, h, i, n)
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]), atol=1e-5, rtol=1e-5)
    assert (probs[:, :, 1, :2] > 0).all() and (probs[:, :, 8, 2:5] == 0).all()  # global row 1; row 8: band 5..8 + globals
    assert (probs[:, :, 8, :2] > 0).all()  # every later query sees the global keys
