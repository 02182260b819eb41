"""Multi-head attention over [memory ; current segment], with kernels chosen by name.

`Attention` owns the projections (no biases, as the reference); the score computation is a *kernel*
looked up in `KERNELS` by `(config.attention, implementation)`. Every kernel has one signature:

    kernel(q, k, v, *, positions, window, dropatt, training) -> (b, h, i, d)

with q (b, h, i, d) for the current segment and k, v (b, h, n, d) for memory + segment; queries are
the last i of the n key positions. `positions` (a `LayerPositions`) supplies the positional terms;
`window` limits each query to its `window` most recent keys (itself included), which is how
`same_length` is expressed (kimiyoung's convention: every query sees exactly mem_len keys once the
memory is full). The eager kernel below is the reference that faster kernels are tested against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.attention_fast import fast_attention, project_context
from txl.config import TransformerXLConfig
from txl.memory import append_rows
from txl.positional import LayerPositions, rel_shift_pad

Kernel = Callable[..., Tensor]


def causal_mask(q_len: int, k_len: int, window: int | None, device: torch.device) -> Tensor:
    """[q_len, k_len] bool, True where query i may attend key j (queries = last q_len keys)."""
    offset = k_len - q_len
    dist = torch.arange(q_len, device=device)[:, None] + offset - torch.arange(k_len, device=device)[None, :]
    visible = dist >= 0
    if window is not None:
        visible &= dist < window
    return visible


def eager_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    positions: LayerPositions,
    window: int | None,
    dropatt: float,
    training: bool,
) -> Tensor:
    """The reference computation, term by term (Dai et al. 2019, eq. in §3.3 and appendix B)."""
    q_len, k_len, d_head = q.shape[-2], k.shape[-2], q.shape[-1]
    q_content, k_content = positions.content(q, k)
    scores = torch.einsum("bhid,bhjd->bhij", q_content, k_content)  # (a)+(c): content terms
    bias = positions.score_bias(q, k_len=k_len, rel_shift=rel_shift_pad)  # (b)+(d) for xl
    if bias is not None:
        scores = scores + bias
    scores = scores * d_head**-0.5
    mask = causal_mask(q_len, k_len, window, q.device)
    scores = scores.float().masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)
    probs = F.dropout(probs, p=dropatt, training=training)
    out = torch.einsum("bhij,bhjd->bhid", probs, v)
    value_term = positions.value_term(probs)
    return out if value_term is None else out + value_term


# (attention name, implementation) -> kernel. "auto" resolves in `resolve_kernel`; "bidirectional" is
# the kernel without a causal mask used when config.causal is False.
KERNELS: dict[tuple[str, str], Kernel] = {
    ("full", "eager"): eager_attention,
    ("full", "fast"): fast_attention,  # same results; measured faster (src/txl/attention_fast.py)
}


def resolve_kernel(attention: str, impl: str) -> Kernel:
    if impl == "auto":
        impl = "fast" if (attention, "fast") in KERNELS else "eager"
    if (attention, impl) not in KERNELS:
        from txl.errors import ConfigError

        available = sorted(i for a, i in KERNELS if a == attention)
        raise ConfigError(
            f"config.attention_impl={impl!r} is not available for attention={attention!r} "
            f"(available: {', '.join(available)})"
        )
    return KERNELS[(attention, impl)]


def call_kernel(kernel: Kernel, q: Tensor, kv: Tensor, **kwargs) -> Tensor:
    """Run `kernel` on queries (b, h, i, d) and the key/value projection kv (b, n, 2·h·d): k and v are
    its two halves as (b, h, n, d) views; the fast kernel also takes kv whole (it trains from it)."""
    b, h, _, d = q.shape
    k, v = kv.view(b, kv.shape[1], 2, h, d).permute(2, 0, 3, 1, 4).unbind(0)
    if kernel is fast_attention:
        kwargs["kv"] = kv
    return kernel(q, k, v, **kwargs)


class Attention(nn.Module):
    """Queries from the current segment only; keys and values from [SG(memory) ; segment]."""

    def __init__(self, config: TransformerXLConfig):
        super().__init__()
        self.n_head, self.d_head = config.n_head, config.d_head
        inner = config.n_head * config.d_head
        self.q_proj = nn.Linear(config.d_model, inner, bias=False)
        self.kv_proj = nn.Linear(config.d_model, 2 * inner, bias=False)
        self.o_proj = nn.Linear(inner, config.d_model, bias=False)
        self.drop = nn.Dropout(config.dropout)
        self.dropatt = config.dropatt
        self.fast_projection = config.attention_impl != "eager"  # the eager path stays the plain reference
        # A bidirectional encoder (causal=False) has its own kernel per attention name; kernels that own
        # parameters or buffers (Linformer projections, Performer features) are modules built per layer.
        kernel = resolve_kernel(config.attention, config.attention_impl if config.causal else "bidirectional")
        self.kernel = kernel(config) if isinstance(kernel, type) else kernel

    def forward(
        self, x: Tensor, context: Tensor, *, positions: LayerPositions, window: int | None,
        projected: Tensor | None = None, sink: list[Tensor] | None = None, context_ends_with_x: bool = False,
    ) -> Tensor:
        """`projected`: kv_proj of the first projected.shape[1] context rows, from the previous call
        (token-level inference reuses them instead of projecting the memory again); `sink`: receives
        kv_proj of the whole context for the next call. `context_ends_with_x`: context is
        [constant memory ; x] (post-LN blocks), so the fast path skips the memory rows' input gradient."""
        b, i, _ = x.shape
        n = context.shape[1]
        q = self.q_proj(x).view(b, i, self.n_head, self.d_head).transpose(1, 2)  # (b, h, i, d)
        if projected is None and context_ends_with_x and self.fast_projection and n > i and torch.is_grad_enabled():
            kv = project_context(context, x, self.kv_proj.weight)
        elif projected is None:
            kv = self.kv_proj(context)  # (b, n, 2*h*d)
        else:
            fresh = self.kv_proj(context[:, projected.shape[1] :])
            kv = append_rows(projected.to(fresh.dtype), fresh)  # amortised O(new rows), not O(memory)
        if sink is not None:
            sink.append(kv)
        out = call_kernel(self.kernel, q, kv, positions=positions, window=window, dropatt=self.dropatt,
                          training=self.training)
        out = out.transpose(1, 2).reshape(b, i, self.n_head * self.d_head)  # (b, i, h*d)
        return self.drop(self.o_proj(out))


# The long-text arena registers its kernels (sliding, sparse, performer, linformer) in KERNELS.
from txl import attention_linformer, attention_performer, attention_sliding, attention_sparse  # noqa: E402, F401
