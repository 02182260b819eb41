"""Safe, atomic checkpoint files: safetensors for tensors, JSON for everything else.

Nothing here unpickles: a checkpoint from a stranger can at worst fail to load with a
`CheckpointError`, never run code (the hole that got Hugging Face's TransfoXL removed, CVE-2023-6730).
Every tensor file txl writes carries a SHA-256 of its tensor bytes in the safetensors metadata, so
truncation and bit flips are detected, not silently loaded; a file txl wrote that has lost its digest
is refused, not loaded unverified (`load_tensors`). Directories are written to a temporary sibling,
fsynced, then renamed into place, so a crash leaves either the old directory or the new one. Single
files are written and read through `txl.io` (link-safe writes; regular files, size caps, no FIFOs).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from txl.errors import (
    CheckpointError,
    DuplicateKeyError,
    OutputError,
    describe_os_error,
    parse_json,
)
from txl.io import CONFIG_LIMIT, fsync_dir, open_regular, refuse_link
from txl.io import read_json as _read_json
from txl.io import write_json as _write_json
from txl.io.rundir import is_real_dir

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DIGEST_KEY = "txl_sha256"
RUN_CHECKPOINTS = ("best", "last")  # the checkpoints inside a `txl train` run directory
BEST_NAME, LAST_NAME = RUN_CHECKPOINTS


# ---------------------------------------------------------------------------------------------
# Files and directories

def write_json(path: Path, data: Any) -> None:
    """JSON (sorted keys, indented, a final newline) through txl.io's writer: a fresh temporary
    (O_EXCL | O_NOFOLLOW), fsync, rename; a crash never leaves half a file, a link is never written through."""
    _write_json(path, data)


def read_json(path: Path, what: str, *, limit: int = CONFIG_LIMIT, follow_links: bool = True) -> Any:
    """A JSON file through txl.io's bounded reader: a regular file (a FIFO is refused, never waited on) of
    at most `limit` bytes, duplicate keys and too-deep nesting refused; every failure one CheckpointError.

    follow_links: a directory the user names (a checkpoint, a Hugging Face snapshot whose files are links
    into its blob store) may hold links; the files of a run directory, which txl wrote as regular files,
    are read with follow_links=False."""
    return _read_json(path, what=what, limit=limit, error=CheckpointError, follow_links=follow_links)


@contextlib.contextmanager
def atomic_directory(final: str | Path) -> Iterator[Path]:
    """Yield a temporary directory next to `final`; on success it replaces `final` in one rename.

    On any exception the temporary directory is removed and `final` is untouched.
    """
    final = Path(final)
    parent = final.parent
    refuse_link(final, "where it writes a checkpoint")
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
    refuse_link(final, "where it writes a checkpoint")
    if final.exists() and not final.is_dir():
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

    Only real directories inside `final`'s parent are ever moved or deleted: a leftover that is a
    symbolic link (a run directory from a stranger can hold `.best.old-x -> /home/you/work`) is
    refused by name, so recovery never pulls a directory from elsewhere into the run.
    """
    final = Path(final)
    parent = final.parent
    if not is_real_dir(parent) and not parent.is_dir():
        return
    refuse_link(final, "where it writes a checkpoint")
    leftovers = sorted(parent.glob(f".{final.name}.old-*")) + sorted(parent.glob(f".{final.name}.tmp-*"))
    for entry in leftovers:
        refuse_link(entry, "during crash recovery")
        refuse_link(entry / final.name, "during crash recovery")
    if not final.exists():
        for old in sorted(parent.glob(f".{final.name}.old-*")):
            candidate = old / final.name
            if is_real_dir(old) and is_real_dir(candidate):
                os.rename(candidate, final)
                break
    for junk in leftovers:
        if is_real_dir(junk):
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
    """Write a safetensors file with a digest of its contents in the metadata (fsynced).

    The file is written under a fresh name created with O_EXCL | O_NOFOLLOW and renamed over `path`,
    so a link at `path` is refused and never written through."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    path = Path(path)
    refuse_link(path)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    meta = {"format": "pt", **(metadata or {}), DIGEST_KEY: tensors_digest(tensors)}
    tmp = None
    try:
        tmp = _exclusive_temporary(path)
        save_file(tensors, str(tmp), metadata=meta)
        fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        tmp = None
    except OSError as err:
        raise OutputError(f"cannot write {path}: {describe_os_error(err)}") from None
    except SafetensorError as err:  # the Rust writer reports I/O failures as "... (os error 28)"
        code = re.search(r"os error (\d+)", str(err))
        if code is None:
            raise
        number = int(code.group(1))
        raise OutputError(f"cannot write {path}: {describe_os_error(OSError(number, os.strerror(number)))}") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _exclusive_temporary(path: Path) -> Path:
    """A new empty regular file next to `path`, created by us (O_EXCL | O_NOFOLLOW)."""
    while True:
        tmp = path.with_name(f".{path.name[:100]}.{os.urandom(6).hex()}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666))
            return tmp
        except FileExistsError:
            continue


# safetensors dtype codes -> torch dtypes (the ones torch can hold)
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


def read_header(path: str | Path, what: str = "tensor file", *,
                follow_links: bool = True) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], dict[str, str]]:
    """The name -> (dtype, shape) table and metadata of a safetensors file, read from its header
    only (no tensor is allocated). A regular file only (txl.io: a FIFO is refused, not waited on);
    duplicate names, malformed entries and a header larger than the file are `CheckpointError`s."""
    path = Path(path)
    corrupt = f"{what} {path} is corrupt or truncated"
    with open_regular(path, what=what, error=CheckpointError, follow_links=follow_links) as f:
        try:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{corrupt} (no safetensors header)")
            length = int.from_bytes(head, "little")
            if length > MAX_HEADER_BYTES or length > size - 8:
                raise CheckpointError(f"{corrupt} (its header claims {length:,} bytes; the file has {size - 8:,})")
            text = f.read(length)
        except OSError as err:
            raise CheckpointError(f"cannot read {what} {path}: {describe_os_error(err, reading=True)}") from None
    try:
        header = parse_json(text)
    except DuplicateKeyError as err:
        raise CheckpointError(f"{what} {path} is ambiguous: in its header, {err}; the file is corrupt or was edited") from None
    except (ValueError, RecursionError) as err:
        raise CheckpointError(f"{corrupt} (header: {str(err)[:80]})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{corrupt} (its header is not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{corrupt} (its metadata is not a table of strings)")
    table = {}
    for name, entry in header.items():
        shape = entry.get("shape") if isinstance(entry, dict) else None
        dtype = _ST_DTYPES.get(entry.get("dtype")) if isinstance(entry, dict) and isinstance(entry.get("dtype"), str) else None
        if dtype is None or not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**63 for d in shape):
            raise CheckpointError(f"{corrupt} (tensor {name[:80]!r} has no valid dtype and shape)")
        table[name] = (dtype, tuple(shape))
    return table, metadata


def written_by_txl(path: Path, metadata: dict[str, str]) -> bool:
    """Whether a safetensors file must carry txl's digest: it sits in a run's best/ or last/ (txl wrote
    those), or its metadata names itself txl's (a `txl_` key: every file txl ever wrote has `txl_kind`
    and `txl_sha256`, since the first checkpoint commit). Weights someone saved with safetensors
    themselves, in a directory of their own, have neither and load unverified, as they always did."""
    return path.parent.name in RUN_CHECKPOINTS or any(key.startswith("txl_") for key in metadata)


def load_tensors(path: str | Path, what: str = "tensor file", *, require_digest: bool | None = None,
                 follow_links: bool = True) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Read a safetensors file and verify its digest. Any damage -> CheckpointError.

    require_digest: whether a missing digest is an error (None: when `written_by_txl`). A file txl wrote
    without a readable digest was damaged (one flipped bit in the key's name would otherwise turn the
    check off) or rewritten by another program; either way it is refused, not loaded unverified."""
    from safetensors import safe_open

    path = Path(path)
    _, header_metadata = read_header(path, what, follow_links=follow_links)  # duplicate names refused first
    required = written_by_txl(path, header_metadata) if require_digest is None else require_digest
    expected = header_metadata.get(DIGEST_KEY)
    if required and not (isinstance(expected, str) and re.fullmatch(r"[0-9a-f]{64}", expected)):
        state = "no" if expected is None else "an unreadable"
        near = [key for key in header_metadata if key != DIGEST_KEY and len(key) == len(DIGEST_KEY)
                and sum(a != b for a, b in zip(key, DIGEST_KEY)) <= 2]
        instead = f" (a damaged key {near[0][:40]!r} stands in its place)" if near and expected is None else ""
        raise CheckpointError(f"{what} {path} has {state} {DIGEST_KEY} digest in its metadata{instead}, which every "
                              "tensor file txl writes carries: the file is damaged or was rewritten by another "
                              f"program; restore it or {use_another_checkpoint(path.parent)}")
    try:
        tensors = {}
        with safe_open(str(path), framework="pt") as f:
            metadata = dict(f.metadata() or {})
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = f.get_tensor(name)
    except Exception as err:  # safetensors raises several types for a damaged file
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"{what} {path} is corrupt or truncated ({msg})") from None
    if metadata != header_metadata:  # the file changed between the two reads
        raise CheckpointError(f"{what} {path} changed while it was read; try again")
    if expected is not None and tensors_digest(tensors) != expected:
        raise CheckpointError(f"{what} {path} is corrupt: its contents do not match the stored SHA-256")
    return tensors, metadata


