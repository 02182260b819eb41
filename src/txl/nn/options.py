"""The options of an attention kernel or a positional encoding, and the size limits of every config.

Each kernel and encoding declares what tunes it as a small frozen dataclass registered with it
(`register("sliding", "fast", options=SlidingOptions)`, `register_encoding("t5", options=T5Options)`).
A model config holds one instance of the selected entry's class (`config.attention_options`,
`config.position_options`), given as a plain dict (`{"window": 3}`) and resolved by `resolve_options`:
an option of another entry is refused by name, a typo gets a did-you-mean. The dataclass checks its
own types and values (`validate`), so a kernel added in one file, a test's or a user's, brings its
checks with it and needs no edit anywhere else.

`LayerConfig` says what the layers, kernels and encodings read of a model config: a Protocol, so
`txl.nn` never imports the model configs above it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from txl.errors import ConfigError, did_you_mean
from txl.io.typed import check_dataclass_types, tuples_from_lists

# Upper bounds, checked at validation: far above any published model (enwik8-large: 24 layers,
# d_model 1024, d_inner 3072; lm1b: vocabulary 793k), low enough that a config.json from a stranger
# cannot make txl compute sizes that overflow or allocate before its weights are checked.
MAX_LAYERS = 1024
MAX_WIDTH = 65536  # d_model, d_embed, n_head × d_head
MAX_INNER = 1 << 20  # d_inner
MAX_VOCAB = 1 << 24
MAX_LENGTH = 1 << 24  # mem_len, clamp_len, cmem_len, windows, max_positions, ... (tokens)


@dataclass(frozen=True)
class Options:
    """Base of a kernel's or an encoding's options. Subclasses are frozen dataclasses with defaults and
    override `validate` (use `self.at_least`, `self.fail`); `where` ("config.attention_options") is set
    by the registry that takes the class, so messages name the option as the user writes it."""

    where: ClassVar[str] = "config.options"

    def __post_init__(self) -> None:
        tuples_from_lists(self)
        check_dataclass_types(self, self.where)
        self.validate()

    def validate(self) -> None:
        """Check the values (types are checked already); raise through `fail`."""

    def fail(self, name: str, text: str) -> None:
        raise ConfigError(f"{self.where}.{name} {text}")

    def at_least(self, low: int | float, *names: str, high: int = MAX_LENGTH) -> None:
        """Every named option is >= low and (integers, lengths) <= high."""
        for name in names:
            value = getattr(self, name)
            values = value if isinstance(value, tuple) else (value,)
            if any(v < low for v in values):
                self.fail(name, f"must be >= {low}, got {list(value) if isinstance(value, tuple) else value}")
            if any(isinstance(v, int) and v > high for v in values):
                self.fail(name, f"must be <= {high:,}, got {value}; no model txl can build has that size "
                                "(is the config damaged?)")

    def for_layer(self, layer_idx: int) -> Options:
        """The options layer `layer_idx` runs with (Longformer's per-layer windows): the same by default.
        The attention layer builds its kernel from the config with these options in place."""
        return self

    def to_dict(self) -> dict[str, Any]:
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in dataclasses.fields(self)}

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


@dataclass(frozen=True)
class NoOptions(Options):
    """What a kernel or encoding that takes no options registers (`{}` in a config)."""


def resolve_options(value: Any, *, kind: str, chosen: str, registry: Mapping[str, type[Options]]) -> Options:
    """`value` (None, a dict, or an Options instance) as the options of the kernel (`kind="attention"`) or
    encoding (`kind="position"`) named `chosen`, whose class `registry[chosen]` is. An option that belongs to another entry
    is refused by name; an instance of another entry's class is taken only when it holds that class's
    defaults (switching kernels with `config.replace(attention=...)`)."""
    cls = registry[chosen]
    where = f"config.{kind}_options"
    selector = "pos_encoding" if kind == "position" else kind
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Options):
        if value == type(value)():
            return cls()
        owner = next((name for name, c in registry.items() if c is type(value)), type(value).__name__)
        changed = {k: v for k, v in value.to_dict().items() if v != getattr(type(value)(), k)}
        raise ConfigError(f"{where} holds options of {selector}={owner!r} ({changed}), not of {selector}={chosen!r}; "
                          f"give {kind}_options for {chosen!r} or remove them")
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a table of the options of {selector}={chosen!r} "
                          f"(e.g. {{}}), got {type(value).__name__}")
    known = cls.names()
    for key in value:
        if key in known:
            continue
        owners = sorted(name for name, c in registry.items() if isinstance(key, str) and key in c.names())
        if owners:
            named = " or ".join(repr(owner) for owner in owners)
            fix = f"{selector}={owners[0]!r}" if len(owners) == 1 else f"{selector} to one of them"
            raise ConfigError(f"{where}.{key} is an option of {selector}={named}, not of {selector}={chosen!r}; "
                              f"set {fix} or remove it")
        takes = f"{selector}={chosen!r} takes " + (", ".join(known) if known else "no options")
        hint = did_you_mean(str(key), known) or f" ({takes})"
        raise ConfigError(f"unknown option {where}.{str(key)[:100]}{hint}")
    return cls(**value)


class LayerConfig(Protocol):
    """What `txl.nn` reads of a model config (TransformerXLConfig, EncoderDecoderConfig and the views
    the encoder–decoder builds): shapes, the causal flag, and the selected kernel and encoding with
    their options. Kernels read `config.attention_options`, encodings `config.position_options`."""

    n_layer: int
    d_model: int
    n_head: int
    d_head: int
    dropout: float
    dropatt: float
    causal: bool
    same_length: bool
    untie_r: bool  # xl: per-layer u, v biases
    memory_tokens: int  # learned keys/values in front of every layer's keys (the layer owns them)
    init_std: float
    attention: str
    attention_impl: str
    attention_options: Any
    pos_encoding: str
    position_options: Any


__all__ = ["LayerConfig", "MAX_INNER", "MAX_LAYERS", "MAX_LENGTH", "MAX_VOCAB", "MAX_WIDTH", "NoOptions", "Options",
           "resolve_options"]
