"""Fixed sparse attention, the "strided" pattern of Child et al. 2019 (Sparse Transformers, arXiv
1904.10509, §4.2), as two kinds of heads (their "interleaved" variant: each head one pattern).

With stride l (`SparseOptions.stride`), the query at position p sees, in

- a **local** head (the first ceil(h/2) heads): A¹ = {p-l, …, p}, the l+1 most recent keys (both ends
  included, as the paper's t = max(0, i-l) … i);
- a **strided** head (the other heads): A² = {j ≤ p : (p - j) mod l = 0}, every l-th key back to the
  start of the memory.

Two layers of such heads connect any pair of positions. With l ≈ sqrt(n) (the paper's choice) a head
costs O(n·sqrt(n)); here l is fixed by the config, so the local heads cost O(n·l) and the strided
heads O(n²/l). Positions count over [memory ; segment], so the memory extends both patterns.

Both patterns are the sliding-window kernel's machinery with one `(window, dilation)` pair per head:
local = (l+1, 1), strided = (unbounded, l). Every positional encoding applies (the strided heads use
its terms at distances that are multiples of l). `attention_impl="eager"` is the dense-mask reference.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from txl.errors import ConfigError
from txl.nn.attention.registry import register
from txl.nn.attention.sliding import UNBOUNDED, SlidingWindowAttention, SlidingWindowReference, shaw_values
from txl.nn.options import LayerConfig, Options


@dataclass(frozen=True)
class SparseOptions(Options):
    """`attention_options` of attention='sparse'."""

    stride: int = 128  # l: local window and stride; the paper picks l ≈ sqrt(context)

    def validate(self) -> None:
        self.at_least(1, "stride")


def sparse_head_windows(config: LayerConfig) -> list[tuple[int, int]]:
    """(window, dilation) per head: local heads first, then strided heads."""
    local = (config.n_head + 1) // 2
    stride = config.attention_options.stride
    return [(stride + 1, 1)] * local + [(UNBOUNDED, stride)] * (config.n_head - local)


def check_sparse(config: LayerConfig) -> None:
    if config.n_head < 2:
        raise ConfigError("config.attention='sparse' needs n_head >= 2 (half local, half strided heads)")
    if shaw_values(config):
        raise ConfigError(
            "config.position_options.values (shaw) needs every head on one attention pattern; it is not "
            "available with attention='sparse' or mixed sliding dilation"
        )


@register("sparse", "fast", check=check_sparse, options=SparseOptions)
class SparseStridedAttention(SlidingWindowAttention):
    """`attention="sparse"`: local + strided heads (Child et al. 2019), block-banded, no n×n matrix."""

    name = "sparse"

    def __init__(self, config: LayerConfig):
        nn.Module.__init__(self)
        self.head_windows = sparse_head_windows(config)
        self.global_tokens = 0


@register("sparse", "eager", check=check_sparse, options=SparseOptions)
class SparseStridedReference(SparseStridedAttention, SlidingWindowReference):
    """The same pattern as a dense mask (O(n²)): the ground truth for `SparseStridedAttention`."""
