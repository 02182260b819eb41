"""Writing into a directory that may come from a stranger, and one writer per run.

A run directory is shared like a file: a colleague's run, one downloaded next to a paper. Its entries
may be symbolic links aimed anywhere (`sample.txt -> ~/.bashrc`), so every file txl writes into it is
created here: a fresh temporary name opened with `O_CREAT | O_EXCL | O_NOFOLLOW` relative to the
directory's own descriptor, fsynced, then renamed over the final name (a rename replaces a link, it
never writes through it). An entry that is already a link is refused by name instead of replaced:
txl never renames or deletes anything outside the directory it was given (SECURITY.md).

`RunLock` is the one-writer rule: an advisory `fcntl.flock` on `RUN/.txl-lock`, held for the whole run.
The kernel drops it when its process dies (even by SIGKILL), so a stale lock file never blocks; a
holder that finishes removes the file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from pathlib import Path

from txl.errors import OutputError, UsageError, describe_os_error
from txl.io.files import (  # noqa: F401 - the writers moved to txl.io; importable from here as before
    TEMPORARY,
    atomic_file,
    is_link,
    open_append,
    open_regular,
    open_update,
    refuse_link,
    remove_stale_temporaries,
    save_array,
    save_figure,
    write_bytes,
    write_text,
)

LOCK_NAME = ".txl-lock"


def is_real_dir(path: Path) -> bool:
    """A directory itself, not a link to one."""
    with contextlib.suppress(OSError, ValueError):
        return stat.S_ISDIR(os.lstat(path).st_mode)
    return False


def check_utf8_path(path: Path, flag: str = "--out") -> None:
    """safetensors (Rust) takes UTF-8 paths only: refuse others before anything is written."""
    try:
        os.fsencode(path).decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{flag} {os.fsdecode(os.fsencode(path))!r} is not a UTF-8 path; txl's checkpoint "
                         "library cannot open it: choose a name in UTF-8") from None


def read_text_nofollow(path: str | Path, limit: int) -> str | None:
    """The text of a regular file in a run of at most `limit` bytes (None when absent); a link, a FIFO or
    a device is refused in one line."""
    path = Path(path)
    refuse_link(path)
    try:
        f = open_regular(path, what="file", error=OutputError, limit=limit)
    except OutputError:
        if not os.path.lexists(path):
            return None
        raise
    with f:
        return f.read(limit).decode("utf-8", "replace")


def _lock_holder(fd: int, wait: float = 2.0) -> str:
    """" (pid N)" of the process holding the lock on `fd`'s file, or "" when it does not say.

    The holder writes its pid just after it takes the lock: a loser of a race that reads the file in
    between sees it empty, so it looks again for up to `wait` seconds."""
    deadline = time.monotonic() + wait
    while True:
        with contextlib.suppress(OSError, ValueError):
            text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            if text.isdigit():
                return f" (pid {int(text)})"
        if time.monotonic() >= deadline:
            return ""
        time.sleep(0.01)


class RunLock:
    """An exclusive advisory lock on a run directory, held until `release()` or the process ends.

    A second holder (another `txl train` on the same --out or --resume) fails at once with a
    `UsageError` naming the holder's pid. Locks taken twice by one process are shared (counted).
    """

    _held: dict[str, RunLock] = {}

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.fd: int | None = None
        self.count = 0
        self.created_dir = False  # the directory was created for this lock: removed again by abandon()

    @classmethod
    def acquire(cls, directory: str | Path, *, created_dir: bool = False) -> RunLock:
        """`created_dir`: the caller just created `directory`; `abandon()` removes it again."""
        key = os.path.realpath(directory)
        lock = cls._held.get(key)
        if lock is None:
            lock = cls(directory)
            lock.created_dir = created_dir
            try:
                lock._take()
            except BaseException:
                if created_dir:
                    with contextlib.suppress(OSError):
                        os.rmdir(directory)
                raise
            cls._held[key] = lock
        lock.count += 1
        return lock

    def _take(self) -> None:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: no advisory locks
            return
        path = self.directory / LOCK_NAME
        for _ in range(100):
            refuse_link(path, "in a run directory")
            # a regular file of ours with one link: a hard link planted as .txl-lock would have us
            # truncate and rewrite a file outside the run (txl.io.check_own_file)
            fd = open_update(path, what="the run lock")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                holder = _lock_holder(fd)
                os.close(fd)
                if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise UsageError(f"{self.directory} is in use by another txl process{holder}; wait for it to "
                                     "finish (or stop it), or pick another --out") from None
                raise OutputError(f"cannot lock {path}: {describe_os_error(err)}") from None
            # The holder removes the file when it finishes; a lock taken on a file that was removed (or
            # replaced) meanwhile guards nothing: try again with the file now at `path`.
            mine = os.fstat(fd)
            try:
                now = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_ino, now.st_dev) == (mine.st_ino, mine.st_dev):
                break
            os.close(fd)
        else:  # pragma: no cover - the file changed under us a hundred times
            raise OutputError(f"cannot lock {path}: it keeps changing; is another program deleting it?")
        with contextlib.suppress(OSError):
            # pid first, then cut to its length: a reader never sees the file empty once it held a pid
            pid = f"{os.getpid()}\n".encode()
            os.pwrite(fd, pid, 0)
            os.ftruncate(fd, len(pid))
        self.fd = fd

    def release(self) -> None:
        """Drop one hold; the last one removes the lock file (while still holding it, so no one else can
        hold a lock on the removed file: see `_take`) and closes it, which drops the flock."""
        self.count -= 1
        if self.count > 0:
            return
        RunLock._held.pop(os.path.realpath(self.directory), None)
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.directory / LOCK_NAME)
            os.close(self.fd)
            self.fd = None

    def abandon(self) -> None:
        """Release after a failed start: the directory created for the lock (if still empty) goes again,
        so the failed command leaves nothing behind."""
        last = self.count == 1
        created_dir = self.created_dir
        self.release()
        if last and created_dir:
            with contextlib.suppress(OSError):
                os.rmdir(self.directory)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()



