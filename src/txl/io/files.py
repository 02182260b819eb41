"""The one writer and the one reader for every file txl touches (SECURITY.md: "every file txl reads from a
stranger is regular, bounded and checked before use; every file it writes is created by it").

A directory may come from a stranger (a colleague's run, a downloaded model, a shared cache): its entries may
be symbolic links aimed anywhere (`sample.txt -> ~/.bashrc`), hard links to files outside it, FIFOs that
block a reader for ever, or sparse files claiming gigabytes. So:

- **Writes** create a fresh temporary under an unguessable name with `O_CREAT | O_EXCL | O_NOFOLLOW`,
  relative to the directory's own descriptor, fsync it, and rename it over the final name: a rename replaces
  a link, it never writes through one, and a crash never leaves half a file. An entry that is already a
  symbolic link is refused by name instead of replaced (txl never renames or deletes outside the directory
  it was given).
- **Files changed in place** (a run's metrics log, its lock) are opened with `O_NOFOLLOW` and must be
  regular files of this user with one link (`st_nlink == 1`): a hard link planted in a run would otherwise
  make txl append to, or truncate, a file elsewhere.
- **Reads** open with `O_NOFOLLOW | O_NONBLOCK` (opening a FIFO cannot block), `fstat` the descriptor
  (regular files only: FIFOs, devices and sockets are refused in one line), and check the size against a
  cap for the kind of file before reading a byte.

Every failure is one typed error from `txl.errors` naming the file. `tests/test_io.py` walks the source
and fails on a bare `open(..., "w")`, `write_text`, `savefig` to a path or `read_text` outside this package.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import stat
from pathlib import Path
from typing import Any, BinaryIO

from txl.errors import (
    CheckpointError,
    DataError,
    DuplicateKeyError,
    OutputError,
    TxlError,
    describe_os_error,
    parse_json,
)

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)

# Size caps per kind of file, checked (by fstat) before anything is read. Generous for what txl writes
# itself (a run.json or a config is a few KB, an optimizer.json a few hundred bytes; metrics.jsonl of a
# 400k-step run ~80 MB; wt103's 267k-word vocab.json ~6 MB), far below what would hurt a 2-core laptop.
CONFIG_LIMIT = 4 * 2**20  # config.json, run.json, trainer_state.json, meta.json, tokenizer_config.json, TOML
STATE_LIMIT = 64 * 2**20  # optimizer.json and other state records
METRICS_LIMIT = 512 * 2**20  # metrics.jsonl
VOCAB_LIMIT = 256 * 2**20  # vocab.json, vocab.pkl, vocab.txt, merges


def size_text(n: int) -> str:
    """'3.0 GiB', '512 KiB', '17 bytes'."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}".replace(".0 ", " ")
    return f"{n} bytes"


# ---------------------------------------------------------------------------------------------
# Links and kinds of entries


def is_link(path: str | Path) -> bool:
    with contextlib.suppress(OSError, ValueError):
        return stat.S_ISLNK(os.lstat(path).st_mode)
    return False


def refuse_link(path: str | Path, where: str = "where it writes") -> None:
    """One line naming an entry that is a symbolic link where txl would write, move or delete."""
    if is_link(path):
        raise OutputError(f"{path} is a symbolic link; txl does not follow links {where} (it would write or move "
                          "files outside it): remove the link or use another directory")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def check_own_file(fd: int, path: str | Path, *, what: str = "file") -> None:
    """A file txl changes in place (appends to, truncates) must be a regular file of this user with one
    link: a hard link planted in a directory would otherwise make txl write to a file elsewhere."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise OutputError(f"{what} {path} is {_kind(st.st_mode)}, not a regular file; remove it or use another "
                          "directory")
    if st.st_nlink != 1:
        raise OutputError(f"{what} {path} has {st.st_nlink} hard links; txl does not write to a file that is "
                          "also elsewhere (it would change the other copy): remove it or use another directory")
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise OutputError(f"{what} {path} belongs to another user (uid {st.st_uid}); txl changes only files of "
                          "its own user in place: remove it or use another directory")


# ---------------------------------------------------------------------------------------------
# Writing


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "wb"):
    """Yield a file to fill; on success it replaces `path` atomically, without following any link there.

    The temporary is created under an unguessable name with O_CREAT | O_EXCL | O_NOFOLLOW in the same
    directory (opened once, then used by descriptor), fsynced and renamed into place. On an exception
    it is removed and `path` is untouched. OS errors become one `OutputError` naming `path`.
    """
    path = Path(path)
    refuse_link(path)
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY | _CLOEXEC | _DIRECTORY)
    except OSError as err:
        raise OutputError(f"cannot write {path}: {describe_os_error(err)}") from None
    tmp = None
    try:
        while tmp is None:
            name = f".{path.name[:100]}.{os.urandom(6).hex()}.tmp"
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o666,
                             dir_fd=dir_fd)
            except FileExistsError:
                continue
            tmp = name
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        tmp = None
        with contextlib.suppress(OSError):
            os.fsync(dir_fd)
    except OSError as err:
        raise OutputError(f"cannot write {path}: {describe_os_error(err)}") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
        os.close(dir_fd)


def write_bytes(path: str | Path, data: bytes) -> None:
    """Create `path` holding `data`, atomically and without following a link (see `atomic_file`)."""
    with atomic_file(path) as f:
        f.write(data)


def write_text(path: str | Path, text: str) -> None:
    write_bytes(path, text.encode("utf-8", "surrogateescape"))


def write_json(path: str | Path, data: Any, *, indent: int | None = 2) -> None:
    """JSON (sorted keys, a final newline) written like any other file here."""
    write_text(path, json.dumps(data, indent=indent, sort_keys=True) + "\n")


def save_figure(fig, path: str | Path, **kwargs) -> None:
    """matplotlib's savefig opens the path itself (following links): render into memory, then write."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=Path(path).suffix.lstrip(".").lower() or "png", **kwargs)
    write_bytes(path, buffer.getvalue())


