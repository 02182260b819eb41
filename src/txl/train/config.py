"""Run configuration: the model section, the training section, presets, TOML files and `--set`.

A run is described by two typed sections, `[model]` (the config of its architecture, chosen by
`model.arch` through `txl.models.registry`) and `[train]` (`TrainConfig`). Sources are merged in order:
preset, `--config FILE.toml`, command-line flags, `--set key=value` (dotted `model.d_model=256`, an option
of the kernel or encoding as `model.attention_options.window=128`, or bare `lr=1e-3` when the name is
unambiguous). Unknown keys and wrong types are `ConfigError`s that name the key. The keys of the old flat
model config (`model.sliding_window=128`) are still taken: `txl.models.migration` moves them when the
model config is built.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from txl.errors import ConfigError, did_you_mean
from txl.io import CONFIG_LIMIT, read_bytes
from txl.io.typed import check_dataclass_types
from txl.models.configuration import ModelConfig
from txl.models.migration import LEGACY_DEFAULTS, legacy_option
from txl.models.registry import ARCHITECTURES, config_from_dict, model_fields

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


# Upper bounds of the integer settings (far above any real run; they keep sizes computed from them finite).
_LENGTH, _STEPS = 1 << 24, 1 << 40
TRAIN_UPPER_BOUNDS = {
    "tgt_len": _LENGTH, "batch_size": _LENGTH, "grad_accum": _LENGTH, "eval_tgt_len": _LENGTH,
    "eval_mem_len": _LENGTH, "eval_batch_size": _LENGTH, "sample_tokens": _LENGTH, "max_steps": _STEPS,
    "warmup_steps": _STEPS, "log_interval": _STEPS, "eval_interval": _STEPS, "save_interval": _STEPS,
    "eval_max_tokens": 1 << 62, "final_max_tokens": 1 << 62, "max_nonfinite": _STEPS,
}


@dataclass
class TrainConfig:
    data: str = "builtin:python-stdlib"  # a data spec, see `txl data list`
    tgt_len: int = 128  # segment length (the paper's L during training)
    batch_size: int = 22  # global batch: parallel streams over all ranks and micro-batches
    grad_accum: int = 1  # micro-batches per step, each with its own memory (the reference's batch_chunk)
    max_steps: int = 400_000  # optimiser steps; also the cosine schedule's horizon
    max_minutes: float = 0.0  # wall-clock budget (0 = none); the run stops cleanly when it is spent
    # what the cosine schedule's horizon is: "minutes" = whichever of max_steps and max_minutes is further
    # along, so a run cut by its minutes ends at eta_min on any machine (with max_minutes set, the learning
    # rate depends on the clock: not bit-reproducible; without it, the same as "steps"); "steps" = max_steps
    # alone (the reference; bit-exact on resume, but a run cut by its minutes stops part-way down the cosine).
    # Runs saved with "steps" (the default before issue 45) keep it: their run.json says so.
    schedule_clock: Literal["steps", "minutes"] = "minutes"
    # muon: Muon on the hidden matrices, AdamW on the rest (txl.train.optim.MuonAdam; Adam's lr, decoupled decay)
    optimizer: Literal["adam", "adamw", "lamb", "muon"] = "adam"
    lr: float = 2.5e-4
    weight_decay: float = 0.0
    schedule: Literal["cosine", "inv_sqrt", "constant"] = "cosine"
    warmup_steps: int = 0
    eta_min: float = 0.0  # cosine floor
    clip: float = 0.25  # gradient-norm clip (0 = off)
    # keep an exponential moving average of the weights with this decay per step (0 = off; e.g. 0.999);
    # every validation scores it too and `best` holds whichever weights did better (txl/train/averaging.py)
    ema: float = 0.0
    # validate the live weights beside the average at every validation (false: the average alone, and
    # both at the run's last validation, so `best` can still be the live weights; ptb-word-hour's ten
    # skipped passes over valid are about 2.5% of its hour)
    eval_live: bool = True
    # dropout schedule (None = model.dropout throughout): the model's dropout layers (model.dropout's, not
    # dropatt nor the embedding dropouts) start at this rate and move linearly to model.dropout over the
    # first dropout_ramp of the run (its progress as the cosine's: steps or minutes, txl.train.optim.dropout_at)
    dropout_start: float | None = None
    dropout_ramp: float = 1.0
    # bf16/fp16 = autocast with fp32 master weights; fp16 adds a GradScaler; auto = bf16 where the device
    # has fast bf16 (CUDA with bf16, a CPU with AVX512-BF16 or AMX), else fp32
    precision: Literal["fp32", "bf16", "fp16", "auto"] = "fp32"
    compile: bool = False  # torch.compile the model (slow first steps, faster after)
    # blocks = recompute each block in the backward instead of keeping its activations (less memory, ~1/3
    # more compute; gradients identical)
    activation_checkpointing: Literal["none", "blocks"] = "none"
    # with several processes: ddp = a full copy per process (DistributedDataParallel); fsdp = parameters,
    # gradients and optimizer state sharded across processes (FSDP2, torch.distributed.fsdp.fully_shard)
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    seed: int = 1111
    varlen: bool = False  # reference's variable segment length during training
    roll: bool = False  # NVIDIA's per-epoch random roll of each training stream
    log_interval: int = 50  # steps between train-loss records
    eval_interval: int = 1000  # steps between validations (and `best` checkpoints)
    save_interval: int = 0  # steps between `last` checkpoints (0 = at each validation)
    eval_tgt_len: int = 0  # 0 = tgt_len
    eval_mem_len: int | None = None  # None = the model's mem_len
    eval_batch_size: int = 10
    eval_max_tokens: int = 0  # validate on the first N tokens only (0 = the whole split)
    eval_warm_memory: bool = True  # warm each eval stream's memory so every scored token has full context
    final_splits: tuple[str, ...] = ("valid",)  # scored at the end of the run with the best weights
    final_max_tokens: int | None = None  # tokens scored per final split (None = eval_max_tokens, 0 = whole)
    max_nonfinite: int = 5  # stop after this many non-finite losses in a row
    sample_tokens: int = 0  # generate this many tokens at the end (0 = no sample)
    sample_prompt: str = ""  # "" = the first line of the valid split (at most 64 tokens)
    # lm = next-token prediction with memory; mlm = masked LM (BERT) for the bidirectional encoder: the
    # model runs with causal=false and mem_len=0 (pos_encoding rope unless set) and gets one more
    # vocabulary id, the mask token; classify = one label per document (a `docs:` corpus), read segment by
    # segment with the memory carrying the earlier segments (txl.train.objectives, issue 47)
    objective: Literal["lm", "mlm", "classify"] = "lm"
    # a corpus read as separate documents: each stream row's memory is emptied where its document ends
    # (training and evaluation), so no document sees another
    document_boundaries: bool = False
    mask_prob: float = 0.15  # mlm: positions picked per segment (80% mask, 10% random, 10% kept)
    adam_betas: tuple[float, float] = (0.9, 0.999)  # adam/adamw/lamb; Vaswani et al. 2017: (0.9, 0.98)
    adam_eps: float = 1e-8  # Vaswani et al. 2017: 1e-9
    # sequence-to-sequence runs (arch = "encoder-decoder", a pair corpus)
    label_smoothing: float = 0.0  # Szegedy et al. 2016; Vaswani et al. 2017 use 0.1
    beam_size: int = 4  # final decoding of the final splits (1 = greedy)
    length_penalty: float = 0.6  # GNMT's alpha for beam search (0 = summed log-probability)

    def __post_init__(self) -> None:
        if isinstance(self.final_splits, list):
            self.final_splits = tuple(self.final_splits)
        if isinstance(self.adam_betas, list):
            self.adam_betas = tuple(self.adam_betas)
        check_dataclass_types(self)
        for f in dataclasses.fields(self):
            _check_range(f.name, getattr(self, f.name))
        # rules that relate two settings
        if not self.eval_live and not self.ema:
            raise ConfigError("train.eval_live=false validates only the weight average, and train.ema is 0 "
                              "(no average): set train.ema (e.g. 0.999) or leave eval_live true")
        if self.dropout_start is not None and self.compile:
            raise ConfigError("train.dropout_start changes the dropout rate every step, which would make "
                              "torch.compile recompile every step: unset train.compile or train.dropout_start")
        if self.batch_size % self.grad_accum:
            raise ConfigError(
                f"train.batch_size={self.batch_size} must be divisible by train.grad_accum={self.grad_accum}"
            )
        if self.objective == "mlm" and self.sample_tokens:
            raise ConfigError("train.sample_tokens generates text, which a masked-LM encoder (objective=mlm) "
                              "cannot; set sample_tokens=0")


_AT_LEAST_ONE = ("tgt_len", "batch_size", "grad_accum", "max_steps", "log_interval", "eval_interval",
                 "eval_batch_size", "max_nonfinite")
_AT_LEAST_ZERO = ("warmup_steps", "save_interval", "eval_tgt_len", "eval_max_tokens", "sample_tokens")
_FINITE_AT_LEAST_ZERO = ("lr", "weight_decay", "eta_min", "clip", "max_minutes")


def _check_range(name: str, value: Any) -> None:
    """The range of one [train] value of the right type (the rules that involve one setting alone)."""
    if name in _AT_LEAST_ONE and value < 1:
        raise ConfigError(f"train.{name} must be >= 1, got {value}")
    if name in _AT_LEAST_ZERO and value < 0:
        raise ConfigError(f"train.{name} must be >= 0, got {value}")
    if name in ("final_max_tokens", "eval_mem_len") and value is not None and value < 0:
        raise ConfigError(f"train.{name} must be >= 0, got {value}")
    limit = TRAIN_UPPER_BOUNDS.get(name)
    if limit is not None and value is not None and value > limit:
        shown = f"{value:,}" if value < 10**15 else f"{value:.3g}"
        raise ConfigError(f"train.{name} must be <= {limit:,}, got {shown}")
    if name in _FINITE_AT_LEAST_ZERO and not 0 <= value < math.inf:  # also rejects NaN (JSON and TOML allow nan/inf)
        raise ConfigError(f"train.{name} must be a finite number >= 0, got {value}")
    if name == "lr" and value == 0:
        raise ConfigError("train.lr must be > 0")
    if name == "seed" and not 0 <= value < 2**63:  # numpy and torch seeds are unsigned 64-bit
        raise ConfigError(f"train.seed must be in [0, 2**63), got {value}")
    if name == "adam_betas" and not all(0 <= b < 1 for b in value):
        raise ConfigError(f"train.adam_betas must be two numbers in [0, 1), got {list(value)}")
    if name == "adam_eps" and not 0 < value < 1:
        raise ConfigError(f"train.adam_eps must be in (0, 1), got {value}")
    if name == "ema" and not 0 <= value < 1:  # (also rejects NaN)
        raise ConfigError(f"train.ema must be in [0, 1) (0 = no weight average), got {value}")
    if name == "dropout_start" and value is not None and not 0 <= value < 1:
        raise ConfigError(f"train.dropout_start must be in [0, 1) (or unset), got {value}")
    if name == "dropout_ramp" and not 0 < value <= 1:
        raise ConfigError(f"train.dropout_ramp must be in (0, 1] (a share of the run), got {value}")
    if name == "label_smoothing" and not 0 <= value < 1:
        raise ConfigError(f"train.label_smoothing must be in [0, 1), got {value}")
    if name == "beam_size" and value < 1:
        raise ConfigError(f"train.beam_size must be >= 1, got {value}")
    if name == "length_penalty" and not 0 <= value < math.inf:
        raise ConfigError(f"train.length_penalty must be a finite number >= 0, got {value}")
    if name == "mask_prob" and not 0.0 < value < 1.0:
        raise ConfigError(f"train.mask_prob must be in (0, 1), got {value}")
    if name == "final_splits":
        for split in value:
            if split not in ("train", "valid", "test"):
                raise ConfigError(f"train.final_splits has {split!r}; use train, valid or test")


def check_train_value(key: str, value: Any) -> Any:
    """One [train] value read back from a run's records (run.json, trainer_state.json), checked alone: its
    type and range as `TrainConfig` checks them (the rules relating two settings need the whole section).
    Returns the value (a list becomes a tuple, as in the config); a bad one is a ConfigError naming it."""
    if key not in TRAIN_KEYS:
        raise ConfigError(f"unknown key train.{key}{did_you_mean(str(key), TRAIN_KEYS)}")
    if isinstance(value, list) and key in ("final_splits", "adam_betas"):
        value = tuple(value)
    probe = TrainConfig()  # valid defaults: only `key` can fail below
    setattr(probe, key, value)
    try:
        check_dataclass_types(probe)
    except ConfigError as err:  # "config.eval_tgt_len must be int, got ..." -> "train.eval_tgt_len ..."
        raise ConfigError(str(err).replace(f"config.{key} ", f"train.{key} ", 1)[:300]) from None
    _check_range(key, value)
    return value


@dataclass
class RunConfig:
    model: dict[str, Any] = field(default_factory=dict)  # fields of the arch's config (vocab from data)
    train: TrainConfig = field(default_factory=TrainConfig)

    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        """The model config; `vocab_size` comes from the corpus unless the run pinned it (masked LM:
        the corpus's + 1, the mask token's id being the last). `train.objective = "mlm"` makes the
        model a bidirectional encoder: causal=false, mem_len=0, same_length=false."""
        values = dict(self.model)
        if self.train.objective == "mlm":
            if values.get("causal") is True:
                raise ConfigError("train.objective='mlm' trains a bidirectional encoder; remove model.causal=true")
            values.update(causal=False, mem_len=0, same_length=False)
            values.setdefault("pos_encoding", "rope")  # xl is causal-only; rope runs with every kernel
            if vocab_size is not None:
                vocab_size += 1  # the mask token
        if vocab_size is not None:
            pinned = values.get("vocab_size")
            if pinned is not None and pinned != vocab_size:
                raise ConfigError(
                    f"model.vocab_size={pinned} but the corpus {self.train.data!r} has {vocab_size} tokens; "
                    "remove model.vocab_size to take it from the data"
                )
            values["vocab_size"] = vocab_size
        elif "vocab_size" not in values:  # a placeholder that fits the cutoffs (wrong types fail below)
            cutoffs = values.get("cutoffs")
            cutoffs = cutoffs if isinstance(cutoffs, list | tuple) else []
            values["vocab_size"] = max([256, *[c + 1 for c in cutoffs if isinstance(c, int)]])
        return config_from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        train = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self.train).items()}
        return {"model": dict(self.model), "train": train}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config") -> RunConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"{where} must be a table with [model] and [train] sections")
        run = cls()
        merge(run, data, where)
        return run


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


# every field of every architecture, and the old flat config's keys (migrated when the config is built)
MODEL_FIELDS = model_fields()
MODEL_KEYS = sorted({*LEGACY_DEFAULTS, *(name for names in MODEL_FIELDS.values() for name in names)})
OPTION_TABLES = {"attention_options": ("attention", "attention"), "position_options": ("position", "pos_encoding")}
TRAIN_KEYS = _fields(TrainConfig)


def merge(run: RunConfig, data: dict[str, Any], where: str) -> None:
    """Apply a {model: {...}, train: {...}} mapping onto `run`, checking every key and value."""
    unknown = sorted(set(data) - {"model", "train"})
    if unknown:
        raise ConfigError(f"unknown section {unknown[0]!r} in {where} (sections: model, train)")
    for section in ("model", "train"):
        if not isinstance(data.get(section, {}), dict):
            raise ConfigError(f"{section} in {where} must be a table ([{section}] with key = value lines), "
                              f"got {type(data[section]).__name__}")
    model = dict(data.get("model", {}))
    for key in model:
        if key not in MODEL_KEYS:
            raise ConfigError(f"unknown key model.{key} in {where}{did_you_mean(str(key), MODEL_KEYS)}")
    train_values = dict(data.get("train", {}))
    for key in train_values:
        if key not in TRAIN_KEYS:
            raise ConfigError(f"unknown key train.{key} in {where}{did_you_mean(str(key), TRAIN_KEYS)}")
    arch = model.get("arch")
    if arch in ARCHITECTURES and arch != run.model.get("arch", "decoder"):
        # switching architecture drops what earlier sources (a preset) set that the new one does not have
        # (heads, attention... for an LSTM), so `--set model.arch=lstm` works over any preset; this
        # source's own settings are still refused by name
        run.model = {k: v for k, v in run.model.items() if k in MODEL_FIELDS[arch]}
    merge_model(run.model, model)
    try:
        run.train = TrainConfig(**{**dataclasses.asdict(run.train), **train_values})
        run.model_config()  # validate the model section now (with the objective), before any data is read
    except ConfigError as err:
        raise ConfigError(f"{err} (in {where})") from None


def merge_model(target: dict[str, Any], source: dict[str, Any]) -> None:
    """`source` (one source's [model] table) onto `target`, later wins: an options table merges key by key;
    a source that changes the kernel (encoding) without giving its options drops the earlier ones; an old
    option key (`sliding_window`) replaces its new name given earlier (`attention_options.window`) and the
    reverse, so the migration never sees both."""
    for table, (_, selector) in OPTION_TABLES.items():
        if selector in source and source[selector] != target.get(selector) and table not in source:
            target.pop(table, None)
    for key, value in source.items():
        moved = legacy_option(key)
        if moved is not None:
            options = target.get(f"{moved[0]}_options")
            if isinstance(options, dict) and moved[2] in options:
                target[f"{moved[0]}_options"] = {k: v for k, v in options.items() if k != moved[2]}
        if key in OPTION_TABLES and isinstance(value, dict):
            kind = OPTION_TABLES[key][0]
            for old in [k for k in target if (m := legacy_option(k)) is not None and m[0] == kind and m[2] in value]:
                del target[old]
            if isinstance(target.get(key), dict):
                value = {**target[key], **value}
        target[key] = value


def parse_value(text: str) -> Any:
    """`--set` values: JSON when it parses (numbers, true/false, null, lists), else the raw string."""
    lowered = text.strip()
    if lowered in ("none", "None"):
        return None
    if lowered in ("True", "False"):
        return lowered == "True"
    try:
        return json.loads(lowered)
    except (ValueError, RecursionError):  # not JSON, a 5000-digit number, [[[[...: keep the string
        return text


def apply_sets(run: RunConfig, assignments: list[str]) -> None:
    """Apply every `--set key=value` together, then validate once: combinations that are only valid
    together (`attention=performer` with `pos_encoding=rope`) work in any order."""
    values: dict[str, dict[str, Any]] = {"model": {}, "train": {}}
    for item in assignments:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        section, _, name = key.rpartition(".")
        table = section.partition(".")[2] if section.startswith("model.") else ""
        if table in OPTION_TABLES:  # model.attention_options.window=128
            values["model"].setdefault(table, {})[name] = parse_value(value)
            continue
        if not section:
            in_model, in_train = name in MODEL_KEYS, name in TRAIN_KEYS
            if in_model and in_train:
                raise ConfigError(f"--set {name} is ambiguous; write model.{name} or train.{name}")
            if not (in_model or in_train):
                hint = did_you_mean(name, [*MODEL_KEYS, *TRAIN_KEYS]) or " (keys: the fields of [model] and [train])"
                raise ConfigError(f"unknown key {name!r} in --set{hint}")
            section = "model" if in_model else "train"
        if section not in ("model", "train"):
            raise ConfigError(f"unknown section {section!r} in --set {key} (sections: model, train)")
        values[section][name] = parse_value(value)
    if not assignments:
        return
    try:
        merge(run, values, "--set")
    except ConfigError as err:  # name the --set flags the message is about, not all of them
        message = str(err).removesuffix(" (in --set)")
        last = {item.partition("=")[0].strip().rpartition(".")[2]: item for item in assignments}  # later wins
        named = [item for name, item in last.items() if name in message]
        raise ConfigError(f"{message} (in --set {' --set '.join(named or last.values())})") from None


# ---------------------------------------------------------------------------------------------
# Presets: TOML files shipped inside the package (src/txl/presets/NAME.toml)


def preset_names() -> list[str]:
    return sorted(p.name.removesuffix(".toml") for p in resources.files("txl.presets").iterdir()
                  if p.name.endswith(".toml"))


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML config the user named (a link is theirs to follow): a regular file of at most CONFIG_LIMIT
    bytes (txl.io: a FIFO is refused, not waited on)."""
    path = Path(path)
    try:
        data = read_bytes(path, what="config file", limit=CONFIG_LIMIT, error=ConfigError, follow_links=True)
    except ConfigError:
        raise
    except ValueError as err:  # a NUL in the path
        raise ConfigError(f"cannot read config file {path}: {err}") from None
    try:
        return tomllib.loads(data.decode("utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {path} is not valid TOML: {err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not valid TOML: invalid UTF-8 at byte {err.start}") from None
    except RecursionError:
        raise ConfigError(f"config file {path} is not valid TOML: arrays or tables nested too deeply") from None


def load_preset(name: str) -> dict[str, Any]:
    names = preset_names()
    if name not in names:
        raise ConfigError(f"unknown preset {name!r} (known: {', '.join(names)})")
    with resources.files("txl.presets").joinpath(f"{name}.toml").open("rb") as f:
        return tomllib.load(f)


def build_run_config(
    *, preset: str | None = None, config_file: str | Path | None = None, sets: list[str] | None = None,
    flags: dict[str, Any] | None = None,
) -> RunConfig:
    run = RunConfig()
    if preset is not None:
        merge(run, load_preset(preset), f"preset {preset}")
    if config_file is not None:
        merge(run, read_toml(config_file), str(config_file))
    if flags:
        merge(run, {"train": {k: v for k, v in flags.items() if v is not None}}, "command-line flags")
    apply_sets(run, sets or [])
    return run
