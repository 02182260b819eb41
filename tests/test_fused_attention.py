"""The fused attention impls (`attention_impl="sdpa"` and `"flex"`, txl.nn.attention.fused) compute
what the eager reference computes, on the CPU (issue 46 item 1): for every kernel that has them (full,
sliding, sparse) and every encoding it takes, with memory, `same_length`, padding where the kernel takes
it, causal and bidirectional, dropout off. Outputs/logits within 1e-5, gradients (of q, k, v, of the
encoding's parameters, of every model parameter) within 1e-4 relative.

torch 2.13's FlexAttention refuses a backward on the CPU (its `_validate_device`), though its math
backward exists: the flex gradient tests patch that check out (`flex_cpu_backward`) and so check the
score_mod / mask_mod gradients, including the one into the captured position term. The auto rule
(fast on the CPU, the fused impl on CUDA) is tested through its decision function without a GPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from txl import TransformerXLConfig
from txl.errors import UsageError
from txl.models.transformer_xl.model import TransformerXL
from txl.nn.attention import KERNELS, AttentionMask, registry
from txl.nn.attention import fused as fused_module
from txl.nn.attention.eager import eager_attention
from txl.nn.attention.xl_fast import fast_attention
from txl.nn.positional import CONTENT_ONLY, POSITIONAL_ENCODINGS

FUSED = ["sdpa", "flex"]
# every registered encoding but nezha, whose value term a fused kernel never returns: it runs the fast kernel
# (test_nezha_is_handed_to_the_fast_kernel below)
ENCODINGS = [name for name in POSITIONAL_ENCODINGS if name != "nezha"]
BIDIRECTIONAL = [p for p, cls in POSITIONAL_ENCODINGS.items() if not cls.causal_only]
SCORE_TERMS = [p for p, cls in POSITIONAL_ENCODINGS.items() if cls.score_terms]
EXTRA = {"shaw": {"position_options": {"max_distance": 6}}}  # clipping active inside the span
D_HEAD, N_HEAD = 8, 4


@pytest.fixture(autouse=True)
def _quiet_flex():
    with warnings.catch_warnings():  # flex without torch.compile warns that it is unfused: the CPU tests mean it
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        yield


@pytest.fixture
def flex_cpu_backward(monkeypatch):
    """FlexAttention's math backward on the CPU, which torch 2.13 refuses up front."""
    monkeypatch.setattr(fused_module, "FLEX_CPU_BACKWARD", True)
    monkeypatch.setattr(torch.nn.attention.flex_attention, "_validate_device", lambda *tensors: None)


@pytest.fixture
def fused_calls(monkeypatch):
    """The calls that reached SDPA or FlexAttention (not a fallback to the fast kernel)."""
    calls = []
    for name in ("_sdpa", "_flex"):
        original = getattr(fused_module, name)
        monkeypatch.setattr(fused_module, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    return calls


def config(**overrides) -> TransformerXLConfig:
    base = dict(vocab_size=53, n_layer=2, d_model=32, n_head=N_HEAD, d_head=D_HEAD, d_inner=48, mem_len=12,
                dropout=0.0, dropatt=0.0)
    return TransformerXLConfig(**{**base, **overrides})


def encoding_positions(pos: str, *, k_len: int, causal: bool = True, seed: int = 0):
    """The positional module of a small model (random non-zero parameters) and its layer-0 terms."""
    torch.manual_seed(seed)
    model = TransformerXL(config(pos_encoding=pos, causal=causal, mem_len=0 if not causal else 12, **EXTRA.get(pos, {})))
    with torch.no_grad():
        for p in model.pos.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    state = model.pos.prepare(k_len=k_len, clamp_len=0, device=torch.device("cpu"), dtype=torch.float32)
    return model.pos, model.pos.layer(0, state)


def qkv(i: int, n: int, b: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, N_HEAD, length, D_HEAD, generator=g).requires_grad_() for length in (i, n, n)]


def run_kernel(kernel, q, k, v, positions, mask, module):
    """Output and gradients (q, k, v and the encoding's parameters) of sum(out · w)."""
    for t in (q, k, v, *module.parameters()):
        t.grad = None
    out, _ = kernel(q, k, v, positions=positions, mask=mask, dropatt=0.0, training=True)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out * weights).sum().backward()
    grads = {"q": q.grad, "k": k.grad, "v": v.grad}
    grads.update({name: p.grad for name, p in module.named_parameters() if p.grad is not None})
    return out.detach(), grads


