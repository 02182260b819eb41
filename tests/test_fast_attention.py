"""The fast path (`attention_impl="fast"` and the fast backend, `backend="auto"`) computes what the eager
reference (`attention_impl="eager"`, `backend="reference"`) computes.

Both models share weights; three segments with memory run in training mode (dropout 0, so the two
are deterministic) and then in evaluation mode. Logits must agree within 1e-5 and every parameter
gradient within 1e-4 relative (issue 6), for every positional encoding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from txl import TransformerXLConfig
from txl.fast import linear as fast_linear
from txl.fast.dropout import cheap_dropout
from txl.fast.memory import projection_key
from txl.models.transformer_xl.model import TransformerXL
from txl.nn.attention import KERNELS, resolve_kernel
from txl.nn.attention.xl_fast import fast_attention, rel_shift_fast
from txl.nn.positional import POSITIONAL_ENCODINGS, rel_shift_pad

ENCODINGS = list(POSITIONAL_ENCODINGS)  # every registered encoding: none escapes the parity test
VARIANTS = {
    "plain": {},
    "same_length": {"same_length": True},
    "clamp_len": {"clamp_len": 5},
    "pre_lnorm": {"pre_lnorm": True},
}
EXTRA = {"shaw": {"position_options": {"max_distance": 6}}}  # clipping active inside the span


def pair(**overrides) -> tuple[TransformerXL, TransformerXL]:
    base = dict(vocab_size=53, n_layer=2, d_model=32, n_head=4, d_head=8, d_inner=48, mem_len=12,
                dropout=0.0, dropatt=0.0)
    config = TransformerXLConfig(**{**base, **overrides})
    torch.manual_seed(0)
    eager = TransformerXL(config.replace(attention_impl="eager", backend="reference"))
    with torch.no_grad():  # non-trivial biases, u/v, LayerNorm shifts
        for p in eager.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    fast = TransformerXL(config.replace(attention_impl="fast"))
    fast.load_state_dict(eager.state_dict())
    return eager, fast


def run_segments(model, tokens, seg=6):
    """Three training segments with memory (loss backward each), then one evaluation segment."""
    model.train()
    model.zero_grad()
    memory, logits = None, []
    for s in range(3):
        x = tokens[:, s * seg : (s + 1) * seg]
        y = tokens[:, s * seg + 1 : (s + 1) * seg + 1]
        out = model(x, memory=memory, labels=y, return_logits=True)
        out.loss.backward()
        memory, logits = out.memory, [*logits, out.logits.detach()]
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.eval()
    with torch.no_grad():
        evaluated = model(tokens[:, 3 * seg : 4 * seg], memory=memory).logits
    return torch.cat(logits, 1), grads, evaluated


def projected(memory):
    """The key/value projections a memory carries (the fast backend's projection cache), or ()."""
    return getattr(memory, "projected", ())


def assert_same(eager, fast, batch=3):
    tokens = torch.randint(0, eager.config.vocab_size, (batch, 25), generator=torch.Generator().manual_seed(1))
    logits_e, grads_e, eval_e = run_segments(eager, tokens)
    logits_f, grads_f, eval_f = run_segments(fast, tokens)
    torch.testing.assert_close(logits_f, logits_e, atol=1e-5, rtol=0)
    torch.testing.assert_close(eval_f, eval_e, atol=1e-5, rtol=0)
    assert grads_e.keys() == grads_f.keys()
    for name, g in grads_e.items():
        rel = (grads_f[name] - g).norm() / g.norm().clamp(min=1e-12)
        assert rel < 1e-4, f"{name}: relative gradient difference {rel:.2e}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("pos", ENCODINGS)
def test_fast_matches_eager(pos, variant):
    eager, fast = pair(pos_encoding=pos, **EXTRA.get(pos, {}), **VARIANTS[variant])
    assert fast.blocks[0].attn.kernel is fast_attention
    assert_same(eager, fast)


@pytest.mark.skipif(fast_linear._ONEDNN is None, reason="no oneDNN linear on this machine")
@pytest.mark.parametrize("overrides", [{}, {"mem_len": 0}, {"pre_lnorm": True}])
@pytest.mark.parametrize("pos", ENCODINGS)
def test_fast_matches_eager_with_every_linear_through_onednn(pos, overrides, monkeypatch):
    """The parity test's shapes are below the oneDNN linear's break-even, so here every product goes
    through it. A Function output that is a view once carried a gradient-less `_base`, and the
    training kernel rebuilt keys and values from it: the key/value projection got no gradient at all
    in fp32 training at real sizes while every small-shape test passed."""
    monkeypatch.setattr(fast_linear, "MIN_MACS", 0)
    monkeypatch.setattr(fast_linear, "MIN_WEIGHT", 0)
    eager, fast = pair(pos_encoding=pos, **EXTRA.get(pos, {}), **overrides)
    x = torch.randn(2, 5, 32)
    assert fast_linear.applies(x, fast.blocks[0].attn.kv_proj.weight)
    assert_same(eager, fast)


def test_packed_kv_never_reads_a_base_that_autograd_does_not_track():
    """k and v as views of a tensor whose `_base` needs no gradient (a Function's view output): the
    packed tensor must still carry the gradient back to them."""
    from txl.nn.attention.xl_fast import packed_kv

    buffer = torch.randn(2 * 7, 2 * 4 * 8)  # (b·n, 2·h·d), as made inside a Function
    kv = buffer.view(2, 7, 64).requires_grad_()  # a requires-grad view whose _base needs no gradient
    assert kv._base is buffer and not buffer.requires_grad
    k, v = kv.view(2, 7, 2, 4, 8).permute(2, 0, 3, 1, 4).unbind(0)
    packed = packed_kv(k, v)
    assert packed.requires_grad
    (packed * torch.arange(packed.numel()).view_as(packed)).sum().backward()
    torch.testing.assert_close(kv.grad, torch.arange(kv.numel(), dtype=torch.float32).view_as(kv))


@pytest.mark.parametrize("overrides", [
    {"untie_r": True},
    {"pos_encoding": "shaw", "position_options": {"values": True, "max_distance": 4}},
    {"cutoffs": (20, 40), "div_val": 2},
    {"mem_len": 0},
])
def test_fast_matches_eager_more_settings(overrides):
    assert_same(*pair(**overrides))


def test_attention_dropout_path_matches_eager_given_the_same_random_stream(monkeypatch):
    import txl.nn.attention.xl_fast as fast_module

    # the fast kernel draws its attention-dropout mask from the cheap CPU source; given F.dropout's
    # stream instead, its composed path must compute exactly what the eager reference does
    monkeypatch.setattr(fast_module, "attention_dropout", lambda x, p, training: F.dropout(x, p, training))
    eager, fast = pair(dropatt=0.3)
    x = torch.randint(0, 53, (2, 10))
    outs = []
    for model in (eager, fast):
        model.train()
        torch.manual_seed(5)
        outs.append(model(x, labels=x).loss)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=0)


