"""Typed errors a user can cause.

Every error a user can trigger (bad config, missing file, corrupt checkpoint, wrong vocabulary, bad CLI
argument, a full or read-only disk) is raised as a subclass of `TxlError` whose message is one line
naming the cause and, where there is one, the fix. The CLI prints that line and exits 2 without a
traceback (unless `--debug`). Anything else escaping is a bug in txl: the CLI keeps its traceback and
asks for a report (see SECURITY.md and docs/guide/robustness.md).
"""

from __future__ import annotations

import errno
import json
import re
import sys
from typing import Any


class TxlError(Exception):
    """Base class for user-facing errors: `str(err)` is one line that names the cause and the fix."""

    exit_code = 2

    def __init__(self, message: object = "", *args: object):
        # Messages quote user input (paths, keys, values); a line break in it must not break the line.
        text = str(message).replace("\r", "\\r").replace("\n", "\\n")
        super().__init__(text, *args)


class ConfigError(TxlError, ValueError):
    """An impossible or unknown configuration value (also a `ValueError`)."""


class DataError(TxlError):
    """A corpus, data spec, vocabulary or prepared cache that cannot be used."""


class CheckpointError(TxlError):
    """A checkpoint directory that is missing, corrupt, or does not match its config."""


class UsageError(TxlError):
    """A command-line argument or API call that cannot be honoured."""


class TrainingError(TxlError):
    """Training cannot continue (e.g. too many non-finite losses in a row, or out of memory)."""


class OutputError(TxlError):
    """A file or directory txl must write cannot be written (read-only location, a path below a
    regular file, a full disk)."""


# What to tell the user for the OS errors a write can hit; the key is the errno.
_OS_FIXES = {
    errno.ENOSPC: "no space left on the device; free some space or choose another location",
    errno.EDQUOT: "disk quota exceeded; free some space or choose another location",
    errno.EROFS: "read-only file system; choose a writable location",
    errno.EACCES: "permission denied; choose a location you can write to",
    errno.EPERM: "operation not permitted; choose a location you can write to",
    errno.ENOTDIR: "a part of the path is a file, not a directory; choose another location",
    errno.EEXIST: "a file with that name exists where a directory is needed; choose another location",
    errno.EFBIG: "the file is larger than the file system or a size limit (ulimit -f) allows; free space or raise the limit",
    errno.EISDIR: "it is a directory; give a file name",
    errno.ENAMETOOLONG: "the path is too long; choose a shorter one",
    errno.ENOENT: "no such file or directory",
}


# The same for reads: what to do about a file txl must read.
_OS_READ_FIXES = {
    errno.EACCES: "permission denied; make the file readable for this user",
    errno.EPERM: "operation not permitted; make the file readable for this user",
    errno.EIO: "input/output error; the disk or network file system is failing, copy the file elsewhere",
    errno.EISDIR: "it is a directory, not a file",
    errno.ENOTDIR: "a part of the path is a file, not a directory",
    errno.ENOENT: "no such file or directory",
}


def describe_os_error(err: OSError, *, reading: bool = False) -> str:
    """One line for an `OSError`: the cause in plain words and the fix (for a write, or a read)."""
    text = (_OS_READ_FIXES if reading else _OS_FIXES).get(err.errno or -1)
    if text is None:
        text = err.strerror or str(err) or type(err).__name__
    return text.replace("\n", " ")


def did_you_mean(name: str, known) -> str:
    """'; did you mean 'n_layer'?' when `name` is a likely typo of a known name, else ''."""
    import difflib

    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
    return f"; did you mean {close[0]!r}?" if close else ""


def is_out_of_memory(err: BaseException) -> bool:
    """True for the ways torch and Python report a failed allocation (CPU or GPU)."""
    if isinstance(err, MemoryError):
        return True
    torch = sys.modules.get("torch")  # never import torch just to classify an error
    if torch is None:
        return False
    if isinstance(err, torch.OutOfMemoryError):
        return True
    # The CPU allocator raises a plain RuntimeError ("DefaultCPUAllocator: can't allocate memory").
    return isinstance(err, RuntimeError) and "can't allocate memory" in str(err)


def describe_out_of_memory(err: BaseException) -> str:
    """'out of memory (could not allocate 95.4 GiB)' from torch's CPU or CUDA allocator message."""
    try:
        text = str(err)[:2000]
    except BaseException:  # noqa: BLE001 - str() itself can fail when memory is exhausted
        return "out of memory"
    found = re.search(r"allocate (\d+) bytes", text)  # CPU: "you tried to allocate 102400000000 bytes"
    if found:
        return f"out of memory (could not allocate {int(found.group(1)) / 2**30:.1f} GiB)"
    found = re.search(r"[Tt]ried to allocate ([\d.]+ [KMGT]i?B)", text)  # CUDA
    return f"out of memory (could not allocate {found.group(1)})" if found else "out of memory"


class DuplicateKeyError(ValueError):
    """A JSON object names a key twice (see `parse_json`)."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(f"key {key[:80]!r} appears twice")
        out[key] = value
    return out


def parse_json(text: str | bytes) -> Any:
    """json.loads that rejects duplicate keys: `{"n_layer": 4, "n_layer": 1e9}` is an error, not "the last
    one wins" (two readers could otherwise disagree on what a file says). Raises DuplicateKeyError, a
    ValueError, like every other malformed input."""
    return json.loads(text, object_pairs_hook=_no_duplicates)


def jsonl_rows(text: str, where: Any):
    """(line number, parsed value) of each non-blank line of a JSONL text; a line that is not JSON is one
    DataError naming `where:line`."""
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, parse_json(line)
        except (ValueError, RecursionError) as err:
            raise DataError(f"{where}:{n} is not a JSON object ({str(err)[:200] or 'nested too deeply'})") from None
