"""txl on a CUDA GPU (issue 46 item 6): the same numbers as on the CPU, and the half-precision paths
that only matter there. Marked `cuda`; every test skips without a GPU.

Run on a GPU machine with `pytest -m cuda tests/test_cuda.py` (`scripts/device_check.sh` does, and
keeps the whole file under ~90 s). TXL_CUDA_TEST_DEVICE=cpu runs the same code on the CPU (the
comparisons are then CPU against CPU), which checks the tests themselves on a machine without a GPU.
With TXL_CUDA_REPORT=PATH each comparison appends its measured differences to PATH as JSON lines, so
the device check reports the figures of the tests that passed, not only the verdicts.

Tolerances: fp32 with TF32 off differs from the CPU only by the order of summation (~1e-6 relative);
bf16 keeps 8 bits of mantissa, so its losses are compared to fp32 within 2% and its gradients by
direction (cosine similarity).
"""

from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch

import helpers
from helpers import finish, train_losses, txl, write_config
from txl import TransformerXLConfig
from txl.generate.decoder import generate, generate_rerun
from txl.io import open_append, read_json
from txl.models.transformer_xl.model import TransformerXL
from txl.nn.memory import Memory

DEVICE = os.environ.get("TXL_CUDA_TEST_DEVICE", "cuda")

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
corpus, cache_dir = helpers.corpus, helpers.cache_dir  # fixtures

IMPLS = ["eager", "fast"]
SMALL = dict(vocab_size=97, n_layer=3, d_model=64, n_head=4, d_head=16, d_inner=128, mem_len=16, dropout=0.0)


@pytest.fixture(autouse=True, scope="module")
def _full_fp32():
    """fp32 products in full precision (TF32 off) and one CPU thread for the CPU side."""
    precision, threads = torch.get_float32_matmul_precision(), torch.get_num_threads()
    torch.set_float32_matmul_precision("highest")
    torch.set_num_threads(1)
    yield
    torch.set_float32_matmul_precision(precision)
    torch.set_num_threads(threads)


def record(test: str, **figures) -> None:
    """Append one test's measured figures to $TXL_CUDA_REPORT (JSON lines), if it is set."""
    path = os.environ.get("TXL_CUDA_REPORT")
    if path:
        with open_append(path) as f:
            f.write(json.dumps({"test": test, "device": DEVICE, **figures}) + "\n")


def build(impl: str = "eager", seed: int = 0, **overrides) -> TransformerXL:
    torch.manual_seed(seed)
    backend = "reference" if impl == "eager" else "auto"
    config = TransformerXLConfig(**{**SMALL, "attention_impl": impl, "backend": backend, **overrides})
    return TransformerXL(config)


def segments(n: int = 3, *, batch: int = 3, tgt_len: int = 12, vocab: int = 97, seed: int = 1):
    stream = torch.randint(0, vocab, (batch, n * tgt_len + 1), generator=torch.Generator().manual_seed(seed))
    return [(stream[:, i * tgt_len : (i + 1) * tgt_len], stream[:, i * tgt_len + 1 : (i + 1) * tgt_len + 1])
            for i in range(n)]


def run_segments(model, parts, device, *, precision: str = "fp32"):
    """Logits, losses and memories over consecutive segments with memory, and the gradients of the
    summed losses (the memory is detached between segments, as in training)."""
    model.zero_grad(set_to_none=True)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    memory, logits, losses, memories = None, [], [], []
    for inputs, labels in parts:
        with torch.autocast(torch.device(device).type, dtype=dtype or torch.float32, enabled=dtype is not None):
            out = model(inputs.to(device), memory=memory, labels=labels.to(device), return_logits=True)
        out.loss.backward()
        memory = out.memory
        logits.append(out.logits.float().detach().cpu())
        losses.append(float(out.loss.detach()))
        memories.append([h.float().cpu() for h in memory.hidden])
    grads = {name: p.grad.float().cpu() for name, p in model.named_parameters() if p.grad is not None}
    return logits, losses, memories, grads


def max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def grad_error(grads, reference) -> float:
    """The largest ||g - g_ref|| / (||g_ref|| + 1e-6) over the parameters."""
    assert grads.keys() == reference.keys()
    return max(float((grads[k] - reference[k]).norm() / (reference[k].norm() + 1e-6)) for k in reference)


@pytest.mark.parametrize("impl", IMPLS)
def test_model_on_the_gpu_equals_the_cpu_with_memory_over_segments(impl):
    cpu_model = build(impl).train()
    gpu_model = copy.deepcopy(cpu_model).to(DEVICE)
    parts = segments()
    cpu = run_segments(cpu_model, parts, "cpu")
    gpu = run_segments(gpu_model, parts, DEVICE)
    figures = dict(logits=max_diff(gpu[0], cpu[0]), loss=max(abs(a - b) for a, b in zip(gpu[1], cpu[1])),
                   memory=max(max_diff(a, b) for a, b in zip(gpu[2], cpu[2])), grad_rel=grad_error(gpu[3], cpu[3]))
    record(f"gpu_equals_cpu[{impl}]", **figures)
    assert figures["logits"] < 1e-4 and figures["loss"] < 1e-5 and figures["memory"] < 1e-4, figures
    assert figures["grad_rel"] < 1e-4, figures