def test_chunked_evaluation_equals_one_chunk(monkeypatch):
    import txl.nn.attention.xl_fast as fast_module

    eager, fast = pair(n_head=4, mem_len=20)
    x = torch.randint(0, 53, (3, 30))
    with torch.no_grad():
        memory = fast.eval()(x[:, :20]).memory
        whole = fast(x[:, 20:], memory=memory).logits
        monkeypatch.setattr(fast_module, "EVAL_CHUNK_ELEMENTS", 10 * 30)  # one head of one row at a time
        chunked = fast(x[:, 20:], memory=memory).logits
        reference = eager.eval()(x[:, 20:], memory=memory).logits
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=0)
    torch.testing.assert_close(chunked, reference, atol=1e-5, rtol=0)


def test_auto_prefers_the_fast_kernel_on_the_cpu():
    """auto chooses per call by device (issue 46): the fast kernel on the CPU, a fused one on CUDA
    (tests/test_fused_attention.py tests the choice)."""
    assert KERNELS[("full", "fast")] is fast_attention
    assert resolve_kernel("full", "auto").kernels["cpu"] is fast_attention
    config = TransformerXLConfig(vocab_size=11, n_layer=1, d_model=8, n_head=2, d_head=4, d_inner=8)
    assert TransformerXL(config).blocks[0].attn.kernel.kernels["cpu"] is fast_attention


@pytest.mark.parametrize(("q_len", "k_len"), [(5, 5), (4, 9), (1, 7), (6, 13)])
def test_rel_shift_fast_gradient_equals_the_reference_on_causal_entries(q_len, k_len):
    raw = torch.randn(2, 3, q_len, k_len, dtype=torch.float64, requires_grad=True)
    dist = torch.arange(q_len)[:, None] + (k_len - q_len) - torch.arange(k_len)
    visible = (dist >= 0).to(torch.float64)  # upper-triangle entries are garbage in both shifts
    weights = torch.randn(2, 3, q_len, k_len, dtype=torch.float64) * visible
    (grad_ref,) = torch.autograd.grad((rel_shift_pad(raw) * weights).sum(), raw)
    (grad_fast,) = torch.autograd.grad((rel_shift_fast(raw) * weights).sum(), raw)
    torch.testing.assert_close(rel_shift_fast(raw) * visible, rel_shift_pad(raw) * visible)
    torch.testing.assert_close(grad_fast, grad_ref)


