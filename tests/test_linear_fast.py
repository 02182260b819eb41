"""The fast backend's oneDNN fp32 linear layers against torch's own (`txl.fast.linear`)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from txl.config import TransformerXLConfig
from txl.fast import linear as linear_fast
from txl.fast.linear import FastLinear, applies, linear
from txl.model import TransformerXL

needs_onednn = pytest.mark.skipif(linear_fast._ONEDNN is None, reason="no oneDNN linear on this machine")


def _inputs(shape, d_in, d_out, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, d_in, generator=g, dtype=torch.float64).float().requires_grad_()
    w = (torch.randn(d_out, d_in, generator=g, dtype=torch.float64) / d_in**0.5).float().requires_grad_()
    b = torch.randn(d_out, generator=g).requires_grad_() if bias else None
    return x, w, b


@needs_onednn
@pytest.mark.parametrize("shape,d_in,d_out", [((4, 128), 128, 512), ((1024,), 512, 128), ((2, 96), 96, 256)])
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_linear_matches_float64_like_torch_forward_and_backward(shape, d_in, d_out, bias):
    x, w, b = _inputs(shape, d_in, d_out, bias)
    assert applies(x, w)
    grad = torch.randn(*shape, d_out, generator=torch.Generator().manual_seed(1))
    results = {}
    for name, fn in (("onednn", linear), ("torch", F.linear)):
        for t in (x, w, b):
            if t is not None:
                t.grad = None
        y = fn(x, w, b)
        y.backward(grad)
        results[name] = [y.detach(), x.grad, w.grad] + ([b.grad] if bias else [])
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if bias else None
    y64 = F.linear(x64, w64, b64)
    y64.backward(grad.double())
    exact = [y64, x64.grad, w64.grad] + ([b64.grad] if bias else [])
    for ours, theirs, truth in zip(results["onednn"], results["torch"], exact):
        assert ours.shape == truth.shape and ours.dtype == torch.float32
        err_ours = (ours.double() - truth).abs().max().item()
        err_torch = (theirs.double() - truth).abs().max().item()
        scale = truth.abs().max().item()
        # fp32 arithmetic in another summation order: as close to float64 as torch's own result
        assert err_ours <= max(4 * err_torch, 1e-6 * scale), (err_ours, err_torch)


@needs_onednn
def test_transposed_weight_view_and_weight_gradient_of_the_view():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(512, 64, generator=g, requires_grad=True)
    proj = (torch.randn(64, 256, generator=g) / 8).requires_grad_()  # used as linear(x, proj.t()), adaptive style
    grad = torch.randn(512, 256, generator=g)
    linear(x, proj.t()).backward(grad)
    ours = (x.grad.clone(), proj.grad.clone())
    x.grad = proj.grad = None
    F.linear(x, proj.t()).backward(grad)
    torch.testing.assert_close(ours[0], x.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours[1], proj.grad, rtol=1e-4, atol=1e-4)


def test_small_products_bf16_autocast_and_missing_op_fall_back_to_torch(monkeypatch):
    x, w, b = _inputs((1,), 128, 512, True)
    assert not applies(x, w)  # a tiny model's generated token: below MIN_MACS and MIN_WEIGHT
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    if linear_fast._ONEDNN is not None:  # a large weight streams faster through oneDNN even for one row
        big_x, big_w, big_b = _inputs((1,), 512, 2048, True)
        assert applies(big_x, big_w)
        torch.testing.assert_close(linear(big_x, big_w, big_b), F.linear(big_x, big_w, big_b), rtol=1e-5, atol=1e-5)
    x, w, b = _inputs((64,), 128, 512, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not applies(x, w)
        assert linear(x, w, b).dtype == torch.bfloat16
    assert not applies(x.double(), w.double())
    monkeypatch.setattr(linear_fast, "_ONEDNN", None)
    assert not applies(x, w)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))


def test_fast_models_use_fast_linear_eager_models_keep_nn_linear_same_state_dict():
    base = dict(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, vocab_size=50, mem_len=8)
    fast = TransformerXL(TransformerXLConfig(**base, backend="auto"))
    eager = TransformerXL(TransformerXLConfig(**base, backend="reference"))
    linears = [m for m in fast.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is FastLinear for m in linears)
    assert all(type(m) is nn.Linear for m in eager.modules() if isinstance(m, nn.Linear))
    assert fast.state_dict().keys() == eager.state_dict().keys()
    eager.load_state_dict(fast.state_dict())  # interchangeable checkpoints


@pytest.mark.slow
def test_torch_compile_of_a_fast_model_trains_a_step():
    """`compile = true` in a run config: inductor cannot lower the oneDNN op, so compiled graphs use
    F.linear (`applies` is False while compiling) and must still match the uncompiled model."""
    torch.manual_seed(0)
    cfg = TransformerXLConfig(n_layer=1, d_model=64, n_head=2, d_head=32, d_inner=128, vocab_size=64, mem_len=16,
                              dropout=0.0)
    model = TransformerXL(cfg)
    x = torch.randint(0, 64, (8, 64), generator=torch.Generator().manual_seed(1))
    assert any(applies(torch.empty(8 * 64, 64), m.weight) for m in model.modules() if isinstance(m, FastLinear))
    expected = model(x, labels=x).loss
    compiled = torch.compile(model)
    loss = compiled(x, labels=x).loss
    loss.backward()
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-4)
    assert all(p.grad is not None for p in model.blocks[0].ff.parameters())
