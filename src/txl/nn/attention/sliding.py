"""Sliding-window attention (Longformer: Beltagy, Peters & Cohan 2020, arXiv 2004.05150), causal
(combinable with Transformer-XL memory) or bidirectional (`causal=false`, the masked-LM encoder), with
optional dilation per head and global tokens.

Positions count over [memory ; segment]; queries are the last i of the n key positions (the kernel
convention of `txl.nn.attention`).

- **Local window** (`SlidingOptions`: `window` = w, `dilation` = s per head): the query at position p
  sees the keys p, p-s, p-2s, …, p-(w-1)s. Dilation widens a head's reach to w·s at the same cost
  (Longformer §3.1 uses it on a few heads of the upper layers). L layers reach L·w·s positions, and
  the memory extends that further across segments, as in Transformer-XL.
- **Per-layer windows and dilation** (Longformer §3.1 and §4.1: a different w per layer, small in the
  lower layers and growing towards the top; dilation only on 2 heads of the upper layers): `window`
  a list with one value per layer, `dilation` a list of per-head lists, one per layer. Each layer's
  kernel is built from `SlidingOptions.for_layer(i)` (txl.nn.attention.layer.layer_config); the most a
  band looks back is `SlidingOptions.reach(n_head)`, the largest (w-1)·s + 1 over layers and heads,
  which is the memory a layer's band can use (a longer memory still serves the global rows).
- **Global tokens** (`global_tokens` = g): the first g positions of the current segment. Causal form
  of Longformer's global attention: a global token attends to every earlier key (memory included),
  and every later query of the segment attends to it whatever its window. Global tokens of earlier
  segments (now in the memory) are ordinary keys.
- **Separate global projections** (`global_projections`; Longformer §3.1: Q_g, K_g, V_g for global
  attention beside Q_s, K_s, V_s for the window): the rows of global queries are computed from q_g, k_g,
  v_g, which the layer makes with its own weights (`forward_global`); every query's band and its global
  columns keep q, k, v, as in Longformer (allenai/longformer and Hugging Face take the global keys and
  values of the local attention from the local projections). Default (None): on when global_tokens > 0;
  `true` also for chosen tokens given per call; `false`: the local projections (txl before issue 48).
- **Position terms on global pairs** (`global_positions`, default on): a pair joined only through a
  global key (outside the query's band, query not global) gets the encoding's score term too (xl, shaw,
  alibi, t5: causal distances are all defined), computed for those pairs only (`pair_terms`, O(i·G·d)).
  RoPE applies everywhere anyway (it rotates q and k). Shaw's value-side term stays on the band and the
  global rows. `false`: the content score alone on those pairs (txl before issue 48).
- **Chosen global tokens** (`model(..., global_mask=)`, `AttentionMask.global_mask`; Longformer's
  global attention on task tokens such as a [CLS] or the question, ETC's global tokens): a chosen
  token sees every key it may see (causal: every earlier one, memory included) and every query sees
  it (causal: every later one). As for `global_tokens`, a chosen query's row has every position term
  (causal with xl/shaw/alibi/t5: one eager block over the span from the first to the last chosen
  query, cheap when they are close, as a [CLS] and a question, dense at worst; otherwise gathered rows,
  O(R·n)), and a pair joined only through a chosen key gets the score term as above. With every token
  chosen the kernel is full attention. Not combinable with `global_tokens` (put the first tokens in the
  mask).
- **Bidirectional** (`causal=false`): each query sees `window` keys on each side, itself
  counted once (2w-1 keys; dilated like the causal window). The blocks' keys then run past their last
  query, where xl/shaw/alibi/t5 terms are not defined by the positional API: the bidirectional
  window takes encodings without score terms (rope, learned, sinusoidal), checked with the config.
  `global_tokens` are chosen tokens there (the first g of the sequence).
- **Memory tokens** (`config.memory_tokens`, in front of the keys: `AttentionMask.memory_tokens`): seen
  by every query with the content score q·k only (see `txl.nn.attention.layer`), merged with the band by
  log-sum-exp in the fast kernel, O(n·m).
- `same_length` (the kernel's `window` argument) caps everything at the `window` most recent keys.

The `fast` kernel (the default) costs O(n·w) time and memory and never builds an n×n matrix:

1. heads with dilation s are regrouped by residue class (positions ≡ r mod s), which turns a dilated
   window into a plain window over every class (the position terms use `stride=s`);
2. the queries of each class are cut into blocks of B; block t attends to the B + w - 1 keys ending
   at its last query (an `unfold` view), so each block is a small eager attention whose queries are
   the last rows of its keys, and `LayerPositions.score_bias` gives the xl/shaw/alibi terms of the
   band only: e.g. xl's (q+v)·W_R R is computed for B + w - 1 distances per block, not n;
3. global columns and rows are computed separately and merged by their log-sum-exp; chosen tokens
   (`global_mask`) are gathered per sequence: O(i·G) for their columns; their rows as above.

The 1/sqrt(d) scale is applied to q (n·d values) rather than to the blocks' scores (n·(B+w)), and
the mask is one additive tensor shared by the batch and the heads (cheaper than a masked_fill).

`SlidingWindowReference` (`attention_impl="eager"`) builds the same pattern as a dense mask, O(n²),
and is the ground truth the fast kernel is tested against.

Size: over 500 lines because the banded kernel (dilation, global, chosen and memory tokens) and its dense
reference stay in one file, the ground truth beside the kernel it checks, as every kernel file here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.errors import ConfigError, UsageError
from txl.nn.attention.eager import eager_attention
from txl.nn.attention.masks import AttentionMask, additive_mask, distances
from txl.nn.attention.pattern import gathered_attention, merge_by_lse
from txl.nn.attention.registry import no_padding, register
from txl.nn.options import LayerConfig, Options
from txl.nn.positional import LayerPositions

UNBOUNDED = 2**31  # a window longer than any sequence (strided heads of the sparse kernel)


@dataclass(frozen=True)
class SlidingOptions(Options):
    """`attention_options` of attention='sliding'. `window` and `dilation` hold one value for every layer or
    a list with one entry per layer (Longformer §3.1/§4.1: windows that grow with depth, dilation on a
    few heads of the upper layers); `for_layer(i)` gives layer i its own plain options."""

    window: int | tuple[int, ...] = 256  # keys each query sees, itself included (counted in dilated steps)
    # per head (or one value for all heads); () = 1: no gaps. Per layer: a list of such lists, one per layer
    dilation: tuple[int, ...] | tuple[tuple[int, ...], ...] = ()
    global_tokens: int = 0  # the first g positions of each segment attend to and are seen by all
    # Longformer's separate projections Q_g, K_g, V_g for the rows of global tokens (3 more d_model ×
    # n_head·d_head weights per layer). None: on when global_tokens > 0; true: also for a `global_mask=`
    # given per call (the weights must exist before it comes); false: global rows use the local projections
    global_projections: bool | None = None
    # the encoding's score term (xl, shaw, alibi, t5, ...) on a pair joined only through a global key
    # (outside the query's window); false: content score alone there (txl before issue 48)
    global_positions: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.dilation, (list, tuple)):  # per layer: the inner lists of JSON/TOML as tuples
            object.__setattr__(self, "dilation", tuple(tuple(d) if isinstance(d, list) else d for d in self.dilation))
        super().__post_init__()

    def validate(self) -> None:
        self.at_least(1, "window")
        self.at_least(0, "global_tokens")
        if self.layer_dilations is None:
            self.at_least(1, "dilation")
        elif not all(self.layer_dilations) or any(s < 1 for d in self.layer_dilations for s in d):
            self.fail("dilation", f"per layer needs a non-empty list of values >= 1 for every layer, got "
                                  f"{[list(d) for d in self.layer_dilations]}")
        if isinstance(self.window, tuple) and not self.window:
            self.fail("window", "must be one value or a list with one value per layer, got []")

    @property
    def layer_dilations(self) -> tuple[tuple[int, ...], ...] | None:
        """The per-layer form of `dilation` (one tuple per layer), or None when it holds one value per head."""
        if self.dilation and all(isinstance(d, tuple) for d in self.dilation):
            return self.dilation  # type: ignore[return-value]
        return None

    @property
    def per_layer(self) -> bool:
        return isinstance(self.window, tuple) or self.layer_dilations is not None

    def layers(self) -> int | None:
        """How many layers the per-layer lists are for (None: one value for every layer); the lists must agree."""
        counts = {len(self.window)} if isinstance(self.window, tuple) else set()
        counts |= {len(self.layer_dilations)} if self.layer_dilations is not None else set()
        if len(counts) > 1:
            self.fail("window", f"and dilation list different numbers of layers ({sorted(counts)}); give one entry per layer")
        return counts.pop() if counts else None

    def for_layer(self, layer_idx: int) -> SlidingOptions:
        """Layer `layer_idx`'s window and dilation as plain values (the kernel reads only these)."""
        if not self.per_layer:
            return self
        window = self.window[layer_idx] if isinstance(self.window, tuple) else self.window
        dilation = self.layer_dilations[layer_idx] if self.layer_dilations is not None else self.dilation
        return dataclasses.replace(self, window=window, dilation=dilation)

    def to_dict(self) -> dict:
        data = super().to_dict()
        data["dilation"] = [list(d) if isinstance(d, tuple) else d for d in data["dilation"]]
        return data

    def reach(self, n_head: int) -> int:
        """The most positions back any layer's local window sees: max over layers and heads of (w-1)·s + 1.
        Memory longer than this still serves the global rows and, through the layers, longer reach; a
        layer's band never looks further."""
        layers = self.layers() or 1
        reaches = []
        for layer in range(layers):
            here = self.for_layer(layer)
            dilation = here.dilation or (1,)
            reaches += [(here.window - 1) * s + 1 for s in (dilation * n_head if len(dilation) == 1 else dilation)]
        return max(reaches)