def assert_parity(got, expected):
    (out, grads), (ref_out, ref_grads) = got, expected
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        rel = float((grads[name] - g).norm() / g.norm().clamp(min=1e-12))
        assert rel < 1e-4, f"{name}: relative gradient difference {rel:.2e}"


MASKS = {  # name: (q_len, k_len, mask kwargs); padding only without memory (txl's model rule)
    "memory": (5, 13, {}),
    "no memory": (9, 9, {}),
    "same_length": (6, 14, {"window": 8}),
    "one query": (1, 11, {}),
}


@pytest.mark.parametrize("case", sorted(MASKS))
@pytest.mark.parametrize("pos", ENCODINGS)
@pytest.mark.parametrize("impl", FUSED)
def test_full_kernel_equals_eager_causal(impl, pos, case, flex_cpu_backward):
    i, n, kwargs = MASKS[case]
    module, positions = encoding_positions(pos, k_len=n)
    mask = AttentionMask(**kwargs)
    q, k, v = qkv(i, n)
    expected = run_kernel(eager_attention, q, k, v, positions, mask, module)
    got = run_kernel(KERNELS[("full", impl)], q, k, v, positions, mask, module)
    assert_parity(got, expected)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("pos", ENCODINGS)
@pytest.mark.parametrize("impl", FUSED)
def test_full_kernel_equals_eager_with_padding(impl, pos, causal, flex_cpu_backward):
    """A padding mask (no memory), left padding of different lengths: a padded query that sees no key
    gives 0, as in eager."""
    if not causal and pos not in BIDIRECTIONAL:
        pytest.skip(f"{pos} is causal only")
    module, positions = encoding_positions(pos, k_len=9, causal=causal)
    padding = torch.ones(2, 9, dtype=torch.bool)
    padding[0, :3] = False
    mask = AttentionMask(causal=causal, key_padding=padding)
    q, k, v = qkv(9, 9)
    expected = run_kernel(eager_attention, q, k, v, positions, mask, module)
    got = run_kernel(KERNELS[("full", impl)], q, k, v, positions, mask, module)
    assert_parity(got, expected)


@pytest.mark.parametrize("pos", BIDIRECTIONAL)
@pytest.mark.parametrize("impl", FUSED)
def test_full_kernel_equals_eager_bidirectional_and_cross(impl, pos, flex_cpu_backward):
    module, positions = encoding_positions(pos, k_len=10, causal=False)
    q, k, v = qkv(10, 10)
    mask = AttentionMask(causal=False)
    assert_parity(run_kernel(KERNELS[("full", impl)], q, k, v, positions, mask, module),
                  run_kernel(eager_attention, q, k, v, positions, mask, module))
    q, k, v = qkv(4, 10)  # cross-attention: no positions, queries not among the keys
    assert_parity(run_kernel(KERNELS[("full", impl)], q, k, v, CONTENT_ONLY, mask, module),
                  run_kernel(eager_attention, q, k, v, CONTENT_ONLY, mask, module))


# ---------------------------------------------------------------------------------------------
# Whole models over segments with memory (the parity of test_fast_attention.py)


def pair(impl: str, **overrides) -> tuple[TransformerXL, TransformerXL]:
    c = config(**overrides)
    torch.manual_seed(0)
    eager = TransformerXL(c.replace(attention_impl="eager", backend="reference"))
    with torch.no_grad():  # non-trivial biases, u/v, position tables
        for p in eager.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    fused = TransformerXL(c.replace(attention_impl=impl))
    fused.load_state_dict(eager.state_dict())
    return eager, fused


def run_segments(model, tokens, seg=6):
    """Three training segments with memory (loss backward each), then one evaluation segment."""
    model.train()
    model.zero_grad()
    memory, logits = None, []
    for s in range(3):
        out = model(tokens[:, s * seg : (s + 1) * seg], memory=memory, labels=tokens[:, s * seg + 1 : (s + 1) * seg + 1],
                    return_logits=True)
        out.loss.backward()
        memory, logits = out.memory, [*logits, out.logits.detach()]
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.eval()
    with torch.no_grad():
        evaluated = model(tokens[:, 3 * seg : 4 * seg], memory=memory).logits
    return torch.cat(logits, 1), grads, evaluated


