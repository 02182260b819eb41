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
matrix); `attention_impl="eager"` builds the same pattern as a dense per-head mask: the reference. The
pattern is not a band of distances, so the encoding's score terms do not apply (`score_terms=False`):
positions come from RoPE/xPos (rotated q and k) or an absolute encoding in the input.
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
    if not config.causal and "previous-row" in axes:
        raise ConfigError("config.attention_options.axes 'previous-row' is the causal grid's past row; "
                          "a bidirectional model (causal=false) takes row and column")
    if config.n_head < len(set(axes)):
        raise ConfigError(f"config.attention='axial' needs n_head >= {len(set(axes))}, one head per axis "
                          f"of attention_options.axes, got n_head={config.n_head}")


def head_axes(n_head: int, axes: tuple[str, ...]) -> list[str]:
    return [axes[t % len(axes)] for t in range(n_head)]


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


@register("axial", "fast", bidirectional=True, score_terms=False, cross_attention=False, check=check_axial,
          options=AxialOptions)
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
        q, k = positions.content(q, k)
        b, h, i, d = q.shape
        n, c = k.shape[-2], self.row
        rows, first = -(-n // c), (n - i) // c  # grid rows; the first row holding a query
        lead = n - i - first * c  # queries padded on the left onto the grid
        q_rows = rows - first
        q_grid = pad_to(F.pad(q, (0, 0, lead, 0)), 2, c).view(b, h, q_rows, c, d)
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
                o, _ = gathered_attention(qs.transpose(2, 3), ks.transpose(2, 3), vs.transpose(2, 3), visible,
                                          dropatt=dropatt, training=training, need_lse=False)
                out[:, heads] = o.transpose(2, 3)
                continue
            if kind == "row":
                keys, values, seen = ks[:, :, first:], vs[:, :, first:], real[:, first:]
            else:  # previous-row: the grid shifted down one row, an empty row on top
                keys, values = F.pad(ks, (0, 0, 0, 0, 1, 0))[:, :, first:rows], F.pad(vs, (0, 0, 0, 0, 1, 0))[:, :, first:rows]
                seen = F.pad(real, (0, 0, 1, 0), value=False)[:, first:rows]
            visible = seen[:, None, :, None, :]  # (b|1, 1, q_rows, 1, c)
            if mask.causal and kind == "row":
                visible = visible & torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
            out[:, heads], _ = gathered_attention(qs, keys, values, visible, dropatt=dropatt, training=training,
                                                  need_lse=False)
        return out.view(b, h, q_rows * c, d)[:, :, lead:lead + i], None

    def extra_repr(self) -> str:
        return f"row={self.row}, axes={self.kinds}"


@register("axial", "eager", bidirectional=True, score_terms=False, cross_attention=False, check=check_axial,
          options=AxialOptions)
class AxialReference(AxialAttention):
    """The same axes as a dense per-head (i, n) mask, O(n²): the ground truth for `AxialAttention`."""

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        refuse(self.name, mask, same_length="")
        q, k = positions.content(q, k)
        i, n = q.shape[-2], k.shape[-2]
        pattern = axial_pattern(self.kinds, i, n, self.row, mask.causal, q.device)
        visible = mask.visible(i, n, q.device) & pattern[None]
        out, probs = dense_masked_attention(q, k, v, visible, dropatt=dropatt, training=training)
        return out, probs if need_weights else None
