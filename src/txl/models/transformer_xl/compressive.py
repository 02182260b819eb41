"""Compressive memory (Rae et al. 2020, "Compressive Transformers for Long-Range Sequence
Modelling", arXiv 1911.05507): a second, older memory per layer.

States leaving the mem_len window are compressed c:1 (`cmem_ratio`) by `MemoryCompressor` into
`Memory.compressed` (at most `cmem_len` per layer) instead of being dropped, and attention runs over
[compressed ; memory ; segment]. A model with `cmem_len > 0` runs its forward passes through
`txl.nn.memory.CompressiveUpdate`, which hands each layer's context to `MemoryCompressor` here; in
training that also returns the attention-reconstruction loss that trains the compression.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.nn.memory import Memory


class MemoryCompressor(nn.Module):
    """Compressive memory (Rae et al. 2020, §3): states older than mem_len are compressed c:1 into a
    second memory of `cmem_len` per layer instead of being dropped.

    `cmem_fn`: "conv" — a 1D convolution with kernel and stride c per layer, the paper's best
    compression, trained by the attention-reconstruction loss; "mean" / "max" — pooling, no parameters.

    When a segment arrives, the e oldest states beyond mem_len leave the memory. The largest multiple
    of c among them (the oldest) is compressed; the rest (fewer than c) stay in the memory until a
    full group of c can leave, so nothing is dropped before it has been compressed, even when states
    arrive one at a time (generation). Compressed states older than cmem_len are dropped.
    """

    def __init__(self, config):
        super().__init__()
        self.ratio, self.cmem_len, self.fn = config.cmem_ratio, config.cmem_len, config.cmem_fn
        self.convs = None
        if self.fn == "conv":
            self.convs = nn.ModuleList(
                nn.Conv1d(config.d_model, config.d_model, kernel_size=self.ratio, stride=self.ratio)
                for _ in range(config.n_layer)
            )

    def compress(self, layer: int, states: Tensor) -> Tensor:
        """(b, e, d) -> (b, e / c, d)."""
        x = states.transpose(1, 2)  # (b, d, e): Conv1d and pooling run over the last axis
        if self.fn == "conv":
            x = self.convs[layer](x)
        elif self.fn == "mean":
            x = F.avg_pool1d(x, self.ratio)
        else:
            x = F.max_pool1d(x, self.ratio)
        return x.transpose(1, 2)

    def forward(
        self,
        contexts: Sequence[Tensor],
        *,
        compressed_len: int,
        mem_len: int,
        q_len: int,
        blocks: Sequence[nn.Module] | None = None,
    ) -> tuple[Memory, Tensor | None]:
        """The next memory from each layer's [compressed ; memory ; segment] (`contexts`), and, given
        the model's `blocks` and when the learned convolution compressed something, the
        attention-reconstruction loss summed over layers (else None)."""
        recent = [c[:, compressed_len:].detach() for c in contexts]  # [memory ; segment] per layer
        older = [c[:, :compressed_len].detach() for c in contexts]
        leaving = recent[0].shape[1] - mem_len
        leaving = leaving - leaving % self.ratio  # whole groups of c; the rest waits in the memory
        if leaving <= 0:
            return Memory(tuple(recent), tuple(older) if compressed_len else ()), None
        hidden, compressed, losses = [], [], []
        for i, (states, old) in enumerate(zip(recent, older)):
            evicted = states[:, :leaving]
            new = self.compress(i, evicted)  # (b, leaving / c, d), with gradient into the conv
            if blocks is not None and self.convs is not None:
                queries = contexts[i][:, -q_len:]  # the segment's input to layer i
                losses.append(attention_reconstruction_loss(blocks[i], queries, evicted, new))
            compressed.append(torch.cat([old, new.detach()], dim=1)[:, -self.cmem_len :])
            hidden.append(states[:, leaving:])
        aux_loss = torch.stack(losses).sum() if losses else None
        return Memory(tuple(hidden), tuple(compressed)), aux_loss


def attention_reconstruction_loss(block: nn.Module, queries: Tensor, evicted: Tensor, compressed: Tensor) -> Tensor:
    """Rae et al. 2020, §3.2 and Algorithm 2: ||attn(h, old_mem) - attn(h, f_c(old_mem))||², the
    attention-reconstruction loss of one layer (mean squared error over the output).

    `attn` is the layer's own attention (its q/kv projections, and its pre-LN norm when the block is
    pre-LN) under stop-gradient, and h (`queries`, the segment's input to this layer) and the evicted
    states are detached: the loss trains the compression only. Content-based softmax attention
    without positional terms or mask, as the paper's algorithm.
    """
    attn = block.attn
    if getattr(block, "pre_lnorm", False):
        norm = block.attn_norm

        def prepare(x: Tensor) -> Tensor:
            return F.layer_norm(x, norm.normalized_shape, norm.weight.detach(), norm.bias.detach(), norm.eps)
    else:

        def prepare(x: Tensor) -> Tensor:
            return x

    b, i, _ = queries.shape
    h, d = attn.n_head, attn.d_head
    q = F.linear(prepare(queries.detach()), attn.q_proj.weight.detach()).view(b, i, h, d).transpose(1, 2)

    def attend(states: Tensor) -> Tensor:
        kv = F.linear(prepare(states), attn.kv_proj.weight.detach()).view(b, states.shape[1], 2, h, d)
        k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)  # each (b, h, n, d)
        probs = (torch.einsum("bhid,bhjd->bhij", q, k) * d**-0.5).float().softmax(-1).to(v.dtype)
        return torch.einsum("bhij,bhjd->bhid", probs, v)

    with torch.no_grad():
        target = attend(evicted)
    return F.mse_loss(attend(compressed), target)