def assert_models_agree(eager, fused):
    tokens = torch.randint(0, eager.config.vocab_size, (3, 25), generator=torch.Generator().manual_seed(1))
    logits_e, grads_e, eval_e = run_segments(eager, tokens)
    logits_f, grads_f, eval_f = run_segments(fused, tokens)
    torch.testing.assert_close(logits_f, logits_e, atol=1e-5, rtol=0)
    torch.testing.assert_close(eval_f, eval_e, atol=1e-5, rtol=0)
    assert grads_e.keys() == grads_f.keys()
    for name, g in grads_e.items():
        rel = float((grads_f[name] - g).norm() / g.norm().clamp(min=1e-12))
        assert rel < 1e-4, f"{name}: relative gradient difference {rel:.2e}"


@pytest.mark.parametrize("same_length", [False, True])
@pytest.mark.parametrize("pos", ENCODINGS)
@pytest.mark.parametrize("impl", FUSED)
def test_full_model_equals_eager_over_segments_with_memory(impl, pos, same_length, flex_cpu_backward, fused_calls):
    eager, fused = pair(impl, pos_encoding=pos, same_length=same_length, **EXTRA.get(pos, {}))
    assert fused.blocks[0].attn.kernel is KERNELS[("full", impl)]
    assert_models_agree(eager, fused)
    assert fused_calls == [f"_{impl}"] * 8  # 2 layers x 4 segments, none handed to the fast kernel


@pytest.mark.parametrize("impl", FUSED)
def test_nezha_is_handed_to_the_fast_kernel(impl, flex_cpu_backward, fused_calls):
    eager, fused = pair(impl, pos_encoding="nezha", position_options={"max_distance": 6})
    assert_models_agree(eager, fused)
    assert fused_calls == []


SLIDING = {  # name: config overrides
    "sliding": dict(attention="sliding", attention_options={"window": 4}),
    "sliding, dilated heads": dict(attention="sliding", attention_options={"window": 3, "dilation": [1, 2, 1, 3]}),
    "sparse": dict(attention="sparse", attention_options={"stride": 3}),
}


@pytest.mark.parametrize("same_length", [False, True])
@pytest.mark.parametrize("pos", ENCODINGS)
@pytest.mark.parametrize("kernel", sorted(SLIDING))
@pytest.mark.parametrize("impl", FUSED)
def test_banded_model_equals_eager_over_segments_with_memory(impl, kernel, pos, same_length, flex_cpu_backward,
                                                             fused_calls):
    overrides = {**SLIDING[kernel], **EXTRA.get(pos, {})}
    eager, fused = pair(impl, pos_encoding=pos, same_length=same_length, **overrides)
    assert type(fused.blocks[0].attn.kernel) is KERNELS[(overrides["attention"], impl)]
    assert_models_agree(eager, fused)
    assert fused_calls == [f"_{impl}"] * 8  # 2 layers x 4 segments, none handed to the fast kernel


@pytest.mark.parametrize("pos", ["rope", "learned"])
@pytest.mark.parametrize("impl", FUSED)
def test_bidirectional_sliding_equals_eager(impl, pos, flex_cpu_backward):
    eager, fused = pair(impl, pos_encoding=pos, causal=False, mem_len=0, attention="sliding",
                        attention_options={"window": 3})
    x = torch.randint(0, 53, (2, 14), generator=torch.Generator().manual_seed(2))
    for model in (eager, fused):
        model.train().zero_grad()
        out = model(x, labels=x, return_logits=True)
        out.loss.backward()
    torch.testing.assert_close(fused(x).logits, eager(x).logits, atol=1e-5, rtol=0)
    for (name, a), (_, b) in zip(eager.named_parameters(), fused.named_parameters()):
        if a.grad is not None:
            assert float((b.grad - a.grad).norm() / a.grad.norm().clamp(min=1e-12)) < 1e-4, name


