"""Every registered attention kernel against its dense reference, and the invariants every kernel must
keep, parametrised from the registry (a new kernel is covered without editing this file): causality,
segment invariance with memory, fast = eager reference, gradients. Then the reference tests of the
pattern kernels (linear, bigbird, lsh, routing, sinkhorn, compressed, synthesizer): each equals its
dense masked computation for a fixed pattern, and reduces to full attention when the pattern covers
everything."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from txl import ConfigError, EncoderDecoderConfig, TransformerXLConfig, UsageError
from txl.models.transformer_xl.model import TransformerXL
from txl.nn.attention.bigbird import BigBirdAttention, BigBirdReference
from txl.nn.attention.buckets import bucket_ranks
from txl.nn.attention.compressed import CompressedAttention
from txl.nn.attention.eager import eager_attention
from txl.nn.attention.inducing import InducingPointAttention
from txl.nn.attention.linear import LinearAttention
from txl.nn.attention.lsh import LSHAttention, LSHReference
from txl.nn.attention.masks import CAUSAL as CAUSAL_MASK
from txl.nn.attention.masks import AttentionMask
from txl.nn.attention.registry import KERNELS, SPECS, kernel_names
from txl.nn.attention.routing import RoutingAttention
from txl.nn.attention.sinkhorn import SinkhornAttention, SinkhornReference, sinkhorn
from txl.nn.attention.synthesizer import SynthesizerAttention
from txl.nn.positional import CONTENT_ONLY, rel_shift_pad

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(vocab_size=61, n_layer=2, d_model=32, n_head=4, d_head=8, d_inner=48, mem_len=16, dropout=0.0,
            dropatt=0.0)
# Small pattern sizes so that a 16-24 token test crosses block, bucket and window boundaries. A kernel
# missing here runs with its defaults.
OPTIONS = {
    "sliding": dict(window=5),
    "sparse": dict(stride=3),
    "linformer": dict(k=8, max_len=32),
    "bigbird": dict(block=3, window=1, global_blocks=1, random_blocks=1),
    "lsh": dict(buckets=4, hashes=2, bucket_window=3),
    "routing": dict(clusters=3, bucket_window=3),
    "sinkhorn": dict(block=3),
    "compressed": dict(ratio=3),
    "synthesizer": dict(max_len=6),
    "inducing": dict(points=5),
    "image-local": dict(query_block=3, memory_block=4),  # short blocks: the tests' inputs span several
    "axial": dict(row=4),
    "etc": dict(chunk=4, radius=2),
}
NAMES = kernel_names()
CAUSAL = [name for name in NAMES if SPECS[name].causal]
BIDIRECTIONAL = [name for name in NAMES if SPECS[name].bidirectional]
BOTH_IMPLS = [name for name in NAMES if (name, "fast") in KERNELS and (name, "eager") in KERNELS]


def config_for(name: str, *, causal: bool = True, **overrides) -> TransformerXLConfig:
    """The kernel `name` on BASE; keyword arguments that are the kernel's options go to attention_options."""
    pos = "xl" if SPECS[name].score_terms and causal else "rope"
    extra = dict(causal=False, mem_len=0) if not causal else {}
    options = {**OPTIONS.get(name, {}), **{k: overrides.pop(k) for k in list(overrides) if k in SPECS[name].options.names()}}
    return TransformerXLConfig(**{**BASE, "attention": name, "pos_encoding": pos, "attention_options": options,
                                  **extra, **overrides})


def build(config: TransformerXLConfig, seed: int = 0) -> TransformerXL:
    torch.manual_seed(seed)
    model = TransformerXL(config).eval()
    with torch.no_grad():  # every parameter non-trivial (biases, position tables, kernel weights)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def kernel_pair(config: TransformerXLConfig):
    """The fast and eager kernels of `config.attention`, with the same parameters and buffers."""
    fast, eager = KERNELS[(config.attention, "fast")], KERNELS[(config.attention, "eager")]
    torch.manual_seed(1)
    fast = fast(config) if isinstance(fast, type) else fast
    eager = eager(config) if isinstance(eager, type) else eager
    if isinstance(fast, torch.nn.Module):
        with torch.no_grad():
            for p in fast.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        eager.load_state_dict(fast.state_dict())
    return fast, eager


def attend(kernel, q, k, v, mask=CAUSAL_MASK, positions=CONTENT_ONLY, **kwargs):
    return kernel(q, k, v, positions=positions, mask=mask, dropatt=0.0, training=False, **kwargs)[0]


def qkv(n: int, i: int, *, seed: int = 0, grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 4, length, 8, generator=g) for length in (i, n, n))
    return [x.requires_grad_(grad) for x in (q, k, v)]


# ---------------------------------------------------------------------------------------------
# Invariants of every kernel, from the registry


@pytest.mark.parametrize("name", CAUSAL)
@pytest.mark.parametrize("impl", ["eager", "fast"])
def test_every_causal_kernel_is_causal(name, impl):
    """Changing token t changes no output before t (also through a sort, a hash or a block summary)."""
    if (name, impl) not in KERNELS:
        pytest.skip(f"{name} has no {impl} kernel")
    model = build(config_for(name, attention_impl=impl))
    x = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model(x, mem_len=0).logits
        for t in (5, 13, 19):
            y = x.clone()
            y[:, t:] = (y[:, t:] * 7 + 3) % 61
            changed = model(y, mem_len=0).logits
            torch.testing.assert_close(changed[:, :t], base[:, :t], atol=1e-5, rtol=1e-5)
            assert not torch.allclose(changed[:, t], base[:, t])


@pytest.mark.parametrize("name", CAUSAL)
@pytest.mark.parametrize("impl", ["eager", "fast"])
def test_every_causal_kernel_is_segment_invariant_with_memory(name, impl):
    """With mem_len covering the history, segments with memory give exactly one long pass's logits."""
    if (name, impl) not in KERNELS:
        pytest.skip(f"{name} has no {impl} kernel")
    model = build(config_for(name, attention_impl=impl))
    x = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x, mem_len=24).logits
        memory, pieces = None, []
        for part in x.split([7, 8, 9], dim=1):  # segment lengths that cross every block boundary
            out = model(part, memory=memory, mem_len=24)
            memory = out.memory
            pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", BOTH_IMPLS)
