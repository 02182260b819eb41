"""Files on disk: the cache location, streaming `.npy` output and input, hashing, locks and the clean-up
of what a killed preparation left.

Every file goes through `txl.io` (the one writer and the one reader): a file only appears under its final
name once it is complete and fsynced, nothing is written through a link planted in the cache, and every
file read from the cache is a regular file checked against its size before a byte is used. A crash leaves
a temporary name behind at worst, and the next run removes it (`remove_stale_dirs`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from txl.errors import DataError, TxlError, describe_os_error
from txl.io import atomic_file, fsync_dir, open_regular, open_update, size_text

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


def sha256_file(path: Path, block: int = HASH_BLOCK, *, what: str = "corpus file") -> str:
    """sha256 of a regular file (a user's source may be reached through a link; a FIFO is refused)."""
    digest = hashlib.sha256()
    with open_regular(path, what=what, follow_links=True) as f:
        try:
            while chunk := f.read(block):
                digest.update(chunk)
        except OSError as err:
            raise DataError(f"cannot read {what} {path}: {describe_os_error(err, reading=True)}") from None
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
        # txl.io's writer: a fresh temporary (O_EXCL | O_NOFOLLOW), renamed to `path` by close()
        self._writing = atomic_file(self.path)
        self._file = self._writing.__enter__()
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
        if self._writing is None:
            return self.count
        self._file.seek(0)
        self._file.write(self._header(self.count))
        writing, self._writing = self._writing, None
        writing.__exit__(None, None, None)  # fsync, rename into place
        return self.count

    def abort(self) -> None:
        """Remove the unfinished file (nothing appears under `path`)."""
        if self._writing is None:
            return
        writing, self._writing = self._writing, None
        with contextlib.suppress(Exception):
            writing.__exit__(DataError, DataError("aborted"), None)

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
def file_lock(path: Path, *, wait: bool = True) -> Iterator[bool]:
    """An advisory lock so two processes preparing the same corpus don't both do the work; yields
    whether it is held (always True when `wait`). The lock file is opened by `txl.io.open_update`:
    a link or a hard link planted under its name is refused, never written through.

    POSIX only (fcntl); elsewhere it is a no-op and the atomic rename still keeps the cache consistent.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield True
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = open_update(path, what="cache lock")
    except TxlError as err:
        raise DataError(str(err)) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except OSError as err:
            if wait or err.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                raise
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


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


# ---------------------------------------------------------------------------------------------
# Reading a prepared array


NPY_HEADER_LIMIT = 1 << 16  # numpy's own writers make 64..4096-byte headers; ours is 128 bytes


def load_npy(path: Path, *, what: str = "prepared array", fix: str = "run `txl data prepare SPEC --force`"):
    """A read-only memory map of a 1-D `.npy` of unsigned integers, checked before anything is mapped:
    a regular file (not a link, FIFO or device), a plain header of at most 64 KiB, and a length that the
    file's size holds exactly, so a header claiming 3 GiB on a small (or sparse) file is refused by
    arithmetic, not discovered by allocating."""
    try:
        f = open_regular(path, what=what)
    except DataError as err:
        raise DataError(f"{err}; {fix}") from None
    with f:
        try:
            size = os.fstat(f.fileno()).st_size
            version = np.lib.format.read_magic(f)
            if version not in ((1, 0), (2, 0), (3, 0)):
                raise ValueError(f"unknown .npy version {version}")
            read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                           (2, 0): np.lib.format.read_array_header_2_0}.get(version)
            if read_header is None:
                raise ValueError("a version 3 header (not one txl writes)")
            shape, fortran, dtype = read_header(f, max_header_size=NPY_HEADER_LIMIT)
            offset = f.tell()
        except (OSError, ValueError, SyntaxError, TypeError) as err:
            raise DataError(f"{what} {path} is unreadable ({str(err)[:200]}); {fix}") from None
        if dtype.kind != "u" or dtype.hasobject:  # token ids are written unsigned; anything else is not ours
            raise DataError(f"{what} {path} is unreadable: it holds {dtype} values, not token ids; {fix}")
        if len(shape) != 1:
            raise DataError(f"{what} {path} is unreadable: it has shape {shape}, not one row of token ids; {fix}")
        claimed = shape[0] * dtype.itemsize
        if offset + claimed != size:
            raise DataError(f"{what} {path} is unreadable: its header claims {size_text(claimed)} of tokens "
                            f"({shape[0]:,} x {dtype}) but the file holds {size_text(max(size - offset, 0))}; {fix}")
        if shape[0] == 0:
            return np.zeros(0, dtype=dtype)
        try:  # mapped from the descriptor that was checked, so nothing can be swapped in between
            return np.memmap(f, dtype=dtype, mode="r", offset=offset, shape=shape)
        except (OSError, ValueError) as err:
            raise DataError(f"{what} {path} is unreadable ({err}); {fix}") from None


# ---------------------------------------------------------------------------------------------
# Temporaries a killed run left


try:
    import fcntl  # noqa: F401

    _HAVE_FLOCK = True
except ImportError:  # pragma: no cover - Windows
    _HAVE_FLOCK = False


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except OSError:  # another user's process, or cannot tell: keep its directory
        return True
    return True


STALE = re.compile(r"^\.(?P<name>[a-z0-9][a-z0-9-]*-[0-9a-f]{16})\.(?:tmp|old)-(?P<pid>\d+)-[0-9a-f]{6}$")


def remove_stale_dirs(root: Path, *, held: str | None = None) -> list[str]:
    """Remove what killed preparations left under the cache's `corpora/` root: directories named
    `.<name>.tmp-<pid>-<hex>` (unfinished) or `.<name>.old-<pid>-<hex>` (killed between the two renames
    of `replace_dir`). A directory is removed only when nobody is preparing `<name>`: its lock is `held`
    by this process, or it can be taken without waiting. Entries of another naming, and anything that is
    not a real directory, are left alone (a link of that naming is unlinked, never followed). Returns
    the names removed."""
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        match = STALE.match(entry.name)
        if match is None:
            continue
        try:
            mode = os.lstat(entry.path).st_mode
        except OSError:
            continue
        name = match["name"]
        if stat.S_ISLNK(mode):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                removed.append(entry.name)
            continue
        if not stat.S_ISDIR(mode):
            continue
        if name == held:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.name)
            continue
        if not _HAVE_FLOCK and _alive(int(match["pid"])):  # no locks to ask: its process may still write it
            continue
        with contextlib.suppress(DataError, OSError), file_lock(root / f".{name}.lock", wait=False) as free:
            if free:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.name)
    return removed
