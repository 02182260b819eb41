"""Positional encodings, chosen by name (`config.pos_encoding`), each with its options
(`config.position_options`: a dataclass registered with the encoding, e.g. `T5Options`).

Every encoding is a model-level module that owns all of its parameters (for all layers) and answers
three questions for the attention of layer `i` (see `LayerPositions`):

- `content(q, k)`: the query/key pair used for the content score `q·k` (xl adds the global content
  bias u to q; RoPE rotates both; the others return them unchanged);
- `score_bias(q, k_len=, rel_shift=)`: an additive term for the attention scores before scaling
  (xl: the position terms (b)+(d) of Dai et al. 2019; Shaw: q·a_K; ALiBi: -m·distance), or None;
- `value_term(probs)`: an additive term for the attention output (Shaw's value side), or None.

Absolute encodings (sinusoidal, learned: txl/nn/positions_absolute.py) instead join a table to the input
embedding in `embed`, at positions 0 … t-1 or the caller's (`embed_positions`, `position_ids=`).

Queries are always the *last* `q_len` positions of the `k_len` keys they attend to (memory first,
then the current segment), so the distance between query i and key j is `i + (k_len - q_len) - j`.
This covers full attention, query-chunked evaluation and windowed blocks with one convention, and it
is what lets the relative encodings use the rel-shift trick (see `rel_shift_pad`). A block may also
hold every `stride`-th position only (dilated and strided heads of the sliding and sparse kernels):
then consecutive keys are `stride` positions apart and distances are multiplied by `stride`.

Dimension names: b batch, h heads, i queries, j keys, d head dim, n = k_len.

The relative encodings sit here together, each beside its paper's formula, as the registry's reference
set (nezha is Shaw's with a fixed table); the interface and registry are in txl/nn/positions_base.py, the
absolute encodings in txl/nn/positions_absolute.py; a new encoding goes in a file of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from txl.errors import ConfigError
from txl.nn.attention.masks import distances
from txl.nn.options import MAX_LENGTH, LayerConfig, Options
from txl.nn.positions_base import (  # noqa: F401 (the interface, importable from here as before)
    CONTENT_ONLY,
    POSITIONAL_ENCODINGS,
    LayerPositions,
    PositionalEncoding,
    RelShift,
    embed_positions,
    encoding_options,
    register_encoding,
    rel_shift_pad,
    rel_shift_strided,
    sinusoid_table,
)

# ---------------------------------------------------------------------------------------------
# The options of the built-in encodings (their defaults are the values txl used before they moved here).


@dataclass(frozen=True)
class ShawOptions(Options):
    max_distance: int = 64  # distances beyond this share one embedding (Shaw et al.'s clipping k)
    values: bool = False  # also add the distance embedding on the value side
    share_heads: bool = False  # one table for all heads (Shaw et al. §3.1); False: one per head
    share_layers: bool = False  # one table for all layers (bert4keras's NEZHA); False: one per layer

    def validate(self) -> None:
        self.at_least(0, "max_distance")


@dataclass(frozen=True)
class T5Options(Options):
    buckets: int = 32  # relative-position buckets (half exact, half log-spaced)
    max_distance: int = 128  # distances beyond this share the last bucket

    def validate(self) -> None:
        self.at_least(1, "buckets", "max_distance")
        if self.buckets < 4 or self.max_distance <= self.buckets // 2:
            self.fail("buckets", f"must be >= 4 and max_distance > buckets/2 (got {self.buckets}, "
                                 f"{self.max_distance}): half the buckets are exact distances, the rest log-spaced "
                                 "beyond")


@dataclass(frozen=True)
class XPosOptions(Options):
    scale_base: int = 512  # B in the decay ζ^(distance/B); larger = slower decay

    def validate(self) -> None:
        self.at_least(1, "scale_base", high=MAX_LENGTH)


@register_encoding("xl")
class XLRelative(PositionalEncoding):
    """Transformer-XL relative positions (Dai et al. 2019, §3.3).

    A_ij = (q_i + u)·k_j + (q_i + v)·W_kR R_{i-j}, with R the (non-learned) sinusoid table for
    distances n-1 … 0 clamped at clamp_len, W_kR a per-layer projection (`r_proj`), and u, v learned
    biases shared by all layers (PyTorch reference) or per layer (`untie_r`, TF large models).
    Dropout is applied to R once per forward (as the reference does), shared by all layers.
    """

    relative = True
    score_terms = True
    causal_only = True

    def __init__(self, config: LayerConfig):
        super().__init__(config)
        n_bias = config.n_layer if config.untie_r else 1
        hd = (n_bias, config.n_head, config.d_head)
        self.u = nn.Parameter(torch.zeros(hd))  # global content bias ("r_w_bias")
        self.v = nn.Parameter(torch.zeros(hd))  # global position bias ("r_r_bias")
        self.r_proj = nn.ModuleList(
            nn.Linear(config.d_model, config.n_head * config.d_head, bias=False) for _ in range(config.n_layer)
        )
        self.drop = nn.Dropout(config.dropout)

    def prepare(self, *, k_len, clamp_len, device, dtype):
        pos = torch.arange(k_len - 1, -1, -1, device=device)  # distances n-1 … 0
        if clamp_len > 0:
            pos = pos.clamp(max=clamp_len)
        table = self.drop(sinusoid_table(pos, self.config.d_model).to(dtype))
        return {"R": table, "clamp_len": clamp_len}

    def query_bias(self, which: str, layer: int) -> Tensor:
        """u ("u", global content bias) or v ("v", global position bias) of `layer`, as (h, 1, d)."""
        param = self.u if which == "u" else self.v
        return param[layer if param.shape[0] > 1 else 0][:, None, :]

    def content(self, layer, state, q, k):
        return q + self.query_bias("u", layer), k

    def projected_table(self, layer: int, state: dict, k_len: int, stride: int = 1) -> Tensor:
        """W_kR R for the distances (k_len-1)·stride, …, stride, 0, (h, n, d)."""
        if stride == 1:
            table = state["R"][-k_len:]
        else:
            # R holds distances n-1 … 0 (row r = distance n-1-r). Distances past the table belong only
            # to padding keys of a dilated block, which are masked: clamp them to the last row.
            last = state["R"].shape[0] - 1
            dist = torch.arange(k_len - 1, -1, -1, device=state["R"].device) * stride
            table = state["R"][(last - dist).clamp(min=0)]
        r = self.r_proj[layer](table).view(k_len, self.config.n_head, self.config.d_head)
        return r.transpose(0, 1)

    def score_bias(self, layer, state, q, *, k_len, rel_shift, stride=1):
        r = self.projected_table(layer, state, k_len, stride)  # (h, n, d)
        raw = torch.einsum("bhid,hjd->bhij", q + self.query_bias("v", layer), r)  # columns = distances
        return rel_shift(raw)

    def xl_terms(self, layer, state, q, *, k_len):
        return (q + self.query_bias("u", layer), q + self.query_bias("v", layer),
                self.projected_table(layer, state, k_len))


@register_encoding("shaw", options=ShawOptions)
class ShawRelative(PositionalEncoding):
    """Shaw et al. 2018: learned embeddings of the clipped distance, on the key side (and optionally
    the value side): e_ij = q_i·(k_j + a^K_{clip(i-j)}), z_i = Σ_j α_ij (v_j + a^V_{clip(i-j)}).

    For a causal LM distances are >= 0, so `max_relative_distance + 1` embeddings per table suffice.
    This is the paper's ablation row "Shaw et al. (2018)" (Dai et al. 2019, Table 6), pure Shaw without
    the reference's extra r_w_bias/r_bias terms. In the bidirectional encoder (`causal=False`) distances
    run from -k to k (the paper's clip(j - i, -k, k)): 2k + 1 embeddings.

    The tables are (layers, rows, heads, d_head): one per layer and head by default; `share_heads` keeps
    one for all heads (as Shaw et al. §3.1: "shared across attention heads"), `share_layers` one for all
    layers (as bert4keras builds its relative embedding once per model), both: one table in all.
    """

    relative = True
    score_terms = True

    def __init__(self, config: LayerConfig):
        super().__init__(config)
        options = config.position_options
        self.clip = options.max_distance
        self.bidirectional = not config.causal
        self.n_head = config.n_head
        shape = (1 if options.share_layers else config.n_layer, self.table_rows(),
                 1 if options.share_heads else config.n_head, config.d_head)
        self.key_table = nn.Parameter(torch.zeros(shape))
        self.value_table = nn.Parameter(torch.zeros(shape)) if options.values else None

    def table_rows(self) -> int:
        return 2 * self.clip + 1 if self.bidirectional else self.clip + 1

    def row_of(self, dist: Tensor) -> Tensor:
        """The table row of each distance i - j (query minus key; negative = a future key)."""
        if self.bidirectional:
            return dist.clamp(-self.clip, self.clip) + self.clip
        return dist.clamp(0, self.clip)  # causal: a future key is masked; any row does

    def table(self, which: str, layer: int, dtype: torch.dtype) -> Tensor:
        """The key ("key") or value ("value") table layer `layer` reads, (rows, h, d)."""
        table = self.key_table if which == "key" else self.value_table
        table = table[layer if table.shape[0] > 1 else 0]
        return table.expand(-1, self.n_head, -1).to(dtype)

    def score_bias(self, layer, state, q, *, k_len, rel_shift, stride=1):
        table = self.table("key", layer, q.dtype)
        if self.bidirectional:  # q·a_r for every row r, then picked per (i, j): no (i, n, d) tensor
            per_row = torch.einsum("bhid,rhd->bhir", q, table)
            rows = self.row_of(distances(q.shape[-2], k_len, q.device) * stride)
            return per_row.gather(-1, rows.expand(*per_row.shape[:2], -1, -1))
        dist = torch.arange(k_len - 1, -1, -1, device=q.device) * stride  # columns = distances n-1 … 0
        raw = torch.einsum("bhid,jhd->bhij", q, table[self.row_of(dist)])
        return rel_shift(raw)

    def value_term(self, layer, state, probs, *, stride=1):
        if self.value_table is None:
            return None
        q_len, k_len = probs.shape[-2:]
        rows = self.row_of(distances(q_len, k_len, probs.device) * stride)  # masked (future) keys have prob 0
        # Sum the probabilities of keys that share a clipped distance, then mix the value embeddings.
        weights = probs.new_zeros(*probs.shape[:-1], self.table_rows())
        weights.scatter_add_(-1, rows.expand_as(probs), probs)  # (b, h, i, rows)
        return torch.einsum("bhir,rhd->bhid", weights, self.table("value", layer, probs.dtype))


@dataclass(frozen=True)
class NezhaOptions(Options):
    max_distance: int = 64  # k: distances clip to [-k, k] (bert4keras's NEZHA: 2·64 + 1 rows)

    def validate(self) -> None:
        self.at_least(0, "max_distance")


def nezha_table(rows: int, depth: int) -> Tensor:
    """bert4keras's `Sinusoidal` initializer: row r (r = 0 … rows-1, the row index, not the signed
    distance) holds sin(r·ω_t) at 2t and cos(r·ω_t) at 2t+1, ω_t = 10000^(-2t/depth); an odd depth's last
    column stays 0. Computed in float64."""
    table = torch.zeros(rows, depth, dtype=torch.float64)
    omega = 10000.0 ** (-2 * torch.arange(depth // 2, dtype=torch.float64) / depth)
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * omega
    table[:, 0 : 2 * (depth // 2) : 2] = angles.sin()
    table[:, 1 : 2 * (depth // 2) : 2] = angles.cos()
    return table.to(torch.float32)


@register_encoding("nezha", options=NezhaOptions)
class NezhaRelative(ShawRelative):
    """NEZHA's functional relative positions (Wei et al. 2019, arXiv 1909.00204; bert4keras's NEZHA: a
    `RelativePositionEmbedding` of 2k + 1 rows with the `Sinusoidal` initializer and trainable=False):
    Shaw et al.'s key and value terms with a fixed table a shared by every head and layer,
    e_ij = q_i·(k_j + a_{r(i,j)}), z_i = Σ_j α_ij (v_j + a_{r(i,j)}), r(i, j) = clip(j - i, -k, k) + k,
    and a_r the sinusoid of the row index r (`nezha_table`), added before the 1/sqrt(d) scaling as in
    bert4keras. A function of distance only: memory-compatible, and bidirectional too. The table is a
    buffer computed from the options, so checkpoints hold nothing for it.
    """

    def __init__(self, config: LayerConfig):
        PositionalEncoding.__init__(self, config)
        self.clip = config.position_options.max_distance
        self.bidirectional = not config.causal
        self.n_head = config.n_head
        table = nezha_table(self.table_rows(), config.d_head)[None, :, None, :]  # (1, rows, 1, d): all layers, heads
        self.register_buffer("key_table", table, persistent=False)

    @property
    def value_table(self) -> Tensor:
        return self.key_table  # one table on both sides

    def table_rows(self) -> int:
        return 2 * self.clip + 1  # as bert4keras, whatever the direction (a causal model reads rows 0 … k)

    def row_of(self, dist: Tensor) -> Tensor:
        return self.clip - dist.clamp(-self.clip, self.clip)  # clip(j - i, -k, k) + k with dist = i - j

    @classmethod
    def check_config(cls, config):
        if config.attention == "sparse":  # the value term needs every head on one pattern (txl.nn.attention.sparse)
            raise ConfigError("config.pos_encoding='nezha' adds a value term, which needs every head on one attention "
                              "pattern; it is not available with attention='sparse'")
        dilation = getattr(config.attention_options, "dilation", ())
        layers = getattr(config.attention_options, "layer_dilations", None) or (dilation,)
        if config.attention == "sliding" and any(len(set(d or ())) > 1 for d in layers):
            raise ConfigError("config.pos_encoding='nezha' adds a value term, which needs every head on one attention "
                              "pattern; it is not available with mixed sliding dilation")


@register_encoding("rope")
class Rotary(PositionalEncoding):
    """RoPE (Su et al. 2021, RoFormer, arXiv 2104.09864, eq. 34): rotate q and k by their positions so
    that q·k depends on i - j only.

    Each pair of channels (2t, 2t+1) turns by the angle pos·θ_t with θ_t = 10000^(-2t/d_head) (the
    paper's interleaved pairs, not the half-split layout of GPT-NeoX). The rotation lives in `content`,
    so it adds no score term: every kernel, including kernelized (performer) and projected (linformer)
    attention, can apply it, and a bidirectional encoder too.

    With memory, key positions are 0 … n-1 and the queries take the last q_len of them, so a segment
    with memory sees exactly the rotations of one long pass (segment invariance holds). Absolute
    positions restart at 0 every forward; only differences matter. `clamp_len` does not apply (a
    rotation has no table to clamp). The angles are computed in float64 and cast to the model dtype.
    """

    relative = True

    @classmethod
    def check_config(cls, config):
        if config.d_head % 2:
            raise ConfigError(f"config.d_head must be even for pos_encoding={cls.name!r}")

    def prepare(self, *, k_len, clamp_len, device, dtype):
        d = self.config.d_head
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d))
        angles = torch.outer(torch.arange(k_len, dtype=torch.float64, device=device), inv_freq)
        return {"cos": angles.cos().to(dtype), "sin": angles.sin().to(dtype)}  # (n, d/2)

    @staticmethod
    def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
        return out.flatten(-2)

    def content(self, layer, state, q, k):
        k_len, q_len = k.shape[-2], q.shape[-2]
        cos, sin = state["cos"][-k_len:], state["sin"][-k_len:]
        return self._rotate(q, cos[-q_len:], sin[-q_len:]), self._rotate(k, cos, sin)


def alibi_slopes(n_head: int) -> Tensor:
    """Head slopes of Press et al. 2022: a geometric sequence starting at 2^(-8/n); for a head count
    that is not a power of two, the power-of-two sequence plus every other slope of the next one."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n_head).is_integer():
        slopes = power_of_two(n_head)
    else:
        closest = 2 ** math.floor(math.log2(n_head))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: n_head - closest]
    return torch.tensor(slopes, dtype=torch.float32)


