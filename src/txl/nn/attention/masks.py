"""Which keys each query may see: the one home of distances, causal, window and padding masks.

Queries are always the *last* `q_len` of the `k_len` keys they attend over ([memory ; segment] for
self-attention), so query i sits at key position i + (k_len - q_len) and its distance to key j is
`i + (k_len - q_len) - j` (negative = a future key). Every kernel, positional encoding and mask in
txl uses this one convention. Cross-attention has no such relation: it is non-causal and only its
padding mask applies.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

# A finite fill keeps rows that see no key (a padded query, padding rows of a block) free of NaN; for
# any row with a visible key, exp(NEG - max) is exactly 0, the same as a -inf fill.
NEG = torch.finfo(torch.float32).min


def distances(q_len: int, k_len: int, device: torch.device) -> Tensor:
    """[q_len, k_len] int64 distance query i -> key j (negative = a future key)."""
    offset = k_len - q_len
    return torch.arange(q_len, device=device)[:, None] + offset - torch.arange(k_len, device=device)[None, :]


def causal_mask(q_len: int, k_len: int, window: int | None, device: torch.device) -> Tensor:
    """[q_len, k_len] bool, True where query i may attend key j: j is not in the future and, with a
    `window`, among the query's `window` most recent keys (itself included)."""
    dist = distances(q_len, k_len, device)
    visible = dist >= 0
    if window is not None:
        visible &= dist < window
    return visible


@functools.lru_cache(maxsize=64)
def causal_bias(q_len: int, k_len: int, window: int | None, device: torch.device, dtype: torch.dtype) -> Tensor:
    """`causal_mask` as an additive [q_len, k_len] tensor: 0 where visible, -inf elsewhere (cached).

    Adding it is cheaper than an in-place `masked_fill_` with a broadcast bool mask on CPU
    (docs/results/benchmarks.md), and -inf + a finite score is -inf, so softmax sees what masking gives."""
    return torch.zeros(q_len, k_len, device=device, dtype=dtype).masked_fill_(
        ~causal_mask(q_len, k_len, window, device), float("-inf"))


def additive_mask(visible: Tensor) -> Tensor:
    """0 where visible, NEG elsewhere (float32): one in-place add instead of a masked_fill."""
    return torch.zeros(visible.shape, dtype=torch.float32, device=visible.device).masked_fill_(~visible, NEG)


@dataclass(frozen=True)
class AttentionMask:
    """What every attention kernel is told about visibility, beside q, k and v.

    causal: queries see no future key (the LM). False: every key is visible (a bidirectional encoder,
        cross-attention over an encoder's output).
    window: causal only; each query sees at most its `window` most recent keys (itself included).
        `same_length` is `window = mem_len` (kimiyoung's convention).
    key_padding: (batch, k_len) bool, True for a real key, False for padding (the Hugging Face
        `attention_mask` convention, 1 = token). None = no padding.
    global_mask: (batch, q_len) bool over the current segment: True for a global token (ETC /
        Longformer / BigBird global attention on chosen positions, e.g. a [CLS] or question tokens). A
        global query sees every key it may see (causal: every earlier key, memory included), and every
        query sees the global keys (causal: the earlier ones). Only kernels registered with
        `global_mask=True` take it (bigbird, sliding; full, where it changes nothing). None = none.
    memory_tokens: the first m keys (and values) are learned memory tokens (`config.memory_tokens`,
        Sukhbaatar et al. 2019), put there by the layer: every query sees them, they have no position
        (content score q·k only, see `txl.nn.attention.layer`), and every length and distance above counts
        the keys after them. Only kernels registered with `memory_tokens=True` take them. 0 = none.
    """

    causal: bool = True
    window: int | None = None
    key_padding: Tensor | None = None
    global_mask: Tensor | None = None
    memory_tokens: int = 0

    def __post_init__(self) -> None:
        if self.window is not None and not self.causal:
            raise ValueError("AttentionMask.window needs causal=True (it counts keys back from each query)")

    def visible(self, q_len: int, k_len: int, device: torch.device) -> Tensor:
        """(batch or 1, 1, q_len, k_len) bool: True where query i may attend key j (k_len counts the
        memory tokens, always visible)."""
        k_len -= self.memory_tokens
        if self.causal:
            visible = causal_mask(q_len, k_len, self.window, device)[None, None]
        else:
            visible = torch.ones(1, 1, q_len, k_len, dtype=torch.bool, device=device)
        if self.key_padding is not None:
            visible = visible & self.key_padding[:, None, None, :].to(device)
        if self.memory_tokens:
            visible = torch.nn.functional.pad(visible, (self.memory_tokens, 0), value=True)
        return visible


CAUSAL = AttentionMask()
