"""Segment-level recurrence state (Dai et al. 2019, §3.2).

Memory is explicit: the model takes a `Memory` (or None) and returns the next one; nothing is hidden
inside a module. For each layer it holds the *input* hidden states of that layer for the latest
`mem_len` positions, detached from the graph (the stop-gradient SG(·) of the paper). It starts empty
(Hugging Face starts with mem_len zero vectors, so its first segment attends to zeros).

Compressive memory (Rae et al. 2020, "Compressive Transformers for Long-Range Sequence Modelling",
arXiv 1911.05507) adds a second, older memory per layer: states leaving the mem_len window are
compressed c:1 (`cmem_ratio`) by `MemoryCompressor` into `Memory.compressed` (at most `cmem_len` per
layer) instead of being dropped, and attention runs over [compressed ; memory ; segment].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class Memory:
    """Per-layer cached hidden states, each (batch, length, d_model), batch-first.

    `compressed` (compressive memory only, else empty) holds per layer the older, compressed states:
    attention runs over [compressed ; hidden ; segment].
    """

    hidden: tuple[Tensor, ...]
    compressed: tuple[Tensor, ...] = ()
    # Token-level inference only (`TransformerXL.forward`): per layer the key/value projections of
    # `hidden`, (batch, length, 2·n_head·d_head), and the key of the weights and dtype they were made
    # with. Derived data: never saved, and every method below that builds a new Memory drops it.
    projected: tuple[Tensor, ...] = ()
    projected_key: tuple = ()

    @property
    def length(self) -> int:
        return self.hidden[0].shape[1] if self.hidden else 0

    @property
    def compressed_length(self) -> int:
        return self.compressed[0].shape[1] if self.compressed else 0

    def layer(self, i: int) -> list[Tensor]:
        """Layer i's cached states that are not empty, oldest first: [compressed ; hidden]."""
        parts = [self.compressed[i]] if self.compressed_length else []
        return parts + ([self.hidden[i]] if self.length else [])

    @property
    def batch_size(self) -> int:
        return self.hidden[0].shape[0]

    def to(self, *args, **kwargs) -> Memory:
        return Memory(tuple(h.to(*args, **kwargs) for h in self.hidden),
                      tuple(c.to(*args, **kwargs) for c in self.compressed))

    def detach(self) -> Memory:
        return Memory(tuple(h.detach() for h in self.hidden), tuple(c.detach() for c in self.compressed))

    def select(self, index: Tensor | slice | int) -> Memory:
        """Rows of the batch (e.g. to keep some streams and drop others)."""
        if isinstance(index, int):
            index = slice(index, index + 1)
        return Memory(tuple(h[index] for h in self.hidden), tuple(c[index] for c in self.compressed))

    @classmethod
    def cat(cls, parts: Sequence[Memory]) -> Memory:
        """The inverse of `select` over consecutive row groups: one memory with all their rows."""
        return cls(tuple(torch.cat(layer) for layer in zip(*(p.hidden for p in parts), strict=True)),
                   tuple(torch.cat(layer) for layer in zip(*(p.compressed for p in parts), strict=True)))

    def truncate(self, mem_len: int) -> Memory | None:
        """Keep the latest mem_len states per layer (the compressed memory is kept as is)."""
        if mem_len <= 0:
            return None
        return Memory(tuple(h[:, -mem_len:] for h in self.hidden), self.compressed)

    def state_dict(self, prefix: str = "memory") -> dict[str, Tensor]:
        """Flat name -> tensor mapping for safetensors (contiguous copies); the compressed memory
        goes under `{prefix}_compressed.{layer}`."""
        out = {f"{prefix}.{i}": h.detach().contiguous() for i, h in enumerate(self.hidden)}
        out.update({f"{prefix}_compressed.{i}": c.detach().contiguous() for i, c in enumerate(self.compressed)})
        return out

    @classmethod
    def from_state_dict(cls, tensors: dict[str, Tensor], prefix: str = "memory") -> Memory | None:
        def layers(name_prefix: str) -> tuple[Tensor, ...]:
            found = sorted(
                (int(name[len(name_prefix) + 1 :]), t)
                for name, t in tensors.items()
                if name.startswith(name_prefix + ".") and name[len(name_prefix) + 1 :].isdigit()
            )
            return tuple(t for _, t in found)

        hidden = layers(prefix)
        if not hidden:
            return None
        return cls(hidden, layers(f"{prefix}_compressed"))

    @classmethod
    def zeros(cls, n_layer: int, batch_size: int, length: int, d_model: int, **tensor_kwargs) -> Memory:
        return cls(tuple(torch.zeros(batch_size, length, d_model, **tensor_kwargs) for _ in range(n_layer)))


def update_memory(contexts: Sequence[Tensor], mem_len: int, *, detach: bool = True) -> Memory | None:
    """Keep the latest `mem_len` positions of each layer's [memory ; input], without gradient.

    `contexts[i]` is layer i's key/value input, i.e. the concatenation the layer attended over, so the
    new memory is simply its tail. (The reference computes end = mlen + qlen - ext_len; with
    ext_len = 0, the only setting we support, that is the same tail.) `detach=False` (callers without
    autograd) keeps the tails as views of `contexts`, which `append_rows` can extend in place.
    """
    if mem_len <= 0:
        return None
    return Memory(tuple(c[:, -mem_len:].detach() if detach else c[:, -mem_len:] for c in contexts))


def append_rows(past: Tensor, new: Tensor) -> Tensor:
    """`torch.cat([past, new], dim=1)` for (b, n, d) tensors without gradients, in amortised
    O(len(new)) instead of O(n): token-by-token generation appends one row per layer per token to a
    memory of mem_len rows, and copying the whole memory every time was a third of a token's time
    (tiny shape, mem_len 1024: two 0.5-1 MiB copies per layer).

    The result is a view of a buffer with spare rows after it. When `past` is such a view ending
    exactly where its buffer was last filled, `new` is written into the spare rows and a longer view is
    returned; otherwise (a plain tensor, a full buffer, or a second append from the same `past`, e.g.
    two continuations of one prompt) a new buffer is made. Rows a view already shows are never
    written again, so every earlier view keeps its values."""
    b, n, d = past.shape
    q = new.shape[1]
    base = past._base
    if (base is not None and not torch.is_grad_enabled() and base.dim() == 3 and base.is_contiguous()
            and base.shape[0] == b and base.shape[2] == d and past.stride() == base.stride()
            and new.dtype == past.dtype and new.device == past.device
            and (torch.is_inference_mode_enabled() or not base.is_inference())):  # inference tensors: no writes outside
        start = (past.storage_offset() - base.storage_offset()) // d
        end = start + n
        if getattr(base, "_txl_filled", None) == end and end + q <= base.shape[1]:
            base[:, end : end + q].copy_(new)
            base._txl_filled = end + q
            return base[:, start : end + q]
    if (torch.is_grad_enabled() and (past.requires_grad or new.requires_grad)) or new.dtype != past.dtype:
        return torch.cat([past, new], dim=1)  # autograd or type promotion: what cat does
    buffer = past.new_empty(b, 2 * (n + q) + 16, d)  # as many spare rows as the rows it holds
    buffer[:, :n].copy_(past)
    buffer[:, n : n + q].copy_(new)
    buffer._txl_filled = n + q
    return buffer[:, : n + q]


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
