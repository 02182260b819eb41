"""What every architecture's config shares: typed fields checked when built, upper bounds, unknown keys
refused by name, the JSON round-trip, and the table of architectures (Hugging Face's `model_type`).

A family's config is a dataclass decorated with `@model_config("decoder")` (one or more `arch` names)
and subclassing `ModelConfig`; it declares its fields and overrides `validate`. The decorator registers
it in `CONFIGS` and makes its constructor refuse a key it does not have in one line: a field of another
architecture says which one has it and that this one has no such option ("config.same_length only applies
to arch='decoder'; the encoder-decoder has no such option: remove it"), an old option key says its new
place (`txl.models.migration`), anything else gets a did-you-mean. `from_dict` runs the migration first,
so config.json files written before the split load unchanged.

The model classes and `build_model` are in `txl.models.registry`; this module imports no torch until a
config's kernel and encoding are checked (`txl --help` and `txl data` start without it).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, ClassVar

from txl.errors import ConfigError, did_you_mean, parse_json
from txl.io import CONFIG_LIMIT, read_text, write_text
from txl.io.typed import check_dataclass_types, tuples_from_lists
from txl.models.migration import legacy_option, migrate
from txl.nn.options import MAX_INNER, MAX_LAYERS, MAX_LENGTH, MAX_VOCAB, MAX_WIDTH, Options, resolve_options

# Upper bounds of the shared integer fields (`txl.nn.options` explains the limits); a family adds its own.
UPPER_BOUNDS: dict[str, int] = {
    "vocab_size": MAX_VOCAB, "n_layer": MAX_LAYERS, "d_model": MAX_WIDTH, "n_head": 4096, "d_head": MAX_WIDTH,
    "d_inner": MAX_INNER, "d_embed": MAX_WIDTH, "div_val": 1 << 10, "mem_len": MAX_LENGTH, "clamp_len": MAX_LENGTH,
    "cmem_len": MAX_LENGTH, "cmem_ratio": MAX_LENGTH, "memory_tokens": MAX_LENGTH, "n_encoder_layer": MAX_LAYERS,
    "source_vocab_size": MAX_VOCAB,
}

CONFIGS: dict[str, type[ModelConfig]] = {}  # arch -> its config class, in registration order


ARCH_ORDER = ("decoder", "encoder-decoder", "lstm", "sha-rnn")  # how messages list them (others after)


def archs_with(name: str) -> list[str]:
    """The architectures whose config has a field `name`."""
    found = [arch for arch, cls in CONFIGS.items() if name in cls.field_names()]
    return sorted(found, key=lambda arch: ARCH_ORDER.index(arch) if arch in ARCH_ORDER else len(ARCH_ORDER))


def quoted(names: list[str]) -> str:
    """['a', 'b', 'c'] -> "'a', 'b' or 'c'"."""
    items = [repr(n) for n in names]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def model_config(*archs: str):
    """Class decorator: make `cls` a dataclass, the config of architectures `archs`, whose constructor
    refuses keys it does not have by name (`ModelConfig.unknown_key`)."""

    def wrap(cls: type[ModelConfig]) -> type[ModelConfig]:
        cls = dataclasses.dataclass(cls)
        init = cls.__init__
        names = frozenset(f.name for f in dataclasses.fields(cls) if f.init)

        @functools.wraps(init)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            arch = kwargs.get("arch", archs[0])
            if isinstance(arch, str) and arch in CONFIGS and arch not in archs:
                raise ConfigError(f"config.arch={arch!r} is a {CONFIGS[arch].__name__}, not a {cls.__name__}; build "
                                  f"it with {CONFIGS[arch].__name__} (txl.models.registry.config_from_dict chooses by arch)")
            for key in kwargs:
                if key not in names:
                    raise ConfigError(cls.unknown_key(key, kwargs))
            init(self, *args, **kwargs)

        cls.__init__ = __init__
        cls.ARCHS = archs
        for arch in archs:
            CONFIGS[arch] = cls
        return cls

    return wrap


class ModelConfig:
    """Base of the architectures' configs (see the module docstring)."""

    ARCHS: ClassVar[tuple[str, ...]] = ()
    FAMILY: ClassVar[str] = "this architecture"  # for messages: "the encoder-decoder"
    REGISTRY_FIELDS: ClassVar[tuple[str, ...]] = ("attention", "pos_encoding")  # names checked by their registry
    OPTION_FIELDS: ClassVar[dict[str, str]] = {}  # field -> the registry kind it holds options for

    def __post_init__(self) -> None:
        tuples_from_lists(self)
        check_dataclass_types(self)
        self._check_bounds()
        self.resolve_options()
        self.validate()

    def validate(self) -> None:
        """The family's own checks (raise `ConfigError` naming the field)."""

    # ------------------------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def unknown_key(cls, key: Any, given: dict[str, Any]) -> str:
        """The one-line message for a key this config does not have."""
        arch = given.get("arch", cls.ARCHS[0])
        key = str(key)
        owners = [a for a in archs_with(key) if a not in cls.ARCHS]
        if owners:
            return f"config.{key} only applies to arch={quoted(owners)}; {cls.FAMILY} has no such option: remove it"
        moved = legacy_option(key)
        if moved is not None and set(cls.OPTION_FIELDS.values()) >= {moved[0]}:
            kind, owner_names, new = moved
            selector = "attention" if kind == "attention" else "pos_encoding"
            return (f"config.{key} is now {kind}_options.{new}, an option of {selector}={quoted(list(owner_names))}: "
                    f"write {kind}_options={{{new!r}: ...}}")
        if moved is not None:
            return f"config.{key} does not apply to arch={arch!r}: {cls.FAMILY} has no such option; remove it"
        hint = did_you_mean(key, cls.field_names()) or f"; remove it (the keys are the {cls.__name__} fields)"
        return f"unknown config key {key[:100]!r}{hint}"

    def _check_bounds(self) -> None:
        for name, limit in UPPER_BOUNDS.items():
            value = getattr(self, name, None)
            if isinstance(value, int) and value > limit:
                shown = f"{value:,}" if value < 10**15 else f"{value:.3g}"
                raise ConfigError(f"config.{name} must be <= {limit:,}, got {shown}; no model txl can build "
                                  "has that size (is the config damaged?)")
        heads = getattr(self, "n_head", 0) * getattr(self, "d_head", 0)
        if heads > MAX_WIDTH:
            raise ConfigError(f"config.n_head × d_head must be <= {MAX_WIDTH:,}, got {heads:,}")

    def resolve_options(self) -> None:
        """Check the kernel and encoding names and turn their options (dicts) into the registered dataclasses."""
        if not self.OPTION_FIELDS:
            return
        from txl.nn.attention.registry import check_attention_name, kernel_options
        from txl.nn.positional import (  # torch: only once a config is built
            POSITIONAL_ENCODINGS,
            encoding_options,
        )

        check_attention_name(self.attention)
        if self.pos_encoding not in POSITIONAL_ENCODINGS:
            names = sorted(POSITIONAL_ENCODINGS)
            hint = did_you_mean(self.pos_encoding, names) or f" (registered: {', '.join(names)})"
            raise ConfigError(f"config.pos_encoding={self.pos_encoding!r} is not a registered positional encoding{hint}")
        self.attention_options = resolve_options(self.attention_options, kind="attention", chosen=self.attention,
                                                 registry=kernel_options())
        self.position_options = resolve_options(self.position_options, kind="position", chosen=self.pos_encoding,
                                                registry=encoding_options())

    # ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values: tuples as lists, options as dicts of all their values."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Options):
                value = value.to_dict()
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        """A config from a dict of either shape (the old flat one is migrated: `txl.models.migration`)."""
        if not isinstance(data, dict):
            raise ConfigError(f"config must be a JSON object, got {type(data).__name__}")
        return cls(**migrate(data))

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"
        if path is not None:
            write_text(path, text)
        return text

    @classmethod
    def from_json(cls, source: str | Path):
        """Read a config from a JSON string or a path to a JSON file."""
        return cls.from_dict(read_config_json(source))

    def replace(self, **changes: Any):
        return dataclasses.replace(self, **changes)