def test_bf16_autocast_is_finite_and_close_to_fp32():
    _, fast = pair(dropout=0.0)
    x = torch.randint(0, 53, (2, 24), generator=torch.Generator().manual_seed(2))
    fast.train()
    fp32 = fast(x[:, :12], labels=x[:, 1:13])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = fast(x[:, :12], labels=x[:, 1:13])
        second = fast(x[:, 12:23], memory=bf16.memory, labels=x[:, 13:24])
    bf16.loss.backward()
    assert torch.isfinite(bf16.logits).all() and torch.isfinite(second.logits).all()
    assert all(torch.isfinite(p.grad).all() for p in fast.parameters() if p.grad is not None)
    assert abs(bf16.loss.item() - fp32.loss.item()) < 0.02 * fp32.loss.item()
    probs32, probs16 = fp32.logits.softmax(-1), bf16.logits.float().softmax(-1)
    assert (probs32 - probs16).abs().max() < 0.02


def test_cheap_dropout_statistics_gradient_and_seeding():
    x = torch.ones(400, 500, requires_grad=True)
    y = cheap_dropout(x, 0.1, True)
    kept = (y > 0).float().mean().item()
    assert abs(kept - 0.9) < 0.005
    assert abs(y.mean().item() - 1.0) < 0.01  # survivors scaled by the exact inverse keep probability
    y.sum().backward()
    assert torch.equal(x.grad, y.detach())  # d/dx = the same mask and scale
    assert cheap_dropout(x, 0.1, False) is x and cheap_dropout(x, 0.0, True) is x
    torch.manual_seed(3)
    a = cheap_dropout(torch.ones(1000), 0.5, True)
    torch.manual_seed(3)
    b = cheap_dropout(torch.ones(1000), 0.5, True)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_relu_dropout_is_dropout_of_relu_with_the_same_random_numbers(dtype):
    from txl.fast.dropout import CheapDropout

    drop = CheapDropout(0.1)
    x = torch.randn(64, 300, dtype=dtype)
    x[0, :5] = 0.0  # relu's kink: zero gradient on both paths
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(5)
    reference = drop(torch.relu(a))
    torch.manual_seed(5)
    fused = drop.after_relu(b)
    assert torch.equal(fused, reference)
    upstream = torch.randn_like(reference)
    reference.backward(upstream)
    fused.backward(upstream)
    assert torch.equal(b.grad, a.grad)
    drop.eval()
    assert torch.equal(drop.after_relu(x.clone()), torch.relu(x))


def test_fast_kernel_drops_attention_from_the_cheap_source_unbiased(monkeypatch):
    import txl.nn.attention.xl_fast as fast_module
    from txl.nn.attention import Attention, AttentionMask

    calls = []

    def spy(x, p, training):
        calls.append((p, training))
        return cheap_dropout(x, p, training)

    monkeypatch.setattr(fast_module, "attention_dropout", spy)
    config = TransformerXLConfig(vocab_size=11, n_layer=1, d_model=16, n_head=2, d_head=8, d_inner=8,
                                 dropout=0.0, dropatt=0.5, attention_impl="fast")
    torch.manual_seed(0)
    layer = Attention(config)
    x = torch.randn(2, 5, 16)
    mask = AttentionMask(causal=False)  # the composed path, where attention dropout lives
    with torch.no_grad():
        expected = layer.eval()(x, mask=mask)[0]
        layer.train()
        torch.manual_seed(7)
        first = layer(x, mask=mask)[0]
        torch.manual_seed(7)
        again = layer(x, mask=mask)[0]
        draws = torch.stack([layer(x, mask=mask)[0] for _ in range(4000)])
    assert calls[:2] == [(0.5, False), (0.5, True)] and len(calls) == 4003  # eval: the identity
    assert torch.equal(first, again)  # seeded by torch.manual_seed, like F.dropout
    assert not torch.allclose(first, expected)  # something was dropped
    # the output is linear in the dropped probabilities (dropout 0 after o_proj): unbiased on average
    spread = draws.std(0) / 4000**0.5
    assert ((draws.mean(0) - expected).abs() < 5 * spread + 1e-6).all()