def test_fast_attention_equals_eager_on_the_gpu():
    """The fast kernel and backend against the eager reference, both on the device, with memory."""
    eager = build("eager").to(DEVICE).train()
    fast = build("fast").to(DEVICE).train()
    fast.load_state_dict(eager.state_dict())
    parts = segments()
    a, b = run_segments(eager, parts, DEVICE), run_segments(fast, parts, DEVICE)
    figures = dict(logits=max_diff(b[0], a[0]), memory=max(max_diff(x, y) for x, y in zip(b[2], a[2])),
                   grad_rel=grad_error(b[3], a[3]))
    record("fast_equals_eager", **figures)
    assert figures["logits"] < 1e-4 and figures["memory"] < 1e-4, figures
    assert figures["grad_rel"] < 1e-4, figures


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_autocast_forward_and_backward_are_finite_and_close_to_fp32(impl):
    model = build(impl).to(DEVICE).train()
    parts = segments()
    full = run_segments(model, parts, DEVICE)
    half = run_segments(model, parts, DEVICE, precision="bf16")
    assert all(math.isfinite(x) for x in half[1]) and all(torch.isfinite(g).all() for g in half[3].values())
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(half[1], full[1]))
    cosine = min(float(torch.nn.functional.cosine_similarity(half[3][k].flatten(), full[3][k].flatten(), dim=0))
                 for k in full[3] if full[3][k].norm() > 1e-6)
    record(f"bf16_close_to_fp32[{impl}]", loss_rel=loss_rel, min_grad_cosine=cosine)
    assert loss_rel < 2e-2, loss_rel
    assert cosine > 0.95, cosine


@pytest.mark.parametrize("impl", IMPLS)
def test_cached_generation_equals_uncached_on_the_gpu(impl):
    """Greedy generation with memory reuse = re-running the whole context each token (init_std 0.3:
    logits far from uniform, so no near-tie that rounding could flip)."""
    model = build(impl, mem_len=400, init_std=0.3, vocab_size=256, n_layer=2, d_model=32, n_head=2, d_head=16,
                  d_inner=64).to(DEVICE).eval()
    prompt = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    reused = generate(model, prompt, max_new_tokens=64, temperature=0.0, mem_len=400, segment_len=64)
    rerun = generate_rerun(model, prompt, max_new_tokens=64)
    record(f"cached_generation[{impl}]", tokens=len(reused), equal=reused == rerun)
    assert reused == rerun
    assert len(set(reused)) > 5  # not a degenerate constant stream


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("impl", IMPLS)
def test_adaptive_softmax_under_half_autocast_is_finite(impl, precision):
    """div_val > 1 under fp16/bf16 autocast (Hugging Face's TransfoXL fails there, transformers #19914)."""
    model = build(impl, vocab_size=300, cutoffs=[40, 120], div_val=2, d_model=64).to(DEVICE).train()
    parts = segments(vocab=300)
    full = run_segments(model, parts, DEVICE)
    half = run_segments(model, parts, DEVICE, precision=precision)
    assert all(math.isfinite(x) for x in half[1]), half[1]
    assert all(torch.isfinite(g).all() for g in half[3].values())
    assert all(torch.isfinite(x).all() for x in half[0])  # log-probabilities of every cluster
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(half[1], full[1]))
    record(f"adaptive_half[{impl},{precision}]", loss_rel=loss_rel)
    assert loss_rel < 2e-2, loss_rel


# Fused attention (txl.nn.attention.fused) against the eager reference, both on the device. Few cases:
# on CUDA every new shape and dtype of a flex call compiles Triton kernels (forward and backward).
FUSED_CASES = [
    ("full", "sdpa", "xl"), ("full", "flex", "xl"), ("full", "sdpa", "rope"), ("full", "sdpa", "t5"),
    ("full", "auto", "xl"), ("sliding", "flex", "xl"), ("sliding", "sdpa", "alibi"),
]
SLIDING_OPTIONS = {"sliding": {"window": 8}}


@pytest.fixture
def _flex_cpu_backward(monkeypatch):
    """With TXL_CUDA_TEST_DEVICE=cpu: FlexAttention's math backward, which torch refuses on the CPU."""
    if DEVICE == "cpu":
        from txl.nn.attention import fused

        monkeypatch.setattr(fused, "FLEX_CPU_BACKWARD", True)
        monkeypatch.setattr(torch.nn.attention.flex_attention, "_validate_device", lambda *tensors: None)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(("attention", "impl", "pos"), FUSED_CASES)
