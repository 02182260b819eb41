"""Files on disk: the cache location, crash-safe writes, streaming `.npy` output and file hashing.

Everything the data layer writes goes through here, so one rule holds everywhere: a file or
directory only appears under its final name once it is complete and fsynced (write to a temporary
name, fsync, rename). A crash or an error leaves a temporary name behind at worst, never a
complete-looking file with half the bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from txl.errors import DataError

HASH_BLOCK = 1 << 20


def cache_root(cache_dir: str | os.PathLike | None) -> Path:
    """`cache_dir`, else `$TXL_CACHE_DIR`, else `~/.cache/txl`; source directories may be read-only."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("TXL_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "txl"


def ensure_dir(path: Path, what: str = "cache directory") -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as err:
        raise DataError(
            f"{what} {path} is not writable ({err.strerror}); set TXL_CACHE_DIR or pass --cache-dir"
        ) from None
    return path


def fsync_dir(path: Path) -> None:
    """Persist a rename: on POSIX the directory entry itself must be flushed."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a temporary sibling, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def sha256_file(path: Path, block: int = HASH_BLOCK) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def smallest_uint(max_value: int) -> np.dtype:
    """The smallest unsigned dtype holding 0..max_value (token ids: uint8 for bytes, uint16 for PTB)."""
    for dtype in (np.uint8, np.uint16, np.uint32, np.uint64):
        if max_value <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise DataError(f"value {max_value} does not fit in 64 bits")


class NpyWriter:
    """Append-only writer of a 1-D `.npy` file whose length is not known in advance.

    Preparation streams tokens, so the array is never held in memory: we write a fixed-size header
    with room for any 64-bit length, append raw little-endian chunks, and rewrite the header with the
    final shape on `close()`. numpy accepts any space padding in the header (format spec v1.0), so
    the result is an ordinary `.npy` that `np.load(..., mmap_mode="r")` maps.
    """

    HEADER_BYTES = 128  # multiple of 64 so the data stays aligned for memory mapping

    def __init__(self, path: Path, dtype: np.dtype | type):
        self.path = Path(path)
        self.dtype = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).itemsize > 1 else np.dtype(dtype)
        self.count = 0
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._file.write(self._header(0))

    def _header(self, length: int) -> bytes:
        descr = np.lib.format.dtype_to_descr(self.dtype)
        text = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': ({length},), }}"
        prefix = b"\x93NUMPY\x01\x00"
        body_len = self.HEADER_BYTES - len(prefix) - 2
        body = text.ljust(body_len - 1).encode("latin1") + b"\n"
        return prefix + len(body).to_bytes(2, "little") + body

    def write(self, ids: np.ndarray) -> None:
        arr = np.asarray(ids)
        if arr.size == 0:
            return
        if arr.dtype != self.dtype:
            arr = arr.astype(self.dtype)
        self._file.write(arr.tobytes())
        self.count += int(arr.size)

    def close(self) -> int:
        if self._file.closed:
            return self.count
        self._file.seek(0)
        self._file.write(self._header(self.count))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return self.count

    def abort(self) -> None:
        self._file.close()

    def __enter__(self) -> NpyWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class TokenBuffer:
    """Collects token ids in a compact typed buffer and flushes them to an `NpyWriter` in chunks.

    Readers emit a few ids per line; buffering them in a preallocated numpy array (never a Python
    list per token) keeps preparation memory flat whatever the corpus size.
    """

    def __init__(self, writer: NpyWriter, capacity: int = 1 << 20):
        self.writer = writer
        self._buf = np.empty(capacity, dtype=writer.dtype)
        self._n = 0

    @property
    def count(self) -> int:
        return self.writer.count + self._n

    def extend(self, ids) -> None:
        arr = np.asarray(ids, dtype=self._buf.dtype) if not isinstance(ids, np.ndarray) else ids
        n = len(arr)
        if n == 0:
            return
        if self._n + n > len(self._buf):
            self.flush()
            if n > len(self._buf):
                self.writer.write(arr)
                return
        self._buf[self._n : self._n + n] = arr
        self._n += n

    def flush(self) -> None:
        if self._n:
            self.writer.write(self._buf[: self._n])
            self._n = 0


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An advisory lock so two processes preparing the same corpus don't both do the work.

    POSIX only (fcntl); elsewhere it is a no-op and the atomic rename still keeps the cache consistent.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished directory into place, replacing an older one (readers holding memory maps of
    the old files keep working: on POSIX the unlinked files live until unmapped)."""
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}-{os.urandom(3).hex()}")
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
