"""Axial attention (Ho et al. 2019, "Axial Attention in Multidimensional Transformers", arXiv 1912.12180),
on a text sequence laid out as a 2-D grid.

The keys [memory ; segment] are written row after row into a grid of rows of `row` = c positions:
key position p sits at row p // c, column p % c (positions count from key 0, as BigBird's blocks: with
`tgt_len` and `mem_len` multiples of c the grid is the stream's own). Each head attends along one axis
(`axes`, assigned to the heads in turn: head t takes `axes[t % len(axes)]`):

- **row**: the keys of the query's own row. Causal: those up to the query (the paper's *masked row
  attention*, the inner decoder's layer); bidirectional: the whole row.
- **column**: the keys of the query's own column. Causal: the rows above and the query itself (*masked
  column attention*); bidirectional: the whole column.
- **previous-row**: causal only, the whole row above the query's (the outer decoder's *unmasked row
  attention* over the grid shifted down one row, §4.2: the row that is entirely in the past); a query
  of the first row sees nothing and gets 0, as the paper's shifted-down first row of zeros.

A row head costs O(c) keys per query and a column head O(n / c), so a layer is O(n·(c + n/c)), O(n^1.5)
at c = sqrt(n). Row and column heads alone reach, in two layers, every earlier position whose column is
at most the query's; with previous-row heads (`axes = ["row", "column", "previous-row"]`, Ho et al.'s
outer + inner decoder in one layer) two layers reach every earlier position.

The fast kernel reshapes the keys into the grid and attends within rows and columns (no (i, n)
matrix); `attention_impl="eager"` builds the same pattern as a dense per-head mask: the reference.
Every positional encoding applies, its score term taken per axis on the grid: a row's keys are the
distances 0 … c-1 from its queries (a c × c term per row), a column's are multiples of c (the term
with `stride=c`), the row above is the first half of a 2c-key term. Transformer-XL's relative
positions (the default) therefore run with memory as in the full kernel. Shaw's value term (and NEZHA's)
would need the probabilities over every key: refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.errors import ConfigError
from txl.nn.attention.masks import AttentionMask
from txl.nn.attention.pattern import dense_masked_attention, gathered_attention, pad_to
from txl.nn.attention.registry import refuse, register
from txl.nn.attention.sliding import shaw_values
from txl.nn.options import LayerConfig, Options
from txl.nn.positional import LayerPositions

AXES = ("row", "column", "previous-row")


@dataclass(frozen=True)
class AxialOptions(Options):
    """`attention_options` of attention='axial'."""

    row: int = 32  # c: positions per row of the grid (the paper's image width); sqrt(context) balances the axes
    axes: tuple[str, ...] = ("row", "column")  # the heads' axes, in turn: row, column, previous-row

    def validate(self) -> None:
        self.at_least(1, "row")
        if not self.axes:
            self.fail("axes", f"needs at least one of {', '.join(AXES)}, got []")
        unknown = [a for a in self.axes if a not in AXES]
        if unknown:
            self.fail("axes", f"takes {', '.join(AXES)}, got {unknown[0]!r}")


def check_axial(config: LayerConfig) -> None:
    axes = config.attention_options.axes
    if shaw_values(config) or config.pos_encoding == "nezha":
        raise ConfigError(f"config.pos_encoding={config.pos_encoding!r} adds a value term over every key, which "
                          "attention='axial' never forms (set position_options.values=false for shaw)")
    if not config.causal and "previous-row" in axes:
        raise ConfigError("config.attention_options.axes 'previous-row' is the causal grid's past row; "
                          "a bidirectional model (causal=false) takes row and column")
    if config.n_head < len(set(axes)):
        raise ConfigError(f"config.attention='axial' needs n_head >= {len(set(axes))}, one head per axis "
                          f"of attention_options.axes, got n_head={config.n_head}")


def head_axes(n_head: int, axes: tuple[str, ...]) -> list[str]:
    return [axes[t % len(axes)] for t in range(n_head)]


def grid_bias(positions: LayerPositions, q: Tensor, k_len: int, stride: int = 1) -> Tensor | None:
    """The encoding's score term for query rows q (B, h, I, d), the last I of k_len keys `stride` apart,
    as (B, h, I, k_len) (None: the encoding adds none)."""
    bias = positions.score_bias(q, k_len=k_len, stride=stride)
    return None if bias is None else bias.expand(*q.shape[:3], k_len)


def rows_of_full_bias(full: Tensor, *, lead: int, first: int, rows: int, c: int, shift: int) -> Tensor:
    """From the (b, h, i, n) term over every pair: (b, h, q_rows, c, c), each query row against key row
    (its row - shift). For sequences shorter than the 2c keys a row term would need (the encoding's
    tables stop at distance n - 1): there it costs O(n²) = O(c²)."""
    b, h, i, n = full.shape
    q_rows = rows - first
    grid = F.pad(full, (0, rows * c - n, lead, q_rows * c - i - lead)).view(b, h, q_rows, c, rows, c)
    key_rows = (first + torch.arange(q_rows, device=full.device) - shift).clamp(min=0)  # row -1: masked anyway
    return grid[:, :, torch.arange(q_rows, device=full.device), :, key_rows, :].permute(1, 2, 0, 3, 4)


def axial_pattern(kinds: list[str], q_len: int, k_len: int, row: int, causal: bool, device: torch.device) -> Tensor:
    """(h, i, n) bool: the keys each head's axis holds for each query (causality and padding apart)."""
    p = torch.arange(q_len, device=device) + k_len - q_len
    j = torch.arange(k_len, device=device)
    q_row, k_row = p[:, None] // row, j[None, :] // row
    by_axis = {
        "row": q_row == k_row,
        "column": (p[:, None] % row) == (j[None, :] % row),
        "previous-row": q_row - 1 == k_row,
    }
    return torch.stack([by_axis[kind] for kind in kinds])