def test_fused_attention_equals_eager_on_the_gpu(attention, impl, pos, precision, _flex_cpu_backward):
    """sdpa / flex (and auto, which is sdpa on CUDA for full) against eager on the device, with memory
    over 3 segments: fp32 within 1e-4 (logits, memory, relative gradients); bf16 autocast within 2% of
    eager fp32 (losses), gradients by direction, and no further from it than eager bf16 is, times 2."""
    overrides = dict(attention=attention, pos_encoding=pos, attention_options=SLIDING_OPTIONS.get(attention))
    eager = build("eager", **overrides).to(DEVICE).train()
    fused = build(impl, **overrides).to(DEVICE).train()
    fused.load_state_dict(eager.state_dict())
    parts = segments()
    reference = run_segments(eager, parts, DEVICE)
    if precision == "fp32":
        got = run_segments(fused, parts, DEVICE)
        figures = dict(logits=max_diff(got[0], reference[0]), memory=max(max_diff(x, y) for x, y in zip(got[2], reference[2])),
                       grad_rel=grad_error(got[3], reference[3]))
        record(f"fused_equals_eager[{attention},{impl},{pos},fp32]", **figures)
        assert figures["logits"] < 1e-4 and figures["memory"] < 1e-4, figures
        assert figures["grad_rel"] < 1e-4, figures
        return
    got = run_segments(fused, parts, DEVICE, precision="bf16")
    eager_half = run_segments(eager, parts, DEVICE, precision="bf16")
    assert all(math.isfinite(x) for x in got[1]) and all(torch.isfinite(g).all() for g in got[3].values())

    def loss_rel(run):
        return max(abs(a - b) / abs(b) for a, b in zip(run[1], reference[1]))

    def cosine(run):
        return min(float(torch.nn.functional.cosine_similarity(run[3][k].flatten(), reference[3][k].flatten(), dim=0))
                   for k in reference[3] if reference[3][k].norm() > 1e-6)

    figures = dict(loss_rel=loss_rel(got), eager_bf16_loss_rel=loss_rel(eager_half), min_grad_cosine=cosine(got),
                   eager_bf16_min_grad_cosine=cosine(eager_half))
    record(f"fused_equals_eager[{attention},{impl},{pos},bf16]", **figures)
    assert figures["loss_rel"] < 2e-2 and figures["loss_rel"] <= 2 * figures["eager_bf16_loss_rel"] + 1e-3, figures
    assert figures["min_grad_cosine"] > 0.95, figures


def test_auto_takes_the_fused_kernel_on_cuda():
    from txl.nn.attention import registry

    expected = registry.CUDA_AUTO["full"] if torch.device(DEVICE).type == "cuda" else "fast"
    assert registry.auto_impl("full", torch.device(DEVICE).type) == expected


def test_memory_stays_on_the_device_under_autocast():
    model = build("fast").to(DEVICE).eval()
    with torch.no_grad(), torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        out = model(torch.randint(0, 97, (2, 8), device=DEVICE), memory=Memory.zeros(3, 2, 16, 64, device=DEVICE))
    assert all(h.device.type == torch.device(DEVICE).type for h in out.memory.hidden)
    assert out.memory.length == 16


# ---------------------------------------------------------------------------------------------
# `txl train --device cuda` (subprocesses, the way a user runs it)

STEADY = ["--set", "schedule=constant", "--set", "warmup_steps=0"]  # the LR does not depend on max_steps


def train(*args, timeout: float = 180) -> str:
    code, log = finish(txl("train", "--device", DEVICE, "--quiet", *args), timeout=timeout)
    assert code == 0, log
    return log


def test_train_on_the_gpu_then_resume_equals_an_uninterrupted_run(tmp_path, corpus):
    config = write_config(tmp_path, corpus, steps=6, dropout=0.1)
    train("--config", str(config), "--out", str(tmp_path / "whole"), *STEADY)
    train("--config", str(config), "--out", str(tmp_path / "part"), "--max-steps", "3", *STEADY)
    train("--resume", str(tmp_path / "part"), "--max-steps", "6")
    whole, part = train_losses(tmp_path / "whole"), train_losses(tmp_path / "part")
    assert sorted(whole) == sorted(part) == list(range(1, 7))
    worst = max(abs(whole[s] - part[s]) for s in whole)
    record("train_resume", max_loss_diff=worst, losses=[whole[s] for s in sorted(whole)])
    assert worst < 1e-3, (whole, part)  # CUDA reductions may differ in order between runs
    state = read_json(tmp_path / "part" / "last" / "trainer_state.json", what="trainer state")
    assert state["step"] == 6


@pytest.mark.parametrize("precision", ["fp16", "auto"])
def test_train_in_half_precision_on_the_gpu(tmp_path, corpus, precision):
    """fp16 trains through the gradient scaler; auto picks bf16 on compute capability >= 8."""
    config = write_config(tmp_path, corpus, steps=3, dropout=0.1)
    train("--config", str(config), "--out", str(tmp_path / "run"), "--set", f"precision={precision}")
    losses = train_losses(tmp_path / "run")
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(x) for x in losses.values()), losses
    used = read_json(tmp_path / "run" / "run.json", what="run file")["precision"]  # what `auto` became
    record(f"train_{precision}", precision_used=used, losses=list(losses.values()))
    if precision == "fp16":
        assert used == "fp16"
    elif DEVICE == "cuda" and torch.cuda.get_device_capability()[0] >= 8:
        assert used == "bf16"
