"""The base of the positional encodings (txl/nn/positional.py has the overview): the encoding interface a
layer sees (`LayerPositions`), the base class and registry (`PositionalEncoding`, `register_encoding`), the
sinusoid table and the rel-shift, apart so the encodings' modules (positional.py, positions_absolute.py)
import it without importing each other.

Dimension names: b batch, h heads, i queries, j keys, d head dim, n = k_len.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.errors import UsageError
from txl.nn.options import LayerConfig, NoOptions, Options

RelShift = Callable[[Tensor], Tensor]


def sinusoid_table(positions: Tensor, dim: int) -> Tensor:
    """[len(positions), dim] table: sin in the first half, cos in the second (the reference layout).

    Computed in float64 so long positions (e.g. 3800) keep their precision, then cast to float32.
    """
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim))
    angles = torch.outer(positions.to(torch.float64), inv_freq)
    return torch.cat([angles.sin(), angles.cos()], dim=-1).to(torch.float32)


def rel_shift_pad(x: Tensor) -> Tensor:
    """The reference rel-shift: [.., i, c] scores against distance `n-1-c` -> [.., i, j] against key j.

    Pad a zero column on the left, view the [q, n+1] block as [n+1, q], drop the first row and view
    it back as [q, n]. Afterwards x[.., i, j] holds the score for distance i + (n - q) - j whenever
    that distance is >= 0; the upper triangle (j beyond the query, negative distance) is garbage that
    the causal mask hides. Dai et al. 2019, appendix B; kimiyoung/transformer-xl `_rel_shift`.
    """
    *lead, q, n = x.shape
    padded = F.pad(x, (1, 0))  # (.., q, n+1)
    padded = padded.view(*lead, n + 1, q)
    return padded[..., 1:, :].reshape(*lead, q, n)


def rel_shift_strided(x: Tensor) -> Tensor:
    """Same result as `rel_shift_pad` on the valid (causal) entries, as a strided view: no copy.

    For a contiguous [.., q, n] block, the score for key j of query i sits at column j + q-1-i of
    row i, i.e. at flat offset (q-1) + i*(n-1) + j, which never leaves the block.
    """
    x = x.contiguous()
    *lead, q, n = x.shape
    lead_strides = list(x.stride()[:-2])
    return x.as_strided((*lead, q, n), (*lead_strides, n - 1, 1), x.storage_offset() + q - 1)


class LayerPositions:
    """What layer `layer` needs from the positional encoding during one forward pass."""

    def __init__(self, encoding: PositionalEncoding, layer: int, state: dict[str, Tensor]):
        self.encoding = encoding
        self.layer = layer
        self.state = state

    def content(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return self.encoding.content(self.layer, self.state, q, k)

    def score_bias(
        self, q: Tensor, *, k_len: int, rel_shift: RelShift = rel_shift_pad, stride: int = 1
    ) -> Tensor | None:
        return self.encoding.score_bias(self.layer, self.state, q, k_len=k_len, rel_shift=rel_shift, stride=stride)

    def value_term(self, probs: Tensor, *, stride: int = 1) -> Tensor | None:
        return self.encoding.value_term(self.layer, self.state, probs, stride=stride)

    def xl_terms(self, q: Tensor, *, k_len: int) -> tuple[Tensor, Tensor, Tensor] | None:
        return self.encoding.xl_terms(self.layer, self.state, q, k_len=k_len)


class PositionalEncoding(nn.Module):
    """Base: no position information at all (each subclass overrides what it uses). A new encoding
    subclasses it and joins the registry with `@register_encoding("name")` (docs/guide/models.md, "Add a kernel or
    a positional encoding")."""

    name: ClassVar[str] = ""
    relative: ClassVar[bool] = False  # True: the encoding is a function of distance only
    # True: adds a term to the attention scores (`score_bias`), which kernels that never form scores
    # (performer, linformer) cannot apply.
    score_terms: ClassVar[bool] = False
    causal_only: ClassVar[bool] = False  # True: defined for causal distances only (no bidirectional encoder)
    options: ClassVar[type[Options]] = NoOptions  # what `config.position_options` holds for it

    def __init__(self, config: LayerConfig | None = None):
        super().__init__()
        self.config = config

    @classmethod
    def check_config(cls, config: LayerConfig) -> None:
        """How the options and the rest of the config combine (raise `ConfigError`); the options'
        own values are checked by their dataclass."""

    takes_position_ids: ClassVar[bool] = False  # True: `embed` takes the caller's `position_ids=` (absolute)

    def embed(self, x: Tensor) -> Tensor:
        """Absolute encodings join their table to the (B, T, ·) token embedding here."""
        return x

    def prepare(self, *, k_len: int, clamp_len: int, device: torch.device, dtype: torch.dtype) -> dict:
        """Per-forward state shared by all layers (e.g. the sinusoid table R)."""
        return {}

    def layer(self, i: int, state: dict) -> LayerPositions:
        return LayerPositions(self, i, state)

    def content(self, layer: int, state: dict, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return q, k

    def score_bias(self, layer: int, state: dict, q: Tensor, *, k_len: int, rel_shift: RelShift, stride: int = 1):
        return None

    def value_term(self, layer: int, state: dict, probs: Tensor, *, stride: int = 1) -> Tensor | None:
        return None

    def xl_terms(self, layer: int, state: dict, q: Tensor, *, k_len: int) -> tuple[Tensor, Tensor, Tensor] | None:
        """Transformer-XL's terms apart, (q + u, q + v, W_kR R) for kernels that fuse them; None for
        every other encoding."""
        return None


def embed_positions(encoding: PositionalEncoding, x: Tensor, position_ids: Tensor | None = None) -> Tensor:
    """`encoding.embed(x)`, with the caller's absolute positions (bert4keras's `custom_position_ids`) when
    `position_ids` is given; a relative encoding, whose positions are distances, refuses them in one line."""
    if position_ids is None:
        return encoding.embed(x)
    if not encoding.takes_position_ids:
        able = ", ".join(name for name, cls in POSITIONAL_ENCODINGS.items() if cls.takes_position_ids)
        raise UsageError(f"position_ids= gives absolute positions, which pos_encoding={encoding.name!r} does not "
                         f"read (its positions are distances between tokens); encodings that take them: {able}")
    return encoding.embed(x, position_ids=position_ids)


# No positions (cross-attention, a content-only score): every term is absent.
CONTENT_ONLY = LayerPositions(PositionalEncoding(), 0, {})

POSITIONAL_ENCODINGS: dict[str, type[PositionalEncoding]] = {}


def register_encoding(name: str, *, options: type[Options] | None = None):
    """Class decorator: make a `PositionalEncoding` subclass available as `pos_encoding=name`, with its
    options dataclass (`config.position_options`; None: the class's `options`, else none)."""

    def add(cls: type[PositionalEncoding]) -> type[PositionalEncoding]:
        cls.name = name
        if options is not None:
            cls.options = options
        if cls.options is not NoOptions:
            cls.options.where = "config.position_options"
        POSITIONAL_ENCODINGS[name] = cls
        return cls

    return add


def encoding_options() -> dict[str, type[Options]]:
    """name -> the options dataclass of every registered encoding."""
    return {name: cls.options for name, cls in POSITIONAL_ENCODINGS.items()}
