"""The encoder–decoder config (`arch = "encoder-decoder"`, Vaswani et al. 2017): only what
`txl.models.seq2seq.model.EncoderDecoder` reads.

n_layer decoder blocks with cross-attention over n_encoder_layer bidirectional blocks, both on the LM's
blocks, so the attention kernel and positional encoding (with their options) are chosen as for the
decoder, and the block options (norm, ffn, n_kv_head, qk_norm) apply to both stacks. `universal = true`
makes it the Universal Transformer encoder-decoder (Dehghani et al. 2019: each stack one shared block with
ACT halting, `act_type`, `universal_signals`; txl.models.transformer_xl.universal). It has no segment memory,
no adaptive or sampled softmax, no compressive memory, no recurrence variant, no reversible or gated blocks
and none of their settings: giving one is refused in one line that names it (`config.same_length only
applies to arch='decoder'; the encoder-decoder has no such option: remove it`); tests/test_universal.py
checks every field of TransformerXLConfig is either honoured here or refused. `encoder_config()` and
`decoder_config()` are the `TransformerXLConfig` views its two stacks are built from.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from txl.errors import ConfigError
from txl.models.configuration import ModelConfig, check_positive, check_probability, model_config
from txl.models.transformer_xl.config import (
    AttentionImpl,
    AttentionName,
    Backend,
    FeedForwardName,
    NormName,
    PositionalName,
    TransformerXLConfig,
)

# The old single config's checks for the encoder-decoder, kept as its messages for these keys.
_NOT_HERE = {
    "mem_len": "config.mem_len must be 0 with arch='encoder-decoder' (no segment memory)",
    "cmem_len": "config.cmem_len must be 0 with arch='encoder-decoder' (no segment memory)",
    "memory_tokens": "config.memory_tokens must be 0 with arch='encoder-decoder' (no segment memory)",
    "cutoffs": "config.cutoffs (adaptive softmax) does not apply to arch='encoder-decoder'",
    "causal": ("config.causal must be true with arch='encoder-decoder' (its decoder is causal, its encoder "
               "bidirectional by construction)"),
}


@model_config("encoder-decoder")
class EncoderDecoderConfig(ModelConfig):
    FAMILY: ClassVar[str] = "the encoder-decoder"
    OPTION_FIELDS: ClassVar[dict[str, str]] = {"attention_options": "attention", "position_options": "position"}
    arch: Literal["encoder-decoder"] = "encoder-decoder"
    # --- shape --------------------------------------------------------------------------------
    vocab_size: int = 256  # target ids
    source_vocab_size: int = 0  # source ids; 0 = one vocabulary shared with the target (vocab_size)
    share_embeddings: bool = True  # one vocabulary: source and target read one embedding table
    n_layer: int = 12  # decoder blocks
    n_encoder_layer: int = 0  # encoder blocks; 0 = n_layer
    d_model: int = 512
    n_head: int = 8
    d_head: int = 64
    d_inner: int = 2048
    # --- regularisation -----------------------------------------------------------------------
    dropout: float = 0.1
    dropatt: float = 0.0
    # --- blocks -------------------------------------------------------------------------------
    pre_lnorm: bool = False  # post-LN as the paper
    final_norm: bool = True  # with pre_lnorm: a final LayerNorm on both stacks
    pos_encoding: PositionalName = "sinusoidal"  # as the paper; learned, rope, t5, shaw run bidirectionally too
    position_options: Any = None  # the encoding's options (a dict; txl/nn/positional.py)
    attention: AttentionName = "full"
    attention_options: Any = None  # the kernel's options (a dict; txl/nn/attention/)
    attention_impl: AttentionImpl = "auto"
    backend: Backend = "auto"
    tie_weight: bool = True  # the output layer reads the target embedding (Press & Wolf 2017)
    # --- block options (as the decoder LM's, docs/guide/models.md "Block options"): both stacks -------------
    norm: NormName = "layernorm"  # every block norm and the final ones; rmsnorm: x / rms(x) * g
    ffn: FeedForwardName = "relu"  # relu (the paper) | gelu | swiglu | geglu
    n_kv_head: int | None = None  # key/value heads of every attention (grouped-query); None = n_head
    qk_norm: bool = False  # RMSNorm of q and k per head before the scores
    # --- Universal Transformer encoder-decoder (Dehghani et al. 2019; txl.models.transformer_xl.universal) -----
    # each stack becomes one shared block applied for up to its depth (n_encoder_layer or n_layer; n_layer)
    # steps with ACT halting per position, as tensor2tensor's universal_transformer
    universal: bool = False
    act_threshold: float = 0.99  # a position halts once its summed halting probability reaches this
    ponder_cost: float = 0.01  # τ: weight of both stacks' ponder cost (steps + remainder) in the training loss
    act_type: Literal["basic", "accumulated"] = "basic"  # t2t's: interpolated state | weighted sum of the steps
    universal_signals: Literal["every-step", "after-first"] = "every-step"  # timestep + position before every step
    init_std: float = 0.02  # positional parameters (the rest: Xavier, as tensor2tensor and fairseq)
    layer_norm_eps: float = 1e-5

    # Facts of the architecture, not options (what code serving every architecture asks of a config):
    causal: ClassVar[bool] = True  # its decoder is a left-to-right LM
    mem_len: ClassVar[int] = 0  # no segment memory

    @classmethod
    def unknown_key(cls, key: Any, given: dict[str, Any]) -> str:
        if key in _NOT_HERE:
            return f"{_NOT_HERE[key]}: the encoder-decoder has no such option; remove it"
        return super().unknown_key(key, given)

    def validate(self) -> None:
        check_positive(self, "vocab_size", "n_layer", "d_model", "n_head", "d_head", "d_inner")
        check_positive(self, "n_encoder_layer", "source_vocab_size", low=0)
        check_probability(self, "dropout", "dropatt")
        for name in ["init_std", "layer_norm_eps"]:
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"config.{name} must be > 0, got {getattr(self, name)}")
        from txl.nn.attention.registry import SPECS
        from txl.nn.positional import POSITIONAL_ENCODINGS  # torch: only once a config is built

        if POSITIONAL_ENCODINGS[self.pos_encoding].causal_only:
            allowed = ", ".join(name for name, cls in POSITIONAL_ENCODINGS.items() if not cls.causal_only)
            raise ConfigError(f"config.pos_encoding={self.pos_encoding!r} is defined for causal distances only; "
                              f"the encoder of arch='encoder-decoder' is bidirectional: use one of {allowed}")
        if not (SPECS[self.attention].bidirectional and SPECS[self.attention].cross_attention):
            able = ", ".join(sorted(name for name, spec in SPECS.items()
                                    if spec.bidirectional and spec.causal and spec.cross_attention))
            raise ConfigError(f"config.attention={self.attention!r} cannot run the bidirectional encoder and "
                              f"cross-attention of arch='encoder-decoder'; use one of {able}")
        if self.share_embeddings and self.source_vocab_size not in (0, self.vocab_size):
            raise ConfigError(f"config.share_embeddings needs one vocabulary, but source_vocab_size="
                              f"{self.source_vocab_size} != vocab_size={self.vocab_size}; set share_embeddings=false")
        self.encoder_config()  # the kernel and encoding can run both stacks
        self.decoder_config()

    # ------------------------------------------------------------------------------------------
    def _view(self, **changes: Any) -> TransformerXLConfig:
        shared = {name: getattr(self, name) for name in (
            "vocab_size", "d_model", "n_head", "d_head", "d_inner", "dropout", "dropatt", "pre_lnorm", "final_norm",
            "pos_encoding", "position_options", "attention", "attention_options", "attention_impl", "backend",
            "tie_weight", "init_std", "layer_norm_eps", "norm", "ffn", "n_kv_head", "qk_norm", "universal",
            "act_threshold", "ponder_cost", "act_type", "universal_signals")}
        return TransformerXLConfig(**shared, mem_len=0, **changes)

    def encoder_config(self) -> TransformerXLConfig:
        """The encoder's blocks: the LM's own, bidirectional and without memory."""
        return self._view(causal=False, n_layer=self.n_encoder_layer or self.n_layer)

    def decoder_config(self) -> TransformerXLConfig:
        """The decoder's self-attention and positions: causal, without memory (cross-attention beside)."""
        return self._view(causal=True, n_layer=self.n_layer)

    def num_parameters_estimate(self) -> int:
        """A lower bound of the non-embedding parameter count (see TransformerXLConfig's); universal: one
        block per stack, whatever the depth."""
        attention = 4 * self.d_model * self.n_head * self.d_head
        ffn = 2 * self.d_model * self.d_inner
        encoder, decoder = (1, 1) if self.universal else (self.n_encoder_layer or self.n_layer, self.n_layer)
        return encoder * (attention + ffn) + decoder * (2 * attention + ffn)


__all__ = ["EncoderDecoderConfig"]
