"""Issue 48's kernels A: Linformer's key-value and layer-wise sharing (Wang et al. 2020), the Sparse
Transformer's fixed pattern (Child et al. 2019), the Synthesizer's factorized variants (Tay et al. 2021) and
the Image Transformer's 1-D local attention (Parmar et al. 2018). Each against a reference written from the
paper's rule (pair by pair in float64, or the formula), fast = eager with gradients, and in a model with small
options: causality, segment invariance with memory and generation with memory where the kernel is causal
(Linformer is not), padding, a three-step training run. (tests/test_kernels.py runs the registry-wide
invariants on every kernel with its default options.)"""

from __future__ import annotations

import copy

import pytest
import torch

from txl import ConfigError, TransformerXLConfig
from txl.models.transformer_xl.model import TransformerXL
from txl.nn.attention.image_local import ImageLocalAttention, ImageLocalReference
from txl.nn.attention.linformer import LinformerAttention
from txl.nn.attention.masks import CAUSAL, AttentionMask
from txl.nn.attention.sparse import (
    SparseFixedAttention,
    SparseFixedReference,
    SparseStridedAttention,
    SparseStridedReference,
)
from txl.nn.attention.synthesizer import SynthesizerAttention, SynthesizerReference, grid_shape
from txl.nn.positional import CONTENT_ONLY

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(vocab_size=61, n_layer=2, d_model=32, n_head=4, d_head=8, d_inner=48, mem_len=32, dropout=0.0,
            dropatt=0.0, pos_encoding="rope")
SMALL = {
    "sparse": dict(stride=4, pattern="fixed", summary=2),
    "image-local": dict(query_block=4, memory_block=3),
    "synthesizer": dict(max_len=6, mode="factorized-dense"),
    "linformer": dict(k=8, max_len=32, sharing="key-value"),
}


def config(name: str, *, causal: bool = True, **overrides) -> TransformerXLConfig:
    extra = {} if causal else dict(causal=False, mem_len=0)
    options = {**SMALL[name], **{k: overrides.pop(k) for k in list(overrides) if k in SMALL[name] or k in
                                 ("factors", "rank")}}
    return TransformerXLConfig(**{**BASE, **extra, "attention": name, "attention_options": options, **overrides})


def qkv(n: int, i: int, *, seed: int = 0, grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 4, length, 8, generator=g).requires_grad_(grad) for length in (i, n, n)]


def attend(kernel, q, k, v, mask=CAUSAL, positions=CONTENT_ONLY):
    return kernel(q, k, v, positions=positions, mask=mask, dropatt=0.0, training=False)[0]


def loop_attention(q, k, v, sees, score=None):
    """softmax over the keys `sees(head, query_pos, key_pos)` holds of q·k/sqrt(d) (or of
    `score(head, row, key_pos)` alone), row by row in float64; a row that sees nothing is 0."""
    b, h, i, d = q.shape
    n = v.shape[2]
    out = torch.zeros(b, h, i, d, dtype=torch.float64)
    for head in range(h):
        for row in range(i):
            p = row + n - i
            keys = [j for j in range(n) if sees(head, p, j)]
            if not keys:
                continue
            if score is None:
                s = torch.stack([(q[:, head, row].double() * k[:, head, j].double()).sum(-1) / d**0.5 for j in keys], -1)
            else:
                s = torch.stack([score(head, row, p, j) for j in keys], -1)
            w = s.softmax(-1)
            out[:, head, row] = sum(w[:, t:t + 1] * v[:, head, j].double() for t, j in enumerate(keys))
    return out