@pytest.mark.parametrize("impl", FUSED)
def test_model_with_padding_equals_eager(impl, flex_cpu_backward):
    eager, fused = pair(impl, pos_encoding="xl", mem_len=0)
    x = torch.randint(1, 53, (2, 10), generator=torch.Generator().manual_seed(3))
    attention_mask = torch.ones_like(x)
    attention_mask[1, :4] = 0  # left padding
    for model in (eager, fused):
        model.train().zero_grad()
        model(x, attention_mask=attention_mask, labels=x).loss.backward()
    torch.testing.assert_close(fused(x, attention_mask=attention_mask).logits,
                               eager(x, attention_mask=attention_mask).logits, atol=1e-5, rtol=0)
    for (name, a), (_, b) in zip(eager.named_parameters(), fused.named_parameters()):
        if a.grad is not None:
            assert float((b.grad - a.grad).norm() / a.grad.norm().clamp(min=1e-12)) < 1e-4, name


# ---------------------------------------------------------------------------------------------
# What the fused kernels leave to the fast kernel, and what they refuse


@pytest.mark.parametrize("impl", FUSED)
def test_fused_falls_back_to_the_fast_kernel_for_what_it_cannot_take(impl, monkeypatch):
    """need_weights, memory tokens, Shaw's value term (and for flex attention dropout): the fast kernel."""
    calls = []
    monkeypatch.setattr(fused_module, "fast_attention", lambda *a, **kw: calls.append(kw) or fast_attention(*a, **kw))
    module, positions = encoding_positions("xl", k_len=9)
    q, k, v = qkv(5, 9)
    kernel = KERNELS[("full", impl)]
    with torch.no_grad():
        out, probs = kernel(q, k, v, positions=positions, mask=AttentionMask(), dropatt=0.0, training=False,
                            need_weights=True)
        assert probs is not None and len(calls) == 1
    _, shaw_values = encoding_positions_with_values()
    with torch.no_grad():
        kernel(q, k, v, positions=shaw_values, mask=AttentionMask(), dropatt=0.0, training=False)
        assert len(calls) == 2
        kernel(q, torch.cat([k[:, :, :2], k], 2), torch.cat([v[:, :, :2], v], 2), positions=positions,
               mask=AttentionMask(memory_tokens=2), dropatt=0.0, training=False)
        assert len(calls) == 3
        kernel(q, k, v, positions=positions, mask=AttentionMask(), dropatt=0.1, training=True)
        assert len(calls) == (4 if impl == "flex" else 3)  # sdpa takes attention dropout (dropout_p)


def encoding_positions_with_values():
    torch.manual_seed(0)
    model = TransformerXL(config(pos_encoding="shaw", position_options={"max_distance": 6, "values": True}))
    state = model.pos.prepare(k_len=9, clamp_len=0, device=torch.device("cpu"), dtype=torch.float32)
    return model.pos, model.pos.layer(0, state)


@pytest.mark.parametrize("impl", FUSED)
def test_fallbacks_still_equal_eager(impl, flex_cpu_backward):
    """The same model results when the fused kernel hands a call to the fast kernel (Shaw values, memory tokens)."""
    eager, fused = pair(impl, pos_encoding="shaw", position_options={"max_distance": 6, "values": True})
    assert_models_agree(eager, fused)
    eager, fused = pair(impl, pos_encoding="xl", memory_tokens=2)
    assert_models_agree(eager, fused)


def test_flex_refuses_to_train_on_the_cpu_in_one_line():
    module, positions = encoding_positions("xl", k_len=9)
    q, k, v = qkv(5, 9)
    with pytest.raises(UsageError, match="attention_impl='flex' has no backward on the CPU") as caught:
        KERNELS[("full", "flex")](q, k, v, positions=positions, mask=AttentionMask(), dropatt=0.0, training=True)
    assert "\n" not in str(caught.value)
    with torch.no_grad():  # evaluation runs
        out, _ = KERNELS[("full", "flex")](q, k, v, positions=positions, mask=AttentionMask(), dropatt=0.0,
                                            training=False)
        ref, _ = eager_attention(q, k, v, positions=positions, mask=AttentionMask(), dropatt=0.0, training=False)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", FUSED)
def test_fused_sliding_refuses_a_padding_mask_as_the_fast_kernel_does(impl):
    torch.manual_seed(0)
    model = TransformerXL(config(attention="sliding", attention_options={"window": 3}, attention_impl=impl, mem_len=0))
    x = torch.randint(0, 53, (2, 8))
    with pytest.raises(UsageError, match="does not take a padding mask"):
        model(x, attention_mask=torch.ones_like(x))


