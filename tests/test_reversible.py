"""Reversible blocks (config.reversible, txl.nn.reversible; Gomez et al. 2017, Reformer): the backward that
rebuilds each block's input from its output gives the gradients of plain backpropagation through the
same blocks (1e-5), with dropout, memory, every kind of positional encoding, both backends; the
activations it keeps do not grow with depth; the config refuses the blocks it cannot invert."""

from __future__ import annotations

import pytest
import torch

from txl import ConfigError, TransformerXLConfig
from txl.models.transformer_xl.model import TransformerXL

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(vocab_size=61, n_layer=3, d_model=32, n_head=4, d_head=8, d_inner=48, mem_len=8, dropout=0.1, dropatt=0.1,
            pre_lnorm=True, reversible=True)


def build(seed: int = 0, **overrides) -> TransformerXL:
    torch.manual_seed(seed)
    model = TransformerXL(TransformerXLConfig(**{**BASE, **overrides})).train()
    with torch.no_grad():  # every parameter non-trivial
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def two_segments(model: TransformerXL, *, reversible: bool, seed: int = 5):
    """Loss over two segments with memory, its gradients, the logits and the next memory."""
    model.reversible_backward = reversible
    model.zero_grad()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 61, (2, 12), generator=g), torch.randint(0, 61, (2, 12), generator=g)
    torch.manual_seed(seed)  # the same dropout masks for both
    first = model(x, labels=y)
    second = model(y, memory=first.memory, labels=x)
    (first.loss + second.loss).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return grads, second.logits.detach(), second.memory


@pytest.mark.parametrize("pos", ["xl", "rope", "shaw", "alibi", "learned", "sinusoidal"])
@pytest.mark.parametrize("backend", ["reference", "auto"])  # auto: the CPU fast backend
def test_reversible_backward_gives_the_gradients_of_plain_backpropagation(pos, backend):
    model = build(pos_encoding=pos, backend=backend)
    rebuilt, logits, memory = two_segments(model, reversible=True)
    plain, plain_logits, plain_memory = two_segments(model, reversible=False)
    assert set(rebuilt) == set(plain) == {n for n, p in model.named_parameters() if p.requires_grad}
    torch.testing.assert_close(logits, plain_logits, atol=0, rtol=0)  # the same forward
    for a, b in zip(memory.hidden, plain_memory.hidden):
        torch.testing.assert_close(a, b, atol=0, rtol=0)  # the memory is written once, with x2
    for name in plain:
        torch.testing.assert_close(rebuilt[name], plain[name], atol=1e-5, rtol=1e-5, msg=name)


def test_reversible_backward_gives_the_input_gradient_and_follows_a_padding_mask():
    model = build(pos_encoding="xl")
    ids = torch.randint(1, 61, (2, 10), generator=torch.Generator().manual_seed(3))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 7:] = 0
    grads = []
    for reversible in (True, False):
        model.reversible_backward = reversible
        embedded: list[torch.Tensor] = []

        def keep(module, inputs, out, embedded=embedded):
            out.retain_grad()
            embedded.append(out)

        handle = model.embed.register_forward_hook(keep)
        torch.manual_seed(2)
        model(ids, attention_mask=attention_mask, labels=ids).loss.backward()
        handle.remove()
        grads.append(embedded[0].grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)


