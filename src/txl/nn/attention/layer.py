"""Multi-head attention: projections, then one kernel call (`txl.nn.attention.registry`).

Self-attention of the Transformer-XL LM: queries from the current segment only, keys and values from
[SG(memory) ; segment] (Dai et al. 2019, §3.2). The memory object gives the layer its keys and values
(`MemoryPass.keys_values`) and keeps what the next segment needs; the layer never learns which
kind of memory it runs on. Cross-attention (an encoder–decoder) takes keys and values from a separate
`source` instead. Projections have no biases, as the reference.

Memory tokens (`config.memory_tokens = m`; Sukhbaatar et al. 2019, "Augmenting Self-attention with
Persistent Memory", arXiv 1907.01470; ETC's global memory): m learned key and value vectors per head,
owned by the layer and put before [memory ; segment] after the projections (they are never projected,
never stored in the segment memory, and the same for every segment). Every query attends to them.
They have no position: a token's score is the plain content score q·k/sqrt(d), with no position term
and no xl content bias u. We chose this over placing the tokens at distance 0 because a token is not
in the sequence: distance 0 would add each encoding's own-position term to every token (xl's
(q+v)·W_R R_0, Shaw's a_0, T5's bucket 0), a per-query offset that differs from encoding to encoding.
The plain score is the same under every encoding and leaves segment invariance and causality as they
are. Under RoPE, xPos and ALiBi it is exactly distance 0 (equal rotations cancel, the decay and the
bias are neutral at 0). The kernel learns of them through `AttentionMask.memory_tokens`.

Grouped-query attention (`config.n_kv_head`; Ainslie et al. 2023, GQA; multi-query at n_kv_head = 1,
Shazeer 2019): the key/value projection makes n_kv_head heads, and query head j reads key/value head
j // (n_head / n_kv_head) (consecutive query heads share one, as Hugging Face's `repeat_kv`). What a
memory keeps is therefore only the key/value heads wherever it keeps projections (the fast backend's
projection cache holds the (b, n, 2·n_kv_head·d_head) projection); the plain memory keeps the layer's
input states (d_model wide), which GQA does not change. The heads are repeated for the kernel, whose
signature stays (b, n_head, n, d) for q, k and v. Memory tokens are per key/value head.

qk-norm (`config.qk_norm`; Henry et al. 2020, Dehghani et al. 2023, as OLMo 2 and Qwen3 use it): q and
k are RMS-normalised per head over d_head, each with a learned gain of d_head (shared by the heads),
after the projection and before the kernel (so before positions: xl's u and v biases, RoPE's rotation).
The scores keep their 1/sqrt(d_head) scale; the gains can learn a sharper one. The memory's projections
are cached before the norm, so a cache stays valid.

Separate global projections (Longformer, Beltagy et al. 2020, §3.1: one set of projections Q_s, K_s, V_s
scores the sliding window, another, Q_g, K_g, V_g, the global attention): when the kernel says it
wants them (`kernel.global_projections`: attention='sliding' with global tokens), the layer owns
`global_q_proj` and `global_kv_proj` and hands the kernel q_g (the segment) and k_g, v_g ([memory ;
source], through the same memory pass: one projection of both, so a projection cache stays one shape)
through `kernel.forward_global`; the kernel computes the rows of global queries from them. Memory
tokens, qk-norm and grouped-query heads apply to them as to q, k, v.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from txl.nn.attention.masks import AttentionMask
from txl.nn.attention.registry import resolve_kernel
from txl.nn.backend import REFERENCE, Backend
from txl.nn.memory import MemoryPass
from txl.nn.positional import CONTENT_ONLY, LayerPositions

if TYPE_CHECKING:  # annotations only: the config module imports the registries
    from txl.models.transformer_xl.config import TransformerXLConfig


class Attention(nn.Module):
    """`out, probs = attn(x, source, positions=, mask=, memory=)`: x (b, i, d_model) makes the queries;
    `source` (b, n, d_model, default x) makes the keys and values. probs (b, h, i, n) only with
    `need_weights`, else None."""

    def __init__(self, config: TransformerXLConfig, *, layer_idx: int = 0, backend: Backend = REFERENCE):
        super().__init__()
        self.layer_idx = layer_idx  # which layer's memory `memory.keys_values` reads and writes
        self.n_head, self.d_head = config.n_head, config.d_head
        self.n_kv_head = getattr(config, "n_kv_head", None) or config.n_head  # grouped-query: fewer k/v heads
        inner = config.n_head * config.d_head
        self.q_proj = backend.Linear(config.d_model, inner, bias=False)
        self.kv_proj = backend.Linear(config.d_model, 2 * self.n_kv_head * config.d_head, bias=False)
        self.o_proj = backend.Linear(inner, config.d_model, bias=False)
        self.drop = backend.Dropout(config.dropout)
        self.dropatt = config.dropatt
        m = config.memory_tokens  # learned keys (index 0) and values (1), per key/value head
        self.memory_tokens = nn.Parameter(torch.zeros(2, self.n_kv_head, m, config.d_head)) if m else None
        qk_norm = getattr(config, "qk_norm", False)  # per-head RMSNorm of q and k (a learned d_head gain)
        self.q_norm = nn.RMSNorm(config.d_head, eps=config.layer_norm_eps) if qk_norm else None
        self.k_norm = nn.RMSNorm(config.d_head, eps=config.layer_norm_eps) if qk_norm else None
        # Kernels that own parameters or buffers (Linformer projections, Performer features) are
        # modules built per layer.
        kernel = resolve_kernel(config.attention, config.attention_impl)
        self.kernel = backend.adopt(kernel(layer_config(config, layer_idx))) if isinstance(kernel, type) else kernel
        self.global_q_proj = self.global_kv_proj = None
        if getattr(self.kernel, "global_projections", False):  # Longformer's Q_g, K_g, V_g
            self.global_q_proj = backend.Linear(config.d_model, inner, bias=False)
            self.global_kv_proj = backend.Linear(config.d_model, 2 * self.n_kv_head * config.d_head, bias=False)
            if not getattr(self.kernel, "global_tokens", 0):  # q_g only for a call with a global_mask (DDP must know)
                self.unused_query_projection = True

    def forward(
        self,
        x: Tensor,
        source: Tensor | None = None,
        *,
        positions: LayerPositions = CONTENT_ONLY,
        mask: AttentionMask,
        memory: MemoryPass | None = None,
        source_norm: Callable[[Tensor], Tensor] | None = None,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """`memory`: a `txl.nn.memory.MemoryPass`; keys and values then run over [memory ; source] and
        the memory keeps `source` (this layer's input) for the next segment. `source_norm` is applied
        to the source rows before their projection (pre-LN blocks normalise [memory ; segment])."""
        b, i, _ = x.shape
        source = x if source is None else source
        project = self.kv_proj if self.global_kv_proj is None else _Both(self.kv_proj, self.global_kv_proj)
        project = project if source_norm is None else _Normed(source_norm, project)
        kv = project(source) if memory is None else memory.keys_values(self.layer_idx, source, project)
        q = self.q_proj(x).view(b, i, self.n_head, self.d_head).transpose(1, 2)  # (b, h, i, d)
        kv_g = None
        if self.global_kv_proj is not None:  # (b, n, 2·kv_h·d) each: local and global keys/values
            kv, kv_g = kv.chunk(2, dim=-1)
        k, v = split_kv(kv, self.n_kv_head)  # (b, kv_h, n, d) each
        if self.memory_tokens is not None:  # keys and values over [tokens ; memory ; segment]
            tokens = self.memory_tokens.to(k.dtype)[:, None].expand(-1, b, -1, -1, -1)  # (2, b, kv_h, m, d)
            k, v = torch.cat([tokens[0], k], dim=2), torch.cat([tokens[1], v], dim=2)
            mask = dataclasses.replace(mask, memory_tokens=tokens.shape[3])
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.n_kv_head != self.n_head:
            k, v = repeat_kv(k, self.n_head), repeat_kv(v, self.n_head)  # (b, h, n, d) each
        if kv_g is not None and (mask.global_mask is not None or self.kernel.global_tokens):
            out, probs = self.kernel.forward_global(q, k, v, self._global_qkv(x, kv_g), positions=positions,
                                                    mask=mask, dropatt=self.dropatt, training=self.training,
                                                    need_weights=need_weights)
        else:
            out, probs = self.kernel(q, k, v, positions=positions, mask=mask, dropatt=self.dropatt,
                                     training=self.training, need_weights=need_weights)
        out = out.transpose(1, 2).reshape(b, i, self.n_head * self.d_head)  # (b, i, h*d)
        return self.drop(self.o_proj(out)), probs

    @torch.no_grad()
    def match_global_projections(self) -> None:
        """Q_g, K_g, V_g := Q_s, K_s, V_s, as Longformer initialises them (§3.1): called once the model's init
        has drawn the weights, a new model starts from the shared behaviour and training separates them."""
        if self.global_q_proj is not None:
            self.global_q_proj.weight.copy_(self.q_proj.weight)
            self.global_kv_proj.weight.copy_(self.kv_proj.weight)

    def _global_qkv(self, x: Tensor, kv_g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q_g (b, h, i, d) of the segment and k_g, v_g (b, h, n, d) of [memory ; source], as q, k, v are made."""
        b, i, _ = x.shape
        q_g = self.global_q_proj(x).view(b, i, self.n_head, self.d_head).transpose(1, 2)
        k_g, v_g = split_kv(kv_g, self.n_kv_head)
        if self.q_norm is not None:
            q_g, k_g = self.q_norm(q_g), self.k_norm(k_g)
        if self.n_kv_head != self.n_head:
            k_g, v_g = repeat_kv(k_g, self.n_head), repeat_kv(v_g, self.n_head)
        return q_g, k_g, v_g


def layer_config(config: TransformerXLConfig, layer_idx: int) -> TransformerXLConfig:
    """The config layer `layer_idx`'s kernel is built from: its attention options as
    `Options.for_layer(layer_idx)` gives them (Longformer's per-layer windows), the rest unchanged."""
    options = config.attention_options
    here = options.for_layer(layer_idx) if options is not None else None
    return config if here is options else dataclasses.replace(config, attention_options=here)


def share_kernels(attentions: Iterable[Attention]) -> None:
    """Parameters shared across layers (Linformer's layer-wise sharing): every kernel with a
    `share_with(first)` method is given the first layer's kernel of the same stack, once, after the
    stack is built (the model and the encoder-decoder's encoder call this)."""
    attentions = list(attentions)
    for attention in attentions[1:]:
        share = getattr(attention.kernel, "share_with", None)
        if share is not None:
            share(attentions[0].kernel)


def split_kv(kv: Tensor, n_head: int) -> tuple[Tensor, Tensor]:
    """The key/value projection (b, n, 2·h·d) as k and v (b, h, n, d): views of its two halves."""
    b, n, width = kv.shape
    return kv.view(b, n, 2, n_head, width // (2 * n_head)).permute(2, 0, 3, 1, 4).unbind(0)


def repeat_kv(x: Tensor, n_head: int) -> Tensor:
    """(b, kv_h, n, d) -> (b, n_head, n, d): each key/value head serves n_head / kv_h consecutive query heads."""
    b, kv_heads, n, d = x.shape
    return x[:, :, None].expand(b, kv_heads, n_head // kv_heads, n, d).reshape(b, n_head, n, d)


class _Both:
    """rows -> [local projection ; global projection] along the features: one row-wise projection, so the
    memory pass (and a projection cache) sees one tensor whatever the call."""

    def __init__(self, local: Callable[[Tensor], Tensor], global_: Callable[[Tensor], Tensor]):
        self.local, self.global_ = local, global_

    def __call__(self, rows: Tensor) -> Tensor:
        return torch.cat([self.local(rows), self.global_(rows)], dim=-1)


class _Normed:
    """rows -> projection(norm(rows)): row-wise, so a memory may project some rows now and some later."""

    def __init__(self, norm: Callable[[Tensor], Tensor], projection: Callable[[Tensor], Tensor]):
        self.norm, self.projection = norm, projection

    def __call__(self, rows: Tensor) -> Tensor:
        return self.projection(self.norm(rows))
