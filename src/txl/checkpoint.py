"""Safe, atomic checkpoint files: safetensors for tensors, JSON for everything else.

Nothing here unpickles: a checkpoint from a stranger can at worst fail to load with a
`CheckpointError`, never run code (the hole that got Hugging Face's TransfoXL removed, CVE-2023-6730).
Every tensor file carries a SHA-256 of its tensor bytes in the safetensors metadata, so truncation
and bit flips are detected, not silently loaded. Directories are written to a temporary sibling,
fsynced, then renamed into place, so a crash leaves either the old directory or the new one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from txl.errors import CheckpointError, ConfigError, DataError, OutputError, describe_os_error

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DIGEST_KEY = "txl_sha256"


# ---------------------------------------------------------------------------------------------
# Files and directories


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a directory be opened
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_json(path: Path, data: Any) -> None:
    """Write JSON through a temporary sibling, fsync, rename: a crash never leaves half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise OutputError(f"cannot write {path}: {describe_os_error(err)}") from None


def read_json(path: Path, what: str) -> Any:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CheckpointError(f"{what} not found: {path}") from None
    except OSError as err:
        raise CheckpointError(f"cannot read {what} {path}: {describe_os_error(err, reading=True)}") from None
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{what} {path} is not UTF-8 text (byte {err.start}); the file is corrupt") from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as err:  # JSONDecodeError, a 5000-digit number, [[[[...
        raise CheckpointError(f"{what} {path} is not valid JSON ({err}); the file is corrupt") from None


@contextlib.contextmanager
def atomic_directory(final: str | Path) -> Iterator[Path]:
    """Yield a temporary directory next to `final`; on success it replaces `final` in one rename.

    On any exception the temporary directory is removed and `final` is untouched.
    """
    final = Path(final)
    parent = final.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        recover_directory(final)
        check_replaceable(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=parent))
    except OSError as err:
        raise OutputError(f"cannot write checkpoint {final}: {describe_os_error(err)}") from None
    try:
        yield tmp
        _default_permissions(tmp)
        fsync_dir(tmp)
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=parent))
            os.rename(final, old / final.name)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_dir(parent)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        kept = "; the previous checkpoint is untouched" if final.exists() else ""
        if isinstance(err, OSError):
            raise OutputError(f"cannot write checkpoint {final}: {describe_os_error(err)}{kept}") from None
        if isinstance(err, OutputError):  # a file inside: name it by where it was going, not the temporary name
            raise OutputError(str(err).replace(str(tmp), str(final)) + kept) from None
        raise


def check_replaceable(final: Path) -> None:
    """Refuse to replace anything but an earlier checkpoint: txl never deletes what it did not write.

    Without this, `save_pretrained("~/Documents")` or `txl import-hf SRC SRC` would swap the whole
    directory (and, run as root, even `/dev/full`) for a checkpoint. A checkpoint is flat: config.json
    plus JSON and safetensors files.
    """
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        raise OutputError(f"{final} exists and is not a directory; choose another location for the checkpoint")
    if not final.exists():
        return
    entries = list(final.iterdir())
    foreign = [e.name for e in entries if not (e.is_file() and e.suffix in (".json", ".safetensors"))]
    if foreign or (entries and not (final / CONFIG_NAME).is_file()):
        what = f"it holds {foreign[0]!r}" if foreign else f"it has no {CONFIG_NAME}"
        raise OutputError(
            f"{final} exists and is not a txl checkpoint ({what}); choose a new directory "
            "(txl only replaces a checkpoint it wrote)"
        )


def recover_directory(final: str | Path) -> None:
    """Undo what a crash inside `atomic_directory` can leave behind.

    The swap renames `final` aside (`.NAME.old-*/NAME`) and then renames the new directory in; a kill
    between the two renames leaves no `final`, so the set-aside copy (complete by construction) is
    moved back. Unfinished temporary directories are deleted.
    """
    final = Path(final)
    parent = final.parent
    if not parent.is_dir():
        return
    if not final.exists():
        for old in sorted(parent.glob(f".{final.name}.old-*")):
            candidate = old / final.name
            if candidate.is_dir():
                os.rename(candidate, final)
                break
    for junk in list(parent.glob(f".{final.name}.tmp-*")) + list(parent.glob(f".{final.name}.old-*")):
        shutil.rmtree(junk, ignore_errors=True)


