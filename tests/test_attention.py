"""The attention interface (`txl.nn.attention`): the registries, a kernel from outside the package, padding
masks, attention probabilities, cross-attention and per-call runtime settings."""

from __future__ import annotations

import typing

import pytest
import torch
import torch.nn.functional as F

from txl import ConfigError, TransformerXLConfig, UsageError
from txl.models.transformer_xl.config import AttentionName, PositionalName
from txl.models.transformer_xl.model import TransformerXL
from txl.nn.attention import KERNELS, Attention, AttentionMask, register
from txl.nn.attention import registry as kernel_registry
from txl.nn.positional import POSITIONAL_ENCODINGS

pytestmark = pytest.mark.usefixtures("one_thread")


def test_config_literals_are_the_registries_keys():
    assert set(typing.get_args(AttentionName)) == {name for name, _ in KERNELS}
    assert set(typing.get_args(PositionalName)) == set(POSITIONAL_ENCODINGS)


def test_unknown_names_are_rejected_naming_the_registry():
    with pytest.raises(ConfigError, match=r"config.attention='slidng' is not a registered attention kernel.*sliding"):
        TransformerXLConfig(attention="slidng")
    with pytest.raises(ConfigError, match=r"config.pos_encoding='rotary' is not a registered positional encoding"):
        TransformerXLConfig(pos_encoding="rotary")


@pytest.fixture
def toy_kernel():
    """A kernel written in this file alone: plain causal softmax attention over [memory ; segment],
    content scores only (no positional terms), registered as attention="toy"."""

    @register("toy", "eager", score_terms=False)
    def toy(q, k, v, *, positions, mask, dropatt, training, need_weights=False):
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(~mask.visible(q.shape[-2], k.shape[-2], q.device), float("-inf"))
        probs = F.dropout(scores.softmax(-1), dropatt, training)
        return probs @ v, probs if need_weights else None

    yield toy
    del KERNELS[("toy", "eager")], kernel_registry.SPECS["toy"]


def test_a_kernel_from_outside_the_package_trains_and_runs_with_memory(toy_kernel, tiny):
    config = tiny(attention="toy", pos_encoding="rope")
    with pytest.raises(ConfigError, match="adds a term to the attention scores"):  # its own spec is checked
        tiny(attention="toy", pos_encoding="xl")
    torch.manual_seed(0)
    model = TransformerXL(config)
    assert model.blocks[0].attn.kernel is toy_kernel
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randint(0, config.vocab_size, (2, 25))
    memory, losses = None, []
    for step in range(3):  # three training steps, each a segment that attends over the last one's memory
        out = model(x[:, step * 8 : step * 8 + 8], memory=memory, labels=x[:, step * 8 + 1 : step * 8 + 9])
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        memory, losses = out.memory, [*losses, out.loss.item()]
        assert memory.length == min(8 * (step + 1), config.mem_len)
    assert all(p.grad is not None for p in model.blocks[0].attn.parameters())
    # memory matters: the last segment's logits change when the memory does
    with torch.no_grad():
        model.eval()
        with_memory = model(x[:, 16:24], memory=memory).logits
        without = model(x[:, 16:24]).logits
    assert not torch.allclose(with_memory, without)


# ---------------------------------------------------------------------------------------------
# Padding: a padded batch gives each sequence what it gets alone.

LENGTHS = (5, 17, 32)
PADDED = {  # name -> config overrides: bidirectional encoders and causal models run without memory
    "full-eager, bidirectional": dict(causal=False, mem_len=0, pos_encoding="rope", attention_impl="eager",
                                      backend="reference"),
    "full-fast, bidirectional": dict(causal=False, mem_len=0, pos_encoding="rope", attention_impl="fast"),
    "performer, bidirectional": dict(causal=False, mem_len=0, attention="performer", pos_encoding="sinusoidal"),
    "linformer, bidirectional": dict(causal=False, mem_len=0, attention="linformer", pos_encoding="learned",
                                     attention_options=dict(k=8, max_len=32)),
    "full-eager, causal": dict(mem_len=0, attention_impl="eager", backend="reference"),
    "full-fast, causal": dict(mem_len=0, attention_impl="fast"),
    "full-fast, causal, shaw": dict(mem_len=0, pos_encoding="shaw", position_options=dict(max_distance=6)),
    "performer, causal": dict(mem_len=0, attention="performer", pos_encoding="rope"),
}