def test_the_coupling_is_the_formula_and_the_blocks_are_invertible():
    """y1 = x1 + F(x2), y2 = x2 + G(y1) from (h, h); output (y1 + y2) / 2; inputs rebuilt from outputs."""
    from txl.nn.attention.masks import CAUSAL
    from txl.nn.positional import CONTENT_ONLY
    from txl.nn.reversible import attention_half, feedforward_half, reversible_blocks

    model = build(pos_encoding="rope", dropout=0.0, dropatt=0.0).eval()
    h = torch.randn(2, 9, 32)
    x1 = x2 = h
    pairs = []
    for block in model.blocks:
        x1 = x1 + attention_half(block, x2, memory=None, positions=CONTENT_ONLY, mask=CAUSAL)[0]
        x2 = x2 + feedforward_half(block, x1)
        pairs.append((x1, x2))
    out, inputs, _ = reversible_blocks(model.blocks, h, memory=None, positions=lambda i, s: CONTENT_ONLY, pos_state={},
                                       mask=CAUSAL)
    torch.testing.assert_close(out, (x1 + x2) / 2)
    assert len(inputs) == 3
    torch.testing.assert_close(inputs[0], h)
    y1, y2 = pairs[-1]
    for block, (before1, before2) in zip(reversed(model.blocks[1:]), reversed(pairs[:-1])):
        back2 = y2 - feedforward_half(block, y1)
        back1 = y1 - attention_half(block, back2, memory=None, positions=CONTENT_ONLY, mask=CAUSAL)[0]
        torch.testing.assert_close(back1, before1, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(back2, before2, atol=1e-6, rtol=1e-5)
        y1, y2 = back1, back2


def saved_activation_bytes(model: TransformerXL, reversible: bool) -> int:
    """Bytes of the tensors autograd keeps for the backward of one forward pass, parameters apart."""
    model.reversible_backward = reversible
    params = {p.data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = max(storages.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    x = torch.randint(0, 61, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, labels=x, mem_len=0).loss
    loss.backward()
    return sum(storages.values())


def test_reversible_activations_do_not_grow_with_depth():
    kept = {(layers, rev): saved_activation_bytes(build(n_layer=layers, dropout=0.0, dropatt=0.0), rev)
            for layers in (2, 6) for rev in (True, False)}
    assert kept[(6, True)] == kept[(2, True)]  # only the last pair (and what is outside the blocks)
    assert kept[(6, False)] > kept[(2, False)] + 2 * (kept[(2, False)] - kept[(2, True)])  # plain: per block
    assert kept[(6, True)] < kept[(6, False)] / 3


def test_reversible_outputs_attentions_and_hidden_states_and_generates():
    model = build(pos_encoding="xl", dropout=0.0, dropatt=0.0).eval()
    x = torch.randint(0, 61, (1, 6))
    out = model(x, output_attentions=True, output_hidden_states=True)
    assert len(out.attentions) == 3 and out.attentions[0].shape == (1, 4, 6, 6)
    assert len(out.hidden_states) == 4
    assert len(model.generate(x, max_new_tokens=4, temperature=0)[0]) == 10


def test_reversible_trains_three_steps():
    model = build(pos_encoding="xl")
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    x = torch.randint(0, 61, (4, 16), generator=torch.Generator().manual_seed(3))
    losses, memory = [], None
    for _ in range(3):
        optimizer.zero_grad()
        out = model(x[:, :-1], labels=x[:, 1:], memory=memory)
        out.loss.backward()
        memory = out.memory
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        optimizer.step()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(("overrides", "refused"), [
    (dict(pre_lnorm=False), "pre_lnorm=False"),
    (dict(residual="gru-gate"), "residual='gru-gate'"),
    (dict(memory_source="same-layer"), "memory_source='same-layer'"),
    (dict(universal=True), "universal=True"),
    (dict(cmem_len=4), "cmem_len=4"),
    (dict(attention="routing", pos_encoding="rope"), None),
    (dict(attention="performer", pos_encoding="rope"), None),
])
def test_reversible_refuses_blocks_it_cannot_invert(overrides, refused):
    message = f"config.reversible needs pre-LN blocks.*got {refused}" if refused else \
        f"config.reversible cannot take attention='{overrides['attention']}'"
    with pytest.raises(ConfigError, match=message):
        TransformerXLConfig(**{**BASE, **overrides})


def test_txl_train_runs_three_steps_with_reversible_blocks(tmp_path):
    """`txl train` (the trainer's clipping, schedule, evaluation and checkpoint) on reversible blocks."""
    import json

    from txl.cli.main import main

    text = tmp_path / "plain.txt"
    text.write_text("the memory of each segment is the layer's input of the one before\n" * 40)
    small = ["--set", "model.n_layer=2", "--set", "model.d_model=32", "--set", "model.n_head=2", "--set", "model.d_head=16",
             "--set", "model.d_inner=64", "--set", "model.mem_len=16", "--set", "tgt_len=16", "--set", "eval_tgt_len=16",
             "--set", "batch_size=4", "--set", "eval_batch_size=2", "--set", "eval_max_tokens=300",
             "--set", "max_steps=3", "--set", "eval_interval=3", "--set", "log_interval=1", "--set", "max_minutes=0",
             "--set", "sample_tokens=0", "--set", "warmup_steps=0", "--quiet"]
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--data", f"text:{text}", "--out", str(run), *small,
                 "--set", "model.pre_lnorm=true", "--set", "model.reversible=true", "--threads", "1"]) == 0
    result = json.loads((run / "result.json").read_text())
    assert result["steps"] == 3
    losses = [json.loads(line).get("loss") for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum(v is not None and v == v for v in losses) >= 3


def test_a_training_step_leaves_nothing_of_its_graph_behind():
    """Training steps carrying the memory free each step's reversible function and what it kept: the
    model's hidden-state list once took the run's own list, and appending the output to it made a cycle
    through the autograd graph that Python's collector cannot free (an arena run grew to 13.7 GB)."""
    import gc

    from txl.nn.reversible import _Run

    model = build()
    memory = None
    for _ in range(3):
        x = torch.randint(0, model.config.vocab_size, (2, 8))
        out = model(x, memory=memory, labels=x)
        out.loss.backward()
        memory = out.memory
    del out
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, _Run)]
