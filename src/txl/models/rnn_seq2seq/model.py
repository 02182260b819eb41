"""The RNN encoder-decoder with attention (Bahdanau et al. 2015, arXiv 1409.0473; Luong et al. 2015,
arXiv 1508.04025), the model seed 003's Attention_study describes and the Transformer replaced.

Reads top to bottom: source embedding -> a (bidirectional) LSTM/GRU encoder over the real tokens only
(packed: padding never enters a state) -> the decoder's initial state, tanh of a projection of the encoder's
final states (the forward direction's at the last real token, the backward one's at the first) -> per target
step: the decoder RNN, the alignment scores of its state against every encoder output (dot, general or
additive; padding masked out), their softmax, the context vector, the attentional vector h~ = tanh(W_c [..]),
and the logits W_out h~. The step order is Luong's (RNN, then attention from the new state, h~ fed to the
next step's input) or Bahdanau's (attention from the previous state, the context fed to the RNN).
`txl.models.rnn_seq2seq.config` has the formulas.

The model keeps the encoder-decoder's contract (`encode`, `decode`, `output_logits`, `new_cache`, the
forward's arguments and `Seq2SeqOutput`), so `txl train`, `txl eval`, `txl generate` and the decoding of
`txl.generate.seq2seq` (greedy, beam search, sampling) run it as they run the Transformer. Its decoding
cache (`RNNDecoderCache`) is the recurrent state, the fed vector and the projected encoder keys.

Dimension names: b batch, s source length, t target length, d d_model, H d_hidden, L decoder layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from txl.errors import ConfigError, UsageError
from txl.models.rnn_seq2seq.config import RNNSeq2SeqConfig
from txl.models.seq2seq.model import Seq2SeqOutput, pair_loss

RecurrentState = Tensor | tuple[Tensor, Tensor]  # GRU: h (L, b, H); LSTM: (h, c)


@dataclass
class RNNDecoderCache:
    """What incremental decoding carries from step to step (pass it back as `cache=`): the decoder's
    recurrent state, the vector fed to the next step (Luong: h~_{t-1}), the encoder outputs projected for the
    alignment (computed at the first step) and the number of target tokens read so far."""

    state: RecurrentState | None = None
    feed: Tensor | None = None  # (b, d)
    keys: Tensor | None = None  # (b, s, H)
    length: int = 0

    def _map(self, fn) -> RNNDecoderCache:
        state = self.state
        if state is not None:  # the batch is dim 1 of a recurrent state
            state = tuple(fn(s, 1) for s in state) if isinstance(state, tuple) else fn(state, 1)
        return RNNDecoderCache(state, None if self.feed is None else fn(self.feed, 0),
                               None if self.keys is None else fn(self.keys, 0), self.length)

    def reorder(self, index: Tensor) -> None:
        """Keep rows `index` of the batch (beam search), in that order (in place)."""
        picked = self._map(lambda t, dim: t.index_select(dim, index))
        self.state, self.feed, self.keys = picked.state, picked.feed, picked.keys

    def select(self, index: Tensor) -> RNNDecoderCache:
        """Rows `index` of the batch, in that order, as a new cache (this one unchanged)."""
        return self._map(lambda t, dim: t.index_select(dim, index))


class Alignment(nn.Module):
    """score(h, s) for a decoder state h (b, H) against encoder outputs s (b, s, H): dot, general, additive.
    `keys(encoded)` is the part that depends on the source only (computed once per source)."""

    def __init__(self, kind: str, hidden: int):
        super().__init__()
        self.kind = kind
        self.w_a = nn.Linear(hidden, hidden, bias=False) if kind == "general" else None
        if kind == "additive":
            self.w_q = nn.Linear(hidden, hidden)
            self.w_k = nn.Linear(hidden, hidden, bias=False)
            self.v = nn.Linear(hidden, 1, bias=False)

    def keys(self, encoded: Tensor) -> Tensor:
        if self.kind == "general":
            return self.w_a(encoded)  # W_a s: then h·(W_a s) is a dot product
        if self.kind == "additive":
            return self.w_k(encoded)
        return encoded

    def forward(self, query: Tensor, keys: Tensor) -> Tensor:
        """query (b, H), keys (b, s, H) -> scores (b, s)."""
        if self.kind == "additive":
            return self.v(torch.tanh(self.w_q(query)[:, None, :] + keys)).squeeze(-1)
        return torch.einsum("bh,bsh->bs", query, keys)


class RNNEncoderDecoder(nn.Module):
    """`out = model(input_ids, attention_mask=, decoder_input_ids=, labels=)`, as `EncoderDecoder`.

    input_ids (b, s) the source; attention_mask (b, s) 1 for a token, 0 for padding (right padding; None =
    no padding); decoder_input_ids (b, t) the target shifted right (start symbol first: teacher forcing);
    labels (b, t) the next target token at each position, -100 = not scored.
    """

    def __init__(self, config: RNNSeq2SeqConfig):
        super().__init__()
        if config.arch != "rnn-seq2seq":
            raise ConfigError(f"RNNEncoderDecoder needs config.arch='rnn-seq2seq', got {config.arch!r}")
        self.config = config
        d, h = config.d_model, config.d_hidden
        rnn = nn.LSTM if config.cell == "lstm" else nn.GRU
        self.target_embed = nn.Embedding(config.vocab_size, d)
        shared = config.share_embeddings and config.source_vocab_size in (0, config.vocab_size)
        self.source_embed = None if shared else nn.Embedding(config.source_vocab_size or config.vocab_size, d)
        self.drop = nn.Dropout(config.dropout)
        n_encoder = config.n_encoder_layer or config.n_layer
        directions = 2 if config.bidirectional else 1
        self.encoder = rnn(d, h // directions, num_layers=n_encoder, bidirectional=config.bidirectional,
                           batch_first=True, dropout=config.dropout if n_encoder > 1 else 0.0)
        # the bridge: encoder summary (b, H) -> the decoder's initial h (and c) of every layer
        self.bridge_h = nn.Linear(h, h * config.n_layer)
        self.bridge_c = nn.Linear(h, h * config.n_layer) if config.cell == "lstm" else None
        step_input = 2 * d if config.decoder_flow == "luong" else d + h
        self.decoder = rnn(step_input, h, num_layers=config.n_layer, batch_first=True,
                           dropout=config.dropout if config.n_layer > 1 else 0.0)
        self.alignment = Alignment(config.alignment, h)
        self.combine = nn.Linear(2 * h + (d if config.decoder_flow == "bahdanau" else 0), d)  # W_c -> h~
        self.head = None if config.tie_weight else nn.Linear(d, config.vocab_size, bias=False)
        self.head_bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.reset_parameters()

    @property
    def source_embedding(self) -> nn.Embedding:
        return self.target_embed if self.source_embed is None else self.source_embed

    def reset_parameters(self) -> None:
        """Every weight uniform in [-init_range, init_range] (Luong et al. 2015; OpenNMT's param_init), the
        output bias 0."""
        for param in self.parameters():
            nn.init.uniform_(param, -self.config.init_range, self.config.init_range)
        nn.init.zeros_(self.head_bias)

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        params = {id(p): p for p in self.parameters()}
        if exclude_embeddings:
            for module in (self.target_embed, self.source_embed):
                for p in module.parameters() if module is not None else ():
                    params.pop(id(p), None)
        return sum(p.numel() for p in params.values())

    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _embed(table: nn.Embedding, ids: Tensor) -> Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= table.num_embeddings):
            bad = int(ids.max()) if int(ids.max()) >= 0 else int(ids.min())
            raise UsageError(f"token id {bad} is outside the vocabulary of {table.num_embeddings} ids")
        return table(ids)

    @staticmethod
    def source_lengths(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
        """(b,) the number of real tokens per source row, checked: padding only on the right, no empty row."""
        if input_ids.dim() != 2:
            raise UsageError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
        if input_ids.shape[1] == 0:
            raise UsageError("the source is empty (length 0): attention needs at least one source token")
        if attention_mask is None:
            return torch.full((input_ids.shape[0],), input_ids.shape[1], dtype=torch.long)
        if attention_mask.shape != input_ids.shape:
            raise UsageError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                             f"got {tuple(attention_mask.shape)}")
        real = (attention_mask != 0).cpu()
        lengths = real.sum(dim=1)
        empty = (lengths == 0).nonzero()
        if len(empty):
            raise UsageError(f"source row {int(empty[0])} is all padding (attention_mask all 0): attention would "
                             "have no key to attend to; drop empty sources from the batch")
        prefix = torch.arange(real.shape[1])[None, :] < lengths[:, None]
        if not bool((prefix == real).all()):
            raise UsageError("attention_mask must mark each source's tokens first and its padding after them "
                             "(right padding): the RNN encoder reads each row up to its length")
        return lengths

    def encode(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """(b, s) source ids -> (b, s, H) encoder outputs (zeros on padding: no query reads them)."""
        lengths = self.source_lengths(input_ids, attention_mask)
        x = self.drop(self._embed(self.source_embedding, input_ids))
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.encoder(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=input_ids.shape[1])
        return out

    def _initial_state(self, encoded: Tensor, lengths: Tensor) -> RecurrentState:
        """tanh(W [forward state at the last real token; backward state at the first]) per decoder layer."""
        rows = torch.arange(encoded.shape[0], device=encoded.device)
        last = encoded[rows, (lengths - 1).to(encoded.device)]  # (b, H)
        if self.config.bidirectional:
            half = encoded.shape[-1] // 2
            summary = torch.cat([last[:, :half], encoded[:, 0, half:]], dim=-1)
        else:
            summary = last
        layers, b, h = self.config.n_layer, encoded.shape[0], self.config.d_hidden

        def per_layer(x: Tensor) -> Tensor:  # (b, L·H) -> (L, b, H)
            return x.view(b, layers, h).transpose(0, 1).contiguous()

        h0 = per_layer(torch.tanh(self.bridge_h(summary)))
        if self.bridge_c is None:
            return h0
        return h0, per_layer(self.bridge_c(summary))

    def decode(self, decoder_input_ids: Tensor, encoded: Tensor, *, attention_mask: Tensor | None = None,
               cache: RNNDecoderCache | None = None, record: list[Tensor] | None = None) -> Tensor:
        """(b, t) target ids (the continuation of `cache`, if given) -> (b, t, d) attentional vectors h~.
        `record`: a list that receives each step's attention weights (b, s)."""
        if decoder_input_ids.dim() != 2:
            raise UsageError(f"decoder_input_ids must be (batch, length), got shape {tuple(decoder_input_ids.shape)}")
        if encoded.shape[0] != decoder_input_ids.shape[0]:
            raise UsageError(f"the encoder output holds batch {encoded.shape[0]} but decoder_input_ids has batch "
                             f"{decoder_input_ids.shape[0]}")
        b = encoded.shape[0]
        mask = None if attention_mask is None else attention_mask.to(encoded.device) != 0
        if mask is not None and bool(mask.all()):
            mask = None
        if cache is not None and cache.state is not None:
            state, feed, keys = cache.state, cache.feed, cache.keys
        else:
            lengths = torch.full((b,), encoded.shape[1], dtype=torch.long) if mask is None else mask.sum(1).cpu()
            state = self._initial_state(encoded, lengths)
            feed = encoded.new_zeros(b, self.config.d_model)
            keys = self.alignment.keys(encoded)
        emb = self.drop(self._embed(self.target_embed, decoder_input_ids))  # (b, t, d)
        luong = self.config.decoder_flow == "luong"
        outputs = []
        for step in range(decoder_input_ids.shape[1]):
            y = emb[:, step]
            if luong:  # RNN on [y; h~_{t-1}], then attention from its output h_t
                top, state = self.decoder(torch.cat([y, feed], dim=-1)[:, None], state)
                top = top[:, 0]
                context = self._attend(top, keys, encoded, mask, record)
                feed = torch.tanh(self.combine(torch.cat([context, top], dim=-1)))
            else:  # attention from h_{t-1} (the top layer's state), then RNN on [y; c_t]
                previous = state[0][-1] if isinstance(state, tuple) else state[-1]
                context = self._attend(previous, keys, encoded, mask, record)
                top, state = self.decoder(torch.cat([y, context], dim=-1)[:, None], state)
                feed = torch.tanh(self.combine(torch.cat([context, top[:, 0], y], dim=-1)))
            outputs.append(feed)
        if cache is not None:
            cache.state, cache.feed, cache.keys = state, feed, keys
            cache.length += decoder_input_ids.shape[1]
        if not outputs:
            return encoded.new_zeros(b, 0, self.config.d_model)
        return torch.stack(outputs, dim=1)

    def _attend(self, query: Tensor, keys: Tensor, encoded: Tensor, mask: Tensor | None,
                record: list[Tensor] | None) -> Tensor:
        """The context vector (b, H): the encoder outputs weighted by the softmax of the alignment scores
        (appended to `record` when given)."""
        scores = self.alignment(query, keys).float()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = scores.softmax(dim=-1)
        if record is not None:
            record.append(weights)
        return torch.einsum("bs,bsh->bh", weights.to(encoded.dtype), encoded)

    def attention_weights(self, input_ids: Tensor, decoder_input_ids: Tensor,
                          attention_mask: Tensor | None = None) -> Tensor:
        """(b, t, s) the alignment of every target step over the source (teacher-forced), for inspection."""
        record: list[Tensor] = []
        encoded = self.encode(input_ids, attention_mask)
        self.decode(decoder_input_ids, encoded, attention_mask=attention_mask, record=record)
        return torch.stack(record, dim=1)

    def new_cache(self) -> RNNDecoderCache:
        """An empty decoding cache (txl.generate.seq2seq asks the model for it)."""
        return RNNDecoderCache()

    def output_logits(self, hidden: Tensor) -> Tensor:
        """(.., d) attentional vectors -> (.., V) logits."""
        weight = self.target_embed.weight if self.head is None else self.head.weight
        return F.linear(hidden, weight, self.head_bias)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        decoder_input_ids: Tensor | None = None,
        labels: Tensor | None = None,
        *,
        encoded: Tensor | None = None,
        cache: RNNDecoderCache | None = None,
        label_smoothing: float = 0.0,
    ) -> Seq2SeqOutput:
        """`encoded`: the encoder output of these sources (skips the encoder). `cache`: decode
        `decoder_input_ids` after the tokens it holds."""
        if decoder_input_ids is None:
            raise UsageError("decoder_input_ids is required (the target shifted right, start symbol first)")
        if encoded is None:
            encoded = self.encode(input_ids, attention_mask)
        else:
            self.source_lengths(input_ids, attention_mask)
        hidden = self.decode(decoder_input_ids, encoded, attention_mask=attention_mask, cache=cache)
        logits = self.output_logits(self.drop(hidden))  # (b, t, V)
        loss, nll = pair_loss(logits, labels, decoder_input_ids, label_smoothing)
        return Seq2SeqOutput(logits=logits, loss=loss, nll=nll, encoded=encoded, cache=cache)

    # ------------------------------------------------------------------------------------------
    def save_pretrained(self, directory) -> None:
        from txl.models.pretrained import save_model

        save_model(self, directory)

    @classmethod
    def from_pretrained(cls, directory, *, map_location="cpu", **overrides) -> RNNEncoderDecoder:
        from txl.models.registry import load_model

        model = load_model(directory, map_location=map_location, **overrides)
        if not isinstance(model, cls):
            raise UsageError(f"{directory} holds arch={model.config.arch!r}, not an RNN encoder-decoder")
        return model


__all__ = ["Alignment", "RNNDecoderCache", "RNNEncoderDecoder"]
