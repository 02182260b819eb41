"""Performer attention, FAVOR+ (Choromanski et al. 2021, "Rethinking Attention with Performers",
arXiv 2009.14794): softmax attention estimated with positive orthogonal random features, in time and
memory linear in the sequence length.

    softmax(q·k / sqrt(d)) ∝ exp(q'·k') ≈ φ(q')·φ(k'),   q' = q / d^(1/4),  k' = k / d^(1/4)
    φ(x)_r = exp(ω_r·x - |x|²/2)   for r = 1 … m  (`features`)

with ω_1 … ω_m blocks of d orthogonal directions whose norms are drawn like Gaussian vectors' (the
paper's "positive orthogonal random features", Lemma 1 and §2.4; the 1/sqrt(m) factor cancels in the
normalisation and is left out). Output_i = Σ_j φ(q_i)·φ(k_j) v_j / Σ_j φ(q_i)·φ(k_j), never forming
the n×n matrix:

- **causal** (the LM): prefix sums S = Σ_{j≤i} φ(k_j) v_jᵀ and z = Σ_{j≤i} φ(k_j) (§2.6), in chunks
  of c = `chunk_size` queries: inside each chunk a small masked quadratic product, across chunks the
  running (S, z). Memory keys simply start the prefix. Everything but the two-op recursion of (S, z)
  is batched over groups of chunks sized to stay in cache (`GROUP_ELEMENTS`). O(n·(c + m)·d) time, O(n·c + (n/c)·m·d) memory: never n×n.
- **bidirectional** (`causal=False`): S and z over all keys at once.

Numerics (bf16/fp16 safe): features, sums and the division run in float32 whatever the input dtype.
exp(ω·x - |x|²/2) can overflow float32 for large keys, so every key gets its own stabiliser
s_j = max_r(ω_r·k'_j - |k'_j|²/2) and the sums run in the scale of the largest s seen so far (an online
rescaling like flash attention's): strictly causal, so no future key changes a past output, and no
exp of a positive number. Queries subtract their own max over features (it cancels in the ratio).
As in the reference implementation, a small constant is added to the features (`FEATURE_EPS`) so a
denominator can never be 0.

Features: one ω per layer, shared by the heads, a persistent buffer (saved with the model, so a
checkpoint evaluates identically). In training they are redrawn every `redraw_interval`
forward passes (0 = never); `redraw_features(model)` redraws every layer at once (e.g. for a trainer
that counts optimizer steps instead). The forward counter is not saved: a resumed run restarts it.

Positional encodings: a kernelized attention never forms scores, so only encodings that live in q/k
(`rope`) or in the input (`sinusoidal`, `learned`) apply; the config rejects xl, shaw and alibi, and
`dropatt` (there are no probabilities to drop) and `same_length` (no window over prefix sums).

`attention_impl="eager"` computes the same feature-map kernel as a masked n×n product: the reference
the chunked prefix sums are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from txl.nn.attention.masks import AttentionMask
from txl.nn.attention.registry import check_no_probabilities, refuse, register
from txl.nn.options import LayerConfig, Options
from txl.nn.positional import LayerPositions


@dataclass(frozen=True)
class PerformerOptions(Options):
    """`attention_options` of attention='performer'."""

    features: int = 256  # random features: more = closer to softmax, cost O(n·features·d_head)
    redraw_interval: int = 1000  # redraw the features every N training forwards; 0 = never

    def validate(self) -> None:
        self.at_least(1, "features", high=65536)
        self.at_least(0, "redraw_interval", high=1 << 40)


FEATURE_EPS = 1e-6  # google-research/performer fast_attention: numerical_stabilizer


def orthogonal_gaussian(n_features: int, dim: int, *, generator: torch.Generator | None = None) -> Tensor:
    """(n_features, dim): stacked blocks of `dim` orthogonal rows (QR of a Gaussian matrix), each row
    rescaled to the norm of a Gaussian vector so that marginally every row is N(0, I)."""
    blocks = []
    for _ in range((n_features + dim - 1) // dim):
        gaussian = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
        q, _ = torch.linalg.qr(gaussian)
        blocks.append(q.T)
    directions = torch.cat(blocks)[:n_features]
    norms = torch.randn(n_features, dim, generator=generator, dtype=torch.float64).norm(dim=1)
    return (directions * norms[:, None]).to(torch.float32)


def feature_logits(x: Tensor, features: Tensor) -> Tensor:
    """ω_r·x' - |x'|²/2 with x' = x / d^(1/4): the log of the positive random features, (.., n, m)."""
    x = x * x.shape[-1] ** -0.25
    return (x @ features.T).sub_((x * x).sum(-1, keepdim=True) / 2)  # in place: one (n, m) buffer


