"""Fused attention: the "sdpa" and "flex" impls of the kernels that form a score matrix (full, sliding,
sparse), for GPUs. Same signature and results as the eager reference (tests/test_fused_attention.py).

- **sdpa**: `torch.nn.functional.scaled_dot_product_attention` on the content pair of
  `positions.content(q, k)` (xl's q + u, RoPE/xPos's rotated q and k), with the encoding's score term
  (xl's rel-shifted (q+v)·W_R R, Shaw's q·a_K, ALiBi's and T5's biases) times the scale plus the mask as
  one additive float `attn_mask` (SDPA scales q·k itself). Without a score term the mask alone goes in:
  none at all, or `is_causal`, when the queries are the whole sequence; `causal_lower_right` when a
  memory comes first (queries are the last i of n keys, so the causal mask is bottom-right aligned;
  SDPA's `is_causal` is top-left); a float mask for `same_length` windows and padding. Attention
  dropout is SDPA's `dropout_p`.
- **flex**: `torch.nn.attention.flex_attention` with a `score_mod` that reads the score term per
  (b, h, q_idx, kv_idx) from a captured tensor, and a `block_mask` for causal-with-memory,
  `same_length`, padding and the sliding/sparse bands (per head window and dilation). A term indexed by
  distance (xl, causal Shaw: the encoding's `rel_shift` contract, columns = distances k_len-1 … 0) is
  captured *before* the rel-shift, which becomes indexing; for the bands only the distances a window
  reaches are computed (O(i·w), not O(i·n)). On CUDA the call is `torch.compile`d (fused Triton
  kernels, forward and backward); elsewhere it runs torch's unfused reference.
- What neither takes falls back to the "fast" kernel of the same attention, which computes the same
  thing (documented in docs/guide/models.md, "Attention impls"): `need_weights`, learned memory tokens,
  Shaw's value term (it needs the probabilities), sliding's global tokens and `global_mask`, and for
  flex attention dropout in training (FlexAttention has no dropout).
- torch 2.13's FlexAttention has no backward on the CPU (`_validate_device` refuses inputs that need
  gradients; its math backward exists and is what the CPU tests check, with that check patched out):
  training with `attention_impl="flex"` on the CPU is refused in one line (`UsageError`).

Which one `attention_impl="auto"` takes on CUDA is `txl.nn.attention.registry.CUDA_AUTO` (no GPU has
measured it yet); on the CPU auto stays the fast kernel.

Dimension names: b batch, h heads, i queries, n keys (memory + segment), d head dim.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import flex_attention as flex_module
from torch.nn.attention.bias import causal_lower_right

from txl.errors import UsageError
from txl.nn.attention.masks import AttentionMask, causal_bias, distances
from txl.nn.attention.registry import add_impl
from txl.nn.attention.sliding import SlidingWindowAttention, effective_window, local_pattern
from txl.nn.attention.sparse import SparseStridedAttention
from txl.nn.attention.xl_fast import fast_attention, rel_shift_fast
from txl.nn.positional import LayerPositions, PositionalEncoding, rel_shift_pad

# torch 2.13 refuses FlexAttention's backward on the CPU; the tests switch this on (with torch's device
# check patched out) to check the score_mod and mask_mod gradients against eager there.
FLEX_CPU_BACKWARD = False


def compute_dtype(q: Tensor) -> torch.dtype:
    """The dtype the kernel computes in: autocast's, if on, else the queries'."""
    device = q.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype


def has_value_term(positions: LayerPositions, q: Tensor) -> bool:
    """Whether the encoding adds a term to the output from the probabilities (Shaw's values), which a
    fused kernel never returns. Asked of the encoding with a 1×1 probe (only encodings that override
    `value_term` are asked)."""
    if type(positions.encoding).value_term is PositionalEncoding.value_term:
        return False
    with torch.no_grad():
        return positions.value_term(q.new_zeros(1, 1, 1, 1)) is not None


def score_term(positions: LayerPositions, q: Tensor, k_len: int) -> tuple[Tensor | None, bool]:
    """The encoding's unscaled score term for the queries q (the last i of k_len keys) and whether it is
    indexed by distance: (.., i, k_len) with column c = distance k_len-1-c, before the rel-shift (the
    `rel_shift` contract of `txl.nn.positional`); else (.., i, k_len) by key. None: no term."""
    seen: list[Tensor] = []

    def keep(raw: Tensor) -> Tensor:
        seen.append(raw)
        return raw

    term = positions.score_bias(q, k_len=k_len, rel_shift=keep)
    if not seen:
        return term, False
    if len(seen) == 1 and term is seen[0]:
        return term, True
    # an encoding that does more than shift: its shifted term by key
    return positions.score_bias(q, k_len=k_len, rel_shift=rel_shift_pad), False


# ---------------------------------------------------------------------------------------------
# sdpa


def _sdpa(q_content: Tensor, k_content: Tensor, v: Tensor, attn_mask, *, dtype: torch.dtype, dropatt: float,
          training: bool, is_causal: bool = False) -> Tensor:
    return F.scaled_dot_product_attention(q_content.to(dtype), k_content.to(dtype), v.to(dtype), attn_mask=attn_mask,
                                          dropout_p=dropatt if training else 0.0, is_causal=is_causal)


def _scaled_term(positions: LayerPositions, q: Tensor, k_len: int, dtype: torch.dtype) -> Tensor | None:
    """The score term by key, times the attention scale, in `dtype` (SDPA adds it after scaling q·k)."""
    term, by_distance = score_term(positions, q, k_len)
    if term is None:
        return None
    if by_distance:  # the strided shift (its garbage is masked); a traced graph takes the reference one
        term = rel_shift_pad(term) if torch.compiler.is_compiling() else rel_shift_fast(term)
    return term.to(dtype) * q.shape[-1] ** -0.5


@add_impl("full", "sdpa")
def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    positions: LayerPositions,
    mask: AttentionMask,
    dropatt: float,
    training: bool,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """`eager_attention` through SDPA (see the module docstring)."""
    if need_weights or mask.memory_tokens or has_value_term(positions, q):
        return fast_attention(q, k, v, positions=positions, mask=mask, dropatt=dropatt, training=training,
                              need_weights=need_weights)
    i, n = q.shape[-2], k.shape[-2]
    dtype = compute_dtype(q)
    q_content, k_content = positions.content(q, k)
    bias = _scaled_term(positions, q, n, dtype)
    empty = None
    if mask.key_padding is not None:  # a padded query may see no key: it sees all, and its output is set to 0
        visible = mask.visible(i, n, q.device)  # (b, 1, i, n)
        empty = ~visible.any(-1, keepdim=True)
        fill = torch.zeros(visible.shape, dtype=dtype, device=q.device).masked_fill_(~(visible | empty), float("-inf"))
        bias = fill if bias is None else bias + fill
    elif mask.causal and (i > 1 or mask.window is not None):  # (one query without a window sees every key)
        if bias is None and mask.window is None:
            is_causal = i == n
            attn_mask = None if is_causal else causal_lower_right(i, n)  # bottom-right: queries after the memory
            return _sdpa(q_content, k_content, v, attn_mask, dtype=dtype, dropatt=dropatt, training=training,
                         is_causal=is_causal), None
        causal = causal_bias(i, n, mask.window, q.device, dtype)
        bias = causal if bias is None else bias + causal
    out = _sdpa(q_content, k_content, v, bias, dtype=dtype, dropatt=dropatt, training=training)
    return (out if empty is None else out.masked_fill(empty, 0.0)), None


# ---------------------------------------------------------------------------------------------
# flex


@functools.cache
def _compiled_flex():
    return torch.compile(flex_module.flex_attention, dynamic=False)


def _flex(q: Tensor, k: Tensor, v: Tensor, score_mod, block_mask, *, dtype: torch.dtype) -> Tensor:
    if q.device.type == "cpu" and not FLEX_CPU_BACKWARD:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            raise UsageError("attention_impl='flex' has no backward on the CPU (torch's FlexAttention): run it "
                             "under torch.no_grad() there, or use attention_impl='auto' (fast on the CPU) or 'sdpa'")
        q, k, v = q.detach(), k.detach(), v.detach()  # (torch refuses any input that requires grad)
    args = (q.to(dtype), k.to(dtype), v.to(dtype))
    kwargs = dict(score_mod=score_mod, block_mask=block_mask, scale=q.shape[-1] ** -0.5)
    if q.device.type == "cuda" and not torch.compiler.is_compiling():
        return _compiled_flex()(*args, **kwargs)  # the fused Triton kernels
    if torch.compiler.is_compiling():
        return flex_module.flex_attention(*args, **kwargs)
    with warnings.catch_warnings():  # off CUDA the unfused reference is what we mean (torch warns it is unfused)
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return flex_module.flex_attention(*args, **kwargs)


def _score_mod(term: Tensor, by_distance: bool, q_len: int, k_len: int, scale: float):
    """A score_mod adding `term` (b or 1, h, i, K) times `scale`: by key, or by distance (column
    K-1-distance, distance = q_idx + k_len - q_len - kv_idx; out-of-range columns are clamped, since
    the mask hides those pairs)."""
    batched = term.shape[0] > 1
    width = term.shape[-1]
    shift = width - 1 - (k_len - q_len)  # column = kv_idx + shift - q_idx

    if by_distance:
        def column(q_idx, kv_idx):
            return (kv_idx + shift - q_idx).clamp(0, width - 1)
    else:
        def column(q_idx, kv_idx):
            return kv_idx

    if batched:
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + term[b, h, q_idx, column(q_idx, kv_idx)] * scale
    else:
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + term[0, h, q_idx, column(q_idx, kv_idx)] * scale

    return score_mod


def _flex_term(positions: LayerPositions, q: Tensor, k_len: int, reach: int, dtype: torch.dtype):
    """(term, by_distance) for a score_mod: a term by distance covers only the `reach` nearest
    distances (all that a window sees), a term by key all k_len keys."""
    term, by_distance = score_term(positions, q, k_len)
    if by_distance and reach < k_len:
        term = term[..., k_len - reach:]  # columns = distances reach-1 … 0
    return (None if term is None else term.to(dtype)), by_distance


def _causal_mod(offset: int, window: int | None):
    def mask_mod(b, h, q_idx, kv_idx):
        dist = q_idx + offset - kv_idx
        return (dist >= 0) & (dist < window) if window is not None else dist >= 0
    return mask_mod


@functools.lru_cache(maxsize=32)
def _causal_block_mask(q_len: int, k_len: int, window: int | None, device: torch.device):
    return flex_module.create_block_mask(_causal_mod(k_len - q_len, window), None, None, q_len, k_len, device=device)


def _full_block_mask(mask: AttentionMask, q_len: int, k_len: int, device: torch.device):
    """(block_mask, rows that see no key (b, 1, i, 1) or None)."""
    padding = mask.key_padding
    if padding is None:
        if not mask.causal or (q_len == 1 and mask.window is None):
            return None, None
        return _causal_block_mask(q_len, k_len, mask.window, device), None
    padding = padding.to(device)
    causal = _causal_mod(k_len - q_len, mask.window) if mask.causal else None

    def mask_mod(b, h, q_idx, kv_idx):
        real = padding[b, kv_idx]
        return real & causal(b, h, q_idx, kv_idx) if causal is not None else real

    block_mask = flex_module.create_block_mask(mask_mod, padding.shape[0], None, q_len, k_len, device=device)
    return block_mask, ~mask.visible(q_len, k_len, device).any(-1, keepdim=True)


@add_impl("full", "flex")
def flex_attention_kernel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    positions: LayerPositions,
    mask: AttentionMask,
    dropatt: float,
    training: bool,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """`eager_attention` through FlexAttention (see the module docstring)."""
    if need_weights or mask.memory_tokens or (training and dropatt > 0) or has_value_term(positions, q):
        return fast_attention(q, k, v, positions=positions, mask=mask, dropatt=dropatt, training=training,
                              need_weights=need_weights)
    i, n, d = q.shape[-2], k.shape[-2], q.shape[-1]
    dtype = compute_dtype(q)
    q_content, k_content = positions.content(q, k)
    reach = n if mask.window is None or not mask.causal else min(n, mask.window)
    term, by_distance = _flex_term(positions, q, n, reach, dtype)
    score_mod = None if term is None else _score_mod(term, by_distance, i, n, d**-0.5)
    block_mask, empty = _full_block_mask(mask, i, n, q.device)
    out = _flex(q_content, k_content, v, score_mod, block_mask, dtype=dtype)
    return (out if empty is None else out.masked_fill(empty, 0.0)), None


# ---------------------------------------------------------------------------------------------
# sliding and sparse: the band of each head (window, dilation) as a mask


def _head_reach(head_windows, horizon: int | None, k_len: int) -> list[tuple[int, int]]:
    """(reach, dilation) per head: a key at distance |dist| is in the band when dist % dilation == 0 and
    |dist| < reach (the window in positions, capped by `same_length` and the sequence)."""
    return [(min(effective_window(w, s, horizon), k_len) * s, s) for w, s in head_windows]


@functools.lru_cache(maxsize=32)
def _band_bias(head_windows: tuple, horizon: int | None, causal: bool, q_len: int, k_len: int,
               device: torch.device, dtype: torch.dtype) -> Tensor:
    """(h, i, n) additive mask of the heads' bands (0 inside, -inf outside), as `sliding_reference`."""
    dist = distances(q_len, k_len, device)
    band = torch.stack([local_pattern(dist, effective_window(w, s, horizon), s, causal=causal) for w, s in head_windows])
    return torch.zeros(band.shape, dtype=dtype, device=device).masked_fill_(~band, float("-inf"))


@functools.lru_cache(maxsize=32)
def _band_block_mask(reach: tuple, causal: bool, q_len: int, k_len: int, device: torch.device):
    limit = torch.tensor([r for r, _ in reach], device=device)
    step = torch.tensor([s for _, s in reach], device=device)
    offset = k_len - q_len

    def mask_mod(b, h, q_idx, kv_idx):
        dist = q_idx + offset - kv_idx
        if not causal:
            dist = dist.abs()
        return (dist >= 0) & (dist % step[h] == 0) & (dist < limit[h])

    return flex_module.create_block_mask(mask_mod, None, len(reach), q_len, k_len, device=device)


class _FusedBand:
    """The forward of a fused sliding/sparse kernel: a mixin before the kernel class (whose `__init__`
    sets `head_windows` and `global_tokens`, and whose `forward`, the fast banded kernel, is the
    fallback)."""

    head_windows: list[tuple[int, int]]
    global_tokens: int

    def falls_back(self, q: Tensor, positions: LayerPositions, mask: AttentionMask, *, dropatt: float,
                   training: bool, need_weights: bool) -> bool:
        return bool(need_weights or mask.memory_tokens or mask.global_mask is not None or self.global_tokens
                    or has_value_term(positions, q))

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        if self.falls_back(q, positions, mask, dropatt=dropatt, training=training, need_weights=need_weights):
            return super().forward(q, k, v, positions=positions, mask=mask, dropatt=dropatt, training=training,
                                   need_weights=need_weights)
        self.check_mask(mask)  # (no padding mask: refused as by the fast kernel)
        q_content, k_content = positions.content(q, k)
        return self.attend(q, q_content, k_content, v, positions=positions, mask=mask, dropatt=dropatt,
                           training=training), None


class _SDPABand(_FusedBand):
    def attend(self, q, q_content, k_content, v, *, positions, mask, dropatt, training):
        i, n = q.shape[-2], k_content.shape[-2]
        dtype = compute_dtype(q)
        bias = _band_bias(tuple(self.head_windows), mask.window, mask.causal, i, n, q.device, dtype)
        term = _scaled_term(positions, q, n, dtype)
        return _sdpa(q_content, k_content, v, bias if term is None else bias + term, dtype=dtype, dropatt=dropatt,
                     training=training)


class _FlexBand(_FusedBand):
    def falls_back(self, q, positions, mask, *, dropatt, training, need_weights):
        return (training and dropatt > 0) or super().falls_back(q, positions, mask, dropatt=dropatt, training=training,
                                                                  need_weights=need_weights)

    def attend(self, q, q_content, k_content, v, *, positions, mask, dropatt, training):
        i, n, d = q.shape[-2], k_content.shape[-2], q.shape[-1]
        dtype = compute_dtype(q)
        reach = tuple(_head_reach(self.head_windows, mask.window, n))
        term, by_distance = _flex_term(positions, q, n, min(n, max(r for r, _ in reach)), dtype)
        score_mod = None if term is None else _score_mod(term, by_distance, i, n, d**-0.5)
        block_mask = _band_block_mask(reach, mask.causal, i, n, q.device)
        return _flex(q_content, k_content, v, score_mod, block_mask, dtype=dtype)


@add_impl("sliding", "sdpa")
class SlidingSDPA(_SDPABand, SlidingWindowAttention):
    """attention='sliding' through SDPA: the band as an (h, i, n) mask, dense (O(n²) work and mask)."""


@add_impl("sliding", "flex")
class SlidingFlex(_FlexBand, SlidingWindowAttention):
    """attention='sliding' through FlexAttention: the band as a block mask (blocks outside it skipped)."""


@add_impl("sparse", "sdpa")
class SparseSDPA(_SDPABand, SparseStridedAttention):
    """attention='sparse' through SDPA: local and strided heads as an (h, i, n) mask, dense."""


@add_impl("sparse", "flex")
class SparseFlex(_FlexBand, SparseStridedAttention):
    """attention='sparse' through FlexAttention: local and strided heads as a block mask."""


__all__ = ["SlidingFlex", "SlidingSDPA", "SparseFlex", "SparseSDPA", "flex_attention_kernel", "sdpa_attention"]
