"""The reference attention kernel, term by term: the ground truth every faster kernel is tested against.

One function covers causal self-attention over [memory ; segment] (the Transformer-XL LM), the
bidirectional encoder and cross-attention (both `mask.causal = False`), each with a padding mask, and
learned memory tokens before the keys (`mask.memory_tokens`: content score only, always visible).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from txl.nn.attention.masks import NEG, AttentionMask
from txl.nn.attention.registry import register
from txl.nn.positional import LayerPositions, rel_shift_pad


@register("full", "eager", bidirectional=True, global_mask=True, memory_tokens=True)  # (every key is seen anyway)
def eager_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    positions: LayerPositions,
    mask: AttentionMask,
    dropatt: float,
    training: bool,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """softmax(((q+u)·k + shift((q+v)·W_R R)) / sqrt(d), masked) · v for xl positions (Dai et al.
    2019, §3.3 and appendix B); other encodings supply their own content pair and score term."""
    tokens = mask.memory_tokens  # learned keys before [memory ; segment]: no position (txl.nn.attention.layer)
    q_len, k_len, d_head = q.shape[-2], k.shape[-2] - tokens, q.shape[-1]
    q_content, k_content = positions.content(q, k[:, :, tokens:] if tokens else k)
    scores = torch.einsum("bhid,bhjd->bhij", q_content, k_content)  # (a)+(c): content terms
    bias = positions.score_bias(q, k_len=k_len, rel_shift=rel_shift_pad)  # (b)+(d) for xl
    if bias is not None:
        scores = scores + bias
    if tokens:
        scores = torch.cat([torch.einsum("bhid,bhjd->bhij", q, k[:, :, :tokens]), scores], dim=-1)
    scores = scores * d_head**-0.5
    visible = mask.visible(q_len, k_len + tokens, q.device)  # (b or 1, 1, i, m + n)
    if mask.key_padding is None:
        probs = scores.float().masked_fill(~visible, float("-inf")).softmax(dim=-1)
    else:  # a padded query may see no key at all: a finite fill, and its row set to 0
        probs = scores.float().masked_fill(~visible, NEG).softmax(dim=-1) * visible.any(-1, keepdim=True)
    probs = probs.to(v.dtype)
    weights = probs if need_weights else None
    probs = F.dropout(probs, p=dropatt, training=training)
    out = torch.einsum("bhij,bhjd->bhid", probs, v)
    value_term = positions.value_term(probs[..., tokens:])
    return (out if value_term is None else out + value_term), weights
