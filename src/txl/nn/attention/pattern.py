"""Shared pieces of the pattern kernels (bigbird, lsh, routing, sinkhorn, compressed, synthesizer).

Each of those kernels lets a query see a *set* of keys chosen by a rule (blocks, hash buckets,
clusters, a sorting). Its dense reference builds that set as a (b|1, h|1, i, n) bool mask and calls
`dense_masked_attention`; its fast version gathers only the chosen keys per block of queries and
calls `gathered_attention`, which returns the log-sum-exp too so that several key sets (global
columns, hash rounds) can be merged exactly (`merge_by_lse`).

None of these kernels forms the Transformer-XL/Shaw/ALiBi score terms (their keys are not a
contiguous band of distances), so they register with `score_terms=False`: positions come from RoPE
(rotated q and k, via `positions.content`) or from an absolute encoding in the input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from txl.nn.attention.masks import NEG


def dense_masked_attention(
    q: Tensor | None, k: Tensor | None, v: Tensor, visible: Tensor, *, dropatt: float, training: bool,
    score_offset: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """softmax(q·k/sqrt(d) + score_offset, over `visible` keys) · v, and the probabilities.

    q (b, h, i, d), k and v (b, h, n, d) (already through `positions.content`); visible broadcastable
    to (b, h, i, n). A row that sees no key gets output 0. `score_offset`: added after scaling,
    broadcastable to (b, h, i, n); with q and k None it is the whole score (a synthetic score)."""
    scores = score_offset.float() if q is None else torch.einsum("bhid,bhjd->bhij", q, k).float() * q.shape[-1] ** -0.5
    if score_offset is not None and q is not None:
        scores = scores + score_offset
    probs = scores.masked_fill(~visible, NEG).softmax(dim=-1) * visible.any(-1, keepdim=True)
    probs = probs.to(v.dtype)
    out = torch.einsum("bhij,bhjd->bhid", F.dropout(probs, p=dropatt, training=training), v)
    return out, probs


def gathered_attention(
    q: Tensor | None, k: Tensor | None, v: Tensor, visible: Tensor, *, dropatt: float, training: bool,
    score_offset: Tensor | None = None, need_lse: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Attention of query blocks over their own gathered keys: q (.., c, d), k and v (.., m, d),
    visible broadcastable to (.., c, m). Returns out (.., c, d) and the log-sum-exp (.., c) of the
    visible scaled scores (NEG for a row that sees nothing, whose output is 0), or None without
    `need_lse` (then one fused softmax). With q and k None, `score_offset` is the whole score."""
    scores = score_offset.float() if q is None else (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    if score_offset is not None and q is not None:
        scores = scores + score_offset
    scores = scores.masked_fill(~visible, NEG)
    any_visible = visible.any(-1)
    if need_lse:
        lse = scores.logsumexp(-1)
        probs = (scores - lse[..., None]).exp()
        lse = lse.masked_fill(~any_visible, NEG)
    else:
        probs, lse = scores.softmax(-1), None
    probs = probs * any_visible[..., None]  # a row that sees nothing: 0, not a uniform average
    out = F.dropout(probs.to(v.dtype), p=dropatt, training=training) @ v
    return out, lse


def merge_by_lse(outs: list[Tensor], lses: list[Tensor]) -> Tensor:
    """Softmax attention over the union of disjoint key sets from each set's output and log-sum-exp."""
    total = torch.stack(lses).logsumexp(0)
    return sum(out * (lse - total).exp()[..., None].to(out.dtype) for out, lse in zip(outs, lses))


def pad_to(x: Tensor, dim: int, multiple: int, value: float = 0.0) -> Tensor:
    """x padded at the end of `dim` to a multiple of `multiple`."""
    extra = -x.shape[dim] % multiple
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return F.pad(x, pad, value=value)
