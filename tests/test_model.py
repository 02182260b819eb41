"""Behaviour of the model core: recurrence, causality, same_length, stop-gradient, adaptive softmax."""

from __future__ import annotations

import pytest
import torch

from txl import TransformerXLConfig
from txl.attention.masks import causal_mask
from txl.memory import Memory
from txl.model import TransformerXL

RELATIVE = ["xl", "shaw", "rope", "alibi"]
ABSOLUTE = ["sinusoidal", "learned"]


def tiny(**overrides) -> TransformerXLConfig:
    base = dict(vocab_size=61, n_layer=2, d_model=32, n_head=4, d_head=8, d_inner=48, mem_len=16,
                dropout=0.0, dropatt=0.0)
    return TransformerXLConfig(**{**base, **overrides})


def build(seed=0, **overrides) -> TransformerXL:
    torch.manual_seed(seed)
    model = TransformerXL(tiny(**overrides)).eval()
    with torch.no_grad():  # make biases/LayerNorm shifts non-trivial so every path matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def two_segments_vs_one_pass(model, seg=8, batch=2):
    torch.manual_seed(3)
    x = torch.randint(0, model.config.vocab_size, (batch, 2 * seg))
    with torch.no_grad():
        full = model(x, mem_len=2 * seg).logits
        first = model(x[:, :seg], mem_len=2 * seg)
        second = model(x[:, seg:], memory=first.memory, mem_len=2 * seg)
    return (second.logits - full[:, seg:]).abs().max().item()


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
        extra = {**extra, "max_relative_distance": 5}  # clipping active inside the 16-token span
    model = build(pos_encoding=pos, **extra)
    assert two_segments_vs_one_pass(model) < 1e-5


@pytest.mark.parametrize("pos", ABSOLUTE)
def test_absolute_positions_show_temporal_confusion(pos):
    # Positions restart each segment, so the second segment is not what one long pass computes.
    assert two_segments_vs_one_pass(build(pos_encoding=pos)) > 1e-3


def test_shaw_value_side_is_segment_invariant():
    model = build(pos_encoding="shaw", shaw_values=True, max_relative_distance=6)
    assert two_segments_vs_one_pass(model) < 1e-5


def test_stop_gradient_through_memory():
    model = build(tie_weight=False).train()  # untied, so input embeddings get gradient only as inputs
    x = torch.randint(0, 61, (2, 16))
    first = model(x[:, :8], labels=x[:, 1:9])
    assert all(not h.requires_grad for h in first.memory.hidden)
    # Only segment 2's loss is back-propagated: segment 1's activations must receive nothing.
    seg1_hidden = first.hidden
    seg1_hidden.retain_grad()
    second = model(x[:, 8:], memory=first.memory, labels=torch.roll(x[:, 8:], -1, 1))
    second.loss.backward()
    assert seg1_hidden.grad is None
    embed_grad = model.embed.layers[0].weight.grad
    touched = embed_grad.abs().sum(-1) > 0
    seg1_only = set(x[:, :8].flatten().tolist()) - set(x[:, 8:].flatten().tolist())
    assert not any(touched[t] for t in seg1_only), "a segment-1-only token embedding got gradient"


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


def test_memory_starts_empty_keeps_latest_and_mem_len_per_call():
    model = build(mem_len=5)
    x = torch.randint(0, 61, (3, 8))
    out = model(x)
    assert out.memory.length == 5 and out.memory.batch_size == 3
    # the memory is the tail of each layer's input: layer 0's input is the (scaled) embedding
    emb = model.embed(x)
    torch.testing.assert_close(out.memory.hidden[0], emb[:, -5:])
    out2 = model(x, memory=out.memory, mem_len=11)
    assert out2.memory.length == 11
    assert model(x, mem_len=0).memory is None  # the vanilla Transformer LM keeps nothing


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


def test_learned_positions_reject_too_long_input():
    from txl.errors import UsageError

    model = build(pos_encoding="learned", max_positions=8)
    with pytest.raises(UsageError, match="max_positions"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_bad_runtime_arguments():
    from txl.errors import UsageError

    model = build()
    with pytest.raises(UsageError, match="mem_len"):
        model(torch.zeros(1, 3, dtype=torch.long), mem_len=-1)
    with pytest.raises(UsageError, match="batch"):
        model(torch.zeros(2, 3, dtype=torch.long), memory=model(torch.zeros(1, 3, dtype=torch.long)).memory)
    with pytest.raises(UsageError, match=r"\(batch, length\)"):
        model(torch.zeros(3, dtype=torch.long))


def test_in_place_memory_gives_the_same_results_and_reuses_the_buffers():
    model = build(mem_len=6)
    x = torch.randint(0, 61, (2, 18))
    with torch.no_grad():
        memory = model(x[:, :6]).memory  # full: 6 states
        reference = model(x[:, 6:10], memory=memory)
        copy = Memory(tuple(h.clone() for h in memory.hidden)).donate()
        buffers = [h.data_ptr() for h in copy.hidden]
        out = model(x[:, 6:10], memory=copy)
        assert out.memory is copy and [h.data_ptr() for h in out.memory.hidden] == buffers
        assert torch.equal(out.logits, reference.logits)
        for a, b in zip(out.memory.hidden, reference.memory.hidden):
            assert torch.equal(a, b)
        # a memory that is not full yet, or a forward with autograd, takes the allocating path
        short = model(x[:, :3]).memory.donate()
        assert model(x[:, 3:5], memory=short).memory is not short
    grad_out = model(x[:, 6:10], memory=copy)
    assert grad_out.memory is not copy


def test_memory_cat_inverts_select_over_row_groups():
    memory = Memory(tuple(torch.randn(5, 3, 4) for _ in range(2)), tuple(torch.randn(5, 2, 4) for _ in range(2)))
    joined = Memory.cat([memory.select(slice(0, 2)), memory.select(slice(2, 4)), memory.select(4)])
    for a, b in zip(joined.hidden + joined.compressed, memory.hidden + memory.compressed, strict=True):
        assert torch.equal(a, b)