@pytest.mark.parametrize("name", list(PADDED))
def test_padded_batch_equals_each_sequence_alone(name, tiny):
    torch.manual_seed(0)
    model = TransformerXL(tiny(**PADDED[name])).eval()
    with torch.no_grad():  # non-trivial biases and shifts
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    vocab = model.config.vocab_size
    sequences = [torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(n)) for n in LENGTHS]
    width = max(LENGTHS)
    ids = torch.zeros(len(LENGTHS), width, dtype=torch.long)  # padding token 0 (any id: it is masked)
    attention_mask = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = seq
        attention_mask[row, : len(seq)] = 1
    labels = ids.roll(-1, dims=1)
    with torch.no_grad():
        batch = model(ids, labels=labels, attention_mask=attention_mask, mem_len=0, return_logits=True)
        for row, seq in enumerate(sequences):
            n = len(seq)
            alone = model(seq[None], labels=labels[row : row + 1, :n], mem_len=0, return_logits=True)
            torch.testing.assert_close(batch.logits[row, :n], alone.logits[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(batch.nll[row, :n], alone.nll[0], atol=1e-5, rtol=0)
            assert (batch.nll[row, n:] == 0).all()  # padding is never scored
    scored = attention_mask.sum().item()
    assert torch.isclose(batch.loss, batch.nll.sum() / scored)


def test_left_padding_with_relative_positions_equals_alone(tiny):
    """Relative positions depend on distances only, so even padding on the left changes nothing."""
    torch.manual_seed(0)
    model = TransformerXL(tiny(mem_len=0)).eval()
    seq = torch.randint(1, 61, (9,))
    ids = torch.cat([torch.zeros(7, dtype=torch.long), seq])[None]
    attention_mask = (torch.arange(16) >= 7).long()[None]
    with torch.no_grad():
        padded = model(ids, attention_mask=attention_mask, mem_len=0).logits[0, 7:]
        alone = model(seq[None], mem_len=0).logits[0]
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("overrides", "match"), [
    (dict(attention="sliding", attention_options=dict(window=4), mem_len=0), "attention='sliding' does not take a padding mask"),
    (dict(attention="sparse", attention_options=dict(stride=4), mem_len=0), "attention='sparse' does not take a padding mask"),
])
def test_kernels_that_cannot_pad_say_so(tiny, overrides, match):
    model = TransformerXL(tiny(**overrides))
    with pytest.raises(UsageError, match=match):
        model(torch.ones(2, 6, dtype=torch.long), attention_mask=torch.ones(2, 6), mem_len=0)


def test_padding_between_real_tokens_with_memory_or_the_wrong_shape_is_refused(tiny):
    """Padding with memory is taken (issue 47; tests/test_padding_memory.py) while each row's real tokens
    stay one run; a gap between them would shift the relative distances and is refused."""
    model = TransformerXL(tiny())
    x = torch.ones(2, 6, dtype=torch.long)
    model(x, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]))
    with pytest.raises(UsageError, match="padding between real tokens"):
        model(x, attention_mask=torch.tensor([[1, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]))
    with pytest.raises(UsageError, match="attention_mask must have the shape of input_ids"):
        model(x, attention_mask=torch.ones(2, 5), mem_len=0)


# ---------------------------------------------------------------------------------------------
# Attention probabilities and hidden states


@pytest.mark.parametrize("pos", list(POSITIONAL_ENCODINGS))
@pytest.mark.parametrize("same_length", [False, True])
def test_output_attentions_sum_to_one_over_visible_keys_and_eager_equals_fast(pos, same_length, tiny):
    config = tiny(pos_encoding=pos, same_length=same_length, mem_len=8)
    torch.manual_seed(0)
    eager = TransformerXL(config.replace(attention_impl="eager", backend="reference")).eval()
    fast = TransformerXL(config.replace(attention_impl="fast")).eval()
    fast.load_state_dict(eager.state_dict())
    x = torch.randint(0, 61, (2, 18))
    results = []
    for model in (eager, fast):
        with torch.no_grad():
            memory = model(x[:, :8]).memory
            results.append(model(x[:, 8:14], memory=memory, output_attentions=True, output_hidden_states=True))
    for probs_e, probs_f in zip(results[0].attentions, results[1].attentions, strict=True):
        assert probs_e.shape == (2, 4, 6, 14)  # (batch, heads, queries, memory + segment keys)
        torch.testing.assert_close(probs_f, probs_e, atol=1e-5, rtol=0)
        distance = torch.arange(6)[:, None] + 8 - torch.arange(14)[None, :]
        visible = (distance >= 0) & ((distance < 8) if same_length else True)
        torch.testing.assert_close(probs_e.sum(-1), torch.ones(2, 4, 6))
        assert (probs_e[..., ~visible] == 0).all()
    hidden = results[0].hidden_states
    assert len(hidden) == config.n_layer + 1 and all(h.shape == (2, 6, 32) for h in hidden)
    torch.testing.assert_close(results[0].hidden, hidden[-1])  # post-LN: no final norm, no dropout in eval
    assert results[0].attentions is not None and eager(x[:, :6]).attentions is None


def test_output_attentions_in_training_with_autograd(tiny):
    torch.manual_seed(0)
    model = TransformerXL(tiny(dropout=0.0)).train()
    x = torch.randint(0, 61, (2, 16))
    first = model(x[:, :8], labels=x[:, 1:9])
    out = model(x[:, 8:15], memory=first.memory, labels=x[:, 9:16], output_attentions=True)
    (out.loss + out.attentions[0].sum()).backward()
    assert model.blocks[0].attn.q_proj.weight.grad is not None
    torch.testing.assert_close(out.attentions[1].sum(-1), torch.ones(2, 4, 7))


def test_kernels_without_probabilities_say_so(tiny):
    model = TransformerXL(tiny(attention="performer", pos_encoding="rope"))
    with pytest.raises(UsageError, match="output_attentions is not available with attention='performer'"):
        model(torch.ones(1, 4, dtype=torch.long), output_attentions=True)


@pytest.mark.parametrize("attention", ["sliding", "sparse"])
def test_windowed_kernels_give_the_dense_references_probabilities(attention, tiny):
    config = tiny(attention=attention, attention_options=dict(window=3) if attention == "sliding" else dict(stride=3))
    torch.manual_seed(0)
    fast = TransformerXL(config).eval()
    eager = TransformerXL(config.replace(attention_impl="eager", backend="reference")).eval()
    eager.load_state_dict(fast.state_dict())
    x = torch.randint(0, 61, (1, 12))
    with torch.no_grad():
        probs_f = fast(x, output_attentions=True).attentions
        probs_e = eager(x, output_attentions=True).attentions
    for a, b in zip(probs_f, probs_e, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        torch.testing.assert_close(a.sum(-1), torch.ones_like(a.sum(-1)))


# ---------------------------------------------------------------------------------------------
# Cross-attention and runtime settings


@pytest.mark.parametrize("impl", ["eager", "fast"])
def test_cross_attention_reads_keys_from_the_source_and_honours_its_padding(impl, tiny):
    config = tiny(attention_impl=impl)
    torch.manual_seed(0)
    layer = Attention(config).eval()
    x, source = torch.randn(2, 5, 32), torch.randn(2, 9, 32)
    real = torch.tensor([[True] * 9, [True] * 6 + [False] * 3])
    with torch.no_grad():
        out, probs = layer(x, source, mask=AttentionMask(causal=False, key_padding=real), need_weights=True)
        alone, _ = layer(x[1:], source[1:, :6], mask=AttentionMask(causal=False))
        # the reference: plain softmax attention over the projected source
        q = layer.q_proj(x).view(2, 5, 4, 8).transpose(1, 2)
        k, v = layer.kv_proj(source).view(2, 9, 2, 4, 8).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / 8**0.5
        expected = scores.masked_fill(~real[:, None, None, :], float("-inf")).softmax(-1)
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(out[1:], alone, atol=1e-6, rtol=0)
    assert probs.shape == (2, 4, 5, 9) and (probs[1, ..., 6:] == 0).all()


def test_clamp_len_and_same_length_per_call_equal_the_model_attributes(tiny):
    torch.manual_seed(0)
    model = TransformerXL(tiny(mem_len=8)).eval()
    x = torch.randint(0, 61, (2, 14))
    with torch.no_grad():
        memory = model(x[:, :8]).memory
        per_call = model(x[:, 8:], memory=memory, clamp_len=3, same_length=True).logits
        default = model(x[:, 8:], memory=memory).logits
        model.clamp_len, model.same_length = 3, True
        attribute = model(x[:, 8:], memory=memory).logits
    torch.testing.assert_close(per_call, attribute, atol=0, rtol=0)
    assert not torch.allclose(per_call, default)
    with pytest.raises(UsageError, match="clamp_len must be >= 0"):
        model(x, clamp_len=-1)


def test_attention_mask_validates_its_window():
    with pytest.raises(ValueError, match="window needs causal=True"):
        AttentionMask(causal=False, window=4)


# ---------------------------------------------------------------------------------------------
# Every registered kernel (parametrised from the registry, so a new one cannot escape these)

KERNEL_NAMES = kernel_registry.kernel_names()
KERNEL_OPTIONS = {"sliding": {"window": 4}, "sparse": {"stride": 3}, "performer": {"features": 32},
                  "linformer": {"k": 8, "max_len": 32}}


def kernel_config(tiny, name: str, **overrides):
    spec = kernel_registry.SPECS[name]
    causal = spec.causal
    return tiny(attention=name, pos_encoding="rope", causal=causal, mem_len=8 if causal else 0,
                attention_options=KERNEL_OPTIONS.get(name, {}), **overrides)


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_every_kernel_fast_equals_its_eager_reference(name, tiny):
    impls = {impl for n, impl in KERNELS if n == name}
    if not {"eager", "fast"} <= impls:  # (the fused sdpa/flex impls: tests/test_fused_attention.py)
        pytest.skip(f"attention={name!r} has no fast implementation ({', '.join(sorted(impls))})")
    config = kernel_config(tiny, name)
    torch.manual_seed(0)
    eager = TransformerXL(config.replace(attention_impl="eager", backend="reference")).eval()
    fast = TransformerXL(config.replace(attention_impl="fast")).eval()
    fast.load_state_dict(eager.state_dict())
    x = torch.randint(0, 61, (2, 20))
    outs = []
    for model in (eager, fast):
        model.zero_grad()
        memory = model(x[:, :10]).memory if config.causal else None
        out = model(x[:, 10:], memory=memory, labels=x[:, 10:])
        out.loss.backward()
        outs.append((out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-5, rtol=0)
    for n, g in outs[0][1].items():
        assert (outs[1][1][n] - g).norm() <= 1e-4 * g.norm().clamp(min=1e-12), n


@pytest.mark.parametrize("impl", ["eager", "fast"])
@pytest.mark.parametrize("name", [n for n in KERNEL_NAMES if kernel_registry.SPECS[n].causal])
def test_every_causal_kernel_never_sees_the_future(name, impl, tiny):
    if (name, impl) not in KERNELS:
        pytest.skip(f"attention={name!r} has no {impl!r} implementation")
    torch.manual_seed(0)
    model = TransformerXL(kernel_config(tiny, name, attention_impl=impl)).eval()
    x = torch.randint(0, 61, (2, 12))
    y = x.clone()
    y[:, 7:] = (y[:, 7:] + 1) % 61
    with torch.no_grad():
        memory = model(torch.randint(0, 61, (2, 8))).memory
        a, b = model(x, memory=memory).logits, model(y, memory=memory).logits
    # rounding only: a kernel that groups tokens by content (routing's clusters) or stabilises features
    # by a maximum over the keys (performer) may sum the past in another order when the future changes
    # (1 ulp, 4e-8 to 6e-8, on an AMD EPYC; exactly equal on an Intel Xeon); a leak moves the past by
    # the order of the future's change (0.7 to 1.0 here)
    assert (a[:, :7] - b[:, :7]).abs().max() <= 1e-6 * a.abs().max()
    assert not torch.allclose(a[:, 7:], b[:, 7:])