def first_non_finite(tensors: dict[str, Tensor] | list[tuple[str, Tensor]]) -> str | None:
    """The name of the first floating-point tensor holding NaN or Inf (None when all are finite); one
    host sync for all of them."""
    items = [(k, v) for k, v in (tensors.items() if isinstance(tensors, dict) else tensors)
             if isinstance(v, Tensor) and v.is_floating_point() and v.numel()]
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, v) in enumerate(items):
        by_device.setdefault(v.device, []).append(i)
    bad = []
    for indices in by_device.values():
        finite = torch.stack([torch.isfinite(items[i][1]).all() for i in indices]).tolist()
        bad += [i for i, ok in zip(indices, finite) if not ok]
    return items[min(bad)][0] if bad else None


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


def read_config_data(directory: str | Path, *, follow_links: bool = True) -> Any:
    """The JSON value of config.json in a checkpoint directory (at most CONFIG_LIMIT bytes: a 1 GB sparse
    file is refused by its size, unread). `txl.models.registry.load_config` turns it into a config."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {directory}")
    return read_json(directory / CONFIG_NAME, "checkpoint config", follow_links=follow_links)


def load_weights(directory: Path, config: Any, build: Callable[[Any], Any], *,
                 map_location: str | torch.device = "cpu"):
    """`build(config)` with the weights of `directory/model.safetensors`, in eval mode. The weights' header
    is checked against the shapes and dtypes the config implies *before* anything is allocated: a
    config.json that declares a model far larger than its weights fails at once instead of exhausting
    memory. Knows no architecture: `build` (txl.models.registry.build_model) does."""
    weights = directory / WEIGHTS_NAME
    if not os.path.lexists(weights):
        raise CheckpointError(f"checkpoint weights not found: {weights}")
    header, _ = read_header(weights, "checkpoint weights")  # (a FIFO or a device is refused in one line)
    held = sum(math.prod(shape) for _, shape in header.values())
    # the estimate is a lower bound of the model's size: far above what the file holds, the config is a
    # bomb and not worth building even on the meta device (a thousand layers take seconds); nearer, the
    # per-tensor comparison below names the first tensor that differs
    if config.num_parameters_estimate() > 8 * held:
        raise CheckpointError(f"{directory}: config.json describes a model of at least "
                              f"{config.num_parameters_estimate():,} parameters but {WEIGHTS_NAME} holds "
                              f"{held:,}; the weights and config.json disagree")
    check_header(expected_tensors(config, build), header, directory)
    tensors, _ = load_tensors(weights, "checkpoint weights")
    model = build(config)
    state = model.state_dict()
    check_state_dict(state, tensors, directory)
    model.load_state_dict({k: v.to(state[k].dtype) for k, v in tensors.items()}, strict=True)
    return model.to(map_location).eval()


def expected_tensors(config: Any, build: Callable[[Any], Any]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """name -> (dtype, shape) of the state dict of `build(config)`, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = build(config)
    return {k: (v.dtype, tuple(v.shape)) for k, v in model.state_dict().items()}


