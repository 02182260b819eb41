"""The positional encodings added for the arena's second wave: T5's bucketed bias, xPos, learned
positions with Su's hierarchical decomposition and merge modes, Shaw (and T5, learned) in the
bidirectional encoder. (Segment invariance of every relative encoding, these included, is in
test_model.py, parametrised from the registry.)"""

from __future__ import annotations

import math

import pytest
import torch

from tiny_models import build
from txl import ConfigError, UsageError
from txl.nn.positional import POSITIONAL_ENCODINGS, build_positional, t5_bucket

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------
# t5


def test_t5_buckets_match_a_hand_computed_table():
    # 32 buckets, max distance 128, causal: 0..15 exact; then 16 + floor(log(d/16)/log(8)·16).
    dist = torch.tensor([0, 1, 15, 16, 20, 31, 32, 64, 100, 127, 128, 1000, -5])
    hand = [0, 1, 15, 16, 16 + int(math.log(20 / 16) / math.log(8) * 16), 16 + int(math.log(31 / 16) / math.log(8) * 16),
            16 + int(math.log(2) / math.log(8) * 16), 16 + int(math.log(4) / math.log(8) * 16),
            16 + int(math.log(100 / 16) / math.log(8) * 16), 31, 31, 31, 0]
    assert hand[4:8] == [17, 21, 21, 26]  # the formula, spelled out once
    assert t5_bucket(dist, num_buckets=32, max_distance=128, bidirectional=False).tolist() == hand
    # Bidirectional: 16 buckets a side, 8 exact; keys after the query in the upper half.
    both = t5_bucket(torch.tensor([0, 3, -3, 7, -7, 8, 200, -200]), num_buckets=32, max_distance=128,
                     bidirectional=True)
    assert both.tolist() == [0, 3, 19, 7, 23, 8, 15, 31]


@pytest.mark.parametrize("bidirectional", [False, True])
def test_t5_buckets_equal_the_hugging_face_t5_reference(bidirectional):
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    distance = torch.arange(-300, 300)
    ours = t5_bucket(distance, num_buckets=32, max_distance=128, bidirectional=bidirectional)
    # HF takes relative_position = key - query.
    theirs = t5.T5Attention._relative_position_bucket(-distance, bidirectional=bidirectional, num_buckets=32,
                                                      max_distance=128)
    assert torch.equal(ours, theirs)


def test_t5_bias_after_scaling_is_the_table_entry_and_shared_by_layers():
    model = build(pos_encoding="t5", position_options=dict(buckets=8, max_distance=16))
    encoding = model.pos
    q = torch.randn(1, 4, 5, 8)
    first = encoding.layer(0, {}).score_bias(q, k_len=9)
    second = encoding.layer(1, {}).score_bias(q, k_len=9)
    assert torch.equal(first, second)
    bucket = t5_bucket(torch.tensor(8 - 2), num_buckets=8, max_distance=16, bidirectional=False)  # query 4 -> key 2
    torch.testing.assert_close(first[0, :, 4, 2] * 8**-0.5, encoding.bias[bucket])


def test_t5_config_checks():
    with pytest.raises(ConfigError, match="config.position_options.buckets"):
        build(pos_encoding="t5", position_options=dict(buckets=2))
    with pytest.raises(ConfigError, match="config.position_options.max_distance"):
        build(pos_encoding="t5", position_options=dict(max_distance=0))


# ---------------------------------------------------------------------------------------------
# xpos


def test_xpos_score_depends_on_distance_only_and_decays_as_zeta_power():
    model = build(pos_encoding="xpos", position_options=dict(scale_base=4))
    encoding = model.pos
    d = 8
    state = encoding.prepare(k_len=12, clamp_len=0, device=torch.device("cpu"), dtype=torch.float32)
    rope = POSITIONAL_ENCODINGS["rope"](model.config)
    rope_state = rope.prepare(k_len=12, clamp_len=0, device=torch.device("cpu"), dtype=torch.float32)
    q_vec, k_vec = torch.randn(d), torch.randn(d)
    q = q_vec.expand(1, 1, 12, d)
    k = k_vec.expand(1, 1, 12, d)
    qx, kx = encoding.layer(0, state).content(q, k)
    qr, kr = rope.layer(0, rope_state).content(q, k)
    zeta = (torch.arange(0, d, 2) / d + 0.4) / 1.4
    for p, j in [(11, 11), (11, 5), (6, 0), (9, 3)]:
        decay = (zeta ** ((p - j) / 4)).repeat_interleave(2)
        expected = (qr[0, 0, p] * kr[0, 0, j] * decay).sum()
        torch.testing.assert_close((qx[0, 0, p] * kx[0, 0, j]).sum(), expected, atol=1e-5, rtol=1e-5)
    # Same distance, other place: same score.
    torch.testing.assert_close((qx[0, 0, 11] * kx[0, 0, 5]).sum(), (qx[0, 0, 6] * kx[0, 0, 0]).sum(),
                               atol=1e-5, rtol=1e-5)


