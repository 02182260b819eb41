"""A checkpoint with what was recorded next to it: the one loader behind `txl eval`, `generate`, `recl`,
`serve` and resume (`load_checkpoint` -> `LoadedCheckpoint`).

It reads the model (any architecture, through `txl.models.registry`), its vocabulary (`txl.data`) and the
run's records (trainer_state.json, run.json). The [train] values it gives back (`train_setting`) are
checked by `RUN_SETTINGS`, their type and range as `txl.train.config.TrainConfig` declares them (a test
keeps the two in agreement), so this module needs nothing above `txl.models`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from txl.errors import CheckpointError, ConfigError, DataError
from txl.io.typed import describe, matches
from txl.models.pretrained import (
    BEST_NAME,
    LAST_NAME,
    RUN_CHECKPOINTS,
    read_json,
    resolve_checkpoint,
    use_another_checkpoint,
)
from txl.models.registry import is_seq2seq, load_config, load_model

# The [train] values the loaders read back: key -> (type, lowest value, highest value). As TrainConfig.
_LENGTH = 1 << 24
RUN_SETTINGS: dict[str, tuple[Any, float, float]] = {
    "tgt_len": (int, 1, _LENGTH),
    "eval_tgt_len": (int, 0, _LENGTH),
    "eval_mem_len": (int | None, 0, _LENGTH),
    "mask_prob": (float, 0.0, 1.0),  # open interval (0, 1)
    "document_boundaries": (bool, 0, 1),  # txl eval scores documents on their own by default
}


def check_run_setting(key: str, value: Any) -> Any:
    """One [train] value read back from a run's records, checked alone (a ConfigError names it)."""
    if key not in RUN_SETTINGS:
        raise ConfigError(f"unknown key train.{key}; the checkpoint loader reads {', '.join(RUN_SETTINGS)}")
    tp, low, high = RUN_SETTINGS[key]
    if not matches(value, tp):
        raise ConfigError(f"train.{key} must be {describe(tp)}, got {value!r} ({type(value).__name__})")
    if value is None:
        return value
    if key == "mask_prob":
        if not low < value < high:
            raise ConfigError(f"train.mask_prob must be in (0, 1), got {value}")
        return value
    if value < low:
        raise ConfigError(f"train.{key} must be >= {low}, got {value}")
    if value > high:
        shown = f"{value:,}" if value < 10**15 else f"{value:.3g}"
        raise ConfigError(f"train.{key} must be <= {high:,}, got {shown}")
    return value


@dataclass
class LoadedCheckpoint:
    """A model directory resolved from a checkpoint or run path, with what was recorded next to it."""

    path: Path  # the model directory (config.json + model.safetensors [+ vocab.json])
    model: Any  # the model (any architecture) in eval mode
    vocab: Any | None  # txl.data.Vocab (PairVocab for the encoder-decoder) from vocab.json, None when absent
    state: dict = field(default_factory=dict)  # trainer_state.json of this directory ({} if absent)
    run: dict = field(default_factory=dict)  # run.json of the run directory ({} if absent)
    # where `state["run"]` and `run` were read (named by the errors of `train_setting`)
    state_file: Path | None = None
    run_file: Path | None = None
    data_file: Path | None = None  # where `state["data"]` was read

    @property
    def data_spec(self) -> str | None:
        """The corpus the run trained on (trainer_state.json or run.json `data`)."""
        for value, where in ((self.state.get("data"), self.data_file), (self.run.get("data"), self.run_file)):
            if value is None or value == "":
                continue
            if not isinstance(value, str) or "\0" in value or len(value) > 4096:
                raise CheckpointError(f"{where} is damaged: its data spec is {str(value)[:80]!r}, not a data spec; "
                                      "restore the file or pass --data SPEC")
            return value
        return None

    def train_setting(self, key: str) -> Any:
        """A [train] value of the run (e.g. tgt_len), from last/trainer_state.json or run.json; None if unknown.
        The value is checked as the run's configuration checks it (type and range), so a damaged record is
        one CheckpointError naming the file, never a crash (or minutes of work) further on."""
        for source, where in ((self.state.get("run"), self.state_file), (self.run.get("config"), self.run_file)):
            if isinstance(source, dict) and isinstance(source.get("train"), dict) and key in source["train"]:
                try:
                    return check_run_setting(key, source["train"][key])
                except ConfigError as err:
                    raise CheckpointError(f"{where} is damaged: {err}; restore the file, or give the value on the "
                                          "command line") from None
        return None

    def another_checkpoint(self) -> str:
        """The fix of a message about this checkpoint's weights: 'use RUN/last (...)' or 'use another checkpoint'."""
        return use_another_checkpoint(self.path)


