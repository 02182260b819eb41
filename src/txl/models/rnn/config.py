"""The recurrent LMs' config (`arch = "lstm" | "sha-rnn"`): only what `txl.models.rnn.model.RecurrentLM`
reads. lstm = AWD-LSTM (Merity et al. 2018), sha-rnn = SHA-RNN (Merity 2019).

n_layer LSTMs; d_model = the embedding and softmax width; d_inner = the LSTM width of all but the last
layer (lstm) or the Boom width (sha-rnn); mem_len = sha-rnn's attention memory (0: nothing carried
across segments); dropout on the output. A Transformer setting (heads, attention kernels, positions...)
is not a field, and a field only sha-rnn reads (dropatt, layer_norm_eps, rnn_attention) is refused for
lstm when set: `config.n_head does not apply to arch='lstm' (the recurrent LM reads only ...); remove it`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

from txl.errors import ConfigError
from txl.models.configuration import ModelConfig, check_positive, check_probability, model_config

RNN_ARCHS = ("lstm", "sha-rnn")
RNNAttention = Literal["penultimate", "all"]
SHA_ONLY = ("dropatt", "layer_norm_eps", "rnn_attention")  # what lstm does not read


@model_config("lstm", "sha-rnn")
class RecurrentConfig(ModelConfig):
    FAMILY: ClassVar[str] = "the recurrent LM"
    REGISTRY_FIELDS: ClassVar[tuple[str, ...]] = ()
    arch: Literal["lstm", "sha-rnn"] = "lstm"
    vocab_size: int = 256
    n_layer: int = 12
    d_model: int = 512
    d_inner: int = 2048
    dropout: float = 0.1  # on the output
    dropatt: float = 0.0  # sha-rnn: on the attention probabilities
    mem_len: int = 512  # sha-rnn: attention memory; lstm: carried hidden state only
    tie_weight: bool = True
    layer_norm_eps: float = 1e-5  # sha-rnn
    # AWD-LSTM's dropoute/dropouti/dropouth/wdrop (txl/nn/regularization.py)
    dropout_embed: float = 0.0  # whole-word dropout: a dropped word's embedding is zero everywhere in the batch
    dropout_input: float = 0.0  # locked (variational) dropout on the embeddings: one mask per sequence
    dropout_hidden: float = 0.0  # lstm: locked dropout between layers; sha-rnn: dropout inside the blocks
    weight_drop: float = 0.0  # DropConnect on the LSTM hidden-to-hidden matrices (training only)
    rnn_attention: RNNAttention = "penultimate"  # sha-rnn: attention on the penultimate block (the paper) or all

    causal: ClassVar[bool] = True  # a left-to-right LM (what generic code asks of a config)

    @classmethod
    def reads(cls, arch: str) -> list[str]:
        return [name for name in cls.field_names() if name != "arch" and not (arch == "lstm" and name in SHA_ONLY)]

    @classmethod
    def unknown_key(cls, key: Any, given: dict[str, Any]) -> str:
        arch = given.get("arch", "lstm")
        arch = arch if arch in RNN_ARCHS else "lstm"
        message = super().unknown_key(key, given)
        if message.startswith("unknown config key"):
            return message
        return (f"config.{key} does not apply to arch={arch!r} (the recurrent LM reads only "
                f"{', '.join(sorted(cls.reads(arch)))}); remove it")

    def validate(self) -> None:
        check_positive(self, "vocab_size", "n_layer", "d_model", "d_inner")
        check_positive(self, "mem_len", low=0)
        check_probability(self, "dropout", "dropatt", "dropout_embed", "dropout_input", "dropout_hidden", "weight_drop")
        if not 0 < self.layer_norm_eps < float("inf"):
            raise ConfigError(f"config.layer_norm_eps must be > 0, got {self.layer_norm_eps}")
        if self.arch == "lstm":
            for f in dataclasses.fields(self):
                if f.name in SHA_ONLY and getattr(self, f.name) != f.default:
                    raise ConfigError(f"config.{f.name} does not apply to arch='lstm' (the recurrent LM reads only "
                                      f"{', '.join(sorted(self.reads('lstm')))}); remove it")
        if self.arch == "sha-rnn" and self.d_inner % self.d_model:
            raise ConfigError(f"config.d_inner must be a multiple of d_model with arch='sha-rnn' (the Boom sums "
                              f"d_inner/d_model chunks back to d_model), got {self.d_inner} and {self.d_model}")

    def num_parameters_estimate(self) -> int:
        """Exactly `txl.models.rnn.model.RecurrentLM(self).num_parameters(exclude_embeddings=True)`."""
        d, n = self.d_model, self.n_layer

        def lstm(inputs: int, hidden: int) -> int:  # W_ih, W_hh, two biases
            return 4 * hidden * (inputs + hidden) + 8 * hidden

        if self.arch == "lstm":
            sizes = [self.d_inner] * (n - 1) + [d]
            return sum(lstm(i, o) for i, o in zip([d] + sizes[:-1], sizes))
        # q projection + its LayerNorm, three gates, the value over-parameterisation, ln_mem, ln_mid
        attention = (d * d + d) + 2 * d + 3 * d + (2 * d * d + 2 * d) + 2 * 2 * d
        blocks_with_attention = n if self.rnn_attention == "all" else 1
        # ln_start, LSTM, ln_ff, ln_xff, Boom's up-projection
        block = 2 * d + lstm(d, d) + 2 * 2 * d + (d * self.d_inner + self.d_inner)
        return n * block + blocks_with_attention * attention


__all__ = ["RNN_ARCHS", "RecurrentConfig"]