def test_fast_models_use_cheap_dropout_and_eager_models_keep_nn_dropout():
    from txl.fast.dropout import CheapDropout

    config = TransformerXLConfig(vocab_size=11, n_layer=1, d_model=8, n_head=2, d_head=4, d_inner=8, dropout=0.1)
    fast = TransformerXL(config)
    eager = TransformerXL(config.replace(backend="reference"))
    assert isinstance(fast.drop, CheapDropout) and isinstance(fast.blocks[0].ff.drop, CheapDropout)
    assert not any(isinstance(m, CheapDropout) for m in eager.modules())
    assert fast.state_dict().keys() == eager.state_dict().keys()


def test_projected_position_table_is_memoised_only_while_nothing_can_change_it():
    eager, fast = pair(mem_len=10)
    fast.eval()
    x = torch.randint(0, 53, (2, 10))
    with torch.no_grad():
        memory = fast(x).memory
        first = fast(x, memory=memory).logits
        cached = fast.pos._table_memo[0][1]
        assert fast(x, memory=memory).logits.equal(first)
        assert fast.pos._table_memo[0][1] is cached  # same length, weights and dtype: reused
        fast.pos.r_proj[0].weight.mul_(1.5)  # an in-place update (as an optimizer step) bumps the version
        changed = fast(x, memory=memory).logits
        eager.pos.r_proj[0].weight.mul_(1.5)
        reference = eager.eval()(x, memory=memory).logits
    assert fast.pos._table_memo[0][1] is not cached
    torch.testing.assert_close(changed, reference, atol=1e-5, rtol=0)
    fast.train()
    fast(x, memory=memory, labels=x).loss.backward()  # training never reads the memo
    assert fast.pos.r_proj[0].weight.grad is not None


