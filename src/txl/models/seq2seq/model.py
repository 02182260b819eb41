"""Encoder–decoder Transformer (Vaswani et al. 2017, arXiv 1706.03762), on txl's blocks.

Reads top to bottom: source embedding -> encoder blocks (bidirectional self-attention, the LM's
`Block` with a padding mask) -> decoder blocks (causal self-attention, cross-attention over the
encoder output with the source padding mask, feed-forward) -> (final LayerNorm when pre-LN) -> output
layer (tied to the target embedding by default). Post-LN by default, as the paper and the seed's
summarisation walkthrough; pre-LN with `pre_lnorm`. Positions come from the registry
(`pos_encoding`: sinusoidal as the paper, or learned / rope), attention kernels from theirs.

Padding is on the right: `attention_mask` marks real source tokens (1) and padding (0); target rows are
padded after their end, so the causal mask alone keeps a real target token from seeing padding (the
seed's "look-ahead mask combined with the target padding mask" is the same set of visible keys), and
padded labels are -100 (not scored). Decoding reuses two caches (`DecoderCache`): the decoder's
self-attention keys/values, which grow by one token per step, and the cross-attention projections of
the encoder output, computed once per source.

Dimension names: b batch, s source length, t target length, d d_model, V target vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from txl.errors import ConfigError, UsageError
from txl.fast import backend_for
from txl.models.seq2seq.config import EncoderDecoderConfig
from txl.models.transformer_xl.config import TransformerXLConfig
from txl.models.transformer_xl.model import Block, FeedForward
from txl.models.transformer_xl.universal import UniversalDepth, additive_positions, position_signal
from txl.nn.attention.layer import Attention, share_kernels
from txl.nn.attention.masks import AttentionMask
from txl.nn.backend import REFERENCE, Backend
from txl.nn.memory import MemoryPass
from txl.nn.norms import build_norm
from txl.nn.positional import LayerPositions, PositionalEncoding, embed_positions

CAUSAL = AttentionMask(causal=True)


class KeyValueCache(MemoryPass):
    """Per decoder layer, the projected keys and values (b, n, 2·h·d) of every token decoded so far.

    What `Attention(memory=...)` reads keys and values through (`txl.nn.memory.MemoryPass`), kept
    across decoding steps (as Hugging Face's `DynamicLayer`): it projects only the new rows and appends
    them."""

    def __init__(self, n_layer: int):
        self.kv: list[Tensor | None] = [None] * n_layer

    @property
    def length(self) -> int:
        return 0 if self.kv[0] is None else self.kv[0].shape[1]

    def keys_values(self, layer: int, fresh: Tensor, project: Callable[[Tensor], Tensor]) -> Tensor:
        new = project(fresh)
        past = self.kv[layer]
        self.kv[layer] = new if past is None else torch.cat([past, new], dim=1)
        return self.kv[layer]

    def reorder(self, index: Tensor) -> None:
        self.kv = [None if kv is None else kv.index_select(0, index) for kv in self.kv]

    def select(self, index: Tensor) -> KeyValueCache:
        """Rows `index` of the batch, in that order, as a new cache (this one unchanged)."""
        selected = type(self)(len(self.kv))
        selected.kv = [None if kv is None else kv.index_select(0, index) for kv in self.kv]
        return selected


class CrossCache(KeyValueCache):
    """Per decoder layer, the cross-attention projection of the encoder output: computed at the first
    step, reused by every later one."""

    def keys_values(self, layer: int, fresh: Tensor, project: Callable[[Tensor], Tensor]) -> Tensor:
        if self.kv[layer] is None:
            self.kv[layer] = project(fresh)
        return self.kv[layer]


@dataclass
class DecoderCache:
    """What incremental decoding carries from step to step (pass it back as `cache=`)."""

    self_attention: KeyValueCache
    cross_attention: CrossCache

    @classmethod
    def empty(cls, n_layer: int) -> DecoderCache:
        return cls(KeyValueCache(n_layer), CrossCache(n_layer))

    @property
    def length(self) -> int:
        return self.self_attention.length

    def reorder(self, index: Tensor) -> None:
        """Keep rows `index` of the batch (beam search), in that order (in place)."""
        self.self_attention.reorder(index)
        self.cross_attention.reorder(index)

    def select(self, index: Tensor) -> DecoderCache:
        """Rows `index` of the batch, in that order, as a new cache (this one unchanged)."""
        return DecoderCache(self.self_attention.select(index), self.cross_attention.select(index))


class DecoderBlock(nn.Module):
    """Causal self-attention, cross-attention over the encoder output, feed-forward; each a residual
    sub-layer with its LayerNorm (post-LN: after the sum; pre-LN: on the sub-layer's input)."""

    def __init__(self, config: TransformerXLConfig, *, layer_idx: int, backend: Backend = REFERENCE):
        super().__init__()
        self.pre_lnorm = config.pre_lnorm
        self.self_attn = Attention(config, layer_idx=layer_idx, backend=backend)
        self.self_norm = build_norm(config.norm, config.d_model, eps=config.layer_norm_eps)
        self.cross_attn = Attention(config, layer_idx=layer_idx, backend=backend)
        self.cross_norm = build_norm(config.norm, config.d_model, eps=config.layer_norm_eps)
        self.ff = FeedForward(config, backend=backend)
        self.ff_norm = build_norm(config.norm, config.d_model, eps=config.layer_norm_eps)

    def forward(self, h: Tensor, encoded: Tensor, *, positions: LayerPositions, cross_mask: AttentionMask,
                cache: DecoderCache | None = None) -> Tensor:
        """h (b, t, d), encoded (b, s, d) -> (b, t, d)."""
        self_cache = None if cache is None else cache.self_attention
        cross_cache = None if cache is None else cache.cross_attention
        if self.pre_lnorm:
            x = self.self_norm(h)
            h = h + self.self_attn(x, positions=positions, mask=CAUSAL, memory=self_cache)[0]
            h = h + self.cross_attn(self.cross_norm(h), encoded, mask=cross_mask, memory=cross_cache)[0]
            return h + self.ff(self.ff_norm(h))
        h = self.self_norm(h + self.self_attn(h, positions=positions, mask=CAUSAL, memory=self_cache)[0])
        h = self.cross_norm(h + self.cross_attn(h, encoded, mask=cross_mask, memory=cross_cache)[0])
        return self.ff_norm(h + self.ff(h))


@dataclass
class Seq2SeqOutput:
    """logits (b, t, V); loss: mean over scored target tokens (label-smoothed when asked); nll (b, t)
    per-token NLL (never smoothed, 0 where the label is -100); encoded (b, s, d) the encoder output
    (pass it back as `encoded=` to skip the encoder); cache: the decoder cache when one was given.
    universal: ponder_depth = the decoder's mean ACT depth (steps + remainder) over the scored target
    tokens, encoder_ponder_depth the encoder's over the real source tokens (None when `encoded=` was given);
    in training mode aux_loss = ponder_cost · (their sum), already included in `loss`."""

    logits: Tensor
    loss: Tensor | None
    nll: Tensor | None
    encoded: Tensor
    cache: DecoderCache | None = None
    ponder_depth: Tensor | None = None
    encoder_ponder_depth: Tensor | None = None
    aux_loss: Tensor | None = None


def pair_loss(logits: Tensor, labels: Tensor | None, decoder_input_ids: Tensor,
              label_smoothing: float = 0.0) -> tuple[Tensor | None, Tensor | None]:
    """(loss, nll) of a sequence-to-sequence forward: nll (b, t) per target token (0 where labels are -100),
    loss its mean over the scored tokens, label-smoothed when asked ((None, None) without labels). Shared by
    every encoder-decoder (the Transformer's and the RNN's)."""
    if labels is None:
        return None, None
    if labels.shape != decoder_input_ids.shape:
        raise UsageError(f"labels must have the shape of decoder_input_ids {tuple(decoder_input_ids.shape)}, "
                         f"got {tuple(labels.shape)}")
    flat = logits.float().reshape(-1, logits.shape[-1])
    nll = F.cross_entropy(flat, labels.reshape(-1), ignore_index=-100, reduction="none").view(labels.shape)
    count = (labels != -100).sum().clamp(min=1)
    if not label_smoothing:
        return nll.sum() / count, nll
    smoothed = F.cross_entropy(flat, labels.reshape(-1), ignore_index=-100, reduction="sum",
                               label_smoothing=label_smoothing)
    return smoothed / count, nll


class EncoderDecoder(nn.Module):
    """`out = model(input_ids, attention_mask=, decoder_input_ids=, labels=)`.

    input_ids (b, s) the source; attention_mask (b, s) 1 for a token, 0 for padding (None = no
    padding); decoder_input_ids (b, t) the target shifted right (start symbol first: teacher
    forcing); labels (b, t) the next target token at each position, -100 = not scored.
    """

    def __init__(self, config: EncoderDecoderConfig):
        super().__init__()
        if config.arch != "encoder-decoder":
            raise ConfigError(f"EncoderDecoder needs config.arch='encoder-decoder', got {config.arch!r}")
        self.config = config
        backend = backend_for(config.backend)  # plain PyTorch or the CPU fast backend's parts (txl/fast)
        d = config.d_model
        n_encoder = config.n_encoder_layer or config.n_layer
        # The encoder's blocks are the LM's own blocks, bidirectional and without memory.
        encoder_view = config.encoder_config()
        decoder_view = config.decoder_config()  # causal self-attention and positions, no memory
        self.target_embed = nn.Embedding(config.vocab_size, d)
        shared = config.share_embeddings and config.source_vocab_size in (0, config.vocab_size)
        self.source_embed = None if shared else nn.Embedding(config.source_vocab_size or config.vocab_size, d)
        self.drop = backend.Dropout(config.dropout)
        self.encoder_pos = backend.positional(encoder_view)
        # universal: one shared block per stack, applied step after step with ACT halting (UniversalDepth)
        universal = config.universal
        self.encoder = nn.ModuleList(Block(encoder_view, layer_idx=i, backend=backend)
                                     for i in range(1 if universal else n_encoder))
        share_kernels(block.attn for block in self.encoder)  # layer-wise shared kernel parameters (Linformer)
        self.decoder_pos = backend.positional(decoder_view)
        self.decoder = nn.ModuleList(DecoderBlock(decoder_view, layer_idx=i, backend=backend)
                                     for i in range(1 if universal else config.n_layer))
        self.encoder_act = UniversalDepth(encoder_view, backend=backend) if universal else None
        self.decoder_act = UniversalDepth(decoder_view, backend=backend) if universal else None
        if universal and config.universal_signals == "every-step":
            additive_positions(self.encoder_pos)  # refuses an absolute encoding not merged by addition
        # pre-LN sums residuals without a norm: both stacks end in one (post-LN output is normalised)
        final = config.pre_lnorm and config.final_norm
        self.encoder_norm = build_norm(config.norm, d, eps=config.layer_norm_eps) if final else nn.Identity()
        self.decoder_norm = build_norm(config.norm, d, eps=config.layer_norm_eps) if final else nn.Identity()
        # Tied (Press & Wolf 2017, as Vaswani et al. §3.4): the output layer reads the target embedding
        # table itself, so a checkpoint holds it once.
        self.head = None if config.tie_weight else backend.Linear(d, config.vocab_size, bias=False)
        self.head_bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.reset_parameters()

    @property
    def source_embedding(self) -> nn.Embedding:
        return self.target_embed if self.source_embed is None else self.source_embed

    def reset_parameters(self) -> None:
        """The init of the reference Transformer implementations (tensor2tensor, fairseq): Xavier-uniform
        linear layers, embedding tables N(0, d_model^-0.5) (scaled by sqrt(d_model) they have unit
        variance, as the sinusoids), LayerNorm (1, 0), biases 0. The LM's N(0, 0.02) suits its width of
        hundreds; on small models it leaves attention uniform for long (a copy task barely moves in 300
        steps)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        for name, param in self.named_parameters():
            if name.startswith(("encoder_pos.", "decoder_pos.")):
                nn.init.normal_(param, 0.0, self.config.init_std)
        for table in (self.target_embed, self.source_embed):
            if table is not None:
                nn.init.normal_(table.weight, 0.0, self.config.d_model**-0.5)
        nn.init.zeros_(self.head_bias)
        for act in (self.encoder_act, self.decoder_act):
            if act is not None:
                act.reset_parameters()  # the halting bias (t2t's act_halting_bias_init = 1)

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            for module in (self.target_embed, self.source_embed):
                for p in module.parameters() if module is not None else ():
                    params.pop(id(p), None)
        return sum(p.numel() for p in params.values())

    # ------------------------------------------------------------------------------------------
    def _embed(self, table: nn.Embedding, ids: Tensor, pos: PositionalEncoding, *, offset: int = 0) -> Tensor:
        """Token embeddings scaled by sqrt(d_model) (Vaswani et al. §3.4), plus absolute positions
        offset..offset+t-1 when the encoding adds them to the input."""
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= table.num_embeddings):
            raise UsageError(f"token id {int(ids.max()) if int(ids.max()) >= 0 else int(ids.min())} is outside "
                             f"the vocabulary of {table.num_embeddings} ids")
        x = table(ids) * self.config.d_model**0.5
        if offset and pos.takes_position_ids:  # positions offset.. (cached decoding), merged as the encoding merges
            positions = torch.arange(offset, offset + ids.shape[1], device=ids.device)
            return self.drop(embed_positions(pos, x, positions))
        return self.drop(pos.embed(x))  # (a relative encoding adds nothing to the input at any offset)

    def encode(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """(b, s) source ids -> (b, s, d) encoder output. Rows of padding carry values no query reads."""
        return self._encode(input_ids, attention_mask)[0]

    def _encode(self, input_ids: Tensor, attention_mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """(encoder output, universal: the mean ACT depth over the real source tokens, else None)."""
        if input_ids.dim() != 2:
            raise UsageError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
        key_padding = self.source_padding(input_ids, attention_mask)
        h = self._embed(self.source_embedding, input_ids, self.encoder_pos)
        state = self.encoder_pos.prepare(k_len=input_ids.shape[1], clamp_len=0,
                                         device=h.device, dtype=h.dtype)
        mask = AttentionMask(causal=False, key_padding=key_padding)
        if self.encoder_act is not None:
            block = self.encoder[0]

            def run_step(x: Tensor, step: int):
                block.attn.layer_idx = step  # per-step structures (xl's W_kR), as a layer of the stack
                try:
                    return block(x, memory=None, positions=self.encoder_pos.layer(step, state), mask=mask)
                finally:
                    block.attn.layer_idx = 0

            h, ponder, _, _ = self.encoder_act.loop(run_step, h, positions=position_signal(self.encoder_pos, h))
            depth = ponder.mean() if key_padding is None else ponder[key_padding].mean()
            return self.encoder_norm(h), depth
        for i, block in enumerate(self.encoder):
            h, _ = block(h, memory=None, positions=self.encoder_pos.layer(i, state), mask=mask)
        return self.encoder_norm(h), None

    @staticmethod
    def source_padding(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor | None:
        """The (b, s) bool mask of real source tokens, checked: a row without any real token would leave
        cross-attention nothing to attend to (the seed's -1e9 fill then averages padding silently)."""
        if input_ids.shape[1] == 0:
            raise UsageError("the source is empty (length 0): cross-attention needs at least one source token")
        if attention_mask is None:
            return None
        if attention_mask.shape != input_ids.shape:
            raise UsageError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                             f"got {tuple(attention_mask.shape)}")
        real = attention_mask.to(device=input_ids.device) != 0
        empty = (~real.any(dim=1)).nonzero()
        if len(empty):
            raise UsageError(f"source row {int(empty[0])} is all padding (attention_mask all 0): cross-attention "
                             "would have no key to attend to; drop empty sources from the batch")
        return None if bool(real.all()) else real

    def decode(self, decoder_input_ids: Tensor, encoded: Tensor, *, attention_mask: Tensor | None = None,
               cache: DecoderCache | None = None) -> Tensor:
        """(b, t) target ids (the continuation of `cache`, if given) -> (b, t, d) final hidden states."""
        return self._decode(decoder_input_ids, encoded, attention_mask=attention_mask, cache=cache)[0]

    def _decode(self, decoder_input_ids: Tensor, encoded: Tensor, *, attention_mask: Tensor | None,
                cache: DecoderCache | None) -> tuple[Tensor, Tensor | None]:
        """(final hidden states, universal: the ACT depth ρ (b, t) of each target position, else None)."""
        if decoder_input_ids.dim() != 2:
            raise UsageError(f"decoder_input_ids must be (batch, length), got shape {tuple(decoder_input_ids.shape)}")
        if encoded.shape[0] != decoder_input_ids.shape[0]:
            raise UsageError(f"the encoder output holds batch {encoded.shape[0]} but decoder_input_ids has batch "
                             f"{decoder_input_ids.shape[0]}")
        past = 0 if cache is None else cache.length
        key_padding = None if attention_mask is None else attention_mask.to(device=encoded.device) != 0
        if key_padding is not None and bool(key_padding.all()):
            key_padding = None
        h = self._embed(self.target_embed, decoder_input_ids, self.decoder_pos, offset=past)
        state = self.decoder_pos.prepare(k_len=past + decoder_input_ids.shape[1], clamp_len=0,
                                         device=h.device, dtype=h.dtype)
        cross_mask = AttentionMask(causal=False, key_padding=key_padding)
        if self.decoder_act is not None:
            block = self.decoder[0]

            def run_step(x: Tensor, step: int):
                # this step's self-attention cache slot; cross-attention reads one projection of the
                # encoder output (slot 0: the same weights and the same encoder output at every step)
                block.self_attn.layer_idx = step
                try:
                    return block(x, encoded, positions=self.decoder_pos.layer(step, state), cross_mask=cross_mask,
                                 cache=cache), None
                finally:
                    block.self_attn.layer_idx = 0

            rows = position_signal(self.decoder_pos, h, offset=past)
            h, ponder, _, _ = self.decoder_act.loop(run_step, h, positions=rows)
            return self.decoder_norm(h), ponder
        for i, block in enumerate(self.decoder):
            h = block(h, encoded, positions=self.decoder_pos.layer(i, state), cross_mask=cross_mask, cache=cache)
        return self.decoder_norm(h), None

    def new_cache(self) -> DecoderCache:
        """An empty decoder cache for incremental decoding (txl.generate.seq2seq asks the model for it); a
        universal decoder keeps one self-attention slot per step."""
        return DecoderCache.empty(self.config.n_layer)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        decoder_input_ids: Tensor | None = None,
        labels: Tensor | None = None,
        *,
        encoded: Tensor | None = None,
        cache: DecoderCache | None = None,
        label_smoothing: float = 0.0,
    ) -> Seq2SeqOutput:
        """`encoded`: the encoder output of these sources (skips the encoder; `attention_mask` still
        masks cross-attention). `cache`: decode `decoder_input_ids` after the tokens it holds."""
        if decoder_input_ids is None:
            raise UsageError("decoder_input_ids is required (the target shifted right, start symbol first)")
        encoder_depth = None
        if encoded is None:
            encoded, encoder_depth = self._encode(input_ids, attention_mask)
        else:
            self.source_padding(input_ids, attention_mask)
        hidden, ponder = self._decode(decoder_input_ids, encoded, attention_mask=attention_mask, cache=cache)
        logits = self.output_logits(self.drop(hidden))  # (b, t, V)
        loss, nll = pair_loss(logits, labels, decoder_input_ids, label_smoothing)
        depth = aux_loss = None
        if ponder is not None:
            scored = (labels != -100) if labels is not None else torch.ones_like(ponder, dtype=torch.bool)
            depth = ponder[scored].mean() if bool(scored.any()) else ponder.mean()
            if self.training and self.config.ponder_cost:  # τ · mean ρ of both stacks joins the training loss
                aux_loss = self.config.ponder_cost * (depth if encoder_depth is None else depth + encoder_depth)
                if loss is not None:
                    loss = loss + aux_loss
        return Seq2SeqOutput(logits=logits, loss=loss, nll=nll, encoded=encoded, cache=cache, ponder_depth=depth,
                             encoder_ponder_depth=encoder_depth, aux_loss=aux_loss)

    def output_logits(self, hidden: Tensor) -> Tensor:
        """(.., d) final hidden states -> (.., V) logits."""
        weight = self.target_embed.weight if self.head is None else self.head.weight
        return F.linear(hidden, weight, self.head_bias)

    # ------------------------------------------------------------------------------------------
    def save_pretrained(self, directory) -> None:
        from txl.models.pretrained import save_model

        save_model(self, directory)

    @classmethod
    def from_pretrained(cls, directory, *, map_location="cpu", **overrides) -> EncoderDecoder:
        from txl.models.registry import load_model

        model = load_model(directory, map_location=map_location, **overrides)
        if not isinstance(model, cls):
            raise UsageError(f"{directory} holds a decoder-only model (arch='decoder'); load it with TransformerXL")
        return model

