"""Transformer-XL language model (Dai et al. 2019, arXiv 1901.02860).

Reads top to bottom: adaptive embedding (-> whole-word dropout) -> dropout (or locked dropout) ->
blocks over [memory ; segment] -> (final LayerNorm when pre-LN) -> dropout -> adaptive softmax.
Tensors are batch-first; memory is explicit state passed in and returned (`Memory`).

Two arena options change the data flow (docs/guide/models.md, "The arena"): compressive memory (`cmem_len > 0`,
Rae et al. 2020) attends over [compressed ; memory ; segment] and returns `aux_loss`; `causal=False`
makes the same blocks a bidirectional encoder for a masked-LM objective (no memory, no causal mask).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.errors import UsageError
from txl.fast import backend_for
from txl.generate.decoder import generate_tokens
from txl.models.transformer_xl.adaptive import AdaptiveEmbedding, AdaptiveLogSoftmax
from txl.models.transformer_xl.compressive import MemoryCompressor
from txl.models.transformer_xl.config import TransformerXLConfig
from txl.models.transformer_xl.universal import UniversalDepth, additive_positions, position_signal
from txl.nn.attention.layer import Attention, share_kernels
from txl.nn.attention.masks import AttentionMask
from txl.nn.backend import REFERENCE, Backend
from txl.nn.checkpointing import checkpointed, wants_checkpoint
from txl.nn.feedforward import activation, fc1_width
from txl.nn.gating import GRUGate
from txl.nn.memory import MemoryPass, MemoryState, register_pytree
from txl.nn.norms import build_norm
from txl.nn.positional import LayerPositions, embed_positions
from txl.nn.positions_absolute import token_embedding_config
from txl.nn.recurrence import same_layer_memory
from txl.nn.regularization import locked_dropout, word_dropout
from txl.nn.reversible import reversible_blocks


class FeedForward(nn.Module):
    """Position-wise FFN: Linear, activation + Dropout, Linear, Dropout. The activation is the config's
    `ffn` (txl/nn/feedforward.py): ReLU as the reference, GELU, or a gated unit (SwiGLU, GeGLU) whose fc1
    makes value and gate, 2·d_inner wide."""

    def __init__(self, config: TransformerXLConfig, *, backend: Backend = REFERENCE):
        super().__init__()
        self.fc1 = backend.Linear(config.d_model, fc1_width(config.ffn, config.d_inner))
        self.activation = activation(config.ffn, config.dropout, dropout_cls=backend.Dropout,
                                     relu_dropout=backend.relu_dropout)
        self.fc2 = backend.Linear(config.d_inner, config.d_model)
        self.drop = backend.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc2(self.activation(self.fc1(x))))


class Block(nn.Module):
    """One decoder layer. Post-LN by default (the paper); pre-LN with `pre_lnorm`; GTrXL's gated pre-LN
    block with `residual="gru-gate"` (Parisotto et al. 2019: each residual sum x + y becomes a GRU gate
    g(x, ReLU(y)), txl/nn/gating.py). The norms are the config's `norm` (LayerNorm or RMSNorm)."""

    def __init__(self, config: TransformerXLConfig, *, layer_idx: int = 0, backend: Backend = REFERENCE):
        super().__init__()
        self.pre_lnorm = config.pre_lnorm
        self.attn = Attention(config, layer_idx=layer_idx, backend=backend)
        self.attn_norm = build_norm(config.norm, config.d_model, eps=config.layer_norm_eps)
        self.ff = FeedForward(config, backend=backend)
        self.ff_norm = build_norm(config.norm, config.d_model, eps=config.layer_norm_eps)
        gated = config.residual == "gru-gate"
        self.attn_gate = GRUGate(config.d_model, backend=backend) if gated else None
        self.ff_gate = GRUGate(config.d_model, backend=backend) if gated else None
        # ERNIE-Doc (memory_source="same-layer"): the memory keeps this block's output, not its input
        self.keeps_output = config.memory_source == "same-layer"

    def forward(
        self, h: Tensor, *, memory: MemoryPass | None, positions: LayerPositions, mask: AttentionMask,
        need_weights: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """h (b, t, d_model) -> (b, t, d_model), and the attention probabilities with `need_weights`.
        `memory` gives the attention [memory ; h] and keeps h (this layer's input) for the next segment,
        or the output with `memory_source="same-layer"` (a `txl.nn.recurrence.SameLayerUpdate`)."""
        if self.attn_gate is not None:  # GTrXL: identity-map reordering, gates instead of sums
            attended, probs = self.attn(self.attn_norm(h), h, positions=positions, mask=mask, memory=memory,
                                        source_norm=self.attn_norm, need_weights=need_weights)
            h = self.attn_gate(h, F.relu(attended))
            out = self.ff_gate(h, F.relu(self.ff(self.ff_norm(h))))
        elif self.pre_lnorm:  # the context [memory ; h] is normalised too
            attended, probs = self.attn(self.attn_norm(h), h, positions=positions, mask=mask, memory=memory,
                                        source_norm=self.attn_norm, need_weights=need_weights)
            h = h + attended
            out = h + self.ff(self.ff_norm(h))
        else:
            attended, probs = self.attn(h, positions=positions, mask=mask, memory=memory, need_weights=need_weights)
            h = self.attn_norm(h + attended)
            out = self.ff_norm(h + self.ff(h))
        if self.keeps_output and memory is not None:
            memory.keep_output(self.attn.layer_idx, out)  # layer_idx: the universal transformer's step too
        return out, probs


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
    attentions: with `output_attentions`, per layer the attention probabilities (b, h, t, keys) over
        [memory ; segment] (before attention dropout; [memory tokens ; memory ; segment] with
        `memory_tokens`), else None.
    hidden_states: with `output_hidden_states`, every layer's input (b, t, d_model), then the last
        layer's output (n_layer + 1 tensors), else None.
    """

    logits: Tensor | None
    loss: Tensor | None
    nll: Tensor | None
    memory: MemoryState | None
    hidden: Tensor
    aux_loss: Tensor | None = None
    attentions: tuple[Tensor, ...] | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    ponder_depth: Tensor | None = None  # universal: mean steps + remainder over the positions (ACT)


# a pytree, as its memory: torch.export and torch.compile return it as it is
register_pytree(TransformerXLOutput, [f.name for f in dataclasses.fields(TransformerXLOutput)])


class TransformerXL(nn.Module):
    """Transformer-XL LM. `out = model(input_ids, memory=None, labels=None)`.

    `labels[b, t]` is the token that should follow `input_ids[b, t]` (already shifted, as the
    reference's data iterator gives it; -100 = not scored). With `causal=False` (bidirectional
    encoder) it is the original token at position t for a masked-LM objective (see
    `txl.data.masking.mask_tokens`), -100 elsewhere. Runtime settings that do not change the
    parameters can differ from training, per call (`mem_len=`, `clamp_len=`, `same_length=`) or as
    the model's defaults (`model.mem_len`, `model.clamp_len`, `model.same_length`).
    `model.checkpoint_blocks = True`: activation checkpointing, each block recomputed in the backward
    (`train.activation_checkpointing = "blocks"`, txl.nn.checkpointing); same results, less memory.
    """

    checkpoint_blocks: bool = False
    reversible_backward: bool = True  # config.reversible: False = plain autograd through the same blocks (tests)

    def __init__(self, config: TransformerXLConfig):
        super().__init__()
        self.config = config
        self.mem_len = config.mem_len
        self.clamp_len = config.clamp_len
        self.same_length = config.same_length
        # the parts every layer is built from: plain PyTorch, or the CPU fast backend's (the default,
        # "auto"; same parameters and results, txl/fast/__init__.py)
        backend = backend_for(config.backend)
        # a widening concat of absolute positions (merge='concat') takes tokens d_model - dim wide
        self.embed = AdaptiveEmbedding(token_embedding_config(config), linear=backend.linear)
        self.drop = backend.Dropout(config.dropout)
        self.pos = backend.positional(config)
        # universal: one block shared by every step (txl.models.transformer_xl.universal), else one block per layer
        self.universal = UniversalDepth(config, backend=backend) if config.universal else None
        if config.universal and config.universal_signals == "every-step":
            additive_positions(self.pos)  # refuses an absolute encoding not merged by addition
        self.blocks = nn.ModuleList(Block(config, layer_idx=i, backend=backend)
                                    for i in range(1 if config.universal else config.n_layer))
        share_kernels(block.attn for block in self.blocks)  # layer-wise shared kernel parameters (Linformer)
        final_norm = config.pre_lnorm and config.final_norm  # post-LN output is already normalised
        self.norm = build_norm(config.norm, config.d_model, eps=config.layer_norm_eps) if final_norm else nn.Identity()
        self.head = AdaptiveLogSoftmax(config, self.embed, linear=backend.linear)
        self.compressor = MemoryCompressor(config) if config.cmem_len else None
        # how a forward pass reads and writes the memory (txl.nn.memory); ERNIE-Doc's same-layer
        # recurrence keeps each layer's output instead (txl.nn.recurrence, the same pass on both backends)
        same_layer = config.memory_source == "same-layer"
        self.memory_kind = same_layer_memory if same_layer else backend.memory_kind
        self.reset_parameters()

    # ------------------------------------------------------------------------------------------
    def reset_parameters(self) -> None:
        """The reference's normal init: weights N(0, init_std), projections N(0, proj_init_std),
        LayerNorm (and RMSNorm) weights N(1, init_std), biases 0; GTrXL gates' b_g at its start value."""
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
            elif isinstance(module, nn.RMSNorm):
                nn.init.normal_(module.weight, 1.0, std)
            elif isinstance(module, GRUGate):
                module.reset_bias()
        for name, param in self.named_parameters():
            if ".projs." in f".{name}":
                nn.init.normal_(param, 0.0, proj_std)
            elif name.startswith("pos.") and not name.startswith("pos.r_proj"):
                nn.init.normal_(param, 0.0, std)  # u, v, Shaw tables, learned absolute table
            elif name in ("head.cluster_weight",) or name.startswith("head.weights."):
                nn.init.normal_(param, 0.0, std)
            elif name in ("head.bias", "head.cluster_bias"):
                nn.init.zeros_(param)
            elif name.endswith(".attn.memory_tokens"):  # learned keys and values (config.memory_tokens)
                nn.init.normal_(param, 0.0, std)
        if hasattr(self.pos, "reset_parameters"):  # an encoding's own init (learned concat: [I | I])
            self.pos.reset_parameters()
        for block in self.blocks:  # Longformer initialises Q_g, K_g, V_g to Q_s, K_s, V_s (§3.1)
            block.attn.match_global_projections()
        if self.universal is not None:
            self.universal.reset_parameters()

    @property
    def takes_position_ids(self) -> bool:
        """Whether `forward` reads `position_ids=` (an absolute encoding: sinusoidal, learned): a decoder that
        feeds a text token by token passes each token's place in its segment (txl.generate.decoder)."""
        return self.pos.takes_position_ids

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
        memory: MemoryState | None = None,
        labels: Tensor | None = None,
        *,
        attention_mask: Tensor | None = None,
        mem_len: int | None = None,
        clamp_len: int | None = None,
        same_length: bool | None = None,
        return_logits: bool | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        global_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> TransformerXLOutput:
        """attention_mask: (b, t), 1 for a token and 0 for padding (the Hugging Face convention); padded
        positions are never attended to and never scored. With memory, the returned memory carries the
        mask of what it holds (`Memory.key_padding`), so later segments never attend to the padding
        either; a row's real tokens must be contiguous over [memory ; segment] (pad a sequence before its
        first token or after its last, and `memory.reset(rows)` before a row starts a new sequence:
        one-line UsageError otherwise). Left padding at a sequence's start and right padding at its end
        give each sequence what it gets run alone, for the relative encodings (docs/guide/data.md,
        "Padding inside the memory"). mem_len / clamp_len / same_length: this call's settings
        (default: the model's attributes). global_mask: (b, t), nonzero for global tokens (chosen
        positions that see and are seen by all, e.g. a [CLS]); for kernels that take it (bigbird, sliding).
        position_ids: (t,) or (b, t) absolute positions of the tokens for the absolute encodings (sinusoidal,
        learned; bert4keras's custom_position_ids), e.g. to continue positions across segments; default 0 … t-1."""
        if input_ids.dim() != 2:
            raise UsageError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
        mem_len = self.mem_len if mem_len is None else mem_len
        clamp_len = self.clamp_len if clamp_len is None else clamp_len
        same_length = self.same_length if same_length is None else same_length
        if mem_len < 0:
            raise UsageError(f"mem_len must be >= 0, got {mem_len}")
        if clamp_len < 0:
            raise UsageError(f"clamp_len must be >= 0 (0 = no clamp), got {clamp_len}")
        batch, q_len = input_ids.shape
        if memory is not None and memory.length and memory.batch_size != batch:
            raise UsageError(f"memory holds batch {memory.batch_size} but input_ids has batch {batch}")
        if not self.config.causal and (mem_len or memory is not None):
            raise UsageError("a bidirectional model (causal=false) takes no memory: pass mem_len=0 and memory=None")
        if same_length and mem_len < 1:
            raise UsageError("same_length needs mem_len >= 1 (each query sees exactly mem_len keys)")
        key_padding = None  # (b, past + t) over the keys [memory ; segment], True = real
        if attention_mask is not None or getattr(memory, "key_padding", None) is not None:
            key_padding = self._key_padding(attention_mask, input_ids, memory=memory, mem_len=mem_len)
            if labels is not None and key_padding is not None:
                labels = labels.masked_fill(~key_padding[:, -q_len:], -100)  # padding is never scored
        if global_mask is not None:
            global_mask = self._global_mask(global_mask, input_ids)
        mask = AttentionMask(causal=self.config.causal, window=mem_len if same_length else None,
                             key_padding=key_padding, global_mask=global_mask)

        memory_update = self.memory_kind(self, memory, mem_len=mem_len, q_len=q_len)
        h = embed_positions(self.pos, self._embed(input_ids), position_ids)  # (b, t, d_model)
        # dropout_input: one mask per sequence (variational) instead of the per-position dropout
        h = locked_dropout(h, self.config.dropout_input, self.training) if self.config.dropout_input else self.drop(h)
        k_len = memory_update.past_length + q_len
        pos_state = self.pos.prepare(k_len=k_len, clamp_len=clamp_len, device=h.device, dtype=h.dtype)
        hidden_states, attentions = [], []
        ponder = None
        recompute = wants_checkpoint(self.checkpoint_blocks)  # activation checkpointing (txl.nn.checkpointing)
        if self.universal is not None:
            h, ponder, hidden_states, attentions = self.universal(
                self.blocks[0], h, memory=memory_update, positions=lambda i: self.pos.layer(i, pos_state), mask=mask,
                need_weights=output_attentions, checkpoint=recompute,
                position_rows=position_signal(self.pos, h, position_ids=position_ids))
        elif self.config.reversible:  # Reformer's reversible blocks: the backward rebuilds each block's input
            h, hidden_states, attentions = reversible_blocks(
                self.blocks, h, memory=memory_update, positions=self.pos.layer, pos_state=pos_state, mask=mask,
                recompute=self.reversible_backward, need_weights=output_attentions)
        else:
            for i, block in enumerate(self.blocks):
                hidden_states.append(h)
                positions = self.pos.layer(i, pos_state)

                def run(x, memory, block=block, positions=positions):
                    return block(x, memory=memory, positions=positions, mask=mask, need_weights=output_attentions)

                h, probs = checkpointed(run, h, memory_update) if recompute else run(h, memory_update)
                attentions.append(probs)
        hidden_states.append(h)
        h = self.drop(self.norm(h))
        new_memory, aux_loss = memory_update.finish()
        if key_padding is not None and new_memory is not None:  # the memory keeps the mask of what it holds
            new_memory = new_memory.with_padding(key_padding[:, -new_memory.length :])
        ponder_depth = None
        if ponder is not None:
            real = torch.ones_like(ponder, dtype=torch.bool) if key_padding is None else key_padding[:, -q_len:]
            ponder_depth = ponder[real].mean()
            if self.training and self.config.ponder_cost:  # τ · mean ρ joins the training loss
                cost = self.config.ponder_cost * ponder_depth
                aux_loss = cost if aux_loss is None else aux_loss + cost

        if return_logits is None:
            # with labels, the adaptive softmax and a training step's sampled softmax need no full logits
            return_logits = labels is None or not (self.config.adaptive or (self.training and self.config.sample_softmax))
        flat_labels = None if labels is None else labels.reshape(-1)
        scores, nll = self.head(h.reshape(batch * q_len, -1), flat_labels, want_scores=return_logits)
        logits = None if scores is None else scores.view(batch, q_len, -1)
        loss = None
        if nll is not None:
            nll = nll.view(batch, q_len)
            count = (labels != -100).sum()
            loss = nll.sum() / count.clamp(min=1)
        return TransformerXLOutput(
            logits=logits, loss=loss, nll=nll, memory=new_memory, hidden=h, aux_loss=aux_loss,
            attentions=tuple(attentions) if output_attentions else None,
            hidden_states=tuple(hidden_states) if output_hidden_states else None,
            ponder_depth=ponder_depth,
        )

    def _embed(self, input_ids: Tensor) -> Tensor:
        """The (scaled) embeddings of input_ids; in training with dropout_embed, every occurrence of a
        dropped word in the batch is zero (whole-word dropout)."""
        x = self.embed(input_ids)
        return word_dropout(x, input_ids, self.config.vocab_size, self.config.dropout_embed, self.training)

    def _global_mask(self, global_mask: Tensor, input_ids: Tensor) -> Tensor:
        from txl.nn.attention.registry import SPECS

        if not SPECS[self.config.attention].global_mask:
            able = ", ".join(sorted(name for name, spec in SPECS.items() if spec.global_mask))
            raise UsageError(f"global_mask is not available with attention={self.config.attention!r} "
                             f"(kernels that take it: {able})")
        if global_mask.shape != input_ids.shape:
            raise UsageError(f"global_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                             f"got {tuple(global_mask.shape)}")
        return global_mask.to(device=input_ids.device) != 0

    def _key_padding(self, attention_mask: Tensor | None, input_ids: Tensor, *, memory: MemoryState | None,
                     mem_len: int) -> Tensor | None:
        """The bool padding mask of the keys, True = real, checked against the call: (b, t) of
        `attention_mask` without memory (any mask, as always); with memory, (b, past + t) over
        [memory ; segment] (the memory's `key_padding`, then the segment's), or None when every key is real.

        Relative positions count positions, padding included, so padding between two real tokens of a
        row would put them further apart than they are alone: with memory, each row's real keys must
        be one run (padding only before or after it)."""
        batch, q_len = input_ids.shape
        if attention_mask is None:
            segment = torch.ones(batch, q_len, dtype=torch.bool, device=input_ids.device)
        elif attention_mask.shape != input_ids.shape:
            raise UsageError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                             f"got {tuple(attention_mask.shape)}")
        else:
            segment = attention_mask.to(device=input_ids.device) != 0
        has_memory = memory is not None and memory.length > 0
        if not mem_len and not has_memory:
            return segment
        if self.compressor is not None:
            raise UsageError("compressive memory (cmem_len > 0) cannot hold padding: pass attention_mask with "
                             "cmem_len = 0, or run each sequence alone")
        real = torch.cat([memory.real_positions().to(segment.device), segment], dim=1) if has_memory else segment
        runs = real[:, 0].long() + (real[:, 1:] & ~real[:, :-1]).sum(dim=1)  # runs of real keys per row
        if bool((runs > 1).any()):
            rows = torch.nonzero(runs > 1).flatten().tolist()
            raise UsageError(f"row(s) {rows} have padding between real tokens over [memory ; segment]: with "
                             "memory, pad a sequence only before its first token or after its last, and call "
                             "memory.reset(rows) before a row starts a new sequence")
        return None if bool(real.all()) else real

    def generate(self, input_ids: Tensor, max_new_tokens: int, **kwargs) -> Tensor:
        """`input_ids` (b, t) followed by up to `max_new_tokens` sampled tokens, (b, t + n), reusing
        the memory token by token (`txl.generate.decoder.sample`, below the models: it knows only their
        contract). Keyword arguments: temperature (0 = greedy), top_k, top_p, eos_token_id, pad_token_id,
        mem_len, segment_len, generator, attention_mask (b, t): 1 for a token, 0 for left padding of shorter prompts."""
        return generate_tokens(self, input_ids, max_new_tokens, **kwargs)

    # ------------------------------------------------------------------------------------------
    def save_pretrained(self, directory: str | Path) -> None:
        """Write `config.json` + `model.safetensors` (atomically; nothing pickled)."""
        from txl.models.pretrained import save_model

        save_model(self, directory)

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, *, map_location: str | torch.device = "cpu", **overrides
    ) -> TransformerXL:
        """Load a directory written by `save_pretrained`, a checkpoint of the trainer, or a run folder
        (its `best`, else `last`). Validates every tensor against config.json and fails with one clear
        `CheckpointError` otherwise."""
        from txl.models.registry import load_model

        return load_model(directory, map_location=map_location, **overrides)