def write_figure(fig, path: str | Path, **kwargs) -> Path:
    """A finished figure as a file: its folder made, written as `save_figure` does, a failure one
    `OutputError` line, and the figure closed in every case. Returns the path."""
    import matplotlib.pyplot as plt

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_figure(fig, path, **kwargs)
    except OSError as err:
        raise OutputError(f"cannot write {path}: {describe_os_error(err)}") from None
    finally:
        plt.close(fig)
    return path


def save_array(path: str | Path, array) -> None:
    """np.save without pickles, into memory, then written like any other file here."""
    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    write_bytes(path, buffer.getvalue())


def _open_own(path: Path, flags: int, mode: int, what: str) -> int:
    """A descriptor of `path` opened with `flags` (plus O_NOFOLLOW | O_NONBLOCK, so neither a link nor a
    FIFO can redirect or block it), checked to be a regular file of this user with one link."""
    refuse_link(path)
    try:
        fd = os.open(path, flags | _NOFOLLOW | _CLOEXEC | _NONBLOCK, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise OutputError(f"{path} is a symbolic link; txl never writes through a link: remove it") from None
        if err.errno == errno.ENXIO:  # a FIFO nobody reads, opened for writing
            raise OutputError(f"{what} {path} is a FIFO, not a regular file; remove it or use another directory") from None
        raise OutputError(f"cannot write {path}: {describe_os_error(err)}") from None
    try:
        check_own_file(fd, path, what=what)
        _set_blocking(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_append(path: str | Path, *, what: str = "file"):
    """Open `path` for appending text (the metrics log of a run): created if absent; an existing entry must
    be a regular file of this user with one link, never a symbolic link (`check_own_file`)."""
    fd = _open_own(Path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666, what)
    return os.fdopen(fd, "a", encoding="utf-8")


def open_update(path: str | Path, *, what: str = "file", create: bool = True) -> int:
    """A descriptor for reading and writing `path` in place (a lock file), with `open_append`'s checks."""
    return _open_own(Path(path), os.O_RDWR | (os.O_CREAT if create else 0), 0o644, what)


TEMPORARY = re.compile(r"^\..+\.[0-9a-f]{12}\.tmp$")  # the names `atomic_file` gives its temporaries


def remove_stale_temporaries(directory: Path, names: tuple[str, ...]) -> None:
    """Delete what a killed writer left of `atomic_file` temporaries for these names (regular files
    only; call with the directory's lock held, so none of them is being written)."""
    for entry in directory.iterdir():
        ours = TEMPORARY.match(entry.name) and any(entry.name.startswith(f".{n}.") for n in names)
        if ours and stat.S_ISREG(os.lstat(entry).st_mode):
            with contextlib.suppress(OSError):
                entry.unlink()


def fsync_dir(path: str | Path) -> None:
    """Persist a rename: on POSIX the directory entry itself must be flushed."""
    with contextlib.suppress(OSError):  # not every file system lets a directory be opened
        fd = os.open(path, os.O_RDONLY | _CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---------------------------------------------------------------------------------------------
# Reading


def _set_blocking(fd: int) -> None:
    with contextlib.suppress(ImportError, OSError):
        import fcntl

        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~_NONBLOCK)


def open_regular(path: str | Path, *, what: str = "file", error: type[TxlError] = DataError,
                 follow_links: bool = False, limit: int | None = None) -> BinaryIO:
    """Open `path` for reading in binary: a regular file (checked on the descriptor, so nothing can swap
    it in between), at most `limit` bytes when given, not a symbolic link unless `follow_links` (a path the
    user typed may be a link; an entry inside a directory from a stranger may not)."""
    path = Path(path)
    flags = os.O_RDONLY | _CLOEXEC | _NONBLOCK | (0 if follow_links else _NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise error(f"{what} not found: {path}") from None
    except OSError as err:
        if err.errno == errno.ELOOP and not follow_links:
            raise error(f"{what} {path} is a symbolic link; txl does not follow links inside a directory it reads "
                        "(it could read a file elsewhere): replace the link with the file") from None
        raise error(f"cannot read {what} {path}: {describe_os_error(err, reading=True)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what} {path} is {_kind(st.st_mode)}, not a regular file; txl reads only regular files: "
                        "replace it with the file")
        if limit is not None and st.st_size > limit:
            raise error(f"{what} {path} is {size_text(st.st_size)}, more than the {size_text(limit)} txl reads for "
                        "such a file; it is not one txl wrote (or it is damaged)")
        _set_blocking(fd)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def read_bytes(path: str | Path, *, what: str = "file", limit: int, error: type[TxlError] = DataError,
               follow_links: bool = False) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (see `open_regular`)."""
    with open_regular(path, what=what, error=error, follow_links=follow_links, limit=limit) as f:
        try:  # ask for what fstat saw (+1 to notice growth): read(n) allocates n bytes up front
            data = f.read(min(limit, os.fstat(f.fileno()).st_size) + 1)
        except OSError as err:
            raise error(f"cannot read {what} {path}: {describe_os_error(err, reading=True)}") from None
    if len(data) > limit:  # it grew past the cap after the check
        raise error(f"{what} {path} is more than the {size_text(limit)} txl reads for such a file")
    return data


def read_text(path: str | Path, *, what: str = "file", limit: int, error: type[TxlError] = DataError,
              follow_links: bool = False) -> str:
    """UTF-8 text of a regular file of at most `limit` bytes; bad UTF-8 is one line naming the byte."""
    data = read_bytes(path, what=what, limit=limit, error=error, follow_links=follow_links)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{what} {path} is not UTF-8 text (byte {err.start}); the file is damaged or of another "
                    "kind") from None


def read_json(path: str | Path, *, what: str = "JSON file", limit: int = CONFIG_LIMIT,
              error: type[TxlError] = CheckpointError, follow_links: bool = False) -> Any:
    """A JSON file through `read_text`, duplicate keys refused (`txl.errors.parse_json`); nesting is
    bounded by the parser's recursion limit, reported in one line."""
    text = read_text(path, what=what, limit=limit, error=error, follow_links=follow_links)
    try:
        return parse_json(text)
    except DuplicateKeyError as err:
        raise error(f"{what} {path} is ambiguous: {err}; the file is damaged or was edited") from None
    except RecursionError:
        raise error(f"{what} {path} nests too deeply to be a JSON file txl reads; the file is damaged") from None
    except ValueError as err:  # JSONDecodeError, a 5000-digit number
        raise error(f"{what} {path} is not valid JSON ({str(err)[:200]}); the file is damaged") from None


def read_proc(path: str, *, limit: int = 4 * 2**20) -> str:
    """A kernel file under /proc (`/proc/cpuinfo`, `/proc/self/status`): fstat gives them size 0, so they
    are read as a stream, up to `limit` bytes. OSError passes through (the callers fall back)."""
    if not path.startswith("/proc/"):
        raise ValueError(f"read_proc reads /proc files only, not {path}")
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", "replace")


def create_log(path: str | Path):
    """A fresh file for a child process's output (the runs of experiments/): an old regular entry is removed
    first, a link is refused, and the new file is created with O_EXCL | O_NOFOLLOW (never truncating a
    file that is also elsewhere)."""
    path = Path(path)
    refuse_link(path)
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISREG(os.lstat(path).st_mode):
            os.unlink(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o666)
    except OSError as err:
        raise OutputError(f"cannot write {path}: {describe_os_error(err)}") from None
    return os.fdopen(fd, "w", encoding="utf-8")