def read_config_json(source: str | Path) -> Any:
    """The JSON value of a config given as a JSON string or a path (a regular file of at most CONFIG_LIMIT
    bytes: a 1 GB sparse config.json is refused unread); one ConfigError for anything unreadable."""
    path = Path(source) if not str(source).lstrip().startswith("{") else None
    try:
        text = read_text(path, what="config file", limit=CONFIG_LIMIT, error=ConfigError,
                         follow_links=True) if path is not None else str(source)
    except ValueError as err:  # a NUL in the path
        raise ConfigError(f"cannot read config file {path}: {err}") from None
    try:
        return parse_json(text)
    except (ValueError, RecursionError) as err:  # duplicate keys, a 5000-digit number, [[[[... too deep
        where = f" in {path}" if path else ""
        raise ConfigError(f"config is not valid JSON{where}: {str(err)[:200]}") from None


def check_positive(config: Any, *names: str, low: int | float = 1) -> None:
    for name in names:
        if getattr(config, name) < low:
            raise ConfigError(f"config.{name} must be >= {low}, got {getattr(config, name)}")


def check_probability(config: Any, *names: str) -> None:
    for name in names:
        p = getattr(config, name)
        if not 0.0 <= p < 1.0:
            raise ConfigError(f"config.{name} must be in [0, 1), got {p}")


__all__ = ["CONFIGS", "ModelConfig", "UPPER_BOUNDS", "check_dataclass_types", "model_config", "read_config_json"]