def test_xpos_is_causal_only_and_needs_even_heads():
    with pytest.raises(ConfigError, match="pos_encoding='xpos' is defined for causal distances only"):
        build(pos_encoding="xpos", causal=False, mem_len=0)
    with pytest.raises(ConfigError, match="config.d_head must be even"):
        build(pos_encoding="xpos", d_head=7)


# ---------------------------------------------------------------------------------------------
# learned: hierarchical decomposition and merge modes


def test_hierarchical_positions_below_the_table_size_equal_the_plain_table():
    model = build(pos_encoding="learned", position_options=dict(max_positions=8, hierarchical=0.4))
    plain = build(pos_encoding="learned", position_options=dict(max_positions=8))
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(model.pos.positions(8), model.pos.table)
    x = torch.randint(0, 61, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(model(x, mem_len=0).logits, plain(x, mem_len=0).logits)


def test_hierarchical_positions_beyond_the_table_follow_su_decomposition():
    model = build(pos_encoding="learned", position_options=dict(max_positions=4, hierarchical=0.3))
    e = model.pos.table.detach()
    u = (e - 0.3 * e[0]) / 0.7
    got = model.pos.positions(16).detach()
    for position in (4, 7, 9, 15):
        torch.testing.assert_close(got[position], 0.3 * u[position // 4] + 0.7 * u[position % 4])
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 61, (1, 16)), mem_len=0).logits).all()  # 4x the table
    with pytest.raises(UsageError, match="max_positions²"):
        model(torch.randint(0, 61, (1, 17)), mem_len=0)


def test_position_merge_modes():
    x = torch.randn(2, 6, 32)
    mul = build(pos_encoding="learned", position_options=dict(merge="mul"))
    e = mul.pos.table[:6]
    torch.testing.assert_close(mul.pos.embed(x), x * (e + 1))
    concat = build(pos_encoding="learned", position_options=dict(merge="concat-project"))
    assert concat.pos.merge_proj.weight.shape == (32, 64)
    torch.manual_seed(0)
    fresh = type(concat)(concat.config)  # freshly initialised: concat starts as add
    torch.testing.assert_close(fresh.pos.embed(x), x + fresh.pos.table[:6])
    torch.testing.assert_close(concat.pos.embed(x), concat.pos.merge_proj(torch.cat([x, concat.pos.table[:6].expand_as(x)], -1)))


@pytest.mark.parametrize(("overrides", "field"), [
    ({"pos_encoding": "rope", "position_options": {"hierarchical": 0.4}}, "position_options.hierarchical"),
    ({"pos_encoding": "learned", "position_options": {"hierarchical": 1.0}}, "position_options.hierarchical"),
    ({"pos_encoding": "rope", "position_options": {"merge": "mul"}}, "position_options.merge"),
    ({"pos_encoding": "learned", "position_options": {"merge": "stack"}}, "position_options.merge"),
])
def test_learned_options_are_checked_by_name(overrides, field):
    with pytest.raises(ConfigError, match=f"config.{field}"):
        build(**overrides)


# ---------------------------------------------------------------------------------------------
# Bidirectional: shaw, t5, learned in the encoder


def test_bidirectional_shaw_uses_signed_clipped_distances_on_keys_and_values():
    config = build(pos_encoding="shaw", causal=False, mem_len=0, position_options=dict(max_distance=2, values=True)).config
    encoding = build_positional(config)
    with torch.no_grad():
        for p in encoding.parameters():
            p.normal_()
    assert encoding.key_table.shape[1] == 5  # -2 … 2
    q, probs = torch.randn(1, 4, 6, 8), torch.rand(1, 4, 6, 6)
    layer = encoding.layer(1, {})
    bias, values = layer.score_bias(q, k_len=6), layer.value_term(probs)
    for i in range(6):
        for j in range(6):
            row = max(-2, min(2, i - j)) + 2
            torch.testing.assert_close(bias[0, :, i, j], (q[0, :, i] * encoding.key_table[1, row]).sum(-1))
    expected = torch.zeros(1, 4, 6, 8)
    for i in range(6):
        for j in range(6):
            expected[0, :, i] += probs[0, :, i, j, None] * encoding.value_table[1, max(-2, min(2, i - j)) + 2]
    torch.testing.assert_close(values, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pos", [name for name, cls in POSITIONAL_ENCODINGS.items() if not cls.causal_only])
def test_every_bidirectional_encoding_runs_the_encoder_both_ways(pos):
    model = build(pos_encoding=pos, causal=False, mem_len=0)
    x = torch.randint(0, 61, (1, 12))
    y = x.clone()
    y[0, 9] = (y[0, 9] + 1) % 61
    with torch.no_grad():
        assert not torch.allclose(model(x).logits[:, :9], model(y).logits[:, :9])  # earlier positions see t=9
