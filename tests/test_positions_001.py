"""Seed 001's position encodings (issue 48, item 1) against bert4keras's formulas, written out here from the
seed's code: the merge modes of `PositionEmbedding` and `SinusoidalPositionEmbedding` (add, mul, zero,
concat that widens), `custom_position_ids` (our `position_ids=`), the hierarchical decomposition with
custom positions, NEZHA's fixed sinusoidal relative table on keys and values (`RelativePositionEmbedding`
with the `Sinusoidal` initializer, trainable=False, and MultiHeadAttention's 'typical_relative' terms), and
Shaw tables shared across heads and/or layers. Tolerances: 1e-5 (logits and outputs), 1e-4 (gradients)."""

from __future__ import annotations

import math

import pytest
import torch

from tiny_models import build, tiny, two_segments_vs_one_pass
from txl import ConfigError, UsageError
from txl.models.migration import migrate
from txl.models.registry import config_from_dict
from txl.models.transformer_xl.model import TransformerXL
from txl.nn.attention.eager import eager_attention
from txl.nn.attention.masks import AttentionMask
from txl.nn.positional import build_positional, nezha_table, sinusoid_table

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = dict(atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# bert4keras, written out (seed 001): the formulas the encodings must reproduce


def b4k_merge(inputs, embeddings, merge_mode, *, custom_position_ids=False):
    """The tail of PositionEmbedding.call / SinusoidalPositionEmbedding.call."""
    if merge_mode == "add":
        return inputs + embeddings
    if merge_mode == "mul":
        return inputs * (embeddings + 1.0)
    if merge_mode == "zero":
        return embeddings
    if not custom_position_ids:
        embeddings = embeddings.expand(inputs.shape[0], -1, -1)  # K.tile(embeddings, [batch_size, 1, 1])
    return torch.cat([inputs, embeddings], dim=-1)


def b4k_position_embedding(inputs, weights, merge_mode, *, hierarchical=None, position_ids=None):
    """PositionEmbedding.call (input_dim = rows of `weights`)."""
    input_dim = weights.shape[0]
    custom = position_ids is not None
    if not custom:
        position_ids = torch.arange(inputs.shape[1])[None]
    if hierarchical:
        alpha = 0.4 if hierarchical is True else hierarchical
        embeddings = (weights - alpha * weights[:1]) / (1 - alpha)
        embeddings = alpha * embeddings[position_ids // input_dim] + (1 - alpha) * embeddings[position_ids % input_dim]
    elif custom:
        embeddings = weights[position_ids]
    else:
        embeddings = weights[None, : inputs.shape[1]]
    return b4k_merge(inputs, embeddings, merge_mode, custom_position_ids=custom)


def b4k_sinusoidal(inputs, output_dim, merge_mode, *, position_ids=None):
    """SinusoidalPositionEmbedding.call: indices 10000^(-2i/d), stack([sin, cos], -1), reshape."""
    seq_len = inputs.shape[1]
    custom = position_ids is not None
    position_ids = torch.arange(seq_len, dtype=torch.float64)[None] if not custom else position_ids.double()
    indices = torch.pow(10000.0, -2 * torch.arange(output_dim // 2, dtype=torch.float64) / output_dim)
    embeddings = torch.einsum("bn,d->bnd", position_ids, indices)
    embeddings = torch.stack([embeddings.sin(), embeddings.cos()], dim=-1).reshape(-1, seq_len, output_dim)
    return b4k_merge(inputs, embeddings.float(), merge_mode, custom_position_ids=custom)


def b4k_sinusoidal_initializer(vocab_size, depth):
    """bert4keras's `Sinusoidal` initializer, loop for loop."""
    embeddings = torch.zeros(vocab_size, depth, dtype=torch.float64)
    for pos in range(vocab_size):
        for i in range(depth // 2):
            theta = pos / math.pow(10000, 2.0 * i / depth)
            embeddings[pos, 2 * i] = math.sin(theta)
            embeddings[pos, 2 * i + 1] = math.cos(theta)
    return embeddings.float()


def b4k_relative_ids(q_len, v_len, input_dim, offset=0):
    """RelativePositionEmbedding.compute_position_ids (queries the last q_len of the v_len keys: offset)."""
    q_idxs = torch.arange(q_len)[:, None] + offset
    v_idxs = torch.arange(v_len)[None, :]
    max_position = (input_dim - 1) // 2
    return (v_idxs - q_idxs).clamp(-max_position, max_position) + max_position


def b4k_typical_relative_attention(q, k, v, table, *, causal):
    """MultiHeadAttention.pay_attention_to with p_bias='typical_relative' (b, h, i, d layout): the position
    term joins before the 1/sqrt(d) scaling; the output adds A·R on the value side."""
    q_len, k_len, d = q.shape[-2], k.shape[-2], q.shape[-1]
    rel = table[b4k_relative_ids(q_len, k_len, table.shape[0], offset=k_len - q_len)]  # (i, j, d)
    a = torch.einsum("bhid,bhjd->bhij", q, k) + torch.einsum("bhid,ijd->bhij", q, rel)
    a = a / d**0.5
    if causal:
        future = torch.arange(k_len)[None, :] > torch.arange(q_len)[:, None] + (k_len - q_len)
        a = a.masked_fill(future, float("-inf"))
    probs = a.softmax(-1)
    return torch.einsum("bhij,bhjd->bhid", probs, v) + torch.einsum("bhij,ijd->bhid", probs, rel)


def randomised(model):
    with torch.no_grad():
        for p in model.pos.parameters():
            p.normal_()
    return model


# ---------------------------------------------------------------------------------------------
# merge modes: learned and sinusoidal, every mode, with and without custom positions


LEARNED_MODES = [("add", {}), ("mul", {}), ("zero", {}), ("concat", {"dim": 8})]


@pytest.mark.parametrize(("merge", "extra"), LEARNED_MODES)
@pytest.mark.parametrize("custom", [False, True])
def test_learned_merge_modes_equal_bert4keras_position_embedding(merge, extra, custom):
    model = randomised(build(pos_encoding="learned", position_options=dict(merge=merge, max_positions=16, **extra),
                             tie_weight=merge != "concat"))
    width = 32 - extra.get("dim", 0)
    x = torch.randn(2, 6, width)
    ids = torch.tensor([[3, 0, 7, 7, 15, 1], [5, 6, 7, 8, 9, 10]]) if custom else None
    got = model.pos.embed(x, position_ids=ids) if custom else model.pos.embed(x)
    expected = b4k_position_embedding(x, model.pos.table.detach(), merge, position_ids=ids)
    assert got.shape == (2, 6, 32)  # zero: bert4keras returns (1, t, w) for broadcasting; the blocks take (b, t, w)
    expected = expected.expand_as(got)
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize("custom", [False, True])
def test_hierarchical_with_custom_positions_equals_bert4keras(custom):
    model = randomised(build(pos_encoding="learned", position_options=dict(max_positions=4, hierarchical=0.3)))
    x = torch.randn(1, 6, 32)
    ids = torch.tensor([[0, 3, 4, 9, 15, 12]]) if custom else None
    got = model.pos.embed(x, position_ids=ids) if custom else model.pos.embed(x)
    torch.testing.assert_close(got, b4k_position_embedding(x, model.pos.table.detach(), "add", hierarchical=0.3,
                                                           position_ids=ids), **TOL)


@pytest.mark.parametrize(("merge", "extra"), LEARNED_MODES)
@pytest.mark.parametrize("custom", [False, True])
def test_sinusoidal_merge_modes_equal_bert4keras_sinusoidal_position_embedding(merge, extra, custom):
    model = build(pos_encoding="sinusoidal", tie_weight=merge != "concat",
                  position_options=dict(merge=merge, layout="interleaved", **extra))
    width = 32 - extra.get("dim", 0)
    x = torch.randn(2, 5, width)
    ids = torch.tensor([[0, 2, 4, 6, 100], [9, 8, 7, 6, 5]]) if custom else None
    got = model.pos.embed(x, position_ids=ids) if custom else model.pos.embed(x)
    expected = b4k_sinusoidal(x, extra.get("dim", 32), merge, position_ids=ids).expand(2, -1, -1)
    torch.testing.assert_close(got, expected, **TOL)


def test_sinusoidal_fractional_positions_as_bert4keras_casts_them():
    model = build(pos_encoding="sinusoidal", position_options=dict(layout="interleaved"))
    x, ids = torch.randn(1, 3, 32), torch.tensor([0.5, 1.25, 7.0])
    torch.testing.assert_close(model.pos.embed(x, position_ids=ids), b4k_sinusoidal(x, 32, "add", position_ids=ids[None]),
                               **TOL)


def test_sinusoidal_default_is_the_reference_layout_and_unchanged():
    # layout 'halves' (every sin, then every cos): the Transformer-XL reference table, txl's sinusoidal before
    model = build(pos_encoding="sinusoidal")
    x = torch.randn(1, 7, 32)
    half = b4k_sinusoidal(torch.zeros(1, 7, 32), 32, "add")[0]  # interleaved
    halves = torch.cat([half[:, 0::2], half[:, 1::2]], dim=-1)
    torch.testing.assert_close(model.pos.embed(x), x + halves, **TOL)
    assert model.config.position_options.to_dict() == {"merge": "add", "dim": 0, "layout": "halves"}


def test_zero_merge_is_positions_alone():
    # the token embedding never reaches the blocks: every input gives the same logits, and no gradient
    model = build(pos_encoding="learned", position_options=dict(merge="zero"))
    x, y = torch.randint(0, 61, (2, 8)), torch.randint(0, 61, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(model(x, mem_len=0).logits, model(y, mem_len=0).logits, **TOL)
    sinusoidal = build(pos_encoding="sinusoidal", position_options=dict(merge="zero"))
    table = sinusoid_table(torch.arange(4), 32)
    torch.testing.assert_close(sinusoidal.pos.embed(torch.randn(3, 4, 32)), table.expand(3, -1, -1), **TOL)


# ---------------------------------------------------------------------------------------------
# concat widens; the projected form stays as concat-project; old configs load as they were


@pytest.mark.parametrize("pos", ["learned", "sinusoidal"])
def test_concat_widens_a_narrower_token_embedding_to_d_model(pos):
    model = build(pos_encoding=pos, position_options=dict(merge="concat", dim=12), tie_weight=False)
    assert model.embed.layers[0].weight.shape == (61, 20)  # tokens take d_model - dim
    assert not hasattr(model.pos, "merge_proj")
    if pos == "learned":
        assert model.pos.table.shape == (1024, 12)
    x = torch.randint(0, 61, (2, 6))
    tokens = model._embed(x)
    h = model.pos.embed(tokens)
    assert h.shape == (2, 6, 32)
    torch.testing.assert_close(h[..., :20], tokens)  # [x ; e]: the tokens untouched, then the positions
    torch.testing.assert_close(h[0, :, 20:], h[1, :, 20:])
    out = model(x, labels=x)
    out.loss.backward()
    assert model.embed.layers[0].weight.grad.abs().sum() > 0


@pytest.mark.parametrize(("options", "extra", "match"), [
    ({"merge": "concat"}, {}, "set position_options.dim.*concat-project"),
    ({"merge": "add", "dim": 4}, {}, "merge='concat' only"),
    ({"merge": "concat", "dim": 32}, {"tie_weight": False}, "must be < d_model=32"),
    ({"merge": "concat", "dim": 8}, {}, "set tie_weight=false"),
    ({"merge": "concat", "dim": 8}, {"tie_weight": False, "d_embed": 16}, "d_embed=16"),
    ({"merge": "concat", "dim": 8}, {"tie_weight": False, "cutoffs": [30]}, "cutoffs"),
])
def test_concat_configs_are_checked_in_one_line(options, extra, match):
    with pytest.raises(ConfigError, match=match):
        tiny(pos_encoding="learned", position_options=options, **extra)


def test_sinusoidal_concat_needs_an_even_width():
    with pytest.raises(ConfigError, match="position_options.dim must be even"):
        tiny(pos_encoding="sinusoidal", position_options=dict(merge="concat", dim=7), tie_weight=False)
    with pytest.raises(ConfigError, match="layout"):
        tiny(pos_encoding="sinusoidal", position_options=dict(layout="stacked"))


def test_concat_project_is_the_former_concat():
    model = build(pos_encoding="learned", position_options=dict(merge="concat-project"))
    x = torch.randn(2, 6, 32)
    e = model.pos.table[:6]
    torch.testing.assert_close(model.pos.embed(x), model.pos.merge_proj(torch.cat([x, e.expand_as(x)], -1)))
    torch.manual_seed(0)
    fresh = TransformerXL(model.config)  # starts as add: W = [I | I]
    torch.testing.assert_close(fresh.pos.embed(x), x + fresh.pos.table[:6])


def test_a_config_dump_from_before_issue_48_keeps_its_projected_concat():
    model = build(pos_encoding="learned", position_options=dict(merge="concat-project"))
    old = model.config.to_dict()
    old["position_options"] = {"max_positions": 1024, "hierarchical": 0.0, "merge": "concat"}  # the pre-48 dump
    config = config_from_dict(old)
    assert config.position_options.merge == "concat-project"
    loaded = TransformerXL(config).eval()
    loaded.load_state_dict(model.state_dict())
    x = torch.randint(0, 61, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, **TOL)
    # the flat shape of before issue 44 too (position_merge moves into position_options, then is renamed)
    flat = {k: v for k, v in old.items() if k != "position_options"}
    flat.update(position_merge="concat", max_positions=1024, hierarchical=0.0)
    assert migrate(flat)["position_options"]["merge"] == "concat-project"
    # a partial dict (a preset, --set) is not a dump: concat without dim is refused, naming both forms
    with pytest.raises(ConfigError, match="concat-project"):
        config_from_dict({"pos_encoding": "learned", "position_options": {"merge": "concat"}})


# ---------------------------------------------------------------------------------------------
# position_ids= in the forward pass


@pytest.mark.parametrize("pos", ["learned", "sinusoidal"])
def test_default_position_ids_are_zero_to_t(pos):
    model = build(pos_encoding=pos)
    x = torch.randint(0, 61, (2, 7))
    with torch.no_grad():
        plain = model(x).logits
        torch.testing.assert_close(model(x, position_ids=torch.arange(7)).logits, plain, **TOL)
        torch.testing.assert_close(model(x, position_ids=torch.arange(7).expand(2, 7)).logits, plain, **TOL)


@pytest.mark.parametrize(("pos", "options"), [("learned", {}), ("sinusoidal", {}), ("learned", {"merge": "mul"}),
                                              ("sinusoidal", {"merge": "concat", "dim": 8})])
def test_continued_positions_remove_the_temporal_confusion(pos, options):
    # Positions restart every segment by default (test_positional); continued by the caller, two segments
    # with memory are one long pass.
    model = build(pos_encoding=pos, position_options=options, tie_weight="dim" not in options)
    assert two_segments_vs_one_pass(model) > 1e-3
    torch.manual_seed(3)
    x = torch.randint(0, 61, (2, 16))
    with torch.no_grad():
        full = model(x, mem_len=16).logits
        first = model(x[:, :8], mem_len=16)
        second = model(x[:, 8:], memory=first.memory, mem_len=16, position_ids=torch.arange(8, 16))
    torch.testing.assert_close(second.logits, full[:, 8:], **TOL)


def test_position_ids_per_row():
    model = build(pos_encoding="learned")
    x = torch.randint(0, 61, (2, 5))
    ids = torch.tensor([[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]])
    with torch.no_grad():
        both = model(x, position_ids=ids).logits
        torch.testing.assert_close(both[:1], model(x[:1]).logits, **TOL)
        torch.testing.assert_close(both[1:], model(x[1:], position_ids=ids[1]).logits, **TOL)


@pytest.mark.parametrize(("pos", "options", "ids", "match"), [
    ("xl", {}, torch.arange(5), "pos_encoding='xl' does not read"),
    ("nezha", {}, torch.arange(5), "encodings that take them: .*learned"),
    ("learned", {}, torch.arange(4), r"must be \(5,\) or \(2, 5\)"),
    ("learned", {}, torch.tensor([0, 1, -1, 2, 3]), ">= 0"),
    ("learned", {}, torch.arange(5.0), "must be integers"),
    ("learned", {"max_positions": 8}, torch.arange(4, 9), "reaches position 8"),
])
def test_bad_position_ids_are_refused_in_one_line(pos, options, ids, match):
    model = build(pos_encoding=pos, position_options=options)
    with pytest.raises(UsageError, match=match):
        model(torch.randint(0, 61, (2, 5)), position_ids=ids)


# ---------------------------------------------------------------------------------------------
# nezha


def test_nezha_table_is_bert4keras_sinusoidal_initializer():
    for rows, depth in [(129, 64), (9, 8), (5, 7)]:
        torch.testing.assert_close(nezha_table(rows, depth), b4k_sinusoidal_initializer(rows, depth), **TOL)


@pytest.mark.parametrize(("causal", "mem"), [(True, 0), (True, 3), (False, 0)])  # an encoder has no memory
def test_nezha_attention_equals_bert4keras_typical_relative(causal, mem):
    config = tiny(pos_encoding="nezha", position_options=dict(max_distance=2), causal=causal,
                  mem_len=0 if not causal else 16)
    encoding = build_positional(config)
    assert list(encoding.parameters()) == [] and encoding.state_dict() == {}  # fixed: trainable=False, nothing saved
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6 + mem, 8), torch.randn(2, 4, 6 + mem, 8)
    for layer in (0, 1):  # one table for every layer and head
        out, _ = eager_attention(q, k, v, positions=encoding.layer(layer, {}), mask=AttentionMask(causal=causal),
                                 dropatt=0.0, training=False)
        expected = b4k_typical_relative_attention(q, k, v, b4k_sinusoidal_initializer(5, 8), causal=causal)
        torch.testing.assert_close(out, expected, **TOL)


def test_nezha_model_impls_agree_and_memory_is_one_pass():
    eager = build(pos_encoding="nezha", attention_impl="eager")
    fast = build(pos_encoding="nezha", attention_impl="fast")
    fast.load_state_dict(eager.state_dict())
    x = torch.randint(0, 61, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(fast(x).logits, eager(x).logits, **TOL)
    assert two_segments_vs_one_pass(eager) < 1e-5
    assert not any(name.startswith("pos.") for name in eager.state_dict())


def test_nezha_refuses_patterns_that_split_the_heads():
    with pytest.raises(ConfigError, match="attention='sparse'"):
        tiny(pos_encoding="nezha", attention="sparse")


# ---------------------------------------------------------------------------------------------
# Shaw: tables shared across heads and/or layers


@pytest.mark.parametrize(("share_heads", "share_layers"), [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("causal", [True, False])
def test_shaw_sharing_shapes_and_formula(share_heads, share_layers, causal):
    k = 2
    config = tiny(pos_encoding="shaw", causal=causal, mem_len=16 if causal else 0,
                  position_options=dict(max_distance=k, values=True, share_heads=share_heads, share_layers=share_layers))
    encoding = build_positional(config)
    rows = 2 * k + 1 if not causal else k + 1
    shape = (1 if share_layers else 2, rows, 1 if share_heads else 4, 8)
    assert encoding.key_table.shape == shape and encoding.value_table.shape == shape
    with torch.no_grad():
        for p in encoding.parameters():
            p.normal_()
    q, probs = torch.randn(1, 4, 5, 8), torch.rand(1, 4, 5, 7)
    for layer in (0, 1):
        positions = encoding.layer(layer, {})
        bias, values = positions.score_bias(q, k_len=7), positions.value_term(probs)
        key = encoding.key_table[0 if share_layers else layer]
        value = encoding.value_table[0 if share_layers else layer]
        expected_values = torch.zeros(1, 4, 5, 8)
        for i in range(5):
            for j in range(7):
                dist = i + 2 - j  # queries are the last 5 of 7 keys
                if causal and dist < 0:
                    continue  # future: garbage the causal mask hides
                row = max(-k, min(k, dist)) + k if not causal else min(k, dist)
                a_k = key[row].expand(4, 8)
                torch.testing.assert_close(bias[0, :, i, j], (q[0, :, i] * a_k).sum(-1), **TOL)
                expected_values[0, :, i] += probs[0, :, i, j, None] * value[row].expand(4, 8)
        if not causal:
            torch.testing.assert_close(values, expected_values, **TOL)
    if share_layers:  # every layer reads the one table
        torch.testing.assert_close(encoding.layer(0, {}).score_bias(q, k_len=7), encoding.layer(1, {}).score_bias(q, k_len=7))


def test_shared_shaw_counts_its_parameters_once_and_trains():
    per_layer_head = build(pos_encoding="shaw", position_options=dict(values=True))
    shared = build(pos_encoding="shaw", position_options=dict(values=True, share_heads=True, share_layers=True))
    assert sum(p.numel() for p in per_layer_head.pos.parameters()) == 2 * 2 * 65 * 4 * 8
    assert sum(p.numel() for p in shared.pos.parameters()) == 2 * 65 * 8
    x = torch.randint(0, 61, (2, 8))
    shared(x, labels=x).loss.backward()
    assert shared.pos.key_table.grad.abs().sum() > 0 and shared.pos.value_table.grad.abs().sum() > 0
    assert two_segments_vs_one_pass(shared) < 1e-5


# ---------------------------------------------------------------------------------------------
# three training steps for every new option


@pytest.mark.parametrize(("pos", "options", "extra"), [
    ("learned", {"merge": "zero"}, {}),
    ("learned", {"merge": "concat", "dim": 8}, {"tie_weight": False}),
    ("sinusoidal", {"merge": "mul", "layout": "interleaved"}, {}),
    ("sinusoidal", {"merge": "concat", "dim": 8}, {"tie_weight": False}),
    ("nezha", {}, {}),
    ("nezha", {"max_distance": 3}, {"causal": False, "mem_len": 0}),
    ("shaw", {"share_heads": True, "values": True}, {}),
    ("shaw", {"share_layers": True}, {}),
])
def test_three_training_steps(pos, options, extra):
    torch.manual_seed(0)
    model = TransformerXL(tiny(pos_encoding=pos, position_options=options, **extra)).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randint(0, 61, (4, 12))
    losses = []
    for _ in range(3):
        loss = model(x[:, :-1], labels=x[:, 1:]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
