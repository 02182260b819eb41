"""Behaviour of the model core: recurrence, causality, same_length, stop-gradient, adaptive softmax."""

from __future__ import annotations

import pytest
import torch

from tiny_models import build, tiny, two_segments_vs_one_pass
from txl.models.transformer_xl.model import TransformerXL
from txl.nn.attention.masks import causal_mask
from txl.nn.memory import Memory
from txl.nn.positional import POSITIONAL_ENCODINGS

# From the registry, so a new encoding cannot escape the invariance and causality tests.
RELATIVE = [name for name, cls in POSITIONAL_ENCODINGS.items() if cls.relative]
ABSOLUTE = [name for name, cls in POSITIONAL_ENCODINGS.items() if not cls.relative]


VARIANTS = {
    "post-ln": {},
    "pre-ln": {"pre_lnorm": True},
    "adaptive": {"cutoffs": (20, 40), "div_val": 2},
    "clamp": {"clamp_len": 5},
    "same_length": {"same_length": True},
}
INVARIANCE_CASES = [(pos, name) for pos in RELATIVE for name in VARIANTS] + [("xl", "untie_r")]
VARIANTS["untie_r"] = {"untie_r": True}


@pytest.mark.parametrize(("pos", "variant"), INVARIANCE_CASES)
def test_segments_with_memory_equal_one_long_pass(pos, variant):
    extra = VARIANTS[variant]
    if pos == "shaw":
        extra = {**extra, "position_options": {"max_distance": 5}}  # clipping active inside the 16-token span
    model = build(pos_encoding=pos, **extra)
    assert two_segments_vs_one_pass(model) < 1e-5


def test_shaw_value_side_is_segment_invariant():
    model = build(pos_encoding="shaw", position_options=dict(values=True, max_distance=6))
    assert two_segments_vs_one_pass(model) < 1e-5


@pytest.mark.parametrize("pos", RELATIVE + ABSOLUTE)
@pytest.mark.parametrize("with_memory", [False, True])
def test_causality(pos, with_memory):
    model = build(pos_encoding=pos)
    torch.manual_seed(4)
    x = torch.randint(0, 61, (1, 12))
    memory = model(torch.randint(0, 61, (1, 10))).memory if with_memory else None
    t = 7
    y = x.clone()
    y[0, t] = (y[0, t] + 1) % 61
    with torch.no_grad():
        a = model(x, memory=memory).logits
        b = model(y, memory=memory).logits
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_same_length_every_query_sees_mem_len_keys():
    mem_len, q_len = 6, 4
    mask = causal_mask(q_len, mem_len + q_len, mem_len, torch.device("cpu"))
    assert mask.sum(-1).tolist() == [mem_len] * q_len
    # Behaviour through the model: with a full memory, memory slot 0 is at distance >= mem_len from
    # every query, so with same_length it is invisible; slot 1 is within reach of query 0.
    model = build(mem_len=mem_len, same_length=True)
    memory = model(torch.randint(0, 61, (1, mem_len))).memory
    assert memory.length == mem_len
    x = torch.randint(0, 61, (1, q_len))

    def poke(slot):
        hidden = []
        for h in memory.hidden:
            h = h.clone()
            h[:, slot] += 1.0
            hidden.append(h)
        return Memory(tuple(hidden))

    with torch.no_grad():
        base = model(x, memory=memory).logits
        slot0 = model(x, memory=poke(0)).logits
        slot1 = model(x, memory=poke(1)).logits
    assert torch.equal(base, slot0)
    assert not torch.allclose(base[:, 0], slot1[:, 0])
    model.same_length = False
    with torch.no_grad():
        assert not torch.allclose(model(x, memory=memory).logits, model(x, memory=poke(0)).logits)


def test_labels_loss_and_per_token_nll_in_input_order():
    for extra in ({}, {"cutoffs": (10, 30), "div_val": 2}, {"cutoffs": (25,), "d_embed": 16}):
        model = build(**extra)
        x = torch.randint(0, 61, (2, 9))
        labels = torch.randint(0, 61, (2, 9))
        labels[0, 3] = -100
        out = model(x, labels=labels, return_logits=True)
        logprobs = out.logits.log_softmax(-1) if not model.config.adaptive else out.logits
        torch.testing.assert_close(logprobs.exp().sum(-1), torch.ones(2, 9), atol=1e-5, rtol=0)
        expected = -logprobs.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
        expected[0, 3] = 0.0
        torch.testing.assert_close(out.nll, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.loss, expected.sum() / 17, atol=1e-5, rtol=1e-5)


def test_adaptive_model_skips_logits_with_labels_unless_asked():
    model = build(cutoffs=(10, 30), div_val=2)
    x = torch.randint(0, 61, (1, 5))
    assert model(x, labels=x).logits is None
    assert model(x).logits.shape == (1, 5, 61)


def test_reference_initialisation():
    torch.manual_seed(0)
    model = TransformerXL(tiny(d_model=64, n_layer=4, cutoffs=(20,), div_val=2, d_inner=256))
    ln = torch.cat([b.attn_norm.weight for b in model.blocks])
    assert abs(ln.mean().item() - 1.0) < 0.01 and 0.01 < ln.std().item() < 0.03
    w = torch.cat([b.ff.fc1.weight.flatten() for b in model.blocks])
    assert abs(w.std().item() - 0.02) < 0.002
    proj = model.embed.projs["0"]
    assert abs(proj.std().item() - 0.01) < 0.002
    assert model.head.bias.abs().sum() == 0 and model.blocks[0].ff.fc1.bias.abs().sum() == 0
    assert abs(model.pos.u.std().item() - 0.02) < 0.01


def test_tied_output_weights_share_storage():
    model = build(cutoffs=(10, 30), div_val=2)
    assert model.head.weight(1) is model.embed.layers[1].weight
    assert model.head.proj(1) is model.embed.projs["1"]
    assert "0" in model.head.projs  # tie_projs defaults to (False, True, True): cluster 0 has its own
    names = set(model.state_dict())
    assert not any(n.startswith("head.weights") for n in names)


def test_untied_model_has_its_own_output_weights():
    model = build(tie_weight=False, tie_projs=(False, False), cutoffs=(20,), d_embed=16)
    assert model.head.weight(0) is not model.embed.layers[0].weight[:20]
    assert set(model.head.projs) == {"0", "1"}


def test_bad_runtime_arguments():
    from txl.errors import UsageError

    model = build()
    with pytest.raises(UsageError, match="mem_len"):
        model(torch.zeros(1, 3, dtype=torch.long), mem_len=-1)
    with pytest.raises(UsageError, match="batch"):
        model(torch.zeros(2, 3, dtype=torch.long), memory=model(torch.zeros(1, 3, dtype=torch.long)).memory)
    with pytest.raises(UsageError, match=r"\(batch, length\)"):
        model(torch.zeros(3, dtype=torch.long))