def _read_optional_json(path: Path, what: str) -> dict:
    """A record next to a checkpoint (trainer_state.json, run.json): {} when there is no such entry; an
    entry that is a FIFO, a device, a link, oversized, not JSON or not an object is one CheckpointError
    (txl wrote it as a small regular file; ignoring a damaged one would silently change the defaults)."""
    if not os.path.lexists(path):
        return {}
    data = read_json(path, what, follow_links=False)
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} {path} is damaged: it holds a JSON {type(data).__name__}, not an object; "
                              "restore the file")
    return data


def no_checkpoint_yet(path: str | Path) -> str | None:
    """The message for a `txl train` run directory that has not saved a checkpoint yet (run.json written,
    no best/ or last/), saying when its first one comes; None for anything else (resolve_checkpoint's
    messages cover a wrong path)."""
    path = Path(path).expanduser()
    if not (path / "run.json").is_file() or any(os.path.lexists(path / name) for name in RUN_CHECKPOINTS):
        return None
    try:
        run = _read_optional_json(path / "run.json", "run record")
        train = run.get("config", {}).get("train", {})
    except (CheckpointError, AttributeError):
        run, train = {}, {}

    def steps(key: str) -> int:
        value = train.get(key) if isinstance(train, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

    # the trainer saves last/ every save_interval steps (eval_interval when it is 0), best/ at a validation
    # that improves (the first always does), and both when training ends or is stopped
    due = [(steps("save_interval"), "train.save_interval"), (steps("eval_interval"), "train.eval_interval"),
           (steps("max_steps"), "train.max_steps")]
    if not steps("save_interval"):
        due = due[1:]  # last/ at every validation step
    elif run.get("validation") is False:
        del due[1]  # no valid split: no best/
    due = [(step, key) for step, key in due if step]
    when = ""
    if due:
        step, key = min(due)
        when = f" at step {step:,} ({key}) or"
    return (f"{path} is a `txl train` run with no checkpoint yet: it saves its first{when} when training stops "
            "(max_minutes, Ctrl-C); run this again then (a run killed before that has nothing to load: train again)")


def load_checkpoint(path: str | Path, *, device: torch.device | str = "cpu", require_vocab: bool = False) -> LoadedCheckpoint:
    """Open a checkpoint directory or a `txl train` run directory (RUN/best, else RUN/last)."""
    from txl.data import Vocab

    started = no_checkpoint_yet(path)
    if started is not None:
        raise CheckpointError(started)
    directory = resolve_checkpoint(path)
    vocab = None
    if (directory / "vocab.json").is_file():
        try:
            if is_seq2seq(load_config(directory)):  # source and target vocabularies
                from txl.data.seq2seq import PairVocab

                vocab = PairVocab.load(directory / "vocab.json")
            else:
                vocab = Vocab.load(directory / "vocab.json")
        except DataError as err:
            raise CheckpointError(f"{directory}/vocab.json: {err}") from None
    elif require_vocab:
        raise CheckpointError(f"{directory} has no vocab.json; it is needed to turn text into token ids "
                              "(checkpoints written by `txl train` have one)")
    model = load_model(directory, map_location=device)
    # A masked-LM encoder (causal=false) has one more id than its vocabulary: the mask token.
    if vocab is not None and model.config.vocab_size not in (vocab.size, vocab.size + (not model.config.causal)):
        raise CheckpointError(f"{directory}: vocab.json has {vocab.size} ids but config.json has vocab_size="
                              f"{model.config.vocab_size}; the checkpoint is inconsistent")
    state_file = data_file = directory / "trainer_state.json"
    state = _read_optional_json(state_file, "trainer state")
    in_run = directory.name in RUN_CHECKPOINTS
    run_file = directory.parent / "run.json" if in_run else None
    run = _read_optional_json(run_file, "run record") if in_run else {}
    if directory.name == BEST_NAME and "run" not in state:  # best/ records no run config; last/ does
        last_file = directory.parent / LAST_NAME / "trainer_state.json"
        last = _read_optional_json(last_file, "trainer state")
        if "run" in last:
            state_file = last_file
        if "data" not in state:
            data_file = last_file
        state = {**last, **state}
    return LoadedCheckpoint(path=directory, model=model, vocab=vocab, state=state, run=run,
                            state_file=state_file, run_file=run_file, data_file=data_file)


__all__ = ["LoadedCheckpoint", "RUN_SETTINGS", "check_run_setting", "load_checkpoint", "no_checkpoint_yet"]