def build(cfg: TransformerXLConfig, seed: int = 0) -> TransformerXL:
    torch.manual_seed(seed)
    model = TransformerXL(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def fast_equals_eager(fast, eager, n, i, mask, *, params=()):
    """Outputs 1e-5 and gradients (q, k, v and the named parameters) 1e-4 of two kernels on the same inputs."""
    outs, grads = [], []
    for kernel in (fast, eager):
        q, k, v = qkv(n, i, grad=True)
        out = attend(kernel, q, k, v, mask)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append(out)
        grads.append([q.grad, k.grad, v.grad] + [dict(kernel.named_parameters())[p].grad for p in params])
        kernel.zero_grad()
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def padded_mask(n: int, *, causal: bool = True, window: int | None = None) -> AttentionMask:
    padding = torch.ones(2, n, dtype=torch.bool)
    padding[1, :3] = False  # a left-padded row
    return AttentionMask(causal=causal, key_padding=padding, window=window)


# ---------------------------------------------------------------------------------------------
# Linformer: key-value and layer-wise sharing


def linformer_model(sharing: str, n_layer: int = 3) -> TransformerXL:
    return build(config("linformer", causal=False, sharing=sharing, n_layer=n_layer, pos_encoding="learned"))


def test_linformer_key_value_sharing_is_the_formula_with_one_matrix():
    """softmax(q (E K)ᵀ / sqrt(d)) (E V): E projects both the keys and the values (Wang et al. §4)."""
    kernel = LinformerAttention(config("linformer", causal=False, sharing="key-value"))
    assert kernel.value_projection is None and [n for n, _ in kernel.named_parameters()] == ["key_projection"]
    q, k, v = qkv(20, 20)
    e = kernel.key_projection.detach()[:, :20].double()
    keys, values = torch.einsum("rj,bhjd->bhrd", e, k.double()), torch.einsum("rj,bhjd->bhrd", e, v.double())
    expected = (q.double() @ keys.transpose(-1, -2) / 8**0.5).softmax(-1) @ values
    got = attend(kernel, q, k, v, AttentionMask(causal=False))
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_linformer_headwise_stays_the_default_with_two_matrices():
    kernel = LinformerAttention(config("linformer", causal=False, sharing="headwise"))
    assert [n for n, _ in kernel.named_parameters()] == ["key_projection", "value_projection"]
    default = TransformerXLConfig(**{**BASE, "causal": False, "mem_len": 0, "attention": "linformer"})
    assert default.attention_options.sharing == "headwise"  # configs saved before the option keep E and F


def test_linformer_layerwise_sharing_holds_one_matrix_for_the_whole_stack():
    model = linformer_model("layerwise")
    names = [name for name in model.state_dict() if "kernel" in name]
    assert names == ["blocks.0.attn.kernel.key_projection"]
    first = model.blocks[0].attn.kernel.key_projection
    for block in model.blocks:
        e, f = block.attn.kernel.projections()
        assert e is first and f is first
    assert sum(p is first for p in model.parameters()) == 1  # the optimizer sees it once
    copied = copy.deepcopy(model)  # (averaging, EMA) the copy's layers share the copy's E
    own = copied.blocks[0].attn.kernel.key_projection
    assert own is not first and all(block.attn.kernel.projections()[0] is own for block in copied.blocks)


def test_linformer_layerwise_equals_key_value_with_equal_matrices_and_sums_their_gradients():
    """One E for all layers is the key-value model whose per-layer E are the same matrix: the same logits
    (1e-5), and the shared E's gradient is the sum of the per-layer gradients (1e-4)."""
    shared, separate = linformer_model("layerwise"), linformer_model("key-value")
    state = {k: v for k, v in separate.state_dict().items() if "kernel" not in k}
    shared.load_state_dict({**state, "blocks.0.attn.kernel.key_projection": shared.blocks[0].attn.kernel.key_projection})
    with torch.no_grad():
        for block in separate.blocks:
            block.attn.kernel.key_projection.copy_(shared.blocks[0].attn.kernel.key_projection)
    x = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(2))
    outs = []
    for model in (shared, separate):
        out = model(x[:, :-1], labels=x[:, 1:], mem_len=0)
        out.loss.backward()
        outs.append(out.logits)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    total = sum(block.attn.kernel.key_projection.grad for block in separate.blocks)
    torch.testing.assert_close(shared.blocks[0].attn.kernel.key_projection.grad, total, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("sharing", ["key-value", "layerwise"])
def test_linformer_shared_models_reload_from_their_state_dict(sharing):
    model = linformer_model(sharing)
    fresh = linformer_model(sharing)
    fresh.load_state_dict(model.state_dict(), strict=True)
    x = torch.randint(0, 61, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(fresh(x, mem_len=0).logits, model(x, mem_len=0).logits, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Sparse Transformer: the fixed pattern


def fixed_sees(l: int, c: int):
    def sees(head, p, j):
        if j > p:
            return False
        if head < 2:  # block heads (the first ceil(4/2))
            return j // l == p // l
        return j % l >= l - c  # summary heads

    return sees


@pytest.mark.parametrize(("n", "i"), [(23, 23), (31, 17), (9, 1), (16, 16)])
@pytest.mark.parametrize(("l", "c"), [(4, 1), (4, 2), (5, 5)])
@pytest.mark.parametrize("kernel", [SparseFixedAttention, SparseFixedReference])
def test_sparse_fixed_equals_its_pair_by_pair_definition(n, i, l, c, kernel):
    q, k, v = qkv(n, i)
    got = attend(kernel(config("sparse", stride=l, summary=c)), q, k, v)
    torch.testing.assert_close(got.double(), loop_attention(q, k, v, fixed_sees(l, c)), atol=1e-5, rtol=1e-5)


def test_sparse_pattern_option_picks_the_kernel_and_strided_stays_the_default():
    fixed = config("sparse")
    assert type(SparseStridedAttention(fixed)) is SparseFixedAttention
    assert type(SparseStridedReference(fixed)) is SparseFixedReference
    strided = config("sparse", pattern="strided")
    assert type(SparseStridedAttention(strided)) is SparseStridedAttention
    from txl.nn.attention.fused import SparseFlex, SparseSDPA
    from txl.nn.attention.registry import resolve_kernel

    for fused in (SparseSDPA, SparseFlex, resolve_kernel("sparse", "auto")):  # they cover the strided bands only
        assert type(fused(fixed)) is SparseFixedAttention
        assert isinstance(fused(strided), SparseStridedAttention) and not isinstance(fused(strided), SparseFixedReference)
    assert TransformerXLConfig(**{**BASE, "attention": "sparse"}).attention_options.pattern == "strided"


@pytest.mark.parametrize(("n", "i", "window"), [(26, 26, None), (30, 11, None), (30, 11, 9)])
def test_sparse_fixed_fast_equals_eager_with_gradients_padding_and_window(n, i, window):
    cfg = config("sparse", stride=5, summary=2)
    fast_equals_eager(SparseFixedAttention(cfg), SparseFixedReference(cfg), n, i, padded_mask(n, window=window))


@pytest.mark.parametrize("pos", ["xl", "alibi", "t5", "shaw"])
def test_sparse_fixed_whose_sets_hold_every_earlier_key_is_full_attention(pos):
    """l >= n and c = l: every head sees every earlier key, so the model is the full-attention model, score
    terms included (the reference's scores are the full kernel's)."""
    cfg = config("sparse", stride=32, summary=32, pos_encoding=pos)
    model = build(cfg)
    full = TransformerXL(TransformerXLConfig(**{**cfg.to_dict(), "attention": "full", "attention_options": {}})).eval()
    full.load_state_dict(model.state_dict())
    x = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(x, mem_len=0).logits, full(x, mem_len=0).logits, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Synthesizer: factorized dense and factorized random


def test_grid_shape_covers_the_row():
    assert grid_shape(256, 0) == (16, 16)
    assert grid_shape(6, 0) == (3, 2)
    assert grid_shape(11, 0) == (4, 3)
    assert grid_shape(11, 2) == (2, 6)
    assert grid_shape(5, 9) == (5, 1)


def test_factorized_dense_rows_are_the_tiled_product_of_two_short_projections():
    """C = H_A(A) * H_B(B): A = F_A(x), B = F_B(x) from the shared hidden layer; C[t] = A[t // b]·B[t mod b]."""
    kernel = SynthesizerAttention(config("synthesizer", max_len=7, mode="factorized-dense"))
    q = torch.randn(2, 4, 5, 8)
    hidden = torch.relu(kernel.hidden(q))
    a, b = kernel.factor_a(hidden), kernel.factor_b(hidden)
    assert (a.shape[-1], b.shape[-1]) == (3, 3)  # ceil(sqrt(7)) = 3, ceil(7/3) = 3
    rows = kernel.rows(q)
    for t in range(7):
        torch.testing.assert_close(rows[..., t], a[..., t // 3] * b[..., t % 3])
    assert sum(p.numel() for p in kernel.parameters()) < sum(
        p.numel() for p in SynthesizerAttention(config("synthesizer", max_len=7, mode="dense")).parameters())


def test_factorized_random_rows_are_a_low_rank_table_independent_of_the_input():
    kernel = SynthesizerAttention(config("synthesizer", max_len=10, mode="factorized-random", rank=2))
    assert kernel.table_a.shape == (4, 4, 2) and kernel.table_b.shape == (4, 3, 2)  # a = 4, b = 3, k = 2
    grid = kernel.table_a.detach() @ kernel.table_b.detach().transpose(-1, -2)  # (h, a, b) = R_1 R_2ᵀ
    assert torch.linalg.matrix_rank(grid[0]) <= 2
    rows = kernel.rows(torch.randn(2, 4, 5, 8))
    for t in range(10):
        torch.testing.assert_close(rows[:, :, :, t], grid[:, t // 3, t % 3][None, :, None].expand(2, -1, 5))
    torch.testing.assert_close(kernel.rows(torch.randn(2, 4, 5, 8)), rows)  # no input in it


@pytest.mark.parametrize("mode", ["factorized-dense", "factorized-random"])
@pytest.mark.parametrize("causal", [True, False])
def test_factorized_synthesizers_attend_by_distance_as_their_rows_say(mode, causal):
    """softmax over the keys within max_len of the query of row[distance column], times v (keys play no part)."""
    L = 4
    kernel = SynthesizerAttention(config("synthesizer", causal=causal, max_len=L, mode=mode))
    q, k, v = qkv(11, 11)
    rows = kernel.rows(q).double()

    def sees(head, p, j):
        return (0 <= p - j < L) if causal else abs(p - j) < L

    def score(head, row, p, j):
        return rows[:, head, row, (p - j) if causal else (p - j + L - 1)]

    expected = loop_attention(q, k, v, sees, score)
    mask = AttentionMask(causal=causal)
    torch.testing.assert_close(attend(kernel, q, k, v, mask).double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attend(kernel, q, torch.randn_like(k), v, mask).double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["factorized-dense", "factorized-random"])
@pytest.mark.parametrize(("causal", "n", "i"), [(True, 26, 26), (True, 30, 11), (False, 21, 21)])
def test_factorized_synthesizers_fast_equal_eager_with_gradients_and_padding(mode, causal, n, i):
    cfg = config("synthesizer", causal=causal, max_len=6, mode=mode)
    torch.manual_seed(3)
    fast = SynthesizerAttention(cfg)
    eager = SynthesizerReference(cfg)
    eager.load_state_dict(fast.state_dict())
    params = [name for name, _ in fast.named_parameters()]
    fast_equals_eager(fast, eager, n, i, padded_mask(n, causal=causal), params=params)


# ---------------------------------------------------------------------------------------------
# Image Transformer: 1-D local attention


def image_local_sees(lq: int, lm: int):
    def sees(head, p, j):
        return (p // lq) * lq - lm <= j <= p

    return sees


@pytest.mark.parametrize(("n", "i"), [(23, 23), (31, 17), (9, 1), (16, 16)])
@pytest.mark.parametrize(("lq", "lm"), [(4, 3), (3, 0), (2, 5)])
@pytest.mark.parametrize("kernel", [ImageLocalAttention, ImageLocalReference])
def test_image_local_equals_its_pair_by_pair_definition(n, i, lq, lm, kernel):
    q, k, v = qkv(n, i)
    got = attend(kernel(config("image-local", query_block=lq, memory_block=lm)), q, k, v)
    torch.testing.assert_close(got.double(), loop_attention(q, k, v, image_local_sees(lq, lm)), atol=1e-5, rtol=1e-5)


def test_image_local_degenerate_blocks():
    """l_q = 1, l_m = 0: each query sees itself only (out = its value); l_m >= n: plain causal attention."""
    q, k, v = qkv(12, 12)
    own = attend(ImageLocalAttention(config("image-local", query_block=1, memory_block=0)), q, k, v)
    torch.testing.assert_close(own, v)
    full = loop_attention(q, k, v, lambda h, p, j: j <= p)
    every = attend(ImageLocalAttention(config("image-local", query_block=4, memory_block=12)), q, k, v)
    torch.testing.assert_close(every.double(), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("n", "i", "window"), [(26, 26, None), (30, 11, None), (30, 11, 6)])
def test_image_local_fast_equals_eager_with_gradients_padding_and_window(n, i, window):
    cfg = config("image-local", query_block=4, memory_block=5)
    fast_equals_eager(ImageLocalAttention(cfg), ImageLocalReference(cfg), n, i, padded_mask(n, window=window))


@pytest.mark.parametrize("pos", ["xl", "shaw", "alibi", "t5", "rope", "learned"])
def test_image_local_fast_model_equals_the_reference_model_with_every_encoding(pos):
    """The fast kernel computes the encoding's score (and Shaw's value) term per span: the same logits
    as the dense reference, over two segments with memory (1e-5), and the same gradients (1e-4)."""
    extra = {"position_options": {"values": True}} if pos == "shaw" else {}
    cfg = config("image-local", pos_encoding=pos, attention_impl="eager", **extra)
    eager = build(cfg).train()
    fast = TransformerXL(TransformerXLConfig(**{**cfg.to_dict(), "attention_impl": "fast"})).train()
    fast.load_state_dict(eager.state_dict())
    assert type(fast.blocks[0].attn.kernel) is ImageLocalAttention
    x = torch.randint(0, 61, (2, 22), generator=torch.Generator().manual_seed(5))
    results = []
    for model in (eager, fast):
        first = model(x[:, :13], labels=x[:, 1:14], mem_len=32)
        second = model(x[:, 13:21], labels=x[:, 14:22], memory=first.memory, mem_len=32)
        (first.loss + second.loss).backward()
        results.append((first.logits, second.logits, [p.grad for p in model.parameters()]))
    for a, b in zip(results[0][:2], results[1][:2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(results[0][2], results[1][2]):
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# in a model with small options


CAUSAL_KERNELS = [("sparse", "rope", {}), ("sparse", "xl", {}), ("image-local", "xl", {}), ("image-local", "rope", {}),
                  ("synthesizer", "rope", {"mode": "factorized-dense"}), ("synthesizer", "rope", {"mode": "factorized-random"})]


@pytest.mark.parametrize(("name", "pos", "options"), CAUSAL_KERNELS,
                         ids=[f"{n}-{p}-{'-'.join(o.values())}" for n, p, o in CAUSAL_KERNELS])
@pytest.mark.parametrize("impl", ["eager", "fast"])
def test_small_kernels_are_causal_and_segment_invariant_with_memory(name, pos, options, impl):
    model = build(config(name, pos_encoding=pos, attention_impl=impl, **options))
    x = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(x, mem_len=0).logits
        for t in (5, 13, 19):
            y = x.clone()
            y[:, t:] = (y[:, t:] * 7 + 3) % 61
            changed = model(y, mem_len=0).logits
            torch.testing.assert_close(changed[:, :t], base[:, :t], atol=1e-5, rtol=1e-5)
            assert not torch.allclose(changed[:, t], base[:, t])
        full = model(x, mem_len=32).logits
        memory, pieces = None, []
        for part in x.split([7, 8, 9], dim=1):  # segments that cross blocks
            out = model(part, memory=memory, mem_len=32)
            memory = out.memory
            pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["sparse", "image-local", "synthesizer"])
def test_small_kernels_generate_with_memory_as_a_rerun_does(name):
    from txl.generate.decoder import generate_rerun, stream_tokens

    model = build(config(name))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    prompt = [1, 2, 3, 4, 5]
    assert list(stream_tokens(model, prompt, max_new_tokens=12, temperature=0)) == \
        list(generate_rerun(model, prompt, max_new_tokens=12))


@pytest.mark.parametrize(("name", "causal"), [("sparse", True), ("image-local", True), ("synthesizer", True),
                                              ("synthesizer", False), ("linformer", False)])
def test_small_kernels_pad_exactly(name, causal):
    cfg = config(name, causal=causal, **({"pos_encoding": "learned"} if name == "linformer" else {}))
    model = build(cfg)
    sequences = [torch.randint(1, 61, (n,), generator=torch.Generator().manual_seed(n)) for n in (11, 6, 9)]
    ids = torch.zeros(3, 11, dtype=torch.long)
    attention_mask = torch.zeros(3, 11, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = seq
        attention_mask[row, : len(seq)] = 1
    with torch.no_grad():
        batch = model(ids, attention_mask=attention_mask, mem_len=0).logits
        for row, seq in enumerate(sequences):
            torch.testing.assert_close(batch[row, : len(seq)], model(seq[None], mem_len=0).logits[0], atol=1e-5, rtol=1e-5)


TRAINED = [("sparse", {}), ("image-local", {}), ("synthesizer", {"mode": "factorized-dense"}),
           ("synthesizer", {"mode": "factorized-random"}), ("linformer", {"sharing": "key-value"}),
           ("linformer", {"sharing": "layerwise"})]


@pytest.mark.parametrize(("name", "options"), TRAINED, ids=[f"{n}-{'-'.join(o.values()) or 'fixed'}" for n, o in TRAINED])
def test_small_kernels_train_three_steps(name, options):
    causal = name != "linformer"
    extra = {} if causal else {"pos_encoding": "learned"}
    model = build(config(name, causal=causal, dropout=0.1, dropatt=0.1, **extra, **options)).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    x = torch.randint(0, 61, (4, 16), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        out = model(x[:, :-1], labels=x[:, 1:], mem_len=0)
        out.loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        optimizer.step()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0]
    kernel_params = [p for block in model.blocks for p in block.attn.kernel.parameters()]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in kernel_params)  # the kernels' own weights learn


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(attention="sparse", attention_options=dict(pattern="diagonal")), "config.attention_options.pattern must be one of"),
    (dict(attention="sparse", attention_options=dict(stride=4, pattern="fixed", summary=5)),
     "config.attention_options.summary must be <= stride"),
    (dict(attention="sparse", attention_options=dict(summary=0)), "config.attention_options.summary must be >= 1"),
    (dict(attention="image-local", attention_options=dict(query_block=0)), "config.attention_options.query_block must be >= 1"),
    (dict(attention="image-local", attention_options=dict(memory_block=-1)), "config.attention_options.memory_block must be >= 0"),
    (dict(attention="image-local", causal=False, mem_len=0), "causal=false"),
    (dict(attention="synthesizer", attention_options=dict(mode="factorised")), "config.attention_options.mode must be one of"),
    (dict(attention="synthesizer", attention_options=dict(rank=0)), "config.attention_options.rank must be >= 1"),
    (dict(attention="synthesizer", attention_options=dict(factors=-2)), "config.attention_options.factors must be >= 0"),
    (dict(attention="linformer", causal=False, mem_len=0, attention_options=dict(sharing="global")),
     "config.attention_options.sharing must be one of"),
])
def test_bad_options_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        TransformerXLConfig(**{**BASE, **overrides})
