"""The RNN encoder-decoder config (`arch = "rnn-seq2seq"`): only what
`txl.models.rnn_seq2seq.model.RNNEncoderDecoder` reads.

The attention-based RNN translation model the Transformer replaced (Bahdanau et al. 2015, Luong et al. 2015;
seed 003's Attention_study): a bidirectional LSTM or GRU encoder (`cell`, `bidirectional`; d_hidden/2 per
direction, so its outputs are d_hidden wide), an RNN decoder of `n_layer` layers whose initial state is a
projection of the encoder's final states, and at every target step an alignment score between the decoder
state and each encoder output (`alignment`):

    dot       score(h, s) = h·s                         (Luong)
    general   score(h, s) = h·(W_a s)                   (Luong's bilinear form)
    additive  score(h, s) = v·tanh(W_q h + W_k s)       (Bahdanau's; Luong's concat v·tanh(W[h; s]) is the same
                                                         with W = [W_q W_k])

softmax over the real source tokens -> the context c = Σ a·s. `decoder_flow` chooses the step order:
`luong` (the RNN steps on [y_{t-1}; h~_{t-1}] (input feeding), then attends from its new state h_t,
h~_t = tanh(W_c [c_t; h_t])) or `bahdanau` (attends from the previous state h_{t-1}, then steps on
[y_{t-1}; c_t], h~_t = tanh(W_c [c_t; h_t; y_{t-1}])). The logits are W_out h~_t (tied to the target embedding
when `tie_weight`: h~ is d_model wide). Transformer settings (heads, attention kernels, positions, memory) are
not fields: giving one is refused by name.
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal

from txl.errors import ConfigError
from txl.models.configuration import ModelConfig, check_positive, check_probability, model_config

Alignment = Literal["dot", "general", "additive"]
Cell = Literal["lstm", "gru"]
DecoderFlow = Literal["luong", "bahdanau"]


@model_config("rnn-seq2seq")
class RNNSeq2SeqConfig(ModelConfig):
    FAMILY: ClassVar[str] = "the RNN encoder-decoder"
    REGISTRY_FIELDS: ClassVar[tuple[str, ...]] = ()
    arch: Literal["rnn-seq2seq"] = "rnn-seq2seq"
    # --- shape --------------------------------------------------------------------------------
    vocab_size: int = 256  # target ids
    source_vocab_size: int = 0  # source ids; 0 = one vocabulary shared with the target (vocab_size)
    share_embeddings: bool = True  # one vocabulary: source and target read one embedding table
    n_layer: int = 2  # decoder RNN layers
    n_encoder_layer: int = 0  # encoder RNN layers; 0 = n_layer
    d_model: int = 256  # embedding width (and the attentional vector h~ that the output layer reads)
    d_hidden: int = 512  # RNN state width: the decoder's, and the encoder's outputs (d_hidden/2 per direction)
    cell: Cell = "lstm"  # the encoder's and the decoder's recurrent cell
    bidirectional: bool = True  # the encoder reads the source both ways
    # --- attention ----------------------------------------------------------------------------
    alignment: Alignment = "general"
    decoder_flow: DecoderFlow = "luong"
    # --- regularisation and init --------------------------------------------------------------
    dropout: float = 0.1  # on the embeddings, between RNN layers, and on h~ before the output layer
    tie_weight: bool = True  # the output layer reads the target embedding (Press & Wolf 2017)
    init_range: float = 0.1  # every weight uniform in [-init_range, init_range] (Luong et al. 2015, OpenNMT)

    # Facts of the architecture, not options (what code serving every architecture asks of a config):
    causal: ClassVar[bool] = True  # its decoder is a left-to-right LM
    mem_len: ClassVar[int] = 0  # no segment memory

    def validate(self) -> None:
        check_positive(self, "vocab_size", "n_layer", "d_model", "d_hidden")
        check_positive(self, "n_encoder_layer", "source_vocab_size", low=0)
        check_probability(self, "dropout")
        if self.bidirectional and self.d_hidden % 2:
            raise ConfigError(f"config.d_hidden must be even with bidirectional=true (d_hidden/2 per direction), "
                              f"got {self.d_hidden}")
        if not 0 < self.init_range < math.inf:
            raise ConfigError(f"config.init_range must be > 0, got {self.init_range}")
        if self.share_embeddings and self.source_vocab_size not in (0, self.vocab_size):
            raise ConfigError(f"config.share_embeddings needs one vocabulary, but source_vocab_size="
                              f"{self.source_vocab_size} != vocab_size={self.vocab_size}; set share_embeddings=false")

    def num_parameters_estimate(self) -> int:
        """Exactly `RNNEncoderDecoder(self).num_parameters(exclude_embeddings=True)` (the output bias included)."""
        gates = 4 if self.cell == "lstm" else 3
        h, d = self.d_hidden, self.d_model

        def rnn(inputs: int, hidden: int, layers: int, directions: int) -> int:
            first = gates * hidden * (inputs + hidden) + 2 * gates * hidden
            rest = gates * hidden * (hidden * directions + hidden) + 2 * gates * hidden
            return directions * (first + (layers - 1) * rest)

        directions = 2 if self.bidirectional else 1
        encoder = rnn(d, h // directions, self.n_encoder_layer or self.n_layer, directions)
        decoder = rnn(2 * d if self.decoder_flow == "luong" else d + h, h, self.n_layer, 1)
        bridge = (h * h + h) * self.n_layer * (2 if self.cell == "lstm" else 1)
        align = {"dot": 0, "general": h * h, "additive": 2 * h * h + h + h}[self.alignment]
        combine = (2 * h + (d if self.decoder_flow == "bahdanau" else 0)) * d + d
        head = (0 if self.tie_weight else d * self.vocab_size) + self.vocab_size
        return encoder + decoder + bridge + align + combine + head


__all__ = ["RNNSeq2SeqConfig"]