@pytest.mark.parametrize("overrides", [{}, {"pre_lnorm": True}, {"same_length": True}, {"pos_encoding": "rope"}])
def test_token_by_token_inference_reuses_projections_and_matches_eager(overrides):
    eager, fast = pair(mem_len=9, **overrides)
    eager.eval(), fast.eval()
    x = torch.randint(0, 53, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        mem_e = eager(x[:, :6]).memory
        mem_f = fast(x[:, :6]).memory
        assert projected(mem_f) == ()  # a prompt segment keeps the plain memory
        for t in range(6, 20):  # one token at a time, memory full after a few steps
            out_e = eager(x[:, t : t + 1], memory=mem_e)
            out_f = fast(x[:, t : t + 1], memory=mem_f)
            torch.testing.assert_close(out_f.logits, out_e.logits, atol=1e-5, rtol=0)
            assert len(projected(out_f.memory)) == 2 and projected(out_e.memory) == ()
            assert projected(out_f.memory)[0].shape[1] == out_f.memory.length
            mem_e, mem_f = out_e.memory, out_f.memory


def test_projection_cache_is_dropped_when_the_weights_change_or_training():
    eager, fast = pair(mem_len=8)
    eager.eval(), fast.eval()
    x = torch.randint(0, 53, (1, 12))
    with torch.no_grad():
        memory = fast(x[:, 7:8], memory=fast(x[:, :7]).memory).memory
        assert memory.key == projection_key(fast, torch.float32)
        for model in (fast, eager):
            model.blocks[1].attn.kv_proj.weight.mul_(0.5)  # e.g. an optimizer step between calls
        assert projection_key(fast, torch.float32) != memory.key
        torch.testing.assert_close(fast(x[:, 8:9], memory=memory).logits,
                                   eager(x[:, 8:9], memory=memory).logits, atol=1e-5, rtol=0)
        long_segment = torch.randint(0, 53, (1, 2))  # a segment, not one token: memory stays at hidden size
        assert projected(fast(long_segment, memory=memory).memory) == ()
    fast.train()
    assert projected(fast(x[:, 8:9], memory=memory).memory) == ()
    assert memory.state_dict().keys() == {"memory.0", "memory.1"}  # derived data is never saved


def test_position_table_memo_follows_mode_and_arguments():
    eager, fast = pair(mem_len=10)
    fast.eval()
    x = torch.randint(0, 53, (1, 10))
    with torch.inference_mode():
        fast(x)  # memoises an inference tensor
    out = fast(x, labels=x)  # eval mode with autograd: must not reuse it (it could not be saved for backward)
    out.loss.backward()
    with torch.no_grad():
        table = fast.pos.prepare(k_len=7, clamp_len=3, device=x.device, dtype=torch.float32)["R"]
        assert fast.pos.prepare(k_len=7, clamp_len=3, device=x.device, dtype=torch.float32)["R"] is table
        fast.pos.train()
        assert fast.pos.prepare(k_len=7, clamp_len=3, device=x.device, dtype=torch.float32)["R"] is not table


@pytest.mark.parametrize("blocks", [2, 3, 4])  # 4 blocks of 6 queries: uneven edges 0, 2, 3, 4, 6
@pytest.mark.parametrize("variant", ["plain", "clamp_len", "same_length"])
def test_query_blocks_in_training_match_eager(monkeypatch, blocks, variant):
    """Training splits the queries into blocks that skip the causally masked keys (blocks of 1-2
    queries here, so the 6-token test segments really are split); results must not change."""
    import txl.nn.attention.xl_fast as fast_module

    monkeypatch.setattr(fast_module, "TRAIN_QUERY_BLOCKS", blocks)
    monkeypatch.setattr(fast_module, "TRAIN_MIN_BLOCK", 1)
    calls = []
    original = fast_module._XLAttention.apply
    monkeypatch.setattr(fast_module._XLAttention, "apply", lambda *a: calls.append(len(a[5]) - 1) or original(*a))
    assert_same(*pair(**VARIANTS[variant]))
    assert calls  # training went through the blocked kernel
    expected = 1 if variant == "same_length" else blocks  # same_length masks the left: one block
    assert set(calls) == {expected}, calls


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_context_projection_matches_linear_and_skips_only_the_memory_rows(precision):
    """`project_context` = F.linear(cat(memory, x)) with gradients for x and the weight only."""
    from txl.fast.projection import project_context

    torch.manual_seed(0)
    memory, x = torch.randn(2, 5, 8), torch.randn(2, 3, 8, requires_grad=True)
    weight = torch.randn(12, 8, requires_grad=True)
    x_ref, weight_ref = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    upstream = torch.randn(2, 8, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        fast = project_context(torch.cat([memory, x], dim=1), x, weight)
        ref = torch.nn.functional.linear(torch.cat([memory, x_ref], dim=1), weight_ref)
    assert fast.dtype == ref.dtype
    (fast.float() * upstream).sum().backward()
    (ref.float() * upstream).sum().backward()
    tol = 1e-6 if precision == "fp32" else 2e-2
    torch.testing.assert_close(fast.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(weight.grad, weight_ref.grad, rtol=tol, atol=tol * 10)
    assert x.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32


@pytest.mark.parametrize("edges", [[0, 5], [0, 2, 5], [0, 1, 3, 5]])
def test_blocked_kernel_in_bf16_matches_fp32_on_the_same_inputs(edges):
    """The bf16 backward has its own layout (transposed key/value accumulators): pin it against the fp32
    kernel on bf16-representable inputs. A wrong slice or shift gives O(1) errors; bf16 rounding
    stays within a few percent of each gradient's scale."""
    from txl.nn.attention.xl_fast import _XLAttention

    torch.manual_seed(0)
    b, h, i, n, d = 2, 3, 5, 9, 8
    inputs = [torch.randn(b, h, i, d), torch.randn(b, h, i, d), torch.randn(b, n, 2 * h * d), torch.randn(h, n, d)]
    inputs = [t.bfloat16().float() for t in inputs]
    upstream = torch.randn(b, h, i, d).bfloat16()
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        leaves = [t.to(dtype).clone().requires_grad_() for t in inputs]
        out = _XLAttention.apply(*leaves, d**-0.5, edges, None)
        out.backward(upstream.to(dtype))
        results[dtype] = [out.float()] + [t.grad.float() for t in leaves]
    for exact, low in zip(results[torch.float32], results[torch.bfloat16]):
        assert (low - exact).abs().max() <= 0.03 * exact.abs().max() + 1e-3


def test_scratch_buffers_made_in_inference_mode_serve_training_afterwards():
    """The kernel's per-thread scratch buffers outlive a call: one first made under inference_mode must
    still be writable by a training step (an inference tensor would refuse in-place writes)."""
    import txl.nn.attention.xl_fast as fast_module

    fast_module._workspaces.__dict__.clear()
    _, fast = pair(mem_len=8)
    x = torch.randint(0, 53, (2, 30), generator=torch.Generator().manual_seed(6))
    fast.eval()
    with torch.inference_mode():  # a long evaluation segment: a scratch buffer larger than training needs
        fast(x[:, 8:28], memory=fast(x[:, :8]).memory)
    assert fast_module._workspaces.__dict__  # the evaluation made a scratch buffer
    fast.train()
    out = fast(x[:, 8:12], memory=fast(x[:, :8]).memory, labels=x[:, 9:13])
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in fast.parameters() if p.grad is not None)
