"""The default TransformerXL (backend "auto", attention_impl "auto": the fast paths) is an ordinary module:
`torch.export.export` of a forward pass with memory, and `torch.compile(fullgraph=True)` of a training
step, work on it as built (issue 44, item 3).

The memory and the output are pytrees (`txl.nn.memory.register_pytree`), so the exported program takes
the memory of the segment before and returns the next one, as the model does. Inside a traced graph the
fast backend takes its traceable forms (`torch.compiler.is_compiling()`): the attention kernel's
composed path, torch's dropout, no projection cache or memoised tables.
"""

from __future__ import annotations

import math

import pytest
import torch

from txl import Memory, TransformerXLConfig
from txl.models.registry import config_from_dict
from txl.models.rnn.model import RecurrentLM
from txl.models.transformer_xl.model import TransformerXL

TINY = dict(vocab_size=61, n_layer=2, d_model=32, n_head=4, d_head=8, d_inner=48, mem_len=8)


def default_model(**overrides) -> TransformerXL:
    config = TransformerXLConfig(**{**TINY, **overrides})
    assert config.backend == "auto" and config.attention_impl == "auto"  # the defaults: the fast paths
    torch.manual_seed(0)
    return TransformerXL(config)


def test_export_of_a_forward_pass_with_memory_gives_eager_outputs():
    model = default_model().eval()
    tokens = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(1))
    first, second, third = tokens[:, :8], tokens[:, 8:16], tokens[:, 16:]
    with torch.no_grad():
        memory = model(first).memory  # segment 1, eager
        eager = model(second, memory=memory)
        eager_next = model(third, memory=eager.memory)
    program = torch.export.export(model, (second,), {"memory": memory})  # segment 2 passes segment 1's memory
    exported = program.module()
    with torch.no_grad():
        out = exported(second, memory=memory)
        out_next = exported(third, memory=out.memory)  # the program's own memory feeds it back
        after = model(second, memory=memory)  # tracing left nothing behind in the eager model
    assert isinstance(out.memory, Memory) and out.memory.length == 8
    torch.testing.assert_close(out.logits, eager.logits, atol=1e-6, rtol=0)
    for exported_layer, eager_layer in zip(out.memory.hidden, eager.memory.hidden, strict=True):
        torch.testing.assert_close(exported_layer, eager_layer, atol=1e-6, rtol=0)
    torch.testing.assert_close(out_next.logits, eager_next.logits, atol=1e-6, rtol=0)
    assert torch.equal(after.logits, eager.logits)


@pytest.mark.parametrize("overrides", [
    {"cmem_len": 4, "cmem_ratio": 2},  # compressive memory: [compressed ; memory ; segment]
    {"universal": True},
    {"arch": "lstm", "n_head": None, "d_head": None},  # recurrent memory: the LSTM states
    {"arch": "sha-rnn", "n_head": None, "d_head": None, "d_inner": 64},  # and SHA-RNN's attention memory
])
def test_every_memory_kind_goes_through_export(overrides):
    config = {**TINY, **overrides}
    config = config_from_dict({k: v for k, v in config.items() if v is not None})  # the arch's own config
    torch.manual_seed(0)
    model = (RecurrentLM if config.arch in ("lstm", "sha-rnn") else TransformerXL)(config).eval()
    tokens = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        memory = model(tokens[:, 8:16], memory=model(tokens[:, :8]).memory).memory  # compressed states too
        eager = model(tokens[:, 16:], memory=memory)
    out = torch.export.export(model, (tokens[:, 16:],), {"memory": memory}).module()(tokens[:, 16:], memory=memory)
    assert type(out.memory) is type(eager.memory)
    torch.testing.assert_close(out.logits, eager.logits, atol=1e-6, rtol=0)
    for exported_tensor, eager_tensor in zip(out.memory.tensors(), eager.memory.tensors(), strict=True):
        torch.testing.assert_close(exported_tensor, eager_tensor, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_compile_fullgraph_of_a_training_step_with_memory():
    model = default_model()  # dropout 0.1 as the default config: the fast backend's dropout modules trace too
    reference = default_model()
    tokens = torch.randint(0, 61, (2, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        memory = model.eval()(tokens[:, :8]).memory
    model.train(), reference.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    compiled = torch.compile(model, fullgraph=True)  # fullgraph: any graph break is an error
    out = compiled(tokens[:, 8:16], memory=memory, labels=tokens[:, 9:17])
    out.loss.backward()
    optimizer.step()

    eager = reference(tokens[:, 8:16], memory=memory, labels=tokens[:, 9:17])
    eager.loss.backward()
    # dropout draws other random numbers inside the graph: the same loss up to them
    assert math.isfinite(out.loss.item()) and abs(out.loss.item() - eager.loss.item()) < 0.05 * eager.loss.item()
    assert isinstance(out.memory, Memory) and out.memory.length == 8
    assert not any(h.requires_grad for h in out.memory.hidden)  # detached: the stop-gradient
    grads = {name for name, p in reference.named_parameters() if p.grad is not None}
    assert grads == {name for name, p in model.named_parameters() if p.grad is not None}
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert all(not torch.equal(before[name], p) for name, p in model.named_parameters() if name in grads)