def _default_permissions(directory: Path) -> None:
    """mkdtemp makes 0700 directories; give checkpoints the permissions of a normally created file."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for path in directory.iterdir():
        if path.is_file():
            os.chmod(path, 0o666 & ~umask)


# ---------------------------------------------------------------------------------------------
# Tensors


def _tensor_bytes(t: Tensor) -> memoryview:
    t = t.detach().contiguous().cpu().reshape(-1)  # 1-D: a 0-d tensor cannot be viewed as bytes
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def tensors_digest(tensors: dict[str, Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def save_tensors(path: str | Path, tensors: dict[str, Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file with a digest of its contents in the metadata (fsynced)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    meta = {"format": "pt", **(metadata or {}), DIGEST_KEY: tensors_digest(tensors)}
    try:
        save_file(tensors, str(path), metadata=meta)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    except OSError as err:
        raise OutputError(f"cannot write {path}: {describe_os_error(err)}") from None
    except SafetensorError as err:  # the Rust writer reports I/O failures as "... (os error 28)"
        code = re.search(r"os error (\d+)", str(err))
        if code is None:
            raise
        number = int(code.group(1))
        raise OutputError(f"cannot write {path}: {describe_os_error(OSError(number, os.strerror(number)))}") from None


def load_tensors(path: str | Path, what: str = "tensor file") -> tuple[dict[str, Tensor], dict[str, str]]:
    """Read a safetensors file, verifying its digest when present. Any damage -> CheckpointError."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{what} not found: {path}")
    try:
        tensors = {}
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = f.get_tensor(name)
    except Exception as err:  # safetensors raises several types for a damaged file
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"{what} {path} is corrupt or truncated ({msg})") from None
    expected = metadata.get(DIGEST_KEY)
    if expected is not None and tensors_digest(tensors) != expected:
        raise CheckpointError(f"{what} {path} is corrupt: its contents do not match the stored SHA-256")
    return tensors, metadata


# ---------------------------------------------------------------------------------------------
# Models


def save_model(model, directory: str | Path, *, extra_files: dict[str, Any] | None = None) -> None:
    """`config.json` + `model.safetensors` (+ optional JSON files), atomically."""
    with atomic_directory(directory) as tmp:
        write_model_files(model, tmp, extra_files=extra_files)


def write_model_files(model, directory: Path, *, extra_files: dict[str, Any] | None = None) -> None:
    model = getattr(model, "module", model)  # unwrap DDP
    model = getattr(model, "_orig_mod", model)  # unwrap torch.compile
    write_json(directory / CONFIG_NAME, model.config.to_dict())
    save_tensors(directory / WEIGHTS_NAME, model.state_dict(), {"txl_kind": "model"})
    for name, data in (extra_files or {}).items():
        write_json(directory / name, data)


