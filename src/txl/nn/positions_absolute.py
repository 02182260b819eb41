"""The absolute encodings, `sinusoidal` and `learned`: a table of positions joined to the token
embedding before the first block, with bert4keras's merge modes and caller-given positions.

Both follow bert4keras's `SinusoidalPositionEmbedding` and `PositionEmbedding` (read in seed 001):
positions are 0 … t-1 in every forward pass (so they restart every segment with memory) unless the
caller passes `position_ids=` (bert4keras's `custom_position_ids`): (t,) or (b, t) integer positions,
floats too for the sinusoid. The position table e (t, w) joins the token embedding x (b, t, ·) by
`merge`:

- `add`: x + e; `mul`: x ⊙ (e + 1); `zero`: e alone (the tokens are dropped: bert4keras's positions-only
  output, for a model that receives its tokens another way);
- `concat`: [x ; e], widening x by w = `dim` as bert4keras does (its output is input width + output_dim).
  The model builds its token embedding `dim` narrower (`token_width`) so that [x ; e] is d_model wide;
  the output layer then cannot share the token table (tie_weight = false, no d_embed, no cutoffs);
- `concat-project`: W [x ; e] with W a d_model × 2·d_model projection initialised to [I | I] (txl's `concat`
  before issue 48; configs that say `concat` without `dim` are migrated to it, txl.models.migration).

The sinusoid is Vaswani et al.'s: frequency ω_k = 10000^(-2k/w); `layout = "halves"` puts every sin
before every cos (the Transformer-XL reference, txl's default), `"interleaved"` alternates
sin(p·ω_k), cos(p·ω_k) as bert4keras's `K.stack([sin, cos], -1)` does.

`learned` with `hierarchical = α` (Su 2020, "层次分解位置编码"): a table e of n = `max_positions` rows
reaches n² positions as q_{i·n + j} = α·u_i + (1-α)·u_j with u = (e - α·e_0) / (1-α), which equals e_j
for every position j < n (the plain table: a model trained on n positions keeps its behaviour there and
extrapolates beyond). Without it, a position past the table is an error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from txl.errors import ConfigError, UsageError
from txl.nn.options import LayerConfig, Options
from txl.nn.positions_base import PositionalEncoding, register_encoding, sinusoid_table

PositionMerge = Literal["add", "mul", "zero", "concat", "concat-project"]
SinusoidLayout = Literal["halves", "interleaved"]


@dataclass(frozen=True)
class MergeOptions(Options):
    """How an absolute table joins the token embedding (both absolute encodings take these)."""

    merge: PositionMerge = "add"  # add | mul (x·(e+1)) | zero (e alone) | concat (widen) | concat-project
    dim: int = 0  # merge='concat': the position part's width w (bert4keras output_dim); tokens get d_model - w

    def validate(self) -> None:
        self.at_least(0, "dim")
        if self.merge == "concat" and not self.dim:
            self.fail("merge", "='concat' widens the token embedding by the position table as bert4keras does: "
                               "set position_options.dim (the positions' width; tokens take d_model - dim), or "
                               "merge='concat-project' for the projected form (txl's concat before issue 48)")
        if self.dim and self.merge != "concat":
            self.fail("dim", f"is the width of the concatenated positions; it applies to merge='concat' only "
                             f"(merge={self.merge!r})")


@dataclass(frozen=True)
class SinusoidalOptions(MergeOptions):
    layout: SinusoidLayout = "halves"  # halves: [sin… ; cos…] (the reference); interleaved: sin, cos pairs (bert4keras)


@dataclass(frozen=True)
class LearnedOptions(MergeOptions):
    max_positions: int = 1024  # rows of the absolute table (positions past it fail without hierarchical)
    hierarchical: float = 0.0  # α of Su's decomposition, reaching max_positions²; 0 = off

    def validate(self) -> None:
        super().validate()
        self.at_least(1, "max_positions")
        if not 0.0 <= self.hierarchical < 1.0:
            self.fail("hierarchical", f"must be in [0, 1) (α; 0 = off), got {self.hierarchical}")


def token_width(config: Any) -> int:
    """The width of the token embedding a model builds for this config: d_model, or d_model - dim when an
    absolute encoding concatenates `dim` position channels (merge='concat')."""
    options = config.position_options
    if isinstance(options, MergeOptions) and options.merge == "concat":
        return config.d_model - options.dim
    return config.d_model


def token_embedding_config(config: Any) -> Any:
    """The config the token embedding is built from: `config` itself, or (widening concat) a copy whose
    d_model is `token_width` (nothing else of it is read by the embedding; its encoding is reset to a plain
    one so the copy's own checks pass)."""
    width = token_width(config)
    if width == config.d_model:
        return config
    return dataclasses.replace(config, d_model=width, pos_encoding="learned", position_options=None)


def check_merge(cls: type[PositionalEncoding], config: LayerConfig, *, even: bool) -> None:
    """How the merge options combine with the rest of the config (even: the table is sin/cos pairs)."""
    options = config.position_options
    width = options.dim if options.merge == "concat" else config.d_model
    name = f"pos_encoding={cls.name!r}"
    if options.merge == "concat":
        if options.dim >= config.d_model:
            raise ConfigError(f"config.position_options.dim={options.dim} must be < d_model={config.d_model}: the "
                              f"token embedding takes d_model - dim channels of [x ; e]")
        tied = [f"{field}={value!r}" for field, value, plain in (
            ("tie_weight", getattr(config, "tie_weight", False), False), ("d_embed", getattr(config, "d_embed", None), None),
            ("cutoffs", list(getattr(config, "cutoffs", ())), [])) if value != plain]
        if tied:
            raise ConfigError(f"config.position_options.merge='concat' narrows the token embedding to d_model - dim, "
                              f"which the output layer cannot share: set tie_weight=false, d_embed=null, cutoffs=[] "
                              f"(got {', '.join(tied)}), or merge='concat-project'")
    if even and width % 2:
        what = "position_options.dim" if options.merge == "concat" else "d_model"
        raise ConfigError(f"config.{what} must be even for {name} (sin/cos pairs), got {width}")


class AbsolutePositions(PositionalEncoding):
    """Shared by the two absolute encodings: a table of positions (`table_for`) joined to x by `merge`."""

    takes_position_ids = True
    fractional = False  # whether positions may be real numbers (the sinusoid), not only table rows

    def __init__(self, config: LayerConfig):
        super().__init__(config)
        options = config.position_options
        self.merge = options.merge
        self.width = options.dim if self.merge == "concat" else config.d_model  # the position table's width
        if self.merge == "concat-project":
            self.merge_proj = nn.Linear(2 * config.d_model, config.d_model, bias=False)

    def reset_parameters(self) -> None:
        """Called by the model after its init: the concat projection starts as [I | I] (plain add)."""
        if self.merge == "concat-project":
            eye = torch.eye(self.config.d_model)
            with torch.no_grad():
                self.merge_proj.weight.copy_(torch.cat([eye, eye], dim=1))

    def table_for(self, positions: Tensor, *, top: int) -> Tensor:
        """(..., width) position embeddings of `positions` (any shape), all below `top`."""
        raise NotImplementedError

    def position_table(self, x: Tensor, position_ids: Tensor | None) -> Tensor:
        """(1 or b, t, width) embeddings of positions 0 … t-1, or of the caller's `position_ids`."""
        batch, length = x.shape[:2]
        if position_ids is None:
            return self.table_for(torch.arange(length, device=x.device), top=length)[None]
        if not isinstance(position_ids, Tensor):
            raise UsageError(f"position_ids must be a tensor of positions, got {type(position_ids).__name__}")
        if position_ids.shape not in ((length,), (batch, length)):
            raise UsageError(f"position_ids must be ({length},) or ({batch}, {length}) like input_ids, got shape "
                             f"{tuple(position_ids.shape)}")
        if position_ids.is_floating_point() and not self.fractional:
            raise UsageError(f"position_ids for pos_encoding={self.name!r} must be integers (rows of its table), "
                             f"got {position_ids.dtype}")
        if position_ids.dtype == torch.bool or position_ids.is_complex():
            raise UsageError(f"position_ids must be integer positions, got {position_ids.dtype}")
        if position_ids.numel() and bool((position_ids < 0).any()):
            raise UsageError(f"position_ids must be >= 0, got {int(position_ids.min())}")
        ids = position_ids.to(x.device)
        top = int(ids.max()) + 1 if ids.numel() else 0
        table = self.table_for(ids, top=top)
        return table if ids.dim() == 2 else table[None]


    def embed(self, x: Tensor, *, position_ids: Tensor | None = None) -> Tensor:
        e = self.position_table(x, position_ids).to(x.dtype)  # (1 or b, t, width)
        if self.merge == "add":
            return x + e
        if self.merge == "mul":
            return x * (e + 1.0)
        if self.merge == "zero":
            return e.expand(x.shape[0], -1, -1)
        expected = self.config.d_model - self.width if self.merge == "concat" else self.config.d_model
        if x.shape[-1] != expected:
            raise UsageError(f"merge={self.merge!r} of pos_encoding={self.name!r} takes token embeddings of width "
                             f"{expected}, got {x.shape[-1]} (this model builds them at another width: use "
                             f"merge='concat-project' or 'add')")
        joined = torch.cat([x, e.expand(x.shape[0], -1, -1)], dim=-1)
        return joined if self.merge == "concat" else self.merge_proj(joined)


@register_encoding("sinusoidal", options=SinusoidalOptions)
class SinusoidalAbsolute(AbsolutePositions):
    """Vaswani et al. 2017 sinusoids joined to the input (bert4keras's `SinusoidalPositionEmbedding`). With
    memory, positions restart at 0 in every segment, as in the paper's ablation: the same position is reused
    for different tokens, the "temporal confusion" that motivates relative positions (Dai et al. 2019, §3.3);
    `position_ids=` lets a caller continue them instead."""

    fractional = True

    @classmethod
    def check_config(cls, config):
        check_merge(cls, config, even=True)

    def table_for(self, positions: Tensor, *, top: int) -> Tensor:
        flat = sinusoid_table(positions.reshape(-1), self.width)  # (N, w): [sin ; cos]
        if self.config.position_options.layout == "interleaved":  # sin(p·ω_0), cos(p·ω_0), sin(p·ω_1), …
            half = self.width // 2
            flat = torch.stack([flat[:, :half], flat[:, half:]], dim=-1).flatten(-2)
        return flat.view(*positions.shape, self.width)


@register_encoding("learned", options=LearnedOptions)
class LearnedAbsolute(AbsolutePositions):
    """A trainable absolute table joined to the input (Al-Rfou et al. 2018, BERT, GPT; bert4keras's
    `PositionEmbedding` with its hierarchical decomposition, see the module docstring). Positions restart
    every segment unless `position_ids=` is given."""

    @classmethod
    def check_config(cls, config):
        check_merge(cls, config, even=False)

    def __init__(self, config: LayerConfig):
        super().__init__(config)
        options = config.position_options
        self.table = nn.Parameter(torch.zeros(options.max_positions, self.width))
        self.alpha = options.hierarchical

    def positions(self, length: int) -> Tensor:
        """(length, width) embeddings of positions 0 … length-1."""
        return self.table_for(torch.arange(length, device=self.table.device), top=length)

    def table_for(self, positions: Tensor, *, top: int) -> Tensor:
        n = self.table.shape[0]
        if not self.alpha:
            if top > n:
                raise UsageError(
                    f"pos_encoding='learned' has {n} positions but the input reaches position {top - 1}; shorten "
                    "the segment, raise max_positions or set hierarchical (e.g. 0.4) to extrapolate"
                )
            return self.table[positions]
        if top > n * n:
            raise UsageError(f"pos_encoding='learned' with hierarchical reaches {n * n} positions "
                             f"(max_positions²) but the input reaches position {top - 1}; raise max_positions")
        u = (self.table - self.alpha * self.table[:1]) / (1 - self.alpha)
        return self.alpha * u[positions // n] + (1 - self.alpha) * u[positions % n]


__all__ = ["LearnedAbsolute", "LearnedOptions", "MergeOptions", "PositionMerge", "SinusoidalAbsolute",
           "SinusoidalOptions", "token_embedding_config", "token_width"]
