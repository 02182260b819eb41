"""Segment-level recurrence state (`txl.nn.memory`): what the memory keeps, its stop-gradient, its row
groups, and the fast backend's in-place evaluation memory."""

from __future__ import annotations

import torch

from tiny_models import build
from txl.nn.memory import Memory


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


def test_every_memory_kind_implements_the_one_interface():
    from txl.fast.memory import ProjectionCache
    from txl.models.rnn.model import RecurrentMemory
    from txl.nn.memory import MemoryState

    hidden = tuple(torch.randn(3, 4, 8) for _ in range(2))
    kinds = [Memory(hidden), Memory(hidden, tuple(torch.randn(3, 2, 8) for _ in range(2))),
             RecurrentMemory(hidden[:1], states=tuple(torch.randn(3, 8) for _ in range(4))),
             ProjectionCache(hidden, projected=tuple(torch.randn(3, 4, 16) for _ in range(2)), key=("k",))]
    for memory in kinds:
        assert isinstance(memory, MemoryState) and memory.length == 4 and memory.batch_size == 3
        fresh = torch.randn(3, 5, 8)
        context = memory.context(0, fresh)
        assert context.shape[1] == 4 + getattr(memory, "compressed_length", 0) + 5
        assert torch.equal(context[:, -5:], fresh)
        following = memory.update([memory.context(i, fresh) for i in range(len(memory.hidden))], mem_len=6)
        assert type(following) in (Memory, RecurrentMemory) and following.length == 6
        assert torch.equal(following.hidden[0], context[:, -6:])
        restored = type(memory).from_state_dict(memory.state_dict())
        for a, b in zip(restored.tensors(), memory.tensors(), strict=False):
            assert torch.equal(a, b)
        rows = type(memory).cat([memory.select(slice(0, 1)), memory.select(slice(1, 3))])
        for a, b in zip(rows.tensors(), memory.tensors(), strict=True):
            assert torch.equal(a, b)
        assert memory.update([fresh], mem_len=0) is None


def test_the_fast_backend_is_built_in_not_attached_afterwards():
    """A default model is built from the fast backend's parts (same random draws, so the same
    parameters as the reference built from the same seed); nothing in txl.fast rewires a built model."""
    import txl.fast
    from tiny_models import tiny
    from txl.fast.linear import FastLinear
    from txl.fast.memory import open_memory
    from txl.models.transformer_xl.model import TransformerXL
    from txl.nn.memory import reference_memory

    torch.manual_seed(0)
    fast = TransformerXL(tiny(dropout=0.1))
    torch.manual_seed(0)
    reference = TransformerXL(tiny(dropout=0.1, backend="reference"))
    assert fast.memory_kind is open_memory and reference.memory_kind is reference_memory
    assert type(fast.blocks[0].attn.q_proj) is FastLinear and type(reference.blocks[0].attn.q_proj) is torch.nn.Linear
    assert fast.state_dict().keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        assert torch.equal(fast.state_dict()[name], value), name
    assert not hasattr(txl.fast, "apply")
