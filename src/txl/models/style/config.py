"""The Style Transformer config (`arch = "style-transformer"`, Dai et al. 2019, arXiv 1905.05621): only what
`txl.models.style.model.StyleTransformer` and its training objective (`txl.train.style`) read.

Two networks: the style transfer network f(x, s), txl's encoder-decoder with a style embedding read as the
encoder's first position (the reference implementation, fastnlp/style-transformer, prepends it the same
way), and the discriminator d, a Transformer encoder over a learned class vector and the sentence (also the
style's embedding for the `conditional` discriminator: is x a real sentence of style s? the `multi`
discriminator tells the styles and "generated" apart, n_styles + 1 classes). The recipe that trains them
adversarially is part of the architecture, so its settings are fields here beside the shapes (the trainer
knows nothing of GANs): the loss weights, the soft-decoding temperature, the pre-training of f by
self-reconstruction alone and the alternation of discriminator and generator steps, with the paper's and
the reference's values as defaults.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from txl.errors import ConfigError, UsageError
from txl.models.configuration import ModelConfig, check_positive, check_probability, model_config
from txl.models.seq2seq.config import EncoderDecoderConfig
from txl.models.transformer_xl.config import (
    AttentionImpl,
    AttentionName,
    Backend,
    PositionalName,
    TransformerXLConfig,
)

Discriminator = Literal["conditional", "multi"]


@model_config("style-transformer")
class StyleTransformerConfig(ModelConfig):
    FAMILY: ClassVar[str] = "the Style Transformer"
    OPTION_FIELDS: ClassVar[dict[str, str]] = {"attention_options": "attention", "position_options": "position"}
    arch: Literal["style-transformer"] = "style-transformer"
    # --- styles and special ids (txl.data.style's vocabulary: <pad> 0, <s> 1, <eos> 2) ---------------
    vocab_size: int = 256
    n_styles: int = 2
    style_names: tuple[str, ...] = ()  # what `txl generate --style NAME` accepts (the corpus's names)
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    max_length: int = 21  # tokens a transfer decodes, <eos> included (the corpus's max_len + 1)
    # --- shape (the reference: 4 layers, d_model 256, 4 heads, pre-LN, no dropout) --------------------
    n_layer: int = 4  # decoder blocks of f
    n_encoder_layer: int = 0  # encoder blocks of f; 0 = n_layer
    n_discriminator_layer: int = 0  # encoder blocks of d; 0 = n_encoder_layer (else n_layer)
    d_model: int = 256
    n_head: int = 4
    d_head: int = 64
    d_inner: int = 1024
    dropout: float = 0.0
    dropatt: float = 0.0
    pre_lnorm: bool = True  # the reference's sub-layers normalise their input, and each stack ends in a norm
    pos_encoding: PositionalName = "sinusoidal"
    position_options: Any = None
    attention: AttentionName = "full"
    attention_options: Any = None
    attention_impl: AttentionImpl = "auto"
    backend: Backend = "auto"
    tie_weight: bool = True
    init_std: float = 0.02
    layer_norm_eps: float = 1e-6  # the reference's
    # --- discriminator ----------------------------------------------------------------------------
    discriminator: Discriminator = "multi"  # the reference's default ("Multi"); the paper reports both
    # --- training recipe (the reference's main.py values) -------------------------------------------
    self_factor: float = 0.25  # weight of the self-reconstruction loss -log p(x | x~, s)
    cycle_factor: float = 0.5  # weight of the cycle reconstruction loss -log p(x | f(x, s'), s)
    adversarial_factor: float = 1.0  # weight of the style loss -log d(s' | f(x, s'))
    temperature: float = 1.0  # softmax temperature of the soft (differentiable) decoding
    word_drop: float = 0.0  # probability of dropping each input word for the self-reconstruction (noise)
    pretrain_steps: int = 500  # steps of self-reconstruction alone before the adversarial training
    discriminator_steps: int = 10  # then, per round: this many discriminator steps ...
    generator_steps: int = 5  # ... and this many steps of f

    causal: ClassVar[bool] = True  # the decoder is left-to-right (a checkpoint's vocabulary check asks)
    mem_len: ClassVar[int] = 0

    def validate(self) -> None:
        check_positive(self, "vocab_size", "n_styles", "max_length", "n_layer", "d_model", "n_head", "d_head",
                       "d_inner", "discriminator_steps", "generator_steps")
        check_positive(self, "n_encoder_layer", "n_discriminator_layer", "pretrain_steps", "pad_id", "bos_id",
                       "eos_id", low=0)
        check_probability(self, "dropout", "dropatt", "word_drop")
        if self.n_styles < 2:
            raise ConfigError(f"config.n_styles must be >= 2 (style transfer is between styles), got {self.n_styles}")
        if self.style_names and len(self.style_names) != self.n_styles:
            raise ConfigError(f"config.style_names has {len(self.style_names)} names for n_styles={self.n_styles}")
        if len(set(self.style_names)) != len(self.style_names):
            raise ConfigError(f"config.style_names repeats a name: {list(self.style_names)}")
        for name in ("pad_id", "bos_id", "eos_id"):
            if getattr(self, name) >= self.vocab_size:
                raise ConfigError(f"config.{name}={getattr(self, name)} is outside vocab_size={self.vocab_size}")
        if len({self.pad_id, self.bos_id, self.eos_id}) < 3:
            raise ConfigError("config.pad_id, bos_id and eos_id must be three different ids")
        for name in ("self_factor", "cycle_factor", "adversarial_factor"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ConfigError(f"config.{name} must be a finite weight >= 0, got {getattr(self, name)}")
        if not 0 < self.temperature < math.inf:
            raise ConfigError(f"config.temperature must be > 0, got {self.temperature}")
        self.generator_config()  # the kernel and encoding can run the encoder-decoder (its own checks)

    # ------------------------------------------------------------------------------------------
    def generator_config(self) -> EncoderDecoderConfig:
        """The style transfer network's encoder-decoder (one vocabulary, shared embeddings)."""
        shared = {name: getattr(self, name) for name in (
            "vocab_size", "n_layer", "n_encoder_layer", "d_model", "n_head", "d_head", "d_inner", "dropout",
            "dropatt", "pre_lnorm", "pos_encoding", "position_options", "attention", "attention_options",
            "attention_impl", "backend", "tie_weight", "init_std", "layer_norm_eps")}
        return EncoderDecoderConfig(**shared, final_norm=True, share_embeddings=True)

    def discriminator_config(self) -> TransformerXLConfig:
        """The discriminator's blocks: bidirectional, without memory."""
        layers = self.n_discriminator_layer or self.n_encoder_layer or self.n_layer
        return self.generator_config().encoder_config().replace(n_layer=layers)

    def num_parameters_estimate(self) -> int:
        """A lower bound of the non-embedding parameter count: the encoder-decoder's and the discriminator's
        blocks (checkpoint loading compares it with the file's size)."""
        layers = self.n_discriminator_layer or self.n_encoder_layer or self.n_layer
        block = 4 * self.d_model * self.n_head * self.d_head + 2 * self.d_model * self.d_inner
        return self.generator_config().num_parameters_estimate() + layers * block

    @property
    def n_classes(self) -> int:
        """The discriminator's outputs: real/fake (conditional) or 'generated' + each style (multi)."""
        return 2 if self.discriminator == "conditional" else self.n_styles + 1

    def style_index(self, style: str) -> int:
        """A style's index from its name (or its index as text)."""
        if style in self.style_names:
            return self.style_names.index(style)
        if style.isdigit() and int(style) < self.n_styles:
            return int(style)
        known = ", ".join(self.style_names) if self.style_names else f"0..{self.n_styles - 1}"
        raise UsageError(f"unknown style {style!r}; this model knows {known}")


__all__ = ["StyleTransformerConfig"]
