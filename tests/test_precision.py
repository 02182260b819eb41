"""Mixed precision (issue 46, item 4): `precision="auto"` chooses by device, and the adaptive softmax
runs under fp16 autocast.

The CUDA decision is tested without a GPU, on faked device properties. The fp16 test runs on the CPU
(torch.autocast("cpu", dtype=torch.float16): the same autocast op lists decide which products run in
half precision); tests/test_cuda.py repeats it on a GPU.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import txl.eval.precision as precision
from txl import TransformerXLConfig
from txl.models.transformer_xl.model import TransformerXL


def fake_cuda(monkeypatch, major: int, *, hip: str | None = None) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(major=major, minor=0))
    monkeypatch.setattr(torch.version, "hip", hip)


@pytest.mark.parametrize(("major", "chosen"), [(9, "bf16"), (8, "bf16"), (7, "fp16"), (6, "fp16")])
def test_auto_is_bf16_from_compute_capability_8_and_fp16_before(monkeypatch, major, chosen):
    fake_cuda(monkeypatch, major)  # H100 9.0, A100 8.0, V100 7.0 / T4 7.5, P100 6.0
    assert precision.resolve_precision("auto", torch.device("cuda")) == chosen
    assert precision.resolve_precision("auto", torch.device("cuda:1")) == chosen
    for given in ("fp32", "bf16", "fp16"):  # an explicit choice is kept
        assert precision.resolve_precision(given, torch.device("cuda")) == given


def test_auto_on_rocm_is_bf16(monkeypatch):
    fake_cuda(monkeypatch, 9, hip="6.0")
    assert precision.resolve_precision("auto", torch.device("cuda")) == "bf16"


def test_auto_on_the_cpu_is_unchanged(monkeypatch):
    fake_cuda(monkeypatch, 7)  # a GPU in the machine does not change the CPU's choice
    for fast in (True, False):
        monkeypatch.setattr(precision, "fast_bf16", lambda device, fast=fast: fast)
        assert precision.resolve_precision("auto", torch.device("cpu")) == ("bf16" if fast else "fp32")


def test_fp16_autocast_context_is_half():
    with precision.autocast(torch.device("cpu"), "fp16"):
        assert torch.get_autocast_dtype("cpu") == torch.float16 and torch.is_autocast_enabled("cpu")


# ---------------------------------------------------------------------------------------------
# The adaptive softmax and embedding in fp16 (Hugging Face's TransfoXL fails with div_val != 1:
# index_copy_ of half rows into a float32 buffer, transformers #19914)

VOCAB = 300


def adaptive_model(div_val: int, backend: str) -> TransformerXL:
    torch.manual_seed(0)
    config = TransformerXLConfig(vocab_size=VOCAB, n_layer=2, d_model=64, n_head=4, d_head=16, d_inner=96, mem_len=8,
                                 dropout=0.0, cutoffs=[40, 120], div_val=div_val, d_embed=64, backend=backend)
    return TransformerXL(config).train()


def two_segments(model, tokens, dtype, scale=1.0):
    """(loss per segment, log-probs per segment, gradients) over two segments with memory, under
    autocast to `dtype` (None: fp32), the loss multiplied by `scale` before the backward pass and the
    gradients divided by it after."""
    model.zero_grad()
    losses, scores, memory = [], [], None
    for part in (tokens[:, :8], tokens[:, 8:16]):
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            out = model(part, memory=memory, labels=part.roll(-1, 1), return_logits=True)  # every cluster scored
        (out.loss * scale).backward()
        losses.append(out.loss.item())
        scores.append(out.logits.detach().float())
        memory = out.memory
    grads = {name: p.grad.detach() / scale for name, p in model.named_parameters() if p.grad is not None}
    return losses, scores, grads


def scaled_fp16(model, tokens):
    """fp16 as the trainer runs it: the loss scaled by torch.amp.GradScaler's scale, which starts at 2^16
    and halves after every step whose gradients overflow (that step is skipped). Without a scale,
    gradients of 1e-7 (the query projection's at initialisation, where attention is near uniform) are
    below fp16's smallest normal number (6.1e-5) and vanish. Returns two_segments' result and the scale."""
    scale = 2.0**16
    while True:
        result = two_segments(model, tokens, torch.float16, scale)
        if all(torch.isfinite(g).all() for g in result[2].values()):
            return result, scale
        scale /= 2


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("div_val", [2, 4])
def test_adaptive_softmax_forward_and_backward_under_fp16_autocast(div_val, backend):
    """Finite and close to fp32. Tolerances: fp16 keeps 11 significant bits (a relative rounding of 4.9e-4
    per operation), accumulated over two layers, a projection per cluster and the log-softmax (in fp32,
    as the head computes it): losses within 1e-3 relative (measured 5e-7), log-probabilities within
    1e-2 absolute of values near -5.7 (measured 3.6e-5), each gradient's norm within 1% of fp32's
    (measured 0.2%, with the loss scaled as the trainer does)."""
    model = adaptive_model(div_val, backend)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    tokens[0, :6] = torch.tensor([1, 50, 130, 299, 41, 119])  # every cluster, its edges included
    full_losses, full_scores, full_grads = two_segments(model, tokens, None)
    (half_losses, half_scores, half_grads), scale = scaled_fp16(model, tokens)
    assert scale >= 2.0**12, scale  # at most a few skipped steps before the scale settles

    assert all(math.isfinite(x) for x in half_losses), half_losses
    for half, full in zip(half_losses, full_losses, strict=True):
        assert abs(half - full) <= 1e-3 * abs(full), (half, full)
    for half, full in zip(half_scores, full_scores, strict=True):
        assert torch.isfinite(half).all() and half.shape == (2, 8, VOCAB)
        torch.testing.assert_close(half, full, atol=1e-2, rtol=0)
        # each row is a distribution over the whole vocabulary (log-sum-exp 0)
        torch.testing.assert_close(half.logsumexp(-1), torch.zeros(2, 8), atol=1e-3, rtol=0)
    assert half_grads.keys() == full_grads.keys()
    for name, grad in half_grads.items():
        assert torch.isfinite(grad).all(), name
        full = full_grads[name].norm().item()
        assert abs(grad.float().norm().item() - full) <= 1e-2 * full, name
