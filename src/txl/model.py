"""Transformer-XL language model (Dai et al. 2019, arXiv 1901.02860).

Reads top to bottom: adaptive embedding -> dropout -> blocks over [memory ; segment] -> (final
LayerNorm when pre-LN) -> dropout -> adaptive softmax. Tensors are batch-first; memory is explicit
state passed in and returned (`Memory`).

Two arena options change the data flow (README "The arena"): compressive memory (`cmem_len > 0`,
Rae et al. 2020) attends over [compressed ; memory ; segment] and returns `aux_loss`; `causal=False`
makes the same blocks a bidirectional encoder for a masked-LM objective (no memory, no causal mask).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.adaptive import AdaptiveEmbedding, AdaptiveLogSoftmax
from txl.attention import Attention
from txl.attention_fast import CheapDropout, use_cheap_dropout
from txl.config import TransformerXLConfig
from txl.errors import UsageError
from txl.linear_fast import use_fast_linear
from txl.memory import Memory, MemoryCompressor, append_rows, update_memory
from txl.positional import LayerPositions, build_positional

# Inference with at most this many new tokens per call (generation) caches the memory's key/value
# projections; longer segments (evaluation) re-project, so memory stays at the hidden states' size
# and results stay bit-identical to a plain forward.
PROJECTION_CACHE_MAX_QUERIES = 1


class FeedForward(nn.Module):
    """Position-wise FFN as the reference: Linear, ReLU, Dropout, Linear, Dropout."""

    def __init__(self, config: TransformerXLConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.d_model, config.d_inner)
        self.fc2 = nn.Linear(config.d_inner, config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.fc1(x)
        if isinstance(self.drop, CheapDropout):  # the fast path's fused ReLU + dropout
            hidden = self.drop.after_relu(hidden)
        else:
            hidden = self.drop(F.relu(hidden))
        return self.drop(self.fc2(hidden))


class Block(nn.Module):
    """One decoder layer. Post-LN by default (the paper); pre-LN with `pre_lnorm`."""

    def __init__(self, config: TransformerXLConfig):
        super().__init__()
        self.pre_lnorm = config.pre_lnorm
        self.attn = Attention(config)
        self.attn_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.ff = FeedForward(config)
        self.ff_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)

    def forward(
        self, h: Tensor, context: Tensor, *, positions: LayerPositions, window: int | None,
        projected: Tensor | None = None, sink: list[Tensor] | None = None, constant_past: bool = False,
    ) -> Tensor:
        # `context` is [memory ; h]: the keys/values this layer attends over. `projected`/`sink`: the
        # key/value projection cache of token-level inference (see `TransformerXL.projection_key`).
        # `constant_past`: the memory rows need no gradient (they are detached states).
        cache = {"projected": projected, "sink": sink}
        if self.pre_lnorm:
            if projected is not None:  # the memory rows are projected already: normalise only h
                context = torch.cat([context[:, : projected.shape[1]], self.attn_norm(h)], dim=1)
            else:
                context = self.attn_norm(context)
            h = h + self.attn(self.attn_norm(h), context, positions=positions, window=window, **cache)
            return h + self.ff(self.ff_norm(h))
        h = self.attn_norm(h + self.attn(h, context, positions=positions, window=window,
                                         context_ends_with_x=constant_past, **cache))
        return self.ff_norm(h + self.ff(h))


@dataclass
class TransformerXLOutput:
    """What one forward pass returns.

    logits: (b, t, V) raw logits for a full softmax; *log-probabilities* when the adaptive softmax is
        on (cutoffs set). None when labels were given to an adaptive model and `return_logits` was not
        asked for (computing every cluster for every token is the expensive part of a large vocab).
    loss: mean NLL (nats) over tokens whose label is not -100; None without labels.
    nll: (b, t) float32 per-token NLL in input order, 0 where the label is -100.
    memory: pass it back as `memory=` with the next segment (None when mem_len is 0).
    hidden: (b, t, d_model) final hidden states fed to the softmax.
    aux_loss: compressive memory's attention-reconstruction loss (Rae et al. 2020), in training mode
        when the learned compression ran this step; add it to `loss` for the backward pass (it only
        reaches the compression weights). Not part of `loss`, so loss/bpc stay the LM's. Else None.
    """

    logits: Tensor | None
    loss: Tensor | None
    nll: Tensor | None
    memory: Memory | None
    hidden: Tensor
    aux_loss: Tensor | None = None


class TransformerXL(nn.Module):
    """Transformer-XL LM. `out = model(input_ids, memory=None, labels=None)`.

    `labels[b, t]` is the token that should follow `input_ids[b, t]` (already shifted, as the
    reference's data iterator gives it; -100 = not scored). With `causal=False` (bidirectional
    encoder) it is the original token at position t for a masked-LM objective (see
    `txl.masked_lm.mask_tokens`), -100 elsewhere. Runtime settings that do not change the
    parameters can differ from training: `mem_len` (per call, or `model.mem_len`), `model.clamp_len`
    and `model.same_length`.
    """

    def __init__(self, config: TransformerXLConfig):
        super().__init__()
        self.config = config
        self.mem_len = config.mem_len
        self.clamp_len = config.clamp_len
        self.same_length = config.same_length
        self.embed = AdaptiveEmbedding(config)
        self.drop = nn.Dropout(config.dropout)
        self.pos = build_positional(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        final_norm = config.pre_lnorm and config.final_norm  # post-LN output is already normalised
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if final_norm else nn.Identity()
        self.head = AdaptiveLogSoftmax(config, self.embed)
        self.compressor = MemoryCompressor(config) if config.cmem_len else None
        if config.attention_impl != "eager":
            use_cheap_dropout(self)  # same distribution, 7x cheaper CPU random numbers
            use_fast_linear(self)  # fp32 products through oneDNN on x86 CPUs (2x MKL's speed here)
        self.reset_parameters()

    # ------------------------------------------------------------------------------------------
    def reset_parameters(self) -> None:
        """The reference's normal init: weights N(0, init_std), projections N(0, proj_init_std),
        LayerNorm weights N(1, init_std), biases 0."""
        std, proj_std = self.config.init_std, self.config.proj_init_std
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, nn.LayerNorm):
                nn.init.normal_(module.weight, 1.0, std)
                nn.init.zeros_(module.bias)
        for name, param in self.named_parameters():
            if ".projs." in f".{name}":
                nn.init.normal_(param, 0.0, proj_std)
            elif name.startswith("pos.") and not name.startswith("pos.r_proj"):
                nn.init.normal_(param, 0.0, std)  # u, v, Shaw tables, learned absolute table
            elif name in ("head.cluster_weight",) or name.startswith("head.weights."):
                nn.init.normal_(param, 0.0, std)
            elif name in ("head.bias", "head.cluster_bias"):
                nn.init.zeros_(param)

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            for p in self.embed.parameters():
                params.pop(id(p), None)
        return sum(p.numel() for p in params.values())

    # ------------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: Tensor,
        memory: Memory | None = None,
        labels: Tensor | None = None,
        *,
        mem_len: int | None = None,
        return_logits: bool | None = None,
        in_place_memory: bool = False,
    ) -> TransformerXLOutput:
        """in_place_memory: without autograd and with a full memory (mem_len states), write the next
        memory into `memory`'s own tensors and return that object, instead of building a new one
        while the old one is still alive: evaluation at long memory then holds one memory, not two
        (at mem_len 3800 on the base shape, 1.5 GB each). The caller gives up the old memory."""
        if input_ids.dim() != 2:
            raise UsageError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
        mem_len = self.mem_len if mem_len is None else mem_len
        if mem_len < 0:
            raise UsageError(f"mem_len must be >= 0, got {mem_len}")
        batch, q_len = input_ids.shape
        if memory is not None and memory.length and memory.batch_size != batch:
            raise UsageError(f"memory holds batch {memory.batch_size} but input_ids has batch {batch}")
        if not self.config.causal and (mem_len or memory is not None):
            raise UsageError("a bidirectional model (causal=false) takes no memory: pass mem_len=0 and memory=None")
        m_len = memory.length if memory is not None else 0
        c_len = memory.compressed_length if memory is not None else 0  # compressive memory only
        k_len = c_len + m_len + q_len
        window = None
        if self.same_length:
            if mem_len < 1:
                raise UsageError("same_length needs mem_len >= 1 (each query sees exactly mem_len keys)")
            window = mem_len

        h = self.drop(self.pos.embed(self.embed(input_ids)))  # (b, t, d_model)
        pos_state = self.pos.prepare(k_len=k_len, clamp_len=self.clamp_len, device=h.device, dtype=h.dtype)
        key = self.projection_key(h.dtype, q_len=q_len, compressed=c_len > 0)
        reuse = key is not None and memory is not None and memory.projected_key == key and m_len > 0
        sink: list[Tensor] | None = [] if key is not None else None
        in_place = (in_place_memory and m_len == mem_len > 0 and c_len == 0 and sink is None
                    and self.compressor is None and not torch.is_grad_enabled())
        contexts = []
        for i, block in enumerate(self.blocks):
            past = [] if k_len == q_len else [m.to(h.dtype) for m in memory.layer(i)]  # [compressed ; memory]
            if sink is not None and len(past) == 1:  # token-level inference: append, do not copy the memory
                context = append_rows(past[0], h)
            else:
                context = torch.cat([*past, h], dim=1) if past else h  # (b, n, d)
            if in_place:  # `context` holds its own copy of the old memory: overwrite the memory now
                memory.hidden[i].copy_(context[:, -mem_len:])
            else:
                contexts.append(context)
            h = block(h, context, positions=self.pos.layer(i, pos_state), window=window,
                      projected=memory.projected[i] if reuse else None, sink=sink,
                      constant_past=not any(m.requires_grad for m in past))
        h = self.drop(self.norm(h))
        aux_loss = None
        if in_place:
            new_memory = memory
        elif self.compressor is None:
            # token-level inference keeps views (no autograd to cut), so the next append stays cheap
            new_memory = update_memory(contexts, mem_len, detach=sink is None)
            if sink is not None and new_memory is not None:
                tails = tuple(kv[:, -new_memory.length :] for kv in sink)
                new_memory = dataclasses.replace(new_memory, projected=tails, projected_key=key)
        else:  # states leaving the memory are compressed instead of dropped (Rae et al. 2020)
            learn = self.training and torch.is_grad_enabled()  # the reconstruction loss trains f_c
            new_memory, aux_loss = self.compressor(
                contexts, compressed_len=c_len, mem_len=mem_len, q_len=q_len, blocks=self.blocks if learn else None
            )

        if return_logits is None:
            return_logits = labels is None or not self.config.adaptive
        flat_labels = None if labels is None else labels.reshape(-1)
        scores, nll = self.head(h.reshape(batch * q_len, -1), flat_labels, want_scores=return_logits)
        logits = None if scores is None else scores.view(batch, q_len, -1)
        loss = None
        if nll is not None:
            nll = nll.view(batch, q_len)
            count = (labels != -100).sum()
            loss = nll.sum() / count.clamp(min=1)
        return TransformerXLOutput(logits=logits, loss=loss, nll=nll, memory=new_memory, hidden=h, aux_loss=aux_loss)

    def projection_key(self, dtype: torch.dtype, *, q_len: int, compressed: bool = False) -> tuple | None:
        """Token-by-token inference (no autograd, eval mode, at most PROJECTION_CACHE_MAX_QUERIES new
        tokens, fast path) keeps the key/value projections of the memory in `Memory.projected`, so a
        generated token costs O(mem_len) attention instead of re-projecting mem_len states in every
        layer. The key names everything the projections depend on: dtype, autocast, and identity and
        version of the weights (an optimizer step or load_state_dict bumps the version), so stale
        projections are never used. None = no cache (training, long segments: evaluation keeps
        memory at the size of the hidden states; the eager reference path)."""
        if (torch.is_grad_enabled() or self.training or q_len > PROJECTION_CACHE_MAX_QUERIES or compressed
                or self.config.attention_impl == "eager"):
            return None
        device = self.head.bias.device.type
        autocast = torch.is_autocast_enabled(device)
        params = [block.attn.kv_proj.weight for block in self.blocks]  # bias-free; read per call, never cached
        if self.config.pre_lnorm:
            params += [p for block in self.blocks for p in (block.attn_norm.weight, block.attn_norm.bias)]
        return (dtype, autocast, torch.get_autocast_dtype(device) if autocast else None,
                *((p.data_ptr(), p._version) for p in params))

    # ------------------------------------------------------------------------------------------
    def save_pretrained(self, directory: str | Path) -> None:
        """Write `config.json` + `model.safetensors` (atomically; nothing pickled)."""
        from txl.checkpoint import save_model

        save_model(self, directory)

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, *, map_location: str | torch.device = "cpu", **overrides
    ) -> TransformerXL:
        """Load a directory written by `save_pretrained` (or by the trainer). Validates every tensor
        against config.json and fails with one clear `CheckpointError` otherwise."""
        from txl.checkpoint import load_model

        return load_model(directory, map_location=map_location, **overrides)


def bits_per_token(nats: float) -> float:
    return nats / math.log(2)