# Stabilisers are constants for autograd: they cancel in the ratio (up to FEATURE_EPS), so their
# gradient is zero, and detaching them lets the (n, m) feature maps be computed in place (large
# fresh buffers are what these kernels spend their time on at 16k-32k tokens).


def query_features(q: Tensor, features: Tensor) -> Tensor:
    logits = feature_logits(q, features)
    return logits.sub_(logits.detach().amax(-1, keepdim=True)).exp_() + FEATURE_EPS  # the max cancels per query


def key_features(k: Tensor, features: Tensor) -> tuple[Tensor, Tensor]:
    """φ(k_j) / exp(s_j) and the per-key stabiliser s_j: φ(k_j) = features · exp(s_j)."""
    logits = feature_logits(k, features)
    stabiliser = logits.detach().amax(-1)  # (.., n)
    return logits.sub_(stabiliser[..., None]).exp_() + FEATURE_EPS, stabiliser


GROUP_ELEMENTS = 1 << 20  # c×c products per batched step of the causal path (4 MB in float32)


def causal_linear_attention(
    phi_q: Tensor, phi_k: Tensor, key_scale: Tensor, v: Tensor, *, chunk_size: int
) -> Tensor:
    """Σ_{j≤p} φq_p·φk_j e^{s_j} v_j / Σ_{j≤p} φq_p·φk_j e^{s_j}, queries = the last i of the n keys.

    phi_q (b, h, i, m); phi_k (b, h, n, m); key_scale = s (b, h, n, no gradient); v (b, h, n, d);
    all float32.
    """
    b, h, i, m = phi_q.shape
    n, d = v.shape[-2:]
    memory_len = n - i
    key_scale = key_scale.detach()
    # v with a column of ones: every product with it carries the normaliser z = Σ φk along with
    # S = Σ φk vᵀ, so numerator and denominator come out of the same matmuls (half the small ops).
    # Appended per group of chunks, not to the whole v: at 32k tokens a (b, h, n, d+1) copy is a
    # fresh 34 MB buffer, above glibc's largest mmap threshold, i.e. new pages faulted in every call.
    def with_ones(x: Tensor) -> Tensor:
        return torch.cat([x, x.new_ones(*x.shape[:-1], 1)], dim=-1)

    # Running state in the scale exp(-top): [S | z] = Σ φk e^{s-top} [vᵀ | 1].
    if memory_len:
        top = key_scale[..., :memory_len].amax(-1)  # (b, h)
        weight = (key_scale[..., :memory_len] - top[..., None]).exp()[..., None]
        state = torch.einsum("bhjm,bhjd->bhmd", phi_k[:, :, :memory_len] * weight, with_ones(v[:, :, :memory_len]))
    else:
        top = key_scale.new_full((b, h), float("-inf"))
        state = v.new_zeros(b, h, m, d + 1)
    # The segment in chunks of c queries (padded at the end to whole chunks; padding keys get scale
    # -inf, i.e. weight 0, padding queries features 1 so their discarded rows never divide 0 by 0).
    c = chunk_size
    n_chunks = -(-i // c)
    pad = n_chunks * c - i

    def chunked(x: Tensor, value: float) -> Tensor:  # (b, h, i, ...) -> (b, h, nc, c, ...), a view if no pad
        if pad:
            x = torch.nn.functional.pad(x.movedim(2, -1), (0, pad), value=value).movedim(-1, 2)
        return x.reshape(b, h, n_chunks, c, *x.shape[3:])

    q_c = chunked(phi_q, 1.0)  # (b, h, nc, c, m)
    k_c = chunked(phi_k[:, :, memory_len:], 0.0)
    v_c = chunked(v[:, :, memory_len:], 0.0)  # (b, h, nc, c, d); padding keys weigh 0 (scale -inf, features 0)
    s_seg = torch.nn.functional.pad(key_scale[:, :, memory_len:], (0, pad), value=float("-inf"))
    # Each query's scale: the largest stabiliser among the keys it sees (a causal running max);
    # the state entering chunk t is kept in the scale reached at the end of chunk t-1.
    query_top = torch.maximum(s_seg.cummax(-1).values, top[..., None]).view(b, h, n_chunks, c)
    chunk_top = query_top[..., -1]  # (b, h, nc)
    before = torch.cat([top[..., None], chunk_top[..., :-1]], dim=-1)  # (b, h, nc)
    s_c = s_seg.view(b, h, n_chunks, c)

    # Chunks go in groups whose c×c products total about GROUP_ELEMENTS numbers: batched enough for
    # few small ops, small enough that the working set stays in cache (one giant (nc, c, c) product
    # made 32k tokens cost far more than twice 16k, docs/results/benchmarks.md; the work itself is linear in n).
    group = max(1, GROUP_ELEMENTS // (b * h * c * c))
    causal = torch.ones(c, c, dtype=torch.bool, device=v.device).tril()
    outs = []
    for q_g, k_g, v_g, s_g, top_g, before_g, end_g in zip(
        q_c.split(group, 2), k_c.split(group, 2), v_c.split(group, 2), s_c.split(group, 2),
        query_top.split(group, 2), before.split(group, -1), chunk_top.split(group, -1),
    ):
        v_g = with_ones(v_g)  # (b, h, g, c, d+1)
        # Inside each chunk: the masked quadratic product, for the group's chunks at once.
        exponent = (s_g[..., None, :] - top_g[..., None]).masked_fill_(~causal, float("-inf")).exp_()
        weights = (q_g @ k_g.transpose(-1, -2)).mul_(exponent)  # (b, h, g, c, c), 0 above the diagonal
        inside = weights @ v_g  # (b, h, g, c, d+1)
        # Across chunks: prefix sums. The recursion is sequential; each chunk's queries read the state
        # entering it right away, so no (nc, m, d) stack of states is ever built. unbind and split,
        # not indexing, in the loops: an index's backward writes a full-size zero gradient each time.
        k_weighted = k_g * (s_g - end_g[..., None]).exp_()[..., None]  # in the scale of the chunk's end
        rescale = (before_g - end_g).exp()  # (b, h, g): old scale -> new scale, <= 1
        from_state = []
        for q_t, k_t, v_t, rescale_t in zip(q_g.unbind(2), k_weighted.unbind(2), v_g.unbind(2), rescale.unbind(-1)):
            from_state.append(q_t @ state)  # (b, h, c, d+1), in the scale `before` of this chunk
            state = state * rescale_t[..., None, None] + k_t.transpose(-1, -2) @ v_t
        carry = (before_g[..., None] - top_g).exp_()[..., None]  # (b, h, g, c, 1): state -> query scale
        total = inside + torch.stack(from_state, dim=2) * carry  # (b, h, g, c, d+1)
        outs.append(total[..., :d] / total[..., d:])
    out = torch.cat(outs, dim=2).reshape(b, h, n_chunks * c, d)
    return out[:, :, :i]


def quadratic_linear_attention(phi_q: Tensor, phi_k: Tensor, key_scale: Tensor, v: Tensor, *, causal: bool) -> Tensor:
    """The same estimator as an explicit (i, n) matrix of φq·φk (masked when causal): the reference."""
    i, n = phi_q.shape[-2], phi_k.shape[-2]
    weights = phi_k * (key_scale - key_scale.amax(-1, keepdim=True)).exp()[..., None]
    scores = phi_q @ weights.transpose(-1, -2)  # (b, h, i, n)
    if causal:
        visible = torch.ones(i, n, dtype=torch.bool, device=v.device).tril(diagonal=n - i)
        scores = scores * visible
    return (scores @ v) / scores.sum(-1, keepdim=True)


def bidirectional_linear_attention(phi_q: Tensor, phi_k: Tensor, key_scale: Tensor, v: Tensor) -> Tensor:
    """Non-causal FAVOR+: one global S = φ(K)ᵀV and z = φ(K)ᵀ1 (a shared max scale is exact here)."""
    weights = phi_k * (key_scale - key_scale.amax(-1, keepdim=True)).exp()[..., None]
    state = torch.einsum("bhjm,bhjd->bhmd", weights, v)
    return (phi_q @ state) / (phi_q @ weights.sum(2)[..., None])


def padded_keys(phi_k: Tensor, key_scale: Tensor, key_padding: Tensor) -> tuple[Tensor, Tensor]:
    """Padding keys out of the sums: their features become exactly 0, and their stabiliser the
    smallest real key's, so it can never rescale the real keys' sums. (b, n) key_padding, True = real."""
    real = key_padding[:, None, :]  # (b, 1, n)
    phi_k = phi_k * real[..., None].to(phi_k.dtype)
    smallest = key_scale.masked_fill(~real, float("inf")).amin(-1, keepdim=True)
    smallest = smallest.masked_fill(smallest.isinf(), 0.0)  # a row of padding only
    return phi_k, torch.where(real, key_scale, smallest)


@register("performer", "fast", bidirectional=True, score_terms=False, check=check_no_probabilities, options=PerformerOptions)
class PerformerAttention(nn.Module):
    """`attention="performer"`: FAVOR+ with chunked causal prefix sums (or bidirectional sums)."""

    chunk_size = 128  # queries per causal step: bounds the intra-chunk matrix at chunk² per head

    def __init__(self, config: LayerConfig):
        super().__init__()
        self.redraw_interval = config.attention_options.redraw_interval
        self.register_buffer("features", orthogonal_gaussian(config.attention_options.features, config.d_head))
        self.forwards_since_redraw = 0

    @torch.no_grad()
    def redraw(self) -> None:
        self.features.copy_(orthogonal_gaussian(*self.features.shape).to(self.features.device))
        self.forwards_since_redraw = 0

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        refuse("performer", mask, need_weights=need_weights, same_length="no window over prefix sums",
               weights="it never forms the attention probabilities")
        if training and self.redraw_interval:
            if self.forwards_since_redraw >= self.redraw_interval:
                self.redraw()
            self.forwards_since_redraw += 1
        q, k = positions.content(q, k)  # RoPE rotates here; absolute encodings are already in the input
        # Float32 throughout, even in a bf16 model or under the trainer's autocast (which would
        # otherwise run these matmuls in bf16).
        with torch.autocast(device_type=q.device.type, enabled=False):
            features = self.features.float()
            phi_q = query_features(q.float(), features)
            phi_k, key_scale = key_features(k.float(), features)
            if mask.key_padding is not None:
                phi_k, key_scale = padded_keys(phi_k, key_scale, mask.key_padding)
            out = self.linear_attention(phi_q, phi_k, key_scale, v.float(), causal=mask.causal)
            if mask.key_padding is not None:  # a query that sees only padding: 0/0
                out = out.nan_to_num(0.0)
        return out.to(v.dtype), None

    def linear_attention(self, phi_q: Tensor, phi_k: Tensor, key_scale: Tensor, v: Tensor, *, causal: bool) -> Tensor:
        if not causal:
            return bidirectional_linear_attention(phi_q, phi_k, key_scale, v)
        return causal_linear_attention(phi_q, phi_k, key_scale, v, chunk_size=self.chunk_size)

    def extra_repr(self) -> str:
        m, d = self.features.shape
        return f"features={m}, d_head={d}, redraw_interval={self.redraw_interval}"


@register("performer", "eager", bidirectional=True, score_terms=False, check=check_no_probabilities, options=PerformerOptions)
class PerformerReference(PerformerAttention):
    """The same random-feature kernel as a masked quadratic product: the ground truth for the prefix sums."""

    def linear_attention(self, phi_q, phi_k, key_scale, v, *, causal):
        return quadratic_linear_attention(phi_q, phi_k, key_scale, v, causal=causal)


def redraw_features(model: nn.Module) -> int:
    """Redraw the random features of every Performer layer in `model`; returns how many were redrawn."""
    layers = [m for m in model.modules() if isinstance(m, PerformerAttention)]
    for layer in layers:
        layer.redraw()
    return len(layers)