def check_header(expected: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 found: dict[str, tuple[torch.dtype, tuple[int, ...]]], where: str | Path) -> None:
    """The tensors a safetensors header lists against those a config implies: names, shapes, float dtypes."""
    _compare({k: s for k, (_, s) in expected.items()}, {k: (d.is_floating_point, d, s) for k, (d, s) in found.items()},
             where)


def check_state_dict(expected: dict[str, Tensor], found: dict[str, Tensor], where: str | Path) -> None:
    _compare({k: tuple(v.shape) for k, v in expected.items()},
             {k: (v.dtype.is_floating_point, v.dtype, tuple(v.shape)) for k, v in found.items()}, where)


def _compare(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[bool, torch.dtype, tuple[int, ...]]],
             where: str | Path) -> None:
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing:
        raise CheckpointError(
            f"{where}: tensor {missing[0]!r} is missing ({len(missing)} missing); "
            "the weights do not match config.json"
        )
    if unexpected:
        raise CheckpointError(
            f"{where}: unexpected tensor {unexpected[0][:200]!r} ({len(unexpected)} unexpected); "
            "the weights do not match config.json"
        )
    for name, want in expected.items():
        is_float, dtype, shape = found[name]
        if shape != tuple(want):
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {shape} but config.json implies "
                f"{tuple(want)}; the weights and config.json disagree"
            )
        if not is_float:
            raise CheckpointError(f"{where}: tensor {name!r} has dtype {dtype}, expected a float dtype")


# ---------------------------------------------------------------------------------------------
# A checkpoint with what was recorded next to it (the one loader behind txl eval / generate / recl)


def other_checkpoint(directory: str | Path) -> Path | None:
    """The run's other checkpoint next to `directory` (RUN/last for RUN/best and the reverse) when it
    exists, else None: what a message about a damaged checkpoint can point to."""
    directory = Path(directory)
    if directory.name not in RUN_CHECKPOINTS:
        return None
    other = directory.parent / (LAST_NAME if directory.name == BEST_NAME else BEST_NAME)
    return other if (other / CONFIG_NAME).is_file() and (other / WEIGHTS_NAME).is_file() else None


def use_another_checkpoint(directory: str | Path) -> str:
    """'use RUN/last (the run's other checkpoint)' when there is one, else 'use another checkpoint'."""
    other = other_checkpoint(directory)
    return f"use {other} (the run's other checkpoint)" if other is not None else "use another checkpoint"