@register("axial", "fast", bidirectional=True, cross_attention=False, check=check_axial, options=AxialOptions)
class AxialAttention(nn.Module):
    """`attention="axial"`: row, column (and previous-row) heads over the grid of the keys."""

    name = "axial"

    def __init__(self, config: LayerConfig):
        super().__init__()
        options = config.attention_options
        self.row = options.row
        self.kinds = head_axes(config.n_head, tuple(options.axes))
        self.groups = [(kind, [t for t, k in enumerate(self.kinds) if k == kind]) for kind in AXES if kind in self.kinds]

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        refuse(self.name, mask, same_length="")
        if need_weights:
            return AxialReference.forward(self, q, k, v, positions=positions, mask=mask, dropatt=dropatt,
                                          training=training, need_weights=True)
        q_raw = q  # the score terms take the projected queries (xl adds its own bias v)
        q, k = positions.content(q, k)
        b, h, i, d = q.shape
        n, c, scale = k.shape[-2], self.row, q.shape[-1] ** -0.5
        rows, first = -(-n // c), (n - i) // c  # grid rows; the first row holding a query
        lead = n - i - first * c  # queries padded on the left onto the grid
        q_rows = rows - first
        q_grid = pad_to(F.pad(q, (0, 0, lead, 0)), 2, c).view(b, h, q_rows, c, d)
        raw_grid = pad_to(F.pad(q_raw, (0, 0, lead, 0)), 2, c).view(b, h, q_rows, c, d)
        k_grid = pad_to(k, 2, c).view(b, h, rows, c, d)
        v_grid = pad_to(v, 2, c).view(b, h, rows, c, d)
        real = torch.arange(rows * c, device=q.device) < n  # (rows·c,) a key, not the grid's padding
        real = real[None] if mask.key_padding is None else real & pad_to(mask.key_padding.to(q.device), 1, c)
        real = real.view(-1, rows, c)  # (b|1, rows, c)
        out = q.new_empty(b, h, q_rows, c, d)
        for kind, heads in self.groups:
            qs, ks, vs = q_grid[:, heads], k_grid[:, heads], v_grid[:, heads]
            if kind == "column":  # along the rows of each column: (b, h, c, rows, d)
                visible = real.transpose(1, 2)[:, None, :, None, :]  # (b|1, 1, c, 1, rows)
                if mask.causal:
                    above = torch.arange(rows, device=q.device) <= first + torch.arange(q_rows, device=q.device)[:, None]
                    visible = visible & above  # (q_rows, rows): the query's row and those above
                # the term of keys c apart: each column's queries are the last q_rows of its rows
                by_column = raw_grid.permute(0, 3, 1, 2, 4).reshape(b * c, h, q_rows, d)
                bias = grid_bias(positions, by_column, rows, stride=c)
                if bias is not None:
                    bias = bias.reshape(b, c, h, q_rows, rows).transpose(1, 2)[:, heads] * scale
                o, _ = gathered_attention(qs.transpose(2, 3), ks.transpose(2, 3), vs.transpose(2, 3), visible,
                                          dropatt=dropatt, training=training, need_lse=False, score_offset=bias)
                out[:, heads] = o.transpose(2, 3)
                continue
            shift = 0 if kind == "row" else 1
            if kind == "row":
                keys, values, seen = ks[:, :, first:], vs[:, :, first:], real[:, first:]
            else:  # previous-row: the grid shifted down one row, an empty row on top
                keys, values = F.pad(ks, (0, 0, 0, 0, 1, 0))[:, :, first:rows], F.pad(vs, (0, 0, 0, 0, 1, 0))[:, :, first:rows]
                seen = F.pad(real, (0, 0, 1, 0), value=False)[:, first:rows]
            if (shift + 1) * c <= n:  # a row's queries are the last c of [row above ;] own row's keys
                bias = grid_bias(positions, raw_grid.transpose(1, 2).reshape(b * q_rows, h, c, d), (shift + 1) * c)
                if bias is not None:
                    bias = bias[..., :c].reshape(b, q_rows, h, c, c).transpose(1, 2)
            else:
                full = grid_bias(positions, q_raw, n)
                bias = None if full is None else rows_of_full_bias(full, lead=lead, first=first, rows=rows, c=c,
                                                                   shift=shift)
            if bias is not None:
                bias = bias[:, heads] * scale
            visible = seen[:, None, :, None, :]  # (b|1, 1, q_rows, 1, c)
            if mask.causal and kind == "row":
                visible = visible & torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
            out[:, heads], _ = gathered_attention(qs, keys, values, visible, dropatt=dropatt, training=training,
                                                  need_lse=False, score_offset=bias)
        return out.view(b, h, q_rows * c, d)[:, :, lead:lead + i], None

    def extra_repr(self) -> str:
        return f"row={self.row}, axes={self.kinds}"


@register("axial", "eager", bidirectional=True, cross_attention=False, check=check_axial, options=AxialOptions)
class AxialReference(AxialAttention):
    """The same axes as a dense per-head (i, n) mask, O(n²): the ground truth for `AxialAttention`."""

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        refuse(self.name, mask, same_length="")
        i, n = q.shape[-2], k.shape[-2]
        bias = positions.score_bias(q, k_len=n)  # the encoding's term over every pair, as the eager kernel
        offset = None if bias is None else bias.float() * q.shape[-1] ** -0.5
        q, k = positions.content(q, k)
        pattern = axial_pattern(self.kinds, i, n, self.row, mask.causal, q.device)
        visible = mask.visible(i, n, q.device) & pattern[None]
        out, probs = dense_masked_attention(q, k, v, visible, dropatt=dropatt, training=training, score_offset=offset)
        return out, probs if need_weights else None