@pytest.mark.parametrize(("causal", "n", "i"), [(True, 23, 23), (True, 31, 17), (True, 9, 1), (False, 22, 22)])
def test_every_fast_kernel_equals_its_dense_reference_with_gradients(name, causal, n, i):
    spec = SPECS[name]
    if (causal and not spec.causal) or (not causal and not spec.bidirectional):
        pytest.skip(f"{name} does not run {'causal' if causal else 'bidirectional'}")
    if not causal and n != i:
        pytest.skip("no memory without causality")
    config = config_for(name, causal=causal)
    fast, eager = kernel_pair(config)
    mask = AttentionMask(causal=causal)
    outs, grads = [], []
    for kernel in (fast, eager):
        q, k, v = qkv(n, i, grad=True)
        out = attend(kernel, q, k, v, mask)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append(out)
        grads.append([q.grad, k.grad, v.grad])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    for a, b in zip(grads[0], grads[1]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_every_kernel_trains_in_a_model(name):
    causal = SPECS[name].causal
    model = build(config_for(name, causal=causal)).train()
    x = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(2))
    out = model(x, labels=x)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# ---------------------------------------------------------------------------------------------
# Full attention, for the "pattern covers everything" tests


def full_attention(q, k, v, *, causal=True, exclude_self=False):
    n, i = k.shape[-2], q.shape[-2]
    visible = AttentionMask(causal=causal).visible(i, n, q.device)
    if exclude_self:
        visible = visible & ~torch.eye(n, dtype=torch.bool)[n - i:]
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v


def test_full_attention_helper_is_the_eager_kernel():
    q, k, v = qkv(20, 12)
    torch.testing.assert_close(full_attention(q, k, v), attend(eager_attention, q, k, v))


# ---------------------------------------------------------------------------------------------
# linear


@pytest.mark.parametrize("feature", ["elu", "relu"])
@pytest.mark.parametrize("causal", [True, False])
def test_linear_attention_equals_its_feature_map_formula(feature, causal):
    q, k, v = qkv(20, 12 if causal else 20)
    kernel = LinearAttention(config_for("linear", causal=causal, feature=feature))
    phi = (lambda x: F.elu(x) + 1) if feature == "elu" else F.relu
    weights = phi(q) @ phi(k).transpose(-1, -2)  # (the features' ε moves this by ~1e-6 relative)
    if causal:
        weights = weights * AttentionMask().visible(12, 20, q.device)
    expected = (weights @ v) / weights.sum(-1, keepdim=True)
    torch.testing.assert_close(attend(kernel, q, k, v, AttentionMask(causal=causal)), expected, atol=1e-4, rtol=1e-4)


def test_linear_refuses_what_it_cannot_do():
    with pytest.raises(ConfigError, match="config.dropatt"):
        config_for("linear", dropatt=0.1)
    with pytest.raises(ConfigError, match="config.same_length"):
        config_for("linear", same_length=True)
    with pytest.raises(ConfigError, match="config.attention_options.feature"):
        config_for("linear", feature="softplus")


# ---------------------------------------------------------------------------------------------
# bigbird