@register_encoding("alibi")
class ALiBi(PositionalEncoding):
    """ALiBi (Press et al. 2022, "Train Short, Test Long", arXiv 2108.12409): no position embedding;
    the scaled score q·k/sqrt(d) gets -m_h · (i - j), with the fixed head slopes of `alibi_slopes`
    (1/2, 1/4, … 1/256 for 8 heads). No parameters; extrapolates past the training length.

    A function of distance only, so it is memory-compatible with the same key-position convention as
    RoPE. Causal only: future keys would get a positive bias (the causal mask hides them here; a
    bidirectional ALiBi would need |i - j| and is not offered).
    """

    relative = True
    score_terms = True
    causal_only = True

    def __init__(self, config: LayerConfig):
        super().__init__(config)
        self.register_buffer("slopes", alibi_slopes(config.n_head), persistent=False)

    def score_bias(self, layer, state, q, *, k_len, rel_shift, stride=1):
        dist = (distances(q.shape[-2], k_len, q.device) * stride).to(q.dtype)
        # Divided by the attention scale so that, after scaling, the bias is exactly -m·distance.
        scale = self.config.d_head**0.5
        return (-(self.slopes.to(q.dtype) * scale)[:, None, None] * dist)[None]  # (1, h, i, j)


def t5_bucket(distance: Tensor, *, num_buckets: int, max_distance: int, bidirectional: bool) -> Tensor:
    """T5's relative position bucket (Raffel et al. 2020, §2.1; `_relative_position_bucket` of the
    reference): distance = query position - key position. Half the buckets hold the exact distances
    0 … nb/2 - 1, the rest are log-spaced up to `max_distance` (beyond: the last bucket).
    Bidirectional: half the buckets for keys after the query, half for keys before."""
    bucket = torch.zeros_like(distance)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (distance < 0).long() * num_buckets  # future keys: the upper half
        distance = distance.abs()
    else:
        distance = distance.clamp(min=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    log_ratio = torch.log(distance.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (num_buckets - max_exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return bucket + torch.where(is_small, distance, large)


@register_encoding("t5", options=T5Options)
class T5Bias(PositionalEncoding):
    """T5's bucketed relative attention bias (Raffel et al. 2020): score += b_h[bucket(i - j)], one
    learned scalar per bucket and head, shared by all layers (as T5), `buckets` buckets log-spaced
    up to `max_distance` (`T5Options`). A function of distance only, so memory-compatible; bidirectional too
    (separate buckets for keys before and after the query). T5 does not scale its scores; here the
    bias is added so that after the 1/sqrt(d) scaling it is exactly b_h[bucket]."""

    relative = True
    score_terms = True

    def __init__(self, config: LayerConfig):
        super().__init__(config)
        self.num_buckets, self.max_distance = config.position_options.buckets, config.position_options.max_distance
        self.bias = nn.Parameter(torch.zeros(self.num_buckets, config.n_head))

    def buckets(self, q_len: int, k_len: int, device, stride: int = 1) -> Tensor:
        return t5_bucket(distances(q_len, k_len, device) * stride, num_buckets=self.num_buckets,
                         max_distance=self.max_distance, bidirectional=not self.config.causal)

    def score_bias(self, layer, state, q, *, k_len, rel_shift, stride=1):
        bucket = self.buckets(q.shape[-2], k_len, q.device, stride)  # (i, n)
        bias = self.bias.to(q.dtype)[bucket].permute(2, 0, 1)  # (h, i, n)
        return (bias * self.config.d_head**0.5)[None]


@register_encoding("xpos", options=XPosOptions)
class XPos(PositionalEncoding):
    """xPos (Sun et al. 2023, "A Length-Extrapolatable Transformer", ACL, arXiv 2212.10554): RoPE whose
    rotation also scales q by ζ^(p/B) and k by ζ^(-p/B), so q_p·k_j carries ζ^((p-j)/B): an
    exponential decay with distance. ζ_t = (2t/d + γ)/(1 + γ) per channel pair (γ = 0.4, the paper's
    torchscale code), B = `XPosOptions.scale_base`.

    Positions count over [memory ; segment] like RoPE's, measured from the last key (only differences
    matter, and this keeps the scales ≤ 1 on the keys and ≥ 1 on the queries of the segment), so it is
    memory-compatible. Lives in q and k (no score term): every kernel can apply it. Causal only: a
    future key would get a growing weight ζ^(-distance/B)."""

    relative = True
    causal_only = True
    gamma = 0.4
    check_config = classmethod(Rotary.check_config.__func__)

    def prepare(self, *, k_len, clamp_len, device, dtype):
        d = self.config.d_head
        state = Rotary.prepare(self, k_len=k_len, clamp_len=clamp_len, device=device, dtype=dtype)
        zeta = (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d + self.gamma) / (1 + self.gamma)
        pos = torch.arange(k_len, dtype=torch.float64, device=device) - (k_len - 1)
        scale = zeta[None, :] ** (pos[:, None] / self.config.position_options.scale_base)  # (n, d/2)
        state["scale"] = scale.repeat_interleave(2, dim=-1).to(dtype)  # (n, d): one factor per channel pair
        return state

    def content(self, layer, state, q, k):
        k_len, q_len = k.shape[-2], q.shape[-2]
        cos, sin, scale = state["cos"][-k_len:], state["sin"][-k_len:], state["scale"][-k_len:]
        q = Rotary._rotate(q, cos[-q_len:], sin[-q_len:]) * scale[-q_len:]
        return q, Rotary._rotate(k, cos, sin) / scale


def build_positional(config: LayerConfig) -> PositionalEncoding:
    return POSITIONAL_ENCODINGS[config.pos_encoding](config)


# The absolute encodings (sinusoidal, learned) live in their own module and register on import.
from txl.nn.positions_absolute import (  # noqa: E402, F401 (registers them; their old import path)
    LearnedAbsolute,
    LearnedOptions,
    PositionMerge,
    SinusoidalAbsolute,
    SinusoidalOptions,
)