def resolve_checkpoint(path: str | Path) -> Path:
    """The model directory behind `path`: a checkpoint directory (config.json + model.safetensors) is
    returned as is; a `txl train` run directory resolves to RUN/best, else RUN/last.

    Used by `txl eval`, `txl generate` and `txl recl`, so all three accept the same thing. Read-only:
    a run whose `best` is missing (e.g. a crash mid-swap) falls back to `last` without repairing it.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"checkpoint not found: {path}; pass a checkpoint directory (config.json + model.safetensors) "
            "or a `txl train` run directory"
        )
    if (path / CONFIG_NAME).is_file() and (path / WEIGHTS_NAME).is_file():
        return path
    for name in ("best", "last"):
        candidate = path / name
        if (candidate / CONFIG_NAME).is_file() and (candidate / WEIGHTS_NAME).is_file():
            return candidate
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a checkpoint directory (config.json + model.safetensors)")
    raise CheckpointError(
        f"{path} is neither a checkpoint (no {CONFIG_NAME} + {WEIGHTS_NAME}) nor a run directory with "
        "best/ or last/; pass the --out directory of `txl train` or a directory written by save_pretrained"
    )


def resolve_model_directory(path: str | Path) -> Path:
    """What `TransformerXL.from_pretrained` loads: a checkpoint directory as is, or a `txl train` run
    directory's `best`, else `last` (like every CLI command). A directory with a config.json is taken
    as a checkpoint, so a damaged one reports its own missing or broken files."""
    path = Path(path).expanduser()
    if path.is_dir() and not (path / CONFIG_NAME).is_file():
        return resolve_checkpoint(path)
    return path


def load_config(directory: str | Path):
    from txl.config import TransformerXLConfig

    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {directory}")
    data = read_json(directory / CONFIG_NAME, "checkpoint config")
    try:
        return TransformerXLConfig.from_dict(data)
    except ConfigError as err:
        raise CheckpointError(f"{directory / CONFIG_NAME}: {err}") from None


def build_model(config):
    """The model class of `config.arch`: `TransformerXL` (decoder) or `txl.seq2seq.EncoderDecoder`."""
    if config.arch == "encoder-decoder":
        from txl.seq2seq.model import EncoderDecoder

        return EncoderDecoder(config)
    from txl.model import TransformerXL

    return TransformerXL(config)


def load_model(directory: str | Path, *, map_location: str | torch.device = "cpu", **overrides):
    directory = resolve_model_directory(directory)
    config = load_config(directory)
    if overrides:
        try:
            config = config.replace(**overrides)
        except (ConfigError, TypeError) as err:
            raise CheckpointError(f"cannot apply {sorted(overrides)} to {directory}: {err}") from None
    tensors, _ = load_tensors(directory / WEIGHTS_NAME, "checkpoint weights")
    model = build_model(config)
    state = model.state_dict()
    check_state_dict(state, tensors, directory)
    model.load_state_dict({k: v.to(state[k].dtype) for k, v in tensors.items()}, strict=True)
    return model.to(map_location).eval()


def check_state_dict(expected: dict[str, Tensor], found: dict[str, Tensor], where: str | Path) -> None:
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing:
        raise CheckpointError(
            f"{where}: tensor {missing[0]!r} is missing ({len(missing)} missing); "
            "the weights do not match config.json"
        )
    if unexpected:
        raise CheckpointError(
            f"{where}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} unexpected); "
            "the weights do not match config.json"
        )
    for name, want in expected.items():
        got = found[name]
        if tuple(got.shape) != tuple(want.shape):
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {tuple(got.shape)} but config.json implies "
                f"{tuple(want.shape)}; the weights and config.json disagree"
            )
        if not got.dtype.is_floating_point:
            raise CheckpointError(f"{where}: tensor {name!r} has dtype {got.dtype}, expected a float dtype")


# ---------------------------------------------------------------------------------------------
# A checkpoint with what was recorded next to it (the one loader behind txl eval / generate / recl)


@dataclass
class LoadedCheckpoint:
    """A model directory resolved from a checkpoint or run path, with what was recorded next to it."""

    path: Path  # the model directory (config.json + model.safetensors [+ vocab.json])
    model: Any  # TransformerXL in eval mode
    vocab: Any | None  # txl.data.Vocab from vocab.json, None when the directory has none
    state: dict = field(default_factory=dict)  # trainer_state.json of this directory ({} if absent)
    run: dict = field(default_factory=dict)  # run.json of the run directory ({} if absent)

    @property
    def data_spec(self) -> str | None:
        """The corpus the run trained on (trainer_state.json or run.json `data`)."""
        return self.state.get("data") or self.run.get("data")

    def train_setting(self, key: str) -> Any:
        """A [train] value of the run (e.g. tgt_len), from last/trainer_state.json or run.json; None if unknown."""
        for source in (self.state.get("run"), self.run.get("config")):
            if isinstance(source, dict) and isinstance(source.get("train"), dict) and key in source["train"]:
                return source["train"][key]
        return None


def _read_optional_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load_checkpoint(path: str | Path, *, device: torch.device | str = "cpu", require_vocab: bool = False) -> LoadedCheckpoint:
    """Open a checkpoint directory or a `txl train` run directory (RUN/best, else RUN/last)."""
    from txl.data import Vocab
    from txl.model import TransformerXL

    directory = resolve_checkpoint(path)
    vocab = None
    if (directory / "vocab.json").is_file():
        try:
            if load_config(directory).arch == "encoder-decoder":  # source and target vocabularies
                from txl.seq2seq.data import PairVocab

                vocab = PairVocab.load(directory / "vocab.json")
            else:
                vocab = Vocab.load(directory / "vocab.json")
        except DataError as err:
            raise CheckpointError(f"{directory}/vocab.json: {err}") from None
    elif require_vocab:
        raise CheckpointError(f"{directory} has no vocab.json; it is needed to turn text into token ids "
                              "(checkpoints written by `txl train` have one)")
    model = TransformerXL.from_pretrained(directory, map_location=device)
    if vocab is not None and vocab.size != model.config.vocab_size:
        raise CheckpointError(f"{directory}: vocab.json has {vocab.size} ids but config.json has vocab_size="
                              f"{model.config.vocab_size}; the checkpoint is inconsistent")
    state = _read_optional_json(directory / "trainer_state.json")
    run = _read_optional_json(directory.parent / "run.json") if directory.name in ("best", "last") else {}
    if directory.name == "best" and "run" not in state:  # best/ records no run config; last/ does
        state = {**_read_optional_json(directory.parent / "last" / "trainer_state.json"), **state}
    return LoadedCheckpoint(path=directory, model=model, vocab=vocab, state=state, run=run)