def test_bigbird_with_a_fixed_random_pattern_equals_its_hand_built_mask():
    config = config_for("bigbird", block=2, window=1, global_blocks=1, random_blocks=1)
    fast = BigBirdAttention(config)
    table = {1: [0], 2: [0], 3: [1], 4: [0], 5: [3], 6: [2], 7: [4], 8: [1], 9: [6]}
    fixed = lambda blocks, n_blocks, causal: torch.tensor([table.get(int(t), [-1]) for t in blocks])  # noqa: E731
    fast.random_table = fixed
    n = 20  # 10 blocks of 2
    visible = torch.zeros(n, n, dtype=torch.bool)
    for p in range(n):
        t = p // 2
        blocks = {t, t - 1, 0, *table.get(t, [])}
        for j in range(p + 1):
            visible[p, j] = (j // 2 in blocks) or t == 0  # block 0 is global: sees (and is seen by) all
    q, k, v = qkv(n, n)
    scores = (q @ k.transpose(-1, -2)) * 8**-0.5
    expected = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v
    torch.testing.assert_close(attend(fast, q, k, v), expected, atol=1e-5, rtol=1e-5)
    reference = BigBirdReference(config)
    reference.random_table = fixed
    torch.testing.assert_close(attend(reference, q, k, v), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_bigbird_with_a_window_covering_everything_is_full_attention(causal):
    config = config_for("bigbird", causal=causal, block=3, window=8, global_blocks=0,
                        random_blocks=0)
    n, i = (24, 15) if causal else (20, 20)
    q, k, v = qkv(n, i)
    torch.testing.assert_close(attend(BigBirdAttention(config), q, k, v, AttentionMask(causal=causal)),
                               full_attention(q, k, v, causal=causal), atol=1e-5, rtol=1e-5)


def test_bigbird_random_blocks_are_earlier_fixed_and_length_independent():
    from txl.nn.attention.bigbird import random_blocks

    short = random_blocks(torch.arange(10), 3, 10, causal=True)
    long = random_blocks(torch.arange(50), 3, 50, causal=True)
    assert torch.equal(long[:10], short)
    assert (short[0] == -1).all()
    t = torch.arange(1, 50)[:, None]
    assert ((long[1:] >= 0) & (long[1:] < t)).all()


# ---------------------------------------------------------------------------------------------
# lsh and routing (bucketed shared-QK attention)


def shared_qk_attention(k, v, visible):
    """softmax(k_p · k_j/|k_j|) over `visible` (self excluded; alone = own value), by hand."""
    n = k.shape[-2]
    scores = (k @ F.normalize(k, dim=-1).transpose(-1, -2)) * 8**-0.5
    visible = visible & ~torch.eye(n, dtype=torch.bool)
    out = scores.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0) @ v
    alone = ~visible.any(-1)
    return torch.where(alone[..., None], v, out)


@pytest.mark.parametrize("kernel", [LSHAttention, LSHReference])
def test_lsh_with_a_fixed_hash_equals_its_dense_masked_computation(kernel):
    config = config_for("lsh", hashes=2, bucket_window=2)
    lsh = kernel(config)
    n = 16
    # Round 0: parity buckets; round 1: position // 4. Fixed hashes, so the pattern is known.
    fixed = torch.stack([torch.arange(n) % 2, torch.arange(n) // 4])
    lsh.buckets = lambda k: fixed.expand(k.shape[0], k.shape[1], -1, -1)
    visible = torch.zeros(n, n, dtype=torch.bool)
    for p in range(n):
        for j in range(p + 1):
            parity = p % 2 == j % 2 and (p - j) // 2 < 2  # within the 2 most recent of its bucket
            quarter = p // 4 == j // 4 and p - j < 2
            visible[p, j] = parity or quarter
    _, k, v = qkv(n, n)
    torch.testing.assert_close(attend(lsh, k, k, v), shared_qk_attention(k, v, visible), atol=1e-5, rtol=1e-5)


def test_lsh_with_one_bucket_and_a_window_covering_everything_is_full_shared_qk_attention():
    config = config_for("lsh", hashes=3, bucket_window=64)
    lsh = LSHAttention(config)
    lsh.rotations.zero_()  # every key hashes to bucket 0 in every round
    _, k, v = qkv(20, 20)
    expected = shared_qk_attention(k, v, AttentionMask().visible(20, 20, k.device)[0, 0])
    torch.testing.assert_close(attend(lsh, k, k, v), expected, atol=1e-5, rtol=1e-5)


def test_bucket_ranks_count_positions_within_each_bucket():
    order, rank = bucket_ranks(torch.tensor([[2, 0, 2, 1, 0, 2]]))
    assert order.tolist() == [[1, 4, 3, 0, 2, 5]]
    assert rank.tolist() == [[0, 0, 1, 0, 1, 2]]


def test_routing_with_fixed_centroids_routes_to_the_nearest_and_learns_only_in_training():
    config = config_for("routing", clusters=2, bucket_window=64, decay=0.5)
    routing = RoutingAttention(config)
    axis = torch.zeros(4, 2, 8)
    axis[:, 0, 0], axis[:, 1, 1] = 1.0, 1.0  # centroid 0 = e0, centroid 1 = e1
    routing.centroids.copy_(axis)
    _, k, v = qkv(16, 16)
    clusters = routing.buckets(k, training=False)[:, :, 0]
    assert torch.equal(clusters, (k[..., 1] > k[..., 0]).long())
    expected = shared_qk_attention(k, v, (clusters[..., :, None] == clusters[..., None, :])
                                   & AttentionMask().visible(16, 16, k.device))
    torch.testing.assert_close(attend(routing, k, k, v), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(routing.centroids, axis)  # evaluation never moves them
    routing(k, k, v, positions=CONTENT_ONLY, mask=AttentionMask(), dropatt=0.0, training=True)
    assert not torch.equal(routing.centroids, axis)
    torch.testing.assert_close(routing.centroids.norm(dim=-1), torch.ones(4, 2))


def test_routing_with_one_cluster_is_full_shared_qk_attention():
    routing = RoutingAttention(config_for("routing", clusters=1, bucket_window=64))
    _, k, v = qkv(20, 20)
    expected = shared_qk_attention(k, v, AttentionMask().visible(20, 20, k.device)[0, 0])
    torch.testing.assert_close(attend(routing, k, k, v), expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# sinkhorn


@pytest.mark.parametrize("kernel", [SinkhornAttention, SinkhornReference])
@pytest.mark.parametrize("causal", [True, False])
def test_sinkhorn_with_a_fixed_permutation_equals_its_dense_masked_computation(kernel, causal):
    config = config_for("sinkhorn", causal=causal, block=3)
    sink = kernel(config)
    n = 18  # 6 blocks
    target = [None, 0, 0, 1, 2, 0] if causal else [3, 5, 0, 4, 1, 2]  # block t also sees block target[t]
    hard = torch.zeros(6, 6)
    for t, s in enumerate(target):
        if s is not None:
            hard[t, s] = 1.0
    sink.sort_matrix = lambda blocks, n, causal: hard.expand(blocks.shape[0], blocks.shape[1], -1, -1)
    visible = torch.zeros(n, n, dtype=torch.bool)
    for p in range(n):
        for j in range(n):
            own = p // 3 == j // 3 and (j <= p or not causal)
            visible[p, j] = own or (target[p // 3] is not None and j // 3 == target[p // 3])
    q, k, v = qkv(n, n)
    scores = (q @ k.transpose(-1, -2)) * 8**-0.5
    expected = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v
    torch.testing.assert_close(attend(sink, q, k, v, AttentionMask(causal=causal)), expected, atol=1e-5, rtol=1e-5)


def test_sinkhorn_with_one_block_covering_everything_is_full_attention():
    sink = SinkhornAttention(config_for("sinkhorn", block=32))
    q, k, v = qkv(20, 12)
    torch.testing.assert_close(attend(sink, q, k, v), full_attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_sinkhorn_balancing_gives_a_doubly_stochastic_matrix():
    allowed = ~torch.eye(5, dtype=torch.bool)
    p = sinkhorn(torch.randn(5, 5), allowed, iters=50)
    torch.testing.assert_close(p.sum(-1), torch.ones(5))
    torch.testing.assert_close(p.sum(-2), torch.ones(5), atol=1e-4, rtol=1e-4)
    assert (p.diagonal() == 0).all()


# ---------------------------------------------------------------------------------------------
# compressed


@pytest.mark.parametrize("causal", [True, False])
def test_compressed_at_ratio_one_with_identity_convolution_is_full_attention(causal):
    kernel = CompressedAttention(config_for("compressed", causal=causal, ratio=1))
    n, i = (20, 13) if causal else (16, 16)
    q, k, v = qkv(n, i)
    torch.testing.assert_close(attend(kernel, q, k, v, AttentionMask(causal=causal)),
                               full_attention(q, k, v, causal=causal), atol=1e-5, rtol=1e-5)


def test_compressed_rows_are_the_strided_convolution_and_only_past_blocks_are_seen():
    kernel = CompressedAttention(config_for("compressed", ratio=3))
    torch.nn.init.normal_(kernel.key_conv)
    torch.nn.init.normal_(kernel.value_conv)
    q, k, v = qkv(12, 12)
    conv = lambda x, w: torch.stack([x[:, :, 3 * t:3 * t + 3].flatten(-2) @ w for t in range(4)], 2)  # noqa: E731
    keys = torch.cat([conv(k, kernel.key_conv), k], 2)
    values = torch.cat([conv(v, kernel.value_conv), v], 2)
    visible = torch.zeros(12, 16, dtype=torch.bool)
    for p in range(12):
        visible[p, : p // 3] = True  # compressed blocks fully before p's block
        visible[p, 4 + 3 * (p // 3): 4 + p + 1] = True  # p's own block, raw, up to p
    scores = (q @ keys.transpose(-1, -2)) * 8**-0.5
    expected = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ values
    torch.testing.assert_close(attend(kernel, q, k, v), expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# synthesizer


@pytest.mark.parametrize("mode", ["dense", "random"])
def test_synthesizer_scores_come_from_the_query_or_a_table_by_distance(mode):
    kernel = SynthesizerAttention(config_for("synthesizer", mode=mode, max_len=4))
    q, k, v = qkv(10, 10)
    rows = kernel.rows(q)  # (b, h, i, 4)
    scores = torch.full((2, 4, 10, 10), float("-inf"))
    for p in range(10):
        for j in range(max(0, p - 3), p + 1):
            scores[:, :, p, j] = rows[:, :, p, p - j]
    expected = scores.softmax(-1) @ v
    torch.testing.assert_close(attend(kernel, q, k, v), expected, atol=1e-5, rtol=1e-5)
    k2 = torch.randn_like(k)
    torch.testing.assert_close(attend(kernel, q, k2, v), expected)  # keys play no part
    if mode == "random":
        torch.testing.assert_close(attend(kernel, torch.randn_like(q), k, v), expected)  # nor queries


# ---------------------------------------------------------------------------------------------
# Config checks of the new options


@pytest.mark.parametrize(("overrides", "field"), [
    (dict(attention="lsh", attention_options=dict(buckets=5)), "attention_options.buckets"),
    (dict(attention="lsh", attention_options=dict(hashes=0)), "attention_options.hashes"),
    (dict(attention="routing", attention_options=dict(bucket_window=0)), "attention_options.bucket_window"),
    (dict(attention="routing", attention_options=dict(decay=1.0)), "attention_options.decay"),
    (dict(attention="bigbird", attention_options=dict(block=0)), "attention_options.block"),
    (dict(attention="bigbird", attention_options=dict(random_blocks=-1)), "attention_options.random_blocks"),
    (dict(attention="sinkhorn", attention_options=dict(temperature=0.0)), "attention_options.temperature"),
    (dict(attention="sinkhorn", same_length=True), "same_length"),
    (dict(attention="compressed", attention_options=dict(ratio=0)), "attention_options.ratio"),
    (dict(attention="compressed", same_length=True), "same_length"),
    (dict(attention="synthesizer", attention_options=dict(mode="factorized")), "attention_options.mode"),
    (dict(attention="synthesizer", attention_options=dict(max_len=0)), "attention_options.max_len"),
])
def test_bad_kernel_options_are_rejected_by_name(overrides, field):
    with pytest.raises(ConfigError, match=f"config.{field}"):
        TransformerXLConfig(**{**BASE, "pos_encoding": "rope", **overrides})


@pytest.mark.parametrize("name", [n for n in CAUSAL if not SPECS[n].score_terms])
def test_kernels_without_score_matrices_reject_score_term_encodings(name):
    with pytest.raises(ConfigError, match="config.pos_encoding='xl' adds a term"):
        config_for(name, pos_encoding="xl")


@pytest.mark.parametrize("name", ["compressed", "sinkhorn", "lsh"])
def test_kernels_that_cannot_pad_or_give_probabilities_say_so(name):
    model = build(config_for(name, mem_len=0))
    x = torch.randint(0, 61, (2, 8))
    if name == "lsh":  # lsh pads (the reference forms its probabilities)
        out = model(x, attention_mask=torch.ones_like(x), output_attentions=True)
        assert out.attentions[0].shape == (2, 4, 8, 8)
        return
    with pytest.raises(UsageError, match=f"attention={name!r}"):
        model(x, attention_mask=torch.ones_like(x))
    with pytest.raises(UsageError, match="output_attentions"):
        model(x, output_attentions=True)


# ---------------------------------------------------------------------------------------------
# inducing points (Set Transformer ISAB)


def test_inducing_points_that_each_pick_one_key_give_full_bidirectional_attention():
    kernel = InducingPointAttention(config_for("inducing", causal=False, points=12))
    perm = torch.randperm(12)
    kernel.summary_weights = lambda k, padding: torch.eye(12)[perm].expand(k.shape[0], k.shape[1], -1, -1)
    q, k, v = qkv(12, 12)
    torch.testing.assert_close(attend(kernel, q, k, v, AttentionMask(causal=False)),
                               full_attention(q, k, v, causal=False), atol=1e-5, rtol=1e-5)


def test_inducing_points_summarise_keys_and_ignore_padding():
    kernel = InducingPointAttention(config_for("inducing", causal=False, points=3))
    q, k, v = qkv(10, 10)
    a = torch.einsum("hmd,bhjd->bhmj", kernel.points, k).mul(8**-0.5).softmax(-1)
    expected = ((q @ (a @ k).transpose(-1, -2)) * 8**-0.5).softmax(-1) @ (a @ v)
    torch.testing.assert_close(attend(kernel, q, k, v, AttentionMask(causal=False)), expected, atol=1e-5, rtol=1e-5)
    padding = torch.ones(2, 10, dtype=torch.bool)
    padding[0, 7:] = False
    padded = attend(kernel, q, k, v, AttentionMask(causal=False, key_padding=padding))
    alone = attend(kernel, q[:1], k[:1, :, :7], v[:1, :, :7], AttentionMask(causal=False))
    torch.testing.assert_close(padded[:1], alone, atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="inducing.*cannot be causal"):
        config_for("inducing")


# ---------------------------------------------------------------------------------------------
# global attention on chosen tokens (global_mask)


def chosen_tokens(i: int) -> torch.Tensor:
    chosen = torch.zeros(2, i, dtype=torch.bool)
    chosen[0, [0, 5]] = True  # e.g. a [CLS] and a question token
    chosen[1, [i - 3]] = True
    return chosen


@pytest.mark.parametrize(("causal", "n", "i"), [(True, 23, 23), (True, 31, 17), (False, 22, 22)])
def test_bigbird_global_mask_equals_its_dense_reference_and_a_hand_built_mask(causal, n, i):
    config = config_for("bigbird", causal=causal, block=3, window=0, global_blocks=0,
                        random_blocks=0)  # own block only, so the chosen tokens are all that reaches further
    fast, eager = kernel_pair(config)
    chosen = chosen_tokens(i)
    mask = AttentionMask(causal=causal, global_mask=chosen)
    q, k, v = qkv(n, i)
    got = attend(fast, q, k, v, mask)
    torch.testing.assert_close(got, attend(eager, q, k, v, mask), atol=1e-5, rtol=1e-5)
    offset = n - i
    key_chosen = torch.nn.functional.pad(chosen, (offset, 0))
    visible = torch.zeros(2, 1, i, n, dtype=torch.bool)
    for b in range(2):
        for p in range(i):
            for j in range(n):
                sees = (p + offset) // 3 == j // 3 or key_chosen[b, j] or chosen[b, p]
                visible[b, 0, p, j] = sees and (j <= p + offset or not causal)
    scores = (q @ k.transpose(-1, -2)) * 8**-0.5
    expected = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def sliding_visible(n: int, i: int, *, window: int, dilation: int, causal: bool, chosen=None) -> torch.Tensor:
    """(b|1, 1, i, n) by hand: the (two-sided, bidirectional) dilated window, plus the chosen tokens'
    rows and columns within causality."""
    offset = n - i
    visible = torch.zeros(1 if chosen is None else len(chosen), 1, i, n, dtype=torch.bool)
    for b in range(visible.shape[0]):
        for p in range(i):
            for j in range(n):
                dist = p + offset - j
                if causal and dist < 0:
                    continue
                local = abs(dist) % dilation == 0 and abs(dist) < window * dilation
                glob = chosen is not None and (chosen[b, p] or (j >= offset and chosen[b, j - offset]))
                visible[b, 0, p, j] = local or bool(glob)
    return visible


@pytest.mark.parametrize(("causal", "n", "i"), [(True, 23, 23), (True, 31, 17), (False, 22, 22), (False, 40, 40)])
@pytest.mark.parametrize("dilation", [1, 2])
def test_sliding_global_mask_equals_its_dense_reference_and_a_hand_built_mask(causal, n, i, dilation):
    config = config_for("sliding", causal=causal, window=3, dilation=(dilation,))
    fast, eager = kernel_pair(config)
    chosen = chosen_tokens(i)
    mask = AttentionMask(causal=causal, global_mask=chosen)
    q, k, v = qkv(n, i, grad=True)
    got = attend(fast, q, k, v, mask)
    torch.testing.assert_close(got, attend(eager, q, k, v, mask), atol=1e-5, rtol=1e-5)
    visible = sliding_visible(n, i, window=3, dilation=dilation, causal=causal, chosen=chosen)
    scores = (q @ k.transpose(-1, -2)) * 8**-0.5
    expected = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    got.square().sum().backward()  # gradients reach the chosen keys through the gathered part
    assert k.grad[0, :, n - i + 5].abs().sum() > 0


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("impl", ["eager", "fast"])
def test_sliding_global_mask_all_false_is_plain_sliding_and_all_true_is_full_attention(causal, impl):
    kernel = KERNELS[("sliding", impl)](config_for("sliding", causal=causal, window=3,
                                                   dilation=(1, 2, 1, 3)))
    n, i = (31, 17) if causal else (22, 22)
    q, k, v = qkv(n, i)
    none, every = torch.zeros(2, i, dtype=torch.bool), torch.ones(2, i, dtype=torch.bool)
    plain = attend(kernel, q, k, v, AttentionMask(causal=causal))
    torch.testing.assert_close(attend(kernel, q, k, v, AttentionMask(causal=causal, global_mask=none)), plain)
    full = attend(eager_attention, q, k, v, AttentionMask(causal=causal))
    assert not torch.allclose(plain, full, atol=1e-3)
    torch.testing.assert_close(attend(kernel, q, k, v, AttentionMask(causal=causal, global_mask=every)), full,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pos", ["xl", "shaw", "alibi", "t5"])
def test_sliding_chosen_rows_take_every_position_term_and_all_chosen_is_full_attention(pos):
    """Causal, with an encoding's score terms: a chosen query's row is full attention over every earlier
    key with all position terms (fast = dense reference), so with every token chosen the kernel is
    full attention (the position terms of pairs joined only by a chosen key: tests/test_longformer.py)."""
    config = config_for("sliding", pos_encoding=pos, position_options={"values": True} if pos == "shaw" else None, window=3)
    model = build(config)
    n, i = 31, 17
    positions = model.pos.layer(0, model.pos.prepare(k_len=n, clamp_len=0, device=torch.device("cpu"),
                                                     dtype=torch.float32))
    fast, eager = kernel_pair(config)
    q, k, v = qkv(n, i, grad=True)
    chosen = chosen_tokens(i)
    outs = []
    for kernel in (fast, eager):
        outs.append(attend(kernel, q, k, v, AttentionMask(global_mask=chosen), positions=positions))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    full = attend(eager_attention, q, k, v, positions=positions)
    torch.testing.assert_close(outs[0][0, :, 5], full[0, :, 5], atol=1e-5, rtol=1e-5)  # a chosen row
    assert not torch.allclose(outs[0][0, :, 6], full[0, :, 6], atol=1e-4)  # not chosen: window + chosen keys
    every = AttentionMask(global_mask=torch.ones(2, i, dtype=torch.bool))
    for kernel in (fast, eager):
        torch.testing.assert_close(attend(kernel, q, k, v, every, positions=positions), full, atol=1e-5, rtol=1e-5)
    outs[0].square().sum().backward()
    assert torch.isfinite(q.grad).all() and q.grad[0, :, 5].abs().sum() > 0


@pytest.mark.parametrize("impl", ["eager", "fast"])
@pytest.mark.parametrize(("window", "dilation"), [(3, 1), (2, 3), (30, 1)])
def test_bidirectional_sliding_sees_the_window_on_both_sides(impl, window, dilation):
    """`causal=false`: each query sees `window` keys on each side of it (itself counted once),
    dilated; a window longer than the sequence is full bidirectional attention."""
    kernel = KERNELS[("sliding", impl)](config_for("sliding", causal=False, window=window,
                                                   dilation=(dilation,)))
    q, k, v = qkv(40, 40)
    visible = sliding_visible(40, 40, window=window, dilation=dilation, causal=False)
    scores = (q @ k.transpose(-1, -2)) * 8**-0.5
    expected = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v
    got = attend(kernel, q, k, v, AttentionMask(causal=False))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    if window >= 40:
        torch.testing.assert_close(got, full_attention(q, k, v, causal=False), atol=1e-5, rtol=1e-5)


def test_bidirectional_sliding_refuses_score_terms_and_global_tokens_with_a_mask():
    with pytest.raises(ConfigError, match="pos_encoding='shaw'.*bidirectional sliding window.*rope"):
        config_for("sliding", causal=False, pos_encoding="shaw")
    x = torch.randint(0, 61, (2, 8))
    with pytest.raises(UsageError, match="global_tokens or a global_mask, not both"):
        build(config_for("sliding", global_tokens=2))(x, mem_len=0, global_mask=torch.ones_like(x))


@pytest.mark.parametrize("name", ["bigbird", "sliding"])
def test_global_mask_in_a_model_reaches_far_and_stays_causal(name):
    narrow = dict(block=2, window=0, global_blocks=0, random_blocks=0) if name == "bigbird" else \
        dict(window=2)
    model = build(config_for(name, n_layer=1, **narrow))
    x = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(4))
    chosen = torch.zeros(2, 16, dtype=torch.long)
    chosen[:, 1] = 1
    y = x.clone()
    y[:, 1] = (y[:, 1] + 5) % 61
    with torch.no_grad():
        plain = model(x, mem_len=0).logits, model(y, mem_len=0).logits
        global_ = model(x, mem_len=0, global_mask=chosen).logits, model(y, mem_len=0, global_mask=chosen).logits
        torch.testing.assert_close(plain[0][:, 4:], plain[1][:, 4:])  # one layer, own block: token 1 unseen
        assert not torch.allclose(global_[0][:, 4:], global_[1][:, 4:])  # chosen: seen by every later query
        z = x.clone()
        z[:, 12:] = (z[:, 12:] + 3) % 61
        torch.testing.assert_close(model(z, mem_len=0, global_mask=chosen).logits[:, :12], global_[0][:, :12])


def test_global_mask_is_refused_by_kernels_that_cannot_take_it_and_checked_for_shape():
    x = torch.randint(0, 61, (2, 8))
    with pytest.raises(UsageError, match="global_mask is not available with attention='lsh'.*bigbird"):
        build(config_for("lsh"))(x, global_mask=torch.ones_like(x))
    with pytest.raises(UsageError, match="global_mask must have the shape of input_ids"):
        build(config_for("bigbird"))(x, global_mask=torch.ones(2, 7))
    full = build(config_for("full"))
    with torch.no_grad():  # full attention already sees everything: the mask changes nothing
        torch.testing.assert_close(full(x, mem_len=0, global_mask=torch.ones_like(x)).logits, full(x, mem_len=0).logits)


# ---------------------------------------------------------------------------------------------
# Padding, for every kernel (or one clear refusal)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("impl", ["eager", "fast"])
def test_every_kernel_pads_exactly_or_refuses_by_name(name, impl):
    if (name, impl) not in KERNELS:
        pytest.skip(f"{name} has no {impl} kernel")
    causal = SPECS[name].causal
    model = build(config_for(name, causal=causal, attention_impl=impl, mem_len=0))
    lengths = (11, 6, 9)
    sequences = [torch.randint(1, 61, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    ids = torch.zeros(3, 11, dtype=torch.long)
    attention_mask = torch.zeros(3, 11, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = seq
        attention_mask[row, : len(seq)] = 1
    with torch.no_grad():
        try:
            batch = model(ids, attention_mask=attention_mask, mem_len=0).logits
        except UsageError as err:
            assert f"attention={name!r}" in str(err) and "padding" in str(err)
            return
        for row, seq in enumerate(sequences):
            alone = model(seq[None], mem_len=0).logits
            torch.testing.assert_close(batch[row, : len(seq)], alone[0], atol=1e-5, rtol=1e-5)


def test_compressed_query_chunks_change_nothing(monkeypatch):
    fast, eager = kernel_pair(config_for("compressed", ratio=3))
    q, k, v = qkv(31, 17)
    whole = attend(fast, q, k, v)
    monkeypatch.setattr(CompressedAttention, "query_chunk", 5)  # 17 queries in 4 chunks
    torch.testing.assert_close(attend(fast, q, k, v), whole)
    torch.testing.assert_close(whole, attend(eager, q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", CAUSAL)
def test_every_causal_kernel_generates_with_memory_as_a_rerun_does(name):
    """Token-by-token decoding with memory (one query per forward) picks what re-running the whole
    context picks: the one-query path of every kernel agrees with its full-segment path."""
    from txl.generate.decoder import generate_rerun, stream_tokens

    model = build(config_for(name, mem_len=64))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)  # far from init, so greedy picks vary
    prompt = [1, 2, 3, 4, 5]
    fast = list(stream_tokens(model, prompt, max_new_tokens=10, temperature=0))
    assert fast == list(generate_rerun(model, prompt, max_new_tokens=10))


# ---------------------------------------------------------------------------------------------
# memory tokens (config.memory_tokens: learned keys and values before [memory ; segment])


def with_tokens(q, k, v, m: int, *, seed: int = 5):
    """k and v with m random token rows in front, and the tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randn(2, 1, k.shape[1], m, k.shape[-1], generator=g).expand(-1, k.shape[0], -1, -1, -1)
    return torch.cat([tokens[0], k], dim=2), torch.cat([tokens[1], v], dim=2), tokens


@pytest.mark.parametrize("pos", ["xl", "rope", "alibi", "t5", "shaw"])
@pytest.mark.parametrize("impl", ["eager", "fast"])
@pytest.mark.parametrize(("causal", "n", "i"), [(True, 31, 17), (True, 9, 1), (False, 22, 22)])
def test_memory_tokens_equal_a_dense_softmax_over_tokens_memory_and_segment(pos, impl, causal, n, i):
    """softmax over [tokens ; memory ; segment]: the tokens' columns are the plain content score q·k
    (no position term, no u), always visible; the other columns are the encoding's usual scores."""
    if not causal and pos in ("xl", "alibi"):
        pytest.skip(f"{pos} is causal only")
    model = build(config_for("full", causal=causal, pos_encoding=pos, position_options={"values": True} if pos == "shaw" else None))
    state = model.pos.prepare(k_len=n, clamp_len=0, device=torch.device("cpu"), dtype=torch.float32)
    positions = model.pos.layer(0, state)
    q, k, v = qkv(n, i)
    k_all, v_all, tokens = with_tokens(q, k, v, 3)
    mask = AttentionMask(causal=causal, memory_tokens=3)
    with torch.no_grad():
        got, probs = KERNELS[("full", impl)](q, k_all, v_all, positions=positions, mask=mask, dropatt=0.0,
                                             training=False, need_weights=True)
        q_content, k_content = positions.content(q, k)
        scores = q_content @ k_content.transpose(-1, -2)
        bias = positions.score_bias(q, k_len=n, rel_shift=rel_shift_pad)
        scores = scores if bias is None else scores + bias
        visible = AttentionMask(causal=causal).visible(i, n, q.device).expand(2, 4, i, n)
        scores = scores.masked_fill(~visible, float("-inf") * 8**0.5)
        scores = torch.cat([q @ tokens[0].transpose(-1, -2), scores], dim=-1) * 8**-0.5
        expected_probs = scores.softmax(-1)
        expected = expected_probs @ v_all
        value_term = positions.value_term(expected_probs[..., 3:])
        expected = expected if value_term is None else expected + value_term
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(probs, expected_probs, atol=1e-6, rtol=1e-5)
    assert probs[..., :3].sum() > 0.05 * probs.sum()  # the tokens take a real share of attention


@pytest.mark.parametrize("impl", ["eager", "fast"])
def test_memory_tokens_whose_scores_vanish_change_nothing(impl):
    """Token keys pushed to -inf scores (exp underflows to 0): the plain kernel's output exactly."""
    q, k, v = qkv(31, 17)
    q[..., 0] = q[..., 0].abs() + 1.0
    k_all, v_all, tokens = with_tokens(q, k, v, 3)
    k_all[:, :, :3] = 0.0
    k_all[:, :, :3, 0] = -1e6
    kernel = KERNELS[("full", impl)]
    got = attend(kernel, q, k_all, v_all, AttentionMask(memory_tokens=3))
    # equal up to the order of fp32 sums, which SIMD width and blocking decide (exact on AVX2 and AVX-512, not
    # on ATen's default/ARM code paths): each output sums n = 34 weighted values, within gamma_n * max|v| of
    # the exact sum (Higham 2002, eq. 3.5), plus the exp and the division of the softmax
    n = k_all.shape[2] + 2
    gamma = n * 2.0**-24 / (1 - n * 2.0**-24)
    torch.testing.assert_close(got, attend(kernel, q, k, v), atol=2 * gamma * v.abs().max().item(), rtol=0.0)


@pytest.mark.parametrize("name", ["full", "sliding"])
@pytest.mark.parametrize("impl", ["eager", "fast"])
@pytest.mark.parametrize("pos", ["xl", "rope"])
def test_memory_tokens_keep_causality_and_segment_invariance(name, impl, pos):
    model = build(config_for(name, memory_tokens=3, attention_impl=impl, pos_encoding=pos))
    x = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = model(x, mem_len=0).logits
        for t in (0, 7, 19):
            y = x.clone()
            y[:, t:] = (y[:, t:] * 7 + 3) % 61
            changed = model(y, mem_len=0).logits
            torch.testing.assert_close(changed[:, :t], base[:, :t], atol=1e-5, rtol=1e-5)
            assert not torch.allclose(changed[:, t], base[:, t])
        full = model(x, mem_len=20).logits
        first = model(x[:, :8], mem_len=20)
        second = model(x[:, 8:], memory=first.memory, mem_len=20)
        assert first.memory.length == 8  # the segment memory holds the segment only, never the tokens
    torch.testing.assert_close(torch.cat([first.logits, second.logits], dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["full", "sliding"])
def test_memory_tokens_generate_with_memory_as_a_rerun_does(name):
    """Decoding token by token (the fast backend's projection cache, one query per forward) with the
    tokens in front of the cached keys picks what re-running the whole context picks."""
    from txl.generate.decoder import generate_rerun, stream_tokens

    model = build(config_for(name, mem_len=64, memory_tokens=4))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    prompt = [1, 2, 3, 4, 5]
    assert list(stream_tokens(model, prompt, max_new_tokens=10, temperature=0)) == \
        list(generate_rerun(model, prompt, max_new_tokens=10))


def test_memory_tokens_are_parameters_that_train_save_and_load(tmp_path):
    config = config_for("full", memory_tokens=4)
    model = build(config)
    tokens = model.blocks[1].attn.memory_tokens
    assert tokens.shape == (2, 4, 4, 8) and tokens.std() > 0.01  # keys and values, per head, initialised
    x = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(3))
    model.train()(x, labels=x).loss.backward()
    assert tokens.grad is not None and tokens.grad.abs().sum() > 0
    plain = build(config_for("full"))
    assert model.num_parameters() - plain.num_parameters() == 2 * 2 * 4 * 4 * 8
    assert not any("memory_tokens" in name for name in plain.state_dict())  # m = 0: no parameter at all
    model.eval().save_pretrained(tmp_path / "m")
    loaded = TransformerXL.from_pretrained(tmp_path / "m")
    torch.testing.assert_close(loaded.blocks[1].attn.memory_tokens, tokens)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits)
        out = model(x, mem_len=0, output_attentions=True)
    assert out.attentions[0].shape == (2, 4, 12, 4 + 12)  # over [tokens ; segment]
    torch.testing.assert_close(out.attentions[0].sum(-1), torch.ones(2, 4, 12))


def test_memory_tokens_in_the_bidirectional_encoder_with_padding():
    model = build(config_for("full", causal=False, memory_tokens=2, mem_len=0))
    lengths = (11, 6)
    sequences = [torch.randint(1, 61, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    ids = torch.zeros(2, 11, dtype=torch.long)
    attention_mask = torch.zeros(2, 11, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = seq
        attention_mask[row, : len(seq)] = 1
    with torch.no_grad():
        batch = model(ids, attention_mask=attention_mask).logits
        for row, seq in enumerate(sequences):
            torch.testing.assert_close(batch[row, : len(seq)], model(seq[None]).logits[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("causal", "n", "i"), [(True, 31, 17), (True, 23, 23), (False, 22, 22)])
@pytest.mark.parametrize("options", [dict(), dict(dilation=(1, 2, 1, 3)), dict(global_tokens=2),
                                     dict(chosen=True)])
def test_sliding_with_memory_tokens_equals_its_dense_reference(causal, n, i, options):
    options = dict(options)
    chosen = chosen_tokens(i) if options.pop("chosen", False) else None
    fast, eager = kernel_pair(config_for("sliding", causal=causal, window=3, **options))
    q, k, v = qkv(n, i, grad=True)
    k_all, v_all, _ = with_tokens(q, k, v, 3)
    mask = AttentionMask(causal=causal, memory_tokens=3, global_mask=chosen)
    got = attend(fast, q, k_all, v_all, mask)
    torch.testing.assert_close(got, attend(eager, q, k_all, v_all, mask), atol=1e-5, rtol=1e-5)
    got.square().sum().backward()
    assert k.grad is not None and torch.isfinite(k.grad).all()


@pytest.mark.parametrize("causal", [True, False])
def test_sliding_with_memory_tokens_and_a_window_covering_everything_is_full_attention_with_them(causal):
    q, k, v = qkv(22, 22)
    k_all, v_all, _ = with_tokens(q, k, v, 3)
    mask = AttentionMask(causal=causal, memory_tokens=3)
    kernel = KERNELS[("sliding", "fast")](config_for("sliding", causal=causal, window=40))
    torch.testing.assert_close(attend(kernel, q, k_all, v_all, mask), attend(eager_attention, q, k_all, v_all, mask),
                               atol=1e-5, rtol=1e-5)


def test_memory_tokens_are_refused_by_kernels_that_cannot_take_them():
    with pytest.raises(ConfigError, match=r"config.memory_tokens needs an attention kernel that takes them \(full, sliding\)"):
        config_for("lsh", memory_tokens=2)
    with pytest.raises(ConfigError, match="config.memory_tokens must be >= 0"):
        config_for("full", memory_tokens=-1)
    with pytest.raises(ConfigError, match="config.memory_tokens must be 0 with arch='encoder-decoder'"):
        EncoderDecoderConfig(**{k: v for k, v in BASE.items() if k != "mem_len"}, memory_tokens=2, pos_encoding="rope")


@pytest.mark.parametrize(("name", "window", "weights"), [
    ("linear", "same_length is not available with attention='linear' (no window over prefix sums)",
     "output_attentions is not available with attention='linear': it never forms the attention probabilities"),
    ("performer", "same_length is not available with attention='performer' (no window over prefix sums)",
     "output_attentions is not available with attention='performer': it never forms the attention probabilities"),
    ("compressed", "same_length is not available with attention='compressed'",
     "output_attentions is not available with attention='compressed': it attends over compressed rows, not keys"),
    ("sinkhorn", "same_length is not available with attention='sinkhorn'",
     "output_attentions is not available with attention='sinkhorn': it attends over sorted (mixed) blocks, not keys"),
    ("inducing", None,
     "output_attentions is not available with attention='inducing': it attends over inducing-point summaries, not keys"),
    ("linformer", None,
     "output_attentions is not available with attention='linformer': it attends over projected rows, not keys"),
])
def test_kernel_refusals_name_the_kernel_and_the_reason(name, window, weights):
    """The refusals written once (`registry.refuse`) keep each kernel's message, word for word."""
    causal = SPECS[name].causal
    kernel = KERNELS[(name, "eager" if (name, "fast") not in KERNELS else "fast")](config_for(name, causal=causal))
    q, k, v = qkv(12, 12)
    with pytest.raises(UsageError) as err:
        attend(kernel, q, k, v, AttentionMask(causal=causal), need_weights=True)
    assert str(err.value) == weights
    if window is not None:
        with pytest.raises(UsageError) as err:
            attend(kernel, q, k, v, AttentionMask(window=4))
        assert str(err.value) == window


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dilation", [(), (1, 2, 1, 3)])
def test_sliding_with_everything_at_once_equals_its_dense_reference(window, dilation):
    """xl positions, memory, a same_length window, mixed dilations, memory tokens and chosen tokens."""
    config = config_for("sliding", window=3, dilation=dilation)
    model = build(config)
    n, i = 31, 17
    positions = model.pos.layer(0, model.pos.prepare(k_len=n, clamp_len=0, device=torch.device("cpu"),
                                                     dtype=torch.float32))
    fast, eager = kernel_pair(config)
    q, k, v = qkv(n, i)
    k_all, v_all, _ = with_tokens(q, k, v, 3)
    mask = AttentionMask(window=window, global_mask=chosen_tokens(i), memory_tokens=3)
    torch.testing.assert_close(attend(fast, q, k_all, v_all, mask, positions=positions),
                               attend(eager, q, k_all, v_all, mask, positions=positions), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["elu", "relu"])
def test_linear_feature_map_is_the_formula_with_its_gradient(kind):
    """φ is shifted in place (one buffer: see txl/nn/attention/linear.py); value and gradient are the formula's."""
    import torch.nn.functional as F

    from txl.nn.attention.linear import feature_map
    from txl.nn.attention.performer import FEATURE_EPS

    x = torch.randn(2, 3, 7, 4, dtype=torch.float64, requires_grad=True)
    formula = (F.elu(x) + 1.0 if kind == "elu" else F.relu(x)) + FEATURE_EPS
    torch.testing.assert_close(feature_map(x, kind), formula)
    assert torch.autograd.gradcheck(lambda t: feature_map(t, kind), (x,))