def test_an_impl_a_kernel_lacks_is_a_config_error():
    from txl.errors import ConfigError

    with pytest.raises(ConfigError, match="attention_impl='sdpa' is not available for attention='performer'"):
        TransformerXL(config(attention="performer", pos_encoding="rope", attention_impl="sdpa"))


# ---------------------------------------------------------------------------------------------
# auto: fast on the CPU, the fused impl on CUDA


def test_auto_decides_by_device():
    assert registry.auto_impl("full", "cpu") == "fast"
    assert registry.auto_impl("full", "cuda") == registry.CUDA_AUTO["full"] == "sdpa"
    assert registry.auto_impl("sliding", "cuda") == registry.CUDA_AUTO["sliding"] == "flex"
    assert registry.auto_impl("sparse", "cpu") == "fast"
    assert registry.auto_impl("performer", "cuda") == "fast"  # no fused impl: fast everywhere
    assert registry.auto_impl("linformer", "cuda") == "eager"
    assert registry.auto_impl("full", "mps") == "fast"


class _FakeQueries:
    def __init__(self, is_cuda: bool):
        self.is_cuda = is_cuda


def test_auto_kernel_runs_the_cuda_kernel_only_for_cuda_queries():
    """The per-call dispatch without a GPU: a stand-in for q says which device it is on."""
    ran = []
    cpu = lambda q, k, v, **kw: ran.append("cpu")  # noqa: E731
    cuda = lambda q, k, v, **kw: ran.append("cuda")  # noqa: E731
    kernel = registry.by_device(cpu, cuda)
    assert registry.by_device(cpu, cuda) is kernel  # one object per pair
    for is_cuda in (False, True, False):
        kernel(_FakeQueries(is_cuda), None, None, positions=None, mask=None, dropatt=0.0, training=False)
    assert ran == ["cpu", "cuda", "cpu"]
    auto_full = registry.resolve_kernel("full", "auto")
    assert auto_full.kernels == {"cpu": fast_attention, "cuda": KERNELS[("full", "sdpa")]}


def test_auto_class_kernel_is_the_fused_class_dispatching_by_device(monkeypatch):
    auto = registry.resolve_kernel("sliding", "auto")
    assert issubclass(auto, KERNELS[("sliding", "flex")]) and auto.kernels["cpu"] is KERNELS[("sliding", "fast")]
    kernel = auto(config(attention="sliding", attention_options={"window": 3}))
    ran = []
    monkeypatch.setattr(KERNELS[("sliding", "fast")], "forward", lambda self, q, *a, **kw: ran.append("cpu"))
    monkeypatch.setattr(KERNELS[("sliding", "flex")], "forward", lambda self, q, *a, **kw: ran.append("cuda"))
    for is_cuda in (True, False):
        kernel.forward(_FakeQueries(is_cuda), None, None, positions=None, mask=None, dropatt=0.0, training=False)
    assert ran == ["cuda", "cpu"]


def test_auto_on_the_cpu_runs_the_fast_kernel(fused_calls):
    """A default model (attention_impl="auto") on the CPU calls today's fast kernel and never a fused one."""
    model = TransformerXL(config())
    assert model.blocks[0].attn.kernel.kernels["cpu"] is fast_attention
    x = torch.randint(0, 53, (2, 6))
    reference = TransformerXL(config(attention_impl="fast"))
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(model(x).logits, reference(x).logits)
    assert fused_calls == []
    with torch.no_grad():  # (the counter counts: the explicit impl goes through it)
        TransformerXL(config(attention_impl="sdpa"))(x)
    assert fused_calls == ["_sdpa"] * 2


@pytest.mark.parametrize("impl", FUSED)
def test_sliding_fallbacks_still_equal_eager(impl, flex_cpu_backward):
    """Global tokens and memory tokens of the sliding window go to its fast kernel: same results."""
    eager, fused = pair(impl, attention="sliding", attention_options={"window": 4, "global_tokens": 2})
    assert_models_agree(eager, fused)
    eager, fused = pair(impl, attention="sliding", attention_options={"window": 4}, memory_tokens=2)
    assert_models_agree(eager, fused)