def head_dilations(config: LayerConfig) -> tuple[int, ...]:
    dilation = config.attention_options.dilation or (1,)
    return dilation * config.n_head if len(dilation) == 1 else dilation


def effective_window(window: int, dilation: int, horizon: int | None) -> int:
    """Window in dilated steps once `same_length` caps reach at `horizon` keys (distance < horizon)."""
    return window if horizon is None else min(window, math.ceil(horizon / dilation))


def local_pattern(dist: Tensor, window: int, dilation: int, *, causal: bool = True) -> Tensor:
    """True where a key at distance `dist` is in the (dilated) local window: the `window` most recent
    keys (causal), or `window` on each side, the query counted once (bidirectional)."""
    if not causal:
        dist = dist.abs()
    return (dist >= 0) & (dist % dilation == 0) & (dist < window * dilation)


def reachable(dist: Tensor, *, causal: bool, horizon: int | None) -> Tensor:
    """True where a key at distance `dist` may be seen at all (causality and `same_length`)."""
    if not causal:
        return torch.ones_like(dist, dtype=torch.bool)
    return (dist >= 0) if horizon is None else (dist >= 0) & (dist < horizon)


def default_block_size(window: int) -> int:
    """Queries per block. Each block computes B + w - 1 keys for w useful ones, so smaller blocks
    waste less; larger blocks make fewer, bigger matmuls. w/4 (within 16..256) measured best on a
    2-core CPU (docs/results/benchmarks.md, "Measurements behind the code")."""
    return max(16, min(256, window // 4))


# ---------------------------------------------------------------------------------------------
# The reference: one dense mask, O(n²).


def sliding_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    positions: LayerPositions,
    head_windows: list[tuple[int, int]],
    global_tokens: int,
    horizon: int | None,
    dropatt: float,
    training: bool,
    return_probs: bool = False,
    causal: bool = True,
    chosen: Tensor | None = None,
    tokens: tuple[Tensor, Tensor] | None = None,
    global_positions: bool = False,
    global_qkv: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """The sliding pattern as a dense masked softmax: `(window, dilation)` per head, global tokens,
    chosen global tokens (`chosen`, (b, i) bool over the queries: `AttentionMask.global_mask`), learned
    memory tokens (`tokens`: their keys and values (b, h, m, d), seen by all, content score only).
    `global_positions`: the encoding's score term also on pairs joined only through a global key (else
    the content score alone there); the value-side term (shaw values) stays on the band and the global
    rows. `global_qkv`: the separate projections (q_g, k_g, v_g) of Longformer's global attention: the
    rows of global queries are computed from them (over every key they may see) instead of q, k, v.
    `return_probs`: also return the probabilities (b, h, i, m + n)."""
    i, n = q.shape[-2], k.shape[-2]
    dist = distances(i, n, q.device)  # (i, n)
    local = torch.stack([local_pattern(dist, effective_window(w, s, horizon), s, causal=causal)
                         for w, s in head_windows])
    memory_len, g = n - i, min(global_tokens, i)
    key_pos, query_pos = torch.arange(n, device=q.device), torch.arange(i, device=q.device)
    global_key = (key_pos >= memory_len) & (key_pos < memory_len + g)  # (n,)
    global_query = query_pos < g  # (i,)
    seen = reachable(dist, causal=causal, horizon=horizon)
    # Position terms where the positional API computes them: the band, and the global rows.
    positioned = local | (global_query[:, None] & seen)  # (h, i, n)
    visible = positioned | (global_key[None, :] & seen)
    rows = global_query[None, :]  # (1 or b, i): the global queries
    if chosen is not None:  # chosen tokens' rows (positioned) and columns (score term outside the band: global_positions)
        chosen = chosen.to(q.device)
        chosen_key = F.pad(chosen, (memory_len, 0))  # (b, n)
        positioned = positioned | (chosen[:, :, None] & seen)[:, None]  # (b, h, i, n)
        visible = visible | positioned | (chosen_key[:, None, :] & seen)[:, None]
        rows = rows | chosen
    scored = visible if global_positions else positioned
    out, weights = _dense_attention(q, k, v, positions=positions, visible=visible, scored=scored,
                                    positioned=positioned, tokens=tokens, dropatt=dropatt, training=training)
    if global_qkv is not None and bool(rows.any()):  # global rows from their own projections: every key they see
        q_g, k_g, v_g = global_qkv
        out_g, weights_g = _dense_attention(q_g, k_g, v_g, positions=positions, visible=seen, scored=seen,
                                            positioned=seen, tokens=tokens, dropatt=dropatt, training=training)
        out = torch.where(rows[:, None, :, None], out_g, out)
        weights = torch.where(rows[:, None, :, None], weights_g, weights)
    return (out, weights) if return_probs else out


def _dense_attention(q: Tensor, k: Tensor, v: Tensor, *, positions: LayerPositions, visible: Tensor, scored: Tensor,
                     positioned: Tensor, tokens: tuple[Tensor, Tensor] | None, dropatt: float,
                     training: bool) -> tuple[Tensor, Tensor]:
    """Dense masked attention over [tokens ; keys]: the score term where `scored`, the value term where
    `positioned`, `visible` keys only (masks broadcastable to (b, h, i, n))."""
    d = q.shape[-1]
    q_content, k_content = positions.content(q, k)
    scores = torch.einsum("bhid,bhjd->bhij", q_content, k_content)
    bias = positions.score_bias(q, k_len=k.shape[-2])
    if bias is not None:
        scores = scores + torch.where(scored, bias, torch.zeros((), dtype=bias.dtype, device=bias.device))
    m = 0
    if tokens is not None:  # learned memory tokens first: always visible, never positioned
        m = tokens[0].shape[-2]
        scores = torch.cat([torch.einsum("bhid,bhjd->bhij", q, tokens[0]), scores], dim=-1)
        visible = F.pad(visible, (m, 0), value=True)
        v = torch.cat([tokens[1], v], dim=2)
    scores = (scores * d**-0.5).float().masked_fill(~visible, float("-inf"))
    weights = scores.softmax(dim=-1).to(v.dtype)
    probs = F.dropout(weights, p=dropatt, training=training)
    out = torch.einsum("bhij,bhjd->bhid", probs, v)
    value_term = positions.value_term(probs[..., m:] * positioned)
    return (out if value_term is None else out + value_term), weights


# ---------------------------------------------------------------------------------------------
# The fast kernel: blocks of a band, O(n·w).


def _attend(
    scores: Tensor,
    bias: Tensor | None,
    mask: Tensor,
    v: Tensor,
    *,
    batch: int,
    positions: LayerPositions,
    stride: int,
    want_lse: bool,
    dropatt: float,
    training: bool,
) -> tuple[Tensor, Tensor | None]:
    """Masked softmax attention of a batch of blocks, as `eager_attention` does it.

    `scores` (batch·G, h, rows, cols) are content scores already scaled by 1/sqrt(d) (through q);
    `bias` is the unscaled position term; `mask` an `additive_mask` (G, 1 or h, rows, cols) shared
    by the batch.
    """
    if bias is not None:
        scores = scores.add_(bias, alpha=v.shape[-1] ** -0.5)
    scores = scores.float()
    scores.view(batch, -1, *scores.shape[1:]).add_(mask)
    lse = scores.logsumexp(dim=-1) if want_lse else None
    probs = F.dropout(scores.softmax(dim=-1).to(v.dtype), p=dropatt, training=training)
    out = torch.einsum("bhij,bhjd->bhid", probs, v)
    value_term = positions.value_term(probs, stride=stride)
    return (out if value_term is None else out + value_term), lse


def _band(
    q_content: Tensor,
    q_raw: Tensor,
    k_content: Tensor,
    v: Tensor,
    key_valid: Tensor,
    *,
    positions: LayerPositions,
    heads: list[int] | None,
    window: int,
    stride: int,
    batch: int,
    block_size: int | None,
    want_lse: bool,
    dropatt: float,
    training: bool,
    after: int = 0,
) -> tuple[Tensor, Tensor | None]:
    """Window attention over X independent sequences, queries = the last I of N keys: each query sees
    its `window` most recent keys and, bidirectional, its `after` next ones (no score terms then:
    the positional API gives terms for queries that are the last rows of their keys).

    q_content (X, hh, I, d) and k_content, v (X, hh, N, d) hold the heads being computed; q_raw
    (X, h, I, d) holds all heads (the positional API returns terms for all of them). X = batch·c
    with c classes innermost; key_valid (c, N) marks real keys (False = padding of a dilated layout).
    """
    X, _, I, _ = q_content.shape
    N = k_content.shape[-2]
    window, after = min(window, N), min(after, N)
    B = min(block_size or default_block_size(window + after), I)

    def pick(bias: Tensor | None) -> Tensor | None:
        return bias if bias is None or heads is None else bias[:, heads]

    if B + window + after - 1 >= N:  # the band covers (almost) everything: one dense block is cheaper
        scores = torch.einsum("bhid,bhjd->bhij", q_content, k_content)
        bias = pick(positions.score_bias(q_raw, k_len=N, stride=stride))
        dist = distances(I, N, q_content.device)
        band = (dist >= -after) & (dist < window)  # (I, N)
        mask = additive_mask(band & key_valid[:, None, :])[:, None]  # (c, 1, I, N)
        return _attend(scores, bias, mask, v, batch=batch, positions=positions, stride=stride,
                       want_lse=want_lse, dropatt=dropatt, training=training)

    n_blocks = math.ceil(I / B)
    K = B + window - 1 + after  # keys per block: the window of its first query through its last query's
    query_pad = n_blocks * B - I
    first_key = N - n_blocks * B - window + 1  # position of block 0's first key (< 0: padding)
    key_pad = max(0, -first_key)

    def query_blocks(x: Tensor) -> Tensor:  # (X, h, I, d) -> (X·nb, h, B, d)
        x = F.pad(x, (0, 0, query_pad, 0))
        X_, h_, _, d_ = x.shape
        return x.view(X_, h_, n_blocks, B, d_).transpose(1, 2).reshape(X_ * n_blocks, h_, B, d_)

    def key_blocks(x: Tensor) -> Tensor:  # (X, h, N, d) -> (X·nb, h, K, d), overlapping windows
        x = F.pad(x, (0, 0, key_pad, after))[:, :, first_key + key_pad :]
        x = x.unfold(2, K, B)  # (X, h, nb, d, K): a view
        X_, h_, _, d_, _ = x.shape
        return x.permute(0, 2, 1, 4, 3).reshape(X_ * n_blocks, h_, K, d_)

    scores = torch.einsum("bhid,bhjd->bhij", query_blocks(q_content), key_blocks(k_content))
    bias = None if after else pick(positions.score_bias(query_blocks(q_raw), k_len=K, stride=stride))
    rows, cols = torch.arange(B, device=q_content.device), torch.arange(K, device=q_content.device)
    dist = rows[:, None] + (K - B - after) - cols[None, :]  # causal: queries are the last B rows of the keys
    band = (dist >= -after) & (dist < window)  # (B, K)
    valid = F.pad(key_valid, (key_pad, after), value=False)[:, first_key + key_pad :].unfold(1, K, B)  # (c, nb, K)
    mask = additive_mask(band & valid[:, :, None, :]).view(-1, 1, B, K)  # (c·nb, 1, B, K)
    out, lse = _attend(scores, bias, mask, key_blocks(v), batch=batch, positions=positions, stride=stride,
                       want_lse=want_lse, dropatt=dropatt, training=training)
    d = out.shape[-1]
    out = out.view(X, n_blocks, -1, B, d).transpose(1, 2).reshape(X, -1, n_blocks * B, d)[:, :, query_pad:]
    if lse is not None:
        lse = lse.view(X, n_blocks, -1, B).transpose(1, 2).reshape(X, -1, n_blocks * B)[:, :, query_pad:]
    return out, lse


def _dilated_band(
    q_content: Tensor,
    q_raw: Tensor,
    k_content: Tensor,
    v: Tensor,
    *,
    heads: list[int] | None,
    window: int,
    dilation: int,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """Regroup positions by residue class mod `dilation`, run `_band` on each class, undo."""
    b, _, i, _ = q_content.shape
    n = k_content.shape[-2]
    if heads is not None:
        q_content, k_content, v = q_content[:, heads], k_content[:, heads], v[:, heads]
    s = dilation
    if s == 1:
        key_valid = torch.ones(1, n, dtype=torch.bool, device=q_content.device)
        return _band(q_content, q_raw, k_content, v, key_valid, heads=heads, window=window, stride=1,
                     batch=b, **kwargs)
    # Pad keys on the left so n + key_pad is a multiple of s, and queries likewise: then position p
    # (after padding) sits in class p % s at index p // s, and each class's queries are still the
    # last rows of its keys.
    key_pad, query_pad = (-n) % s, (-i) % s

    def to_classes(x: Tensor, pad: int) -> Tensor:  # (b, h, L, d) -> (b·s, h, (L+pad)/s, d)
        x = F.pad(x, (0, 0, pad, 0))
        b_, h_, L, d_ = x.shape
        return x.view(b_, h_, L // s, s, d_).permute(0, 3, 1, 2, 4).reshape(b_ * s, h_, L // s, d_)

    key_valid = (torch.arange(n + key_pad, device=q_content.device) >= key_pad).view(-1, s).T  # (s, N)
    out, lse = _band(to_classes(q_content, query_pad), to_classes(q_raw, query_pad),
                     to_classes(k_content, key_pad), to_classes(v, key_pad), key_valid,
                     heads=heads, window=window, stride=s, batch=b, **kwargs)

    def from_classes(x: Tensor) -> Tensor:  # (b·s, h, I, ...) -> (b, h, I·s, ...)[last i]
        x = x.view(b, s, *x.shape[1:]).transpose(1, 2)  # (b, h, s, I, ...)
        x = x.transpose(2, 3).reshape(b, x.shape[1], -1, *x.shape[4:])  # (b, h, I·s, ...)
        return x[:, :, query_pad:]

    return from_classes(out), (None if lse is None else from_classes(lse[..., None])[..., 0])


def banded_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    positions: LayerPositions,
    head_windows: list[tuple[int, int]],
    global_tokens: int,
    horizon: int | None,
    dropatt: float,
    training: bool,
    block_size: int | None = None,
    causal: bool = True,
    chosen: Tensor | None = None,
    tokens: tuple[Tensor, Tensor] | None = None,
    global_positions: bool = False,
    global_qkv: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Tensor:
    """O(n·w) attention with `(window, dilation)` per head, global tokens, chosen global tokens
    (`chosen`, (b, i) bool) and memory tokens (`tokens`, keys and values (b, h, m, d)); same result as
    `sliding_reference` (`global_positions`, `global_qkv`: as there)."""
    b, h, i, d = q.shape
    n = k.shape[-2]
    if not causal and global_tokens:  # no score terms bidirectional: the first g are chosen tokens
        first = torch.zeros(b, i, dtype=torch.bool, device=q.device)
        first[:, :global_tokens] = True
        chosen, global_tokens = (first if chosen is None else chosen.to(q.device) | first), 0
    q_content, k_content = positions.content(q, k)
    q_content = q_content * d**-0.5  # scale the (i, d) queries, not the (i, w) scores
    g = min(global_tokens, i)
    common = dict(positions=positions, block_size=block_size,
                  want_lse=g > 0 or chosen is not None or tokens is not None, dropatt=dropatt, training=training)
    groups: dict[tuple[int, int], list[int]] = {}
    for head, (w, s) in enumerate(head_windows):
        groups.setdefault((effective_window(w, s, horizon), s), []).append(head)
    if len(groups) == 1:
        (window, dilation), = groups
        out, lse = _dilated_band(q_content, q, k_content, v, heads=None, window=window, dilation=dilation,
                                 after=0 if causal else window - 1, **common)
    else:  # heads with different windows or dilations: one band per group
        out = q.new_empty(b, h, i, d)
        lse = q.new_empty(b, h, i, dtype=torch.float32) if common["want_lse"] else None
        for (window, dilation), heads in groups.items():
            part, part_lse = _dilated_band(q_content, q, k_content, v, heads=heads, window=window,
                                           dilation=dilation, after=0 if causal else window - 1, **common)
            out[:, heads] = part
            if lse is not None:
                lse[:, heads] = part_lse
    if tokens is not None:  # every query sees the memory tokens: content score q·k, merged by log-sum-exp
        scores = (q * d**-0.5) @ tokens[0].transpose(-1, -2)  # (b, h, i, m)
        every = torch.ones(1, 1, 1, scores.shape[-1], dtype=torch.bool, device=q.device)
        out_t, lse_t = gathered_attention(None, None, tokens[1], every, dropatt=dropatt, training=training,
                                          score_offset=scores)
        out, lse = merge_by_lse([out, out_t], [lse, lse_t]), torch.logaddexp(lse, lse_t)
    # Global pairs outside the band get the encoding's score term when asked (causal: distances >= 0).
    pair_positions = positions if global_positions and causal and type(positions.encoding).score_terms else None
    if chosen is not None:
        chosen = chosen.to(q.device)
        score_rows = causal and type(positions.encoding).score_terms
        out = _with_chosen(q_content, k_content, v, out, lse, chosen, head_windows=head_windows,
                           causal=causal, horizon=horizon, dropatt=dropatt, training=training,
                           positioned_rows=score_rows or global_qkv is not None, pair_positions=pair_positions,
                           q_raw=q)
        q_rows, k_rows, v_rows = (q, k, v) if global_qkv is None else global_qkv
        if score_rows:
            out = _positioned_rows(q_rows, k_rows, v_rows, out, chosen, positions=positions, horizon=horizon,
                                   tokens=tokens, dropatt=dropatt, training=training)
        elif global_qkv is not None:
            out = _content_rows(q_rows, k_rows, v_rows, out, chosen, positions=positions, causal=causal,
                                horizon=horizon, tokens=tokens, dropatt=dropatt, training=training)
        return out
    if g == 0:
        return out

    # Global columns: every query also attends to the g global keys outside its local window
    # (content score, plus the score term with global_positions), merged with the band by log-sum-exp.
    memory_len = n - i
    keys = slice(memory_len, memory_len + g)
    dist = torch.arange(i, device=q.device)[:, None] - torch.arange(g, device=q.device)[None, :]  # (i, g)
    causal = (dist >= 0) if horizon is None else (dist >= 0) & (dist < horizon)
    in_band = torch.stack([local_pattern(dist, effective_window(w, s, horizon), s) for w, s in head_windows])
    mask = additive_mask(causal & ~in_band)[None]  # (1, h, i, g)
    scores = torch.einsum("bhid,bhjd->bhij", q_content, k_content[:, :, keys])
    bias = None
    if pair_positions is not None:
        key_index = torch.arange(memory_len, memory_len + g, device=q.device).expand(1, i, g)
        bias = pair_terms(pair_positions, q, key_index, k_len=n, max_distance=i - 1)
    out_global, lse_global = _attend(scores, bias, mask, v[:, :, keys], batch=b, positions=_NO_POSITIONS,
                                     stride=1, want_lse=True, dropatt=dropatt, training=training)
    total = torch.logaddexp(lse, lse_global)
    band_weight = (lse - total).exp()[..., None].to(out.dtype)  # (b, h, i, 1)
    global_weight = (lse_global - total).exp()[..., None].to(out.dtype)
    out = out * band_weight + out_global * global_weight
    # Global rows: the first g queries attend to every earlier key, with all position terms. They
    # are the last rows of the first memory_len + g keys: exactly the eager kernel's convention.
    if global_qkv is not None:  # Longformer's separate projections for the global rows
        q, k, v = global_qkv
    keys, values, m = k[:, :, : memory_len + g], v[:, :, : memory_len + g], 0
    if tokens is not None:  # (the eager kernel takes memory tokens in front of the keys)
        keys, values, m = torch.cat([tokens[0], keys], dim=2), torch.cat([tokens[1], values], dim=2), tokens[0].shape[-2]
    rows, _ = eager_attention(q[:, :, :g], keys, values, positions=positions,
                              mask=AttentionMask(window=horizon, memory_tokens=m), dropatt=dropatt, training=training)
    return torch.cat([rows, out[:, :, g:]], dim=2)


def _with_chosen(
    q_content: Tensor,
    k_content: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    chosen: Tensor,
    *,
    head_windows: list[tuple[int, int]],
    causal: bool,
    horizon: int | None,
    dropatt: float,
    training: bool,
    positioned_rows: bool = False,
    pair_positions: LayerPositions | None = None,
    q_raw: Tensor | None = None,
) -> Tensor:
    """Merge chosen global tokens into the band's result `out` (with its log-sum-exp `lse`): every
    query also sees the chosen keys outside its band (gathered: O(i·G)), then each chosen query also
    sees every other key it may see (dense rows: O(R·n)). Content scores only (q_content is scaled),
    but for `pair_positions` given: the chosen columns get its score term (`pair_terms`, q_raw the
    unscaled queries). `positioned_rows`: the chosen rows are left to `_positioned_rows` (score terms)
    or `_content_rows` (separate global projections)."""
    b, h, i, d = q_content.shape
    n = k_content.shape[-2]
    memory_len = n - i
    query_pos = torch.arange(i, device=q_content.device) + memory_len

    def band_of(dist: Tensor) -> Tensor:  # (..., i, m) distances -> (..., h, i, m) in some head's band
        return torch.stack([local_pattern(dist, effective_window(w, s, horizon), s, causal=causal)
                            for w, s in head_windows], dim=-3)

    count = int(chosen.sum(-1).max()) if chosen.numel() else 0
    if count == 0:
        return out
    # Columns: the chosen keys (positions in [memory ; segment]) outside each query's band.
    order = chosen.long().argsort(dim=-1, descending=True, stable=True)[:, :count] + memory_len  # (b, G)
    valid = chosen.gather(1, order - memory_len)  # (b, G): slots past a row's own count are False
    dist = query_pos[None, :, None] - order[:, None, :]  # (b, i, G)
    seen = valid[:, None, :] & reachable(dist, causal=causal, horizon=horizon)  # (b, i, G)
    seen = seen[:, None] & ~band_of(dist)  # (b, h, i, G)
    index = order[:, None, :, None].expand(b, h, count, d)
    scores = q_content @ k_content.gather(2, index).transpose(-1, -2)
    if pair_positions is not None:
        scores = scores + pair_terms(pair_positions, q_raw, order[:, None, :].expand(b, i, count), k_len=n) * d**-0.5
    out_c, lse_c = gathered_attention(None, None, v.gather(2, index), seen, dropatt=dropatt, training=training,
                                      score_offset=scores)
    lse_total = torch.logaddexp(lse, lse_c)
    out = merge_by_lse([out, out_c], [lse, lse_c])
    if positioned_rows:
        return out
    # Rows: each chosen query also sees every reachable key outside its band and not chosen.
    rows = int(chosen.sum(-1).max())
    where = chosen.long().argsort(dim=-1, descending=True, stable=True)[:, :rows]  # (b, R) query indices
    keep = chosen.gather(1, where)  # (b, R): padding slots write back what was there
    dist = query_pos[where][:, :, None] - torch.arange(n, device=q_content.device)  # (b, R, n)
    key_chosen = F.pad(chosen, (memory_len, 0))  # (b, n)
    rest = (keep[:, :, None] & reachable(dist, causal=causal, horizon=horizon) & ~key_chosen[:, None, :])
    rest = rest[:, None] & ~band_of(dist)  # (b, h, R, n)
    picked = where[:, None, :, None].expand(b, h, rows, d)
    scores = q_content.gather(2, picked) @ k_content.transpose(-1, -2)  # (b, h, R, n)
    out_r, lse_r = gathered_attention(None, None, v, rest, dropatt=dropatt, training=training, score_offset=scores)
    merged = merge_by_lse([out.gather(2, picked), out_r], [lse_total.gather(2, where[:, None].expand(b, h, rows)), lse_r])
    return out.scatter(2, picked, torch.where(keep[:, None, :, None], merged, out.gather(2, picked)))


def _positioned_rows(q: Tensor, k: Tensor, v: Tensor, out: Tensor, chosen: Tensor, *, positions: LayerPositions,
                     horizon: int | None, tokens: tuple[Tensor, Tensor] | None, dropatt: float,
                     training: bool) -> Tensor:
    """Causal chosen queries with an encoding's score terms (xl, shaw, alibi, t5): their rows see every
    earlier key with all position terms, as `global_tokens` rows do. The positional API gives terms
    for queries that are the last rows of their keys, so one eager block runs from the first to the
    last chosen query (over the keys up to the last): O(span·n), cheap for chosen tokens close
    together (a [CLS], a question), dense at worst; rows in the span that are not chosen are dropped."""
    i, n = q.shape[-2], k.shape[-2]
    where = chosen.any(0).nonzero()[:, 0]
    if len(where) == 0:
        return out
    first, last = int(where[0]), int(where[-1])
    end = n - i + last + 1
    keys, values, m = k[:, :, :end], v[:, :, :end], 0
    if tokens is not None:
        keys, values, m = torch.cat([tokens[0], keys], dim=2), torch.cat([tokens[1], values], dim=2), tokens[0].shape[-2]
    rows, _ = eager_attention(q[:, :, first:last + 1], keys, values, positions=positions,
                              mask=AttentionMask(window=horizon, memory_tokens=m), dropatt=dropatt, training=training)
    span = chosen[:, None, first:last + 1, None]  # (b, 1, span, 1)
    return torch.cat([out[:, :, :first], torch.where(span, rows, out[:, :, first:last + 1]), out[:, :, last + 1:]], dim=2)


def _content_rows(q: Tensor, k: Tensor, v: Tensor, out: Tensor, chosen: Tensor, *, positions: LayerPositions,
                  causal: bool, horizon: int | None, tokens: tuple[Tensor, Tensor] | None, dropatt: float,
                  training: bool) -> Tensor:
    """The rows of chosen queries from their own projections (Longformer's Q_g, K_g, V_g), for encodings
    without score terms (RoPE rotates q and k; absolute ones are in the input): each sees every key it may
    see and the memory tokens, gathered per sequence (O(R·n)); the rows of `out` are replaced."""
    b, h, i, d = q.shape
    n = k.shape[-2]
    rows = int(chosen.sum(-1).max())
    where = chosen.long().argsort(dim=-1, descending=True, stable=True)[:, :rows]  # (b, R) query indices
    keep = chosen.gather(1, where)  # (b, R): padding slots write back what was there
    q_content, k_content = positions.content(q, k)
    picked = where[:, None, :, None].expand(b, h, rows, d)
    scores = (q_content.gather(2, picked) * d**-0.5) @ k_content.transpose(-1, -2)  # (b, h, R, n)
    dist = (where + n - i)[:, :, None] - torch.arange(n, device=q.device)  # (b, R, n)
    seen = reachable(dist, causal=causal, horizon=horizon)[:, None]  # (b, 1, R, n)
    values = v
    if tokens is not None:  # every query sees the memory tokens: content score q·k
        scores = torch.cat([(q.gather(2, picked) * d**-0.5) @ tokens[0].transpose(-1, -2), scores], dim=-1)
        seen = F.pad(seen, (tokens[0].shape[-2], 0), value=True)
        values = torch.cat([tokens[1], v], dim=2)
    rows_out, _ = gathered_attention(None, None, values, seen, dropatt=dropatt, training=training,
                                     score_offset=scores, need_lse=False)
    return out.scatter(2, picked, torch.where(keep[:, None, :, None], rows_out, out.gather(2, picked)))


def pair_terms(positions: LayerPositions, q: Tensor, key_index: Tensor, *, k_len: int,
               max_distance: int | None = None) -> Tensor:
    """The encoding's unscaled score term for query row r of q (b, h, i, d) (the last i of k_len keys)
    and the keys `key_index` ((b or 1, i, G), positions in [0, k_len)): (b or 1, h, i, G). Only for keys at
    or before their query (distances >= 0); other entries are garbage for the caller to mask.

    Cheap, O(i·G·d), for the pairs a band leaves out (global columns): xl gathers its projected table
    W_R R by distance; any other encoding is read off one-row calls of its `score_bias` (a single query
    that is the last row of K keys gets its term for the distances K-1 … 0 unshifted) on the basis
    queries e_1 … e_d and 0, which give the whole term when it is affine in q (xl, shaw, alibi, t5: q·a +
    c); a real query row is checked against that, and an encoding that is not affine gets its dense
    by-key term (O(i·k_len)) instead (the check is skipped while compiling). `max_distance`: a bound
    known without reading the keys (no device sync, no graph break)."""
    b, h, i, d = q.shape
    dist = (key_index.new_tensor(k_len - i) + torch.arange(i, device=q.device)[:, None]) - key_index
    if max_distance is not None:
        K = max_distance + 1
    else:
        K = max(int(dist.max()) + 1, 1) if dist.numel() else 1
    column = K - 1 - dist.clamp(0, K - 1)  # (b or 1, i, G): the column of each distance in a by-distance term
    xl = positions.xl_terms(q, k_len=K)
    if xl is not None:
        _, q_v, table = xl  # (b, h, i, d), (h, K, d)
        return _gather_dot(q_v, table.transpose(1, 2), None, column)
    zero = q.new_zeros(1, h, 1, d)
    basis = torch.eye(d, dtype=q.dtype, device=q.device)[:, None, None, :].expand(d, h, 1, d)
    probe = q[:1, :, -1:]
    term = positions.score_bias(torch.cat([basis, zero, probe]), k_len=K)[:, :, 0]  # (d + 2 or 1, h, K)
    if term.shape[0] == 1:  # a term of the distance alone (alibi, t5)
        return _gather_dot(None, None, term[0], column)
    offset, slopes = term[d], (term[:d] - term[d]).permute(1, 0, 2)  # (h, K), (h, d, K)
    predicted = torch.einsum("hd,hdk->hk", probe[0, :, 0], slopes) + offset
    actual = term[d + 1]
    predicted, actual = predicted.detach().float(), actual.detach().float()
    if torch.compiler.is_compiling() or torch.allclose(predicted, actual, rtol=1e-3, atol=1e-4 * float(actual.abs().max()) + 1e-6):
        return _gather_dot(q, slopes, offset, column)
    bias = positions.score_bias(q, k_len=k_len)  # not affine in q: the dense term, by key
    return bias.gather(-1, key_index.expand(bias.shape[0], i, -1)[:, None].expand(-1, bias.shape[1], -1, -1))


def _gather_dot(q: Tensor | None, slopes: Tensor | None, offset: Tensor | None, column: Tensor) -> Tensor:
    """q (b, h, i, d) · slopes (h, d, K)[..., column] + offset (h, K)[..., column], column (b or 1, i, G):
    (b or 1, h, i, G), in chunks of G that keep the gathered (h, b, i, G', d) slopes small."""
    if slopes is None:
        return offset[:, column].transpose(0, 1)
    b, h, i, d = q.shape
    G = column.shape[-1]
    step = max(1, (1 << 24) // max(1, h * max(b, column.shape[0]) * i * d))
    parts = []
    for start in range(0, G, step):
        col = column[..., start:start + step]  # (b or 1, i, g)
        gathered = slopes[:, :, col]  # (h, d, b or 1, i, g)
        part = torch.einsum("bhid,hdbig->bhig", q, gathered.expand(-1, -1, b, -1, -1))
        if offset is not None:
            part = part + offset[:, col].transpose(0, 1)
        parts.append(part)
    return torch.cat(parts, dim=-1)


class _NoPositions:
    """Global columns carry no position term (see the module docstring)."""

    @staticmethod
    def value_term(probs: Tensor, *, stride: int = 1) -> None:
        return None


_NO_POSITIONS = _NoPositions()


# ---------------------------------------------------------------------------------------------
# Kernels chosen by config.attention = "sliding".


def shaw_values(config: LayerConfig) -> bool:
    """Whether Shaw's value-side term is on (one pattern for all heads needed)."""
    return config.pos_encoding == "shaw" and config.position_options.values


def check_sliding(config: LayerConfig) -> None:
    from txl.nn.positional import POSITIONAL_ENCODINGS

    options = config.attention_options
    layers = options.layers()
    if layers is not None and getattr(config, "universal", False):
        raise ConfigError("config.attention_options.window/dilation per layer need distinct layers; universal=true "
                          "applies one block at every step: give one value for all layers")
    if layers is not None and layers != config.n_layer:
        raise ConfigError(f"config.attention_options.window/dilation per layer need one entry per layer "
                          f"(n_layer={config.n_layer}), got {layers}")
    for dilation in options.layer_dilations or (options.dilation,):
        if dilation and (len(dilation) not in (1, config.n_head) or min(dilation) < 1):
            raise ConfigError(
                f"config.attention_options.dilation needs one value >= 1 for all heads or one per head "
                f"(n_head={config.n_head}), got {list(dilation)}"
            )
        if shaw_values(config) and len(set(dilation)) > 1:
            raise ConfigError(
                "config.position_options.values (shaw) needs every head on one attention pattern; it is not "
                "available with attention='sparse' or mixed sliding dilation"
            )
    if config.attention == "sliding" and not config.causal and POSITIONAL_ENCODINGS[config.pos_encoding].score_terms:
        # the band's blocks get score terms for queries that are the last rows of their keys only
        allowed = ", ".join(name for name, cls in POSITIONAL_ENCODINGS.items()
                            if not cls.score_terms and not cls.causal_only)
        raise ConfigError(f"config.pos_encoding={config.pos_encoding!r} adds a term to the attention scores, "
                          f"which the bidirectional sliding window does not form; use one of {allowed}")


@register("sliding", "fast", bidirectional=True, check=check_sliding, global_mask=True, memory_tokens=True,
          cross_attention=False, options=SlidingOptions)  # (a window needs the queries among the keys)
class SlidingWindowAttention(nn.Module):
    """`attention="sliding"`: Longformer's sliding window (Beltagy et al. 2020), O(n·w); causal, or
    bidirectional (`causal=false`: the window on both sides); global tokens by `global_mask`."""

    name = "sliding"
    global_positions = False  # (class defaults: for subclasses built without SlidingOptions, e.g. sparse)
    global_projections = False

    def __init__(self, config: LayerConfig):
        super().__init__()
        options = config.attention_options
        if options.per_layer:
            raise ValueError("a sliding kernel takes one layer's options: build it from "
                             "txl.nn.attention.layer.layer_config(config, layer_idx)")
        self.head_windows = [(options.window, s) for s in head_dilations(config)]
        self.global_tokens = options.global_tokens
        self.global_positions = options.global_positions
        # Longformer's Q_g, K_g, V_g: the layer owns them when the kernel asks (txl.nn.attention.layer)
        self.global_projections = (options.global_tokens > 0 if options.global_projections is None
                                   else options.global_projections)

    def check_mask(self, mask: AttentionMask) -> None:
        no_padding(self.name, mask)
        if mask.global_mask is not None and self.global_tokens:
            raise UsageError("attention='sliding' takes global_tokens or a global_mask, not both: put the "
                             "first tokens in the global_mask and set global_tokens=0")

    @staticmethod
    def split_tokens(k: Tensor, v: Tensor, mask: AttentionMask):
        """(k, v, tokens): the learned memory tokens in front of the keys (`mask.memory_tokens`) apart."""
        m = mask.memory_tokens
        if not m:
            return k, v, None
        return k[:, :, m:], v[:, :, m:], (k[:, :, :m], v[:, :, :m])

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        return self.forward_global(q, k, v, None, positions=positions, mask=mask, dropatt=dropatt, training=training,
                                   need_weights=need_weights)

    def forward_global(self, q, k, v, global_qkv: tuple[Tensor, Tensor, Tensor] | None, *, positions: LayerPositions,
                       mask: AttentionMask, dropatt: float, training: bool, need_weights: bool = False):
        """`forward` with Longformer's separate global projections: `global_qkv` = (q_g, k_g, v_g), q_g
        (b, h, i, d) and k_g, v_g (b, h, n, d) over [memory ; segment] (no memory tokens: those of k and v
        serve both), from which the rows of global queries are computed. The fused impls reach this for
        global attention too (they fall back to the banded kernel there)."""
        self.check_mask(mask)
        if need_weights:  # the probabilities over every key: the dense reference forms them
            return SlidingWindowReference.forward_global(self, q, k, v, global_qkv, positions=positions, mask=mask,
                                                         dropatt=dropatt, training=training, need_weights=True)
        k, v, tokens = self.split_tokens(k, v, mask)
        out = banded_attention(q, k, v, positions=positions, head_windows=self.head_windows,
                               global_tokens=self.global_tokens, horizon=mask.window, dropatt=dropatt,
                               training=training, causal=mask.causal, chosen=mask.global_mask, tokens=tokens,
                               global_positions=self.global_positions, global_qkv=global_qkv)
        return out, None

    def extra_repr(self) -> str:
        extra = ", global_projections=True" if self.global_projections else ""
        return f"head_windows={self.head_windows}, global_tokens={self.global_tokens}{extra}"


@register("sliding", "eager", bidirectional=True, check=check_sliding, global_mask=True, memory_tokens=True,
          cross_attention=False, options=SlidingOptions)  # (a window needs the queries among the keys)
class SlidingWindowReference(SlidingWindowAttention):
    """The same pattern as a dense mask (O(n²)): the ground truth for `SlidingWindowAttention`."""

    def forward(self, q, k, v, *, positions: LayerPositions, mask: AttentionMask, dropatt: float, training: bool,
                need_weights: bool = False):
        return self.forward_global(q, k, v, None, positions=positions, mask=mask, dropatt=dropatt, training=training,
                                   need_weights=need_weights)

    def forward_global(self, q, k, v, global_qkv, *, positions: LayerPositions, mask: AttentionMask, dropatt: float,
                       training: bool, need_weights: bool = False):
        self.check_mask(mask)
        k, v, tokens = self.split_tokens(k, v, mask)
        out, probs = sliding_reference(q, k, v, positions=positions, head_windows=self.head_windows,
                                       global_tokens=self.global_tokens, horizon=mask.window, dropatt=dropatt,
                                       training=training, return_probs=True, causal=mask.causal,
                                       chosen=mask.global_mask, tokens=tokens, global_positions=self.global_positions,
                                       global_qkv=global_qkv)
        return out, probs if need_weights else None
