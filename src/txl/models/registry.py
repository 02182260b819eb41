"""Architectures by name: `arch` -> (config class, model class), as Hugging Face's `model_type`.

    config = config_from_dict({"arch": "lstm", "n_layer": 2})   # the old flat shape is migrated too
    model = build_model(config)                                  # ModelClass(config)
    model = load_model("runs/x/best")                            # config.json + model.safetensors

Config classes are imported here (no torch); model classes and the checkpoint files on first use. Each model chooses its
backend in its own constructor, so `build_model` is only `ModelClass(config)`. A new architecture
registers its config with `@model_config(...)` (txl.models.configuration) and its model here.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from txl.errors import CheckpointError, ConfigError
from txl.models.configuration import CONFIGS, ModelConfig, quoted
from txl.models.migration import migrate
from txl.models.rnn.config import RecurrentConfig
from txl.models.rnn_seq2seq.config import RNNSeq2SeqConfig
from txl.models.seq2seq.config import EncoderDecoderConfig
from txl.models.style.config import StyleTransformerConfig
from txl.models.transformer_xl.config import TransformerXLConfig

# arch -> (config class, "module:ModelClass")
ARCHITECTURES: dict[str, tuple[type[ModelConfig], str]] = {
    "decoder": (TransformerXLConfig, "txl.models.transformer_xl.model:TransformerXL"),
    "encoder-decoder": (EncoderDecoderConfig, "txl.models.seq2seq.model:EncoderDecoder"),
    "lstm": (RecurrentConfig, "txl.models.rnn.model:RecurrentLM"),
    "sha-rnn": (RecurrentConfig, "txl.models.rnn.model:RecurrentLM"),
    "rnn-seq2seq": (RNNSeq2SeqConfig, "txl.models.rnn_seq2seq.model:RNNEncoderDecoder"),
    "style-transformer": (StyleTransformerConfig, "txl.models.style.model:StyleTransformer"),
}
ARCHS = tuple(ARCHITECTURES)
MODEL_CONFIGS = (TransformerXLConfig, EncoderDecoderConfig, RecurrentConfig, RNNSeq2SeqConfig, StyleTransformerConfig)
# The architectures trained on pair corpora, with one contract (encode, decode, output_logits, new_cache):
# `txl train`, `txl eval`, `txl generate --input` and txl.generate.seq2seq serve them all alike.
SEQ2SEQ_ARCHS = ("encoder-decoder", "rnn-seq2seq")


def is_seq2seq(config: ModelConfig | str) -> bool:
    """Whether a config (or an arch name) is a sequence-to-sequence model (`SEQ2SEQ_ARCHS`)."""
    return (config if isinstance(config, str) else getattr(config, "arch", None)) in SEQ2SEQ_ARCHS


def not_a_language_model(config: ModelConfig) -> tuple[str, str] | None:
    """For a model that does not continue text, (what it is, the command it takes instead); None for a
    language model (decoder-only or recurrent; a bidirectional one is refused by its own check)."""
    if is_seq2seq(config):
        return f"a sequence-to-sequence model ({config.arch})", "decode sources with txl generate RUN --input FILE"
    if getattr(config, "arch", None) == "style-transformer":
        return "a Style Transformer", "rewrite sentences with txl generate RUN --style S --prompt TEXT (or --input FILE)"
    if getattr(config, "num_labels", 0):
        return "a document classifier", "score documents with txl eval RUN"
    return None


assert set(CONFIGS) == set(ARCHITECTURES), "every registered config has a model"


def config_class(arch: Any) -> type[ModelConfig]:
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise ConfigError(f"config.arch must be one of {quoted(list(ARCHS))}, got {arch!r}")
    return ARCHITECTURES[arch][0]


def config_from_dict(data: Any) -> ModelConfig:
    """The config of `data["arch"]` (default "decoder") from a dict of either shape (old flat configs
    are migrated: txl.models.migration); one ConfigError naming the field for anything wrong."""
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a JSON object, got {type(data).__name__}")
    data = migrate(data)
    return config_class(data.get("arch", "decoder")).from_dict(data)


def model_class(config: ModelConfig) -> type:
    if getattr(config, "num_labels", 0):  # the decoder with a classification head (issue 47)
        module, name = "txl.models.transformer_xl.classify", "TransformerXLClassifier"
        return getattr(importlib.import_module(module), name)
    module, _, name = ARCHITECTURES[config.arch][1].partition(":")
    return getattr(importlib.import_module(module), name)


def build_model(config: ModelConfig):
    """The model of `config.arch`: `TransformerXL` (decoder), `EncoderDecoder`, `RecurrentLM` (lstm, sha-rnn),
    `RNNEncoderDecoder` (rnn-seq2seq), `StyleTransformer` (style-transformer)."""
    return model_class(config)(config)


def model_fields() -> dict[str, list[str]]:
    """arch -> the fields of its config."""
    return {arch: cls.field_names() for arch, (cls, _) in ARCHITECTURES.items()}


def load_config(directory: str | Path, *, follow_links: bool = True) -> ModelConfig:
    """config.json of a checkpoint directory, migrated and checked (one CheckpointError naming the file)."""
    from txl.models.pretrained import CONFIG_NAME, read_config_data  # torch: the checkpoint side only

    data = read_config_data(directory, follow_links=follow_links)
    try:
        return config_from_dict(data)
    except ConfigError as err:
        raise CheckpointError(f"{Path(directory) / CONFIG_NAME}: {err}") from None


def load_model(directory: str | Path, *, map_location: Any = "cpu", **overrides: Any):
    """A model from config.json + model.safetensors (a checkpoint directory, or a `txl train` run
    directory's best, else last), its architecture read from config.json. `overrides` replace config
    fields (e.g. attention_impl="eager"). Headers and shapes are checked before anything is allocated
    (txl.models.pretrained.load_weights)."""
    from txl.models.pretrained import load_weights, resolve_model_directory

    directory = resolve_model_directory(directory)
    config = load_config(directory)
    if overrides:
        try:
            config = config.replace(**overrides)
        except (ConfigError, TypeError) as err:
            raise CheckpointError(f"cannot apply {sorted(overrides)} to {directory}: {err}") from None
    return load_weights(directory, config, build_model, map_location=map_location)


def expected_tensors(config: ModelConfig) -> dict[str, tuple[Any, tuple[int, ...]]]:
    """name -> (dtype, shape) of the state dict of `build_model(config)` (built on the meta device)."""
    from txl.models.pretrained import expected_tensors as expected

    return expected(config, build_model)


__all__ = ["ARCHITECTURES", "ARCHS", "SEQ2SEQ_ARCHS", "build_model", "config_class", "config_from_dict",
           "expected_tensors", "is_seq2seq", "load_config", "load_model", "model_class"]
