"""`txl data download NAME`: fetch a benchmark archive, verify it, extract the files the readers need.

Safety rules, in the order they apply:

1. The archive streams into `<dest>/<archive>.part`. A dropped connection is retried with an HTTP
   `Range` request from the bytes already on disk (a server that ignores Range gets a restart);
   after `retries` failures the `.part` stays, and the same command later resumes it.
2. The whole archive is checked against its pinned sha256 (or `--sha256`). On a mismatch the `.part`
   is deleted, so a corrupt download can neither be resumed nor mistaken for a good one.
3. Only the known members are extracted, into a fresh directory `<dest>/.txl-extract-<pid>-<random>`
   that this run creates, each checked against its own pin where we have one, and renamed into place
   only once all of them passed. Member names in the archive are never used as output paths, so a
   hostile archive cannot write outside `dest`; a tar's PAX and GNU long-name headers are bounded
   before `tarfile` reads them (`bounded_tar`).
4. Nothing is written through a link planted in `dest` (issue 50): the `.part` that a resume appends to
   is opened by `txl.io.open_update` (O_NOFOLLOW, a regular file of this user with one link, else one
   line naming it), the extracted files are created by `txl.io.atomic_file` inside the fresh directory,
   and the archive is read by `txl.io.open_regular` (no links, regular files only).

Pins (see the report in docs/guide/data.md, "Download"): the archive sha256 values were cross-checked
against several independent public projects that pin the same files; nobody could download the
archives from this build machine, so treat them as corroborated, not measured here. The PTB archive
has no pin we could corroborate; its six extracted files are pinned instead (sha256 measured on the
copies in the shared data directory, the word-level ones also match public pins).

Size: one download's safety rules (resume, digest, bounded extraction, link and path checks) read in
the order they apply; split across modules, a reviewer could no longer check them against each other.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import math
import os
import re
import shutil
import stat
import tarfile
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from txl.data.cache import _alive, ensure_dir
from txl.errors import DataError, TxlError, describe_os_error
from txl.io import atomic_file, fsync_dir, open_regular, open_update, size_text

CHUNK = 1 << 16


@dataclass(frozen=True)
class Member:
    """A file extracted from the archive: its path inside, its output name, and what it must hash to."""

    name: str
    dest: str
    sha256: str | None = None
    size: int | None = None


@dataclass(frozen=True)
class Source:
    name: str
    urls: tuple[str, ...]
    archive: str
    kind: str  # "zip" | "tgz"
    sha256: str | None
    members: tuple[Member, ...]
    specs: tuple[str, ...]
    pin_note: str
    max_bytes: int = 1 << 30  # the archive: the download stops (and is deleted) past this
    md5: str | None = None  # a second archive pin where no sha256 is corroborated (see the PTB note)
    max_unpacked: int = 1 << 30  # all extracted members together


_PTB_DATA = "simple-examples/data/"
SOURCES: dict[str, Source] = {
    s.name: s
    for s in [
        Source(
            "enwik8",
            ("https://mattmahoney.net/dc/enwik8.zip",),
            "enwik8.zip",
            "zip",
            # enwik8.zip, 36,445,475 bytes; the same value is pinned by several unrelated public repos.
            "547994d9980ebed1288380d652999f38a14fe291a6247c157c3d33d4932534bc",
            # The payload: exactly 1e8 bytes; sha256 likewise corroborated by several public repos.
            (
                Member(
                    "enwik8",
                    "enwik8",
                    "2b49720ec4d78c3c9fabaee6e4179a5e997302b3a70029f30f2d582218c024a8",
                    100_000_000,
                ),
            ),
            ("enwik8",),
            "archive and payload sha256 corroborated by independent public pins (not downloaded here)",
            max_bytes=48 << 20,  # 36,445,475 bytes
            max_unpacked=100_000_000,
        ),
        Source(
            "text8",
            ("https://mattmahoney.net/dc/text8.zip",),
            "text8.zip",
            "zip",
            # Corroborated by two unrelated public repos; the payload is exactly 1e8 bytes.
            "a6640522afe85d1963ad56c05b0ede0a0c000dddc9671758a6cc09b7a38e5232",
            (Member("text8", "text8", None, 100_000_000),),
            ("text8",),
            "archive sha256 corroborated by two independent public pins (not downloaded here)",
            max_bytes=48 << 20,  # about 31 MB
            max_unpacked=100_000_000,
        ),
        Source(
            "wikitext103",
            (
                "https://wikitext.smerity.com/wikitext-103-v1.zip",
                "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip",
            ),
            "wikitext-103-v1.zip",
            "zip",
            "242ba0f20b329cfdf1ccc61e9e9e5b59becf189db7f7a81cd2a0e2fc31539590",
            tuple(
                Member(f"wikitext-103/wiki.{s}.tokens", f"wiki.{s}.tokens")
                for s in ("train", "valid", "test")
            ),
            ("wikitext103",),
            "archive sha256 corroborated by several independent public pins (not downloaded here)",
            max_bytes=256 << 20,  # about 181 MB
            max_unpacked=640 << 20,  # about 540 MB of text
        ),
        Source(
            "wikitext2",
            (
                "https://wikitext.smerity.com/wikitext-2-v1.zip",
                "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-2-v1.zip",
            ),
            "wikitext-2-v1.zip",
            "zip",
            "92675f1d63015c1c8b51f1656a52d5bdbc33aafa60cc47a218a66e7ee817488c",
            tuple(
                Member(f"wikitext-2/wiki.{s}.tokens", f"wiki.{s}.tokens") for s in ("train", "valid", "test")
            ),
            ("wikitext2",),
            "archive sha256 corroborated by several independent public pins (not downloaded here)",
            max_bytes=16 << 20,  # about 4.5 MB
            max_unpacked=32 << 20,
        ),
        Source(
            "ptb",
            ("https://www.fit.vutbr.cz/~imikolov/rnnlm/simple-examples.tgz",),
            "simple-examples.tgz",
            "tgz",
            None,  # no corroborated sha256 of the archive: its MD5 (below) and the files' sha256 are pinned
            (
                Member(
                    _PTB_DATA + "ptb.train.txt",
                    "ptb.train.txt",
                    "fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf",
                    5_101_618,
                ),
                Member(
                    _PTB_DATA + "ptb.valid.txt",
                    "ptb.valid.txt",
                    "c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2",
                    399_782,
                ),
                Member(
                    _PTB_DATA + "ptb.test.txt",
                    "ptb.test.txt",
                    "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0",
                    449_945,
                ),
                Member(
                    _PTB_DATA + "ptb.char.train.txt",
                    "ptb.char.train.txt",
                    "e313d91425e06c4f0a8fb6e881dcce0c291f2a0e9f4dda54833069b122f91da9",
                    10_034_964,
                ),
                Member(
                    _PTB_DATA + "ptb.char.valid.txt",
                    "ptb.char.valid.txt",
                    "21661f63ec355085879458b6524644d4add5573541b4be14fb52ab2e2e995eb8",
                    786_084,
                ),
                Member(
                    _PTB_DATA + "ptb.char.test.txt",
                    "ptb.char.test.txt",
                    "1ef5607ac3c463b16e38bfe7900dd3bfc91de5a96e0f21e7eab5188b465b8ebe",
                    884_846,
                ),
            ),
            ("ptb-word", "ptb-char"),
            "archive pinned by its MD5 (corroborated by several public projects) and the six extracted files by "
            "sha256 (measured locally)",
            max_bytes=48 << 20,  # about 34 MB
            md5="30177ea32e27c525793142b6bf2c8e2d",
            max_unpacked=64 << 20,  # the six files: 17.7 MB
        ),
    ]
}

Log = Callable[[str], None]

MAX_MEMBERS = 100_000  # entries an archive may list (the real ones hold a few dozen)
DEADLINE = 6 * 3600.0  # seconds for a whole download, retries included
MIN_RATE = 1024.0  # bytes per second, averaged over RATE_WINDOW seconds
RATE_WINDOW = 60.0


@dataclass
class Limits:
    """What a download may cost; every check is made while the bytes arrive, before they are written."""

    max_bytes: int
    deadline: float  # time.monotonic() by which the download must be complete
    min_rate: float
    window: float
    url: str = ""
    seconds: float = 0.0  # the deadline, as given (for messages)

    def fail(self, part: Path, why: str) -> DataError:
        part.unlink(missing_ok=True)  # nothing is left behind
        return DataError(f"download of {self.url} stopped: {why}; the partial file was deleted")


def download(
    name: str,
    dest: str | os.PathLike | None = None,
    *,
    url: str | None = None,
    sha256: str | None = None,
    retries: int = 3,
    timeout: float = 60.0,
    backoff: float = 1.0,
    keep_archive: bool = False,
    force: bool = False,
    log: Log | None = None,
    max_bytes: int | None = None,
    deadline: float = DEADLINE,
    min_rate: float = MIN_RATE,
    rate_window: float = RATE_WINDOW,
) -> Path:
    """Download, verify and extract benchmark `name` into `dest`; returns the directory.

    `url` replaces the canonical mirrors; `sha256` replaces the archive pin and then also skips the
    per-file pins (a different archive has different files). Raises `DataError` on any failure.

    Limits hold while streaming: the archive stops at `max_bytes` (default: the corpus's own limit),
    the whole download at `deadline` seconds, and a transfer slower than `min_rate` bytes/s over
    `rate_window` seconds is abandoned; each deletes the partial file.
    """
    say = log or (lambda _msg: None)
    if name not in SOURCES:
        raise DataError(f"no download for {name!r}; downloadable: {', '.join(SOURCES)}")
    src = SOURCES[name]
    if url is not None:
        check_url(url)
    for flag, value in (("--deadline", deadline), ("--min-rate", min_rate), ("--rate-window", rate_window)):
        if not 0 <= value < math.inf:
            raise DataError(f"{flag} must be a finite number >= 0, got {value}")
    if max_bytes is not None and not 0 < max_bytes <= 1 << 50:
        raise DataError(f"--max-bytes must be in [1, 2**50], got {max_bytes}")
    if dest is None:
        from txl.data.spec import default_data_root

        dest = default_data_root() / name
    dest = ensure_dir(Path(dest).expanduser().absolute(), "destination directory")
    remove_stale_extracts(dest)
    expected = sha256.lower().strip() if sha256 else src.sha256
    if sha256 is not None and (len(expected) != 64 or any(c not in "0123456789abcdef" for c in expected)):
        raise DataError(f"--sha256 {sha256!r} is not a 64-digit hex sha256")
    check_members = sha256 is None

    outputs = [dest / m.dest for m in src.members]
    if not force and all(p.is_file() for p in outputs):
        say(f"{name}: already present in {dest}")
        return dest

    final_archive = dest / src.archive
    part = dest / (src.archive + ".part")
    if final_archive.is_file() and not force:
        archive = final_archive  # a previous run kept it; re-verify below before trusting it
    else:
        archive = part
        limits = Limits(max_bytes=max_bytes or src.max_bytes, deadline=time.monotonic() + deadline,
                        min_rate=min_rate, window=rate_window, seconds=deadline)
        urls = (url,) if url else src.urls
        try:
            _fetch_any(urls, part, retries=retries, timeout=timeout, backoff=backoff, log=say, limits=limits)
        except Unreachable as err:
            raise DataError(f"{err}; {offline_hint(src, dest, urls)}") from None

    if expected is None and src.md5 is not None:
        md5 = _digest(archive, hashlib.md5)
        if md5 != src.md5:
            archive.unlink(missing_ok=True)
            raise DataError(f"checksum mismatch for {src.archive}: expected md5 {src.md5}, got {md5}; the download "
                            "was deleted, run again (or pass --sha256 if the file changed upstream)")
    digest = _sha256(archive)
    if expected is None:
        say(
            f"{name}: no pinned sha256 for {src.archive}; got {digest} (the extracted files are checked instead)"
        )
    elif digest != expected:
        archive.unlink(missing_ok=True)
        raise DataError(
            f"checksum mismatch for {src.archive}: expected sha256 {expected}, got {digest}; the download was "
            f"deleted, run again (or pass --sha256 if the file changed upstream)"
        )
    _extract(src, archive, dest, check_members, say)
    if keep_archive:
        if archive != final_archive:
            os.replace(archive, final_archive)
            fsync_dir(dest)
    else:
        archive.unlink(missing_ok=True)
    say(f"{name}: ready in {dest}; specs: {', '.join(f'{s}:{dest}' for s in src.specs)}")
    return dest


def _sha256(path: Path) -> str:
    return _digest(path, hashlib.sha256)


def _digest(path: Path, kind) -> str:
    digest = kind()
    with open_regular(path, what="downloaded archive") as f:  # a link planted in dest is refused
        try:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        except OSError as err:
            raise DataError(f"cannot read {path}: {describe_os_error(err, reading=True)}") from None
    return digest.hexdigest()


def check_url(url: str) -> None:
    """One line for a `--url` that cannot name an archive over HTTP(S) (issue 50: a malformed one gave a
    traceback, `file:` read a local file and `ftp:` went around the HTTP checks)."""
    def bad(why: str) -> DataError:
        return DataError(f"--url {url[:200]!r} is not a download URL ({why}); write it as "
                         "https://HOST/PATH/ARCHIVE (http or https)")

    if not isinstance(url, str) or not url or len(url) > 8192:
        raise bad("empty or longer than 8192 characters")
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise bad("it holds a space or a control character; percent-encode it")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # ValueError for a port that is not a number in [0, 65535]
    except ValueError as err:
        raise bad(str(err)) from None
    if parts.scheme.lower() not in ("http", "https"):
        raise bad(f"scheme {parts.scheme + ':' if parts.scheme else 'missing'}")
    if not parts.hostname:
        raise bad("no host")
    if port == 0:
        raise bad("port 0")


class Unreachable(DataError):
    """No byte came from any mirror because no connection was made (no network, DNS, refused)."""


def _fetch_any(urls: tuple[str, ...], part: Path, **kwargs) -> None:
    errors: list[DataError] = []
    for url in urls:
        try:
            _fetch(url, part, **kwargs)
            return
        except DataError as err:
            errors.append(err)
    text = str(errors[0]) if len(errors) == 1 else " | ".join(map(str, errors))
    raise (Unreachable if all(isinstance(e, Unreachable) for e in errors) else DataError)(text)


def offline_hint(src: Source, dest: Path, urls: tuple[str, ...]) -> str:
    """What to do without a network: fetch the archive elsewhere, then let txl check and unpack it here
    (a complete archive in DEST is verified and extracted without a connection), or unpack it anywhere
    and point the corpus spec at that folder (the readers accept the unpacked layout as it is)."""
    specs = " or ".join(f"--data {spec}:DIR" for spec in src.specs)
    return (f"no network? get {urls[0]} on a machine that has one, put {src.archive} in {dest} and run this "
            f"command again (it is checked and unpacked offline), or unpack it into DIR and train with {specs}; "
            "or retry when online")


def _lsize(path: Path) -> int:
    """Bytes in `path` for a message, without following a link (0 when absent)."""
    with contextlib.suppress(OSError):
        return os.lstat(path).st_size
    return 0


def _open_part(part: Path) -> int:
    """A descriptor of the `.part` the download appends to: created if absent; an existing entry must be
    a regular file of this user with one link (txl.io.open_update), so a symbolic or hard link planted
    under its name is refused instead of written through."""
    try:
        return open_update(part, what="partial download")
    except TxlError as err:
        raise DataError(f"{err} (the download resumes only from a .part it wrote itself)") from None


def _fetch(url: str, part: Path, **kwargs) -> None:
    """Stream `url` into `part`, resuming with HTTP Range after a dropped connection. A `.part` this call
    created and that got no byte is removed when it fails (a wrong URL leaves nothing behind)."""
    existed = os.path.lexists(part)
    try:
        _fetch_into(url, part, **kwargs)
    except BaseException:
        with contextlib.suppress(OSError):
            if not existed and stat.S_ISREG((st := os.lstat(part)).st_mode) and st.st_size == 0:
                part.unlink()
        raise


def _fetch_into(url: str, part: Path, *, retries: int, timeout: float, backoff: float, log: Log,
                limits: Limits) -> None:
    limits.url = url
    failures = 0
    while True:
        fd = _open_part(part)
        with os.fdopen(fd, "r+b") as f:
            have = os.fstat(f.fileno()).st_size  # the file opened, not whatever a name points at
            if have > limits.max_bytes:
                f.close()
                raise limits.fail(part, f"{part.name} already holds {have:,} bytes, more than the "
                                        f"{limits.max_bytes:,} allowed")
            restart = _fetch_once(url, part, f, have, timeout=timeout, limits=limits)
        if restart is None:
            return
        if restart == "restart":
            part.unlink(missing_ok=True)
            continue
        failures += 1
        err = restart
        got = _lsize(part)
        reason = getattr(err, "reason", None) or err
        if time.monotonic() >= limits.deadline:
            raise limits.fail(part, f"it was not done within {limits.seconds:g} s (--deadline; {reason})") from None
        if failures > retries and got == 0 and isinstance(err, urllib.error.URLError):  # never connected
            raise Unreachable(f"cannot reach {urllib.parse.urlsplit(url).hostname} ({reason})") from None
        if failures > retries:
            raise DataError(
                f"download of {url} interrupted after {got:,} bytes ({reason}); run the same command "
                f"again to resume from {part.name}"
            ) from None
        log(f"connection problem after {got:,} bytes ({reason}); resuming ({failures}/{retries})")
        time.sleep(backoff * failures)


def _fetch_once(url: str, part: Path, f, have: int, *, timeout: float, limits: Limits):
    """One request into the open `.part` `f` holding `have` bytes: None when complete, "restart" when
    the `.part` must be dropped, or the connection error to retry after."""
    headers = {"User-Agent": "txl-data/1", "Accept-Encoding": "identity"}
    if have:
        headers["Range"] = f"bytes={have}-"
    try:
        remaining = limits.deadline - time.monotonic()
        if remaining <= 0:
            raise limits.fail(part, f"it was not done within {limits.seconds:g} s (--deadline)")
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=min(timeout, remaining)
        ) as resp:
            if have and resp.status == 206 and _range_start(resp) == have:
                total = _content_length(resp, have)
            elif resp.status == 206:  # a range we did not ask for: start again from zero
                return "restart"
            else:  # 200: the server sent the whole file (no Range support): restart cleanly
                if resp.status != 200:
                    raise DataError(f"download of {url} failed: unexpected HTTP {resp.status}")
                have, total = 0, _content_length(resp, 0)
            if total is not None and total > limits.max_bytes:
                raise limits.fail(part, f"the server announces {total:,} bytes, more than the "
                                        f"{limits.max_bytes:,} allowed for this corpus (--max-bytes)")
            _stream(resp, f, part, have, limits)
        size = os.fstat(f.fileno()).st_size
        if total is not None and size != total:
            raise ConnectionError(f"connection closed after {size:,} of {total:,} bytes")
        return None
    except urllib.error.HTTPError as err:
        if err.code == 416 and have:  # our .part is not a prefix of what the server has: restart
            return "restart"
        raise DataError(f"download of {url} failed: HTTP {err.code} {err.reason}; check the URL") from None
    except _WriteError as err:  # our disk, not the connection
        part.unlink(missing_ok=True)
        raise DataError(f"cannot write {part}: {describe_os_error(err.error)}; the partial file was "
                        "deleted") from None
    except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
        return err


class _WriteError(Exception):
    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


class _ReadError(Exception):
    """Reading a member out of the archive failed (a damaged stream), as opposed to writing it."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


def _stream(resp, f, part: Path, have: int, limits: Limits) -> None:
    """Copy the body into the open `.part` `f` from byte `have` (0: the file is emptied first) as it
    arrives (read1: whatever the socket has, so a trickle cannot hide behind a full-buffer read),
    checking size, deadline and rate before every write."""
    try:
        f.seek(have)
        f.truncate(have)
    except OSError as err:
        raise _WriteError(err) from None
    size = have
    window_start, window_bytes = time.monotonic(), size
    while True:
        chunk = resp.read1(CHUNK) if hasattr(resp, "read1") else resp.read(CHUNK)
        if not chunk:
            break
        size += len(chunk)
        now = time.monotonic()
        if size > limits.max_bytes:
            raise limits.fail(part, f"the body passed {limits.max_bytes:,} bytes, the limit for this corpus "
                                    "(--max-bytes)")
        if now >= limits.deadline:
            raise limits.fail(part, f"it was not done within {limits.seconds:g} s (--deadline)")
        if limits.window and now - window_start >= limits.window:
            rate = (size - window_bytes) / (now - window_start)
            if rate < limits.min_rate:
                raise limits.fail(part, f"the transfer was slower than the minimum of {limits.min_rate:,.0f} "
                                        f"bytes/s over {limits.window:g} s (--min-rate)")
            window_start, window_bytes = now, size
        try:
            f.write(chunk)
        except OSError as err:
            raise _WriteError(err) from None
    try:
        f.flush()
        os.fsync(f.fileno())
    except OSError as err:
        raise _WriteError(err) from None


def _range_start(resp) -> int | None:
    value = resp.headers.get("Content-Range", "")
    with contextlib.suppress(ValueError, IndexError):
        return int(value.split()[1].split("-")[0])
    return None


def _content_length(resp, offset: int) -> int | None:
    value = resp.headers.get("Content-Length")
    return offset + int(value) if value and value.isdigit() else None


def _normalize(name: str) -> str:
    while name.startswith("./"):
        name = name[2:]
    return name


# Tar headers that `tarfile` reads whole into memory before it returns the member they describe: PAX
# extended headers ('x' per member, 'g' global, Solaris 'X') and GNU long names and link targets
# ('L', 'K'). A real one holds a path and a few numbers (a few KB at most); a 408 KB tgz carrying one
# of 400 MB cost 1.2 GB (issue 50). Sparse members, whose maps tarfile also gathers in memory, are
# never part of the published archives and are refused.
TAR_HEADER_LIMIT = 1 << 20  # one header
TAR_HEADERS_TOTAL = 16 << 20  # all of them in one archive
_LONG_HEADERS = {tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
                 tarfile.GNUTYPE_LONGLINK}


class ArchiveError(DataError):
    """An archive whose structure is refused before it is read (an oversized header, a sparse member)."""


def _bounded_tarinfo(name: str, header_limit: int, total_limit: int) -> type[tarfile.TarInfo]:
    left = [total_limit]

    class BoundedTarInfo(tarfile.TarInfo):
        # `TarFile(tarinfo=...)` is public; `_proc_member` is where tarfile dispatches on the header type
        # right after reading the 512-byte header block, before it reads the extended header's data (the
        # same method since Python 2.6; tests/test_data_hostile.py fails if it stops being called).
        def _proc_member(self, tarfile_):
            if self.type in _LONG_HEADERS:
                if self.size > header_limit:
                    raise ArchiveError(f"{name} has a tar header of {size_text(self.size)} (type "
                                       f"{self.type.decode('latin-1')!r}), more than the {size_text(header_limit)} "
                                       "txl reads for one; it is not a published archive")
                if self.size > left[0]:
                    raise ArchiveError(f"{name} has more than {size_text(total_limit)} of extended tar "
                                       "headers in all; it is not a published archive")
                left[0] -= self.size
            return super()._proc_member(tarfile_)

        def _proc_sparse(self, tarfile_):
            raise ArchiveError(f"{name} holds a sparse member; the published archives hold none")

        def _proc_gnusparse_00(self, *args):
            raise ArchiveError(f"{name} holds a sparse member; the published archives hold none")

        _proc_gnusparse_01 = _proc_gnusparse_10 = _proc_gnusparse_00

    return BoundedTarInfo


@contextlib.contextmanager
def bounded_tar(path: Path, *, header_limit: int = TAR_HEADER_LIMIT, total_limit: int = TAR_HEADERS_TOTAL,
                name: str | None = None) -> Iterator[tarfile.TarFile]:
    """`tarfile.open(path, "r:*")` of a regular file (not a link), whose PAX and GNU long-name headers
    are refused (`ArchiveError`) when one passes `header_limit` bytes or all pass `total_limit`, before
    tarfile reads them."""
    with open_regular(path, what="downloaded archive") as raw, tarfile.open(
            fileobj=raw, mode="r:*", tarinfo=_bounded_tarinfo(name or path.name, header_limit, total_limit)) as tf:
        yield tf


EXTRACT = re.compile(r"^\.txl-extract-(?P<pid>\d+)-[A-Za-z0-9_]+$")


def remove_stale_extracts(dest: Path) -> None:
    """Remove the extraction directories (`.txl-extract-<pid>-*`) of downloads whose process is gone
    (killed mid-extraction). Only real directories of that naming are touched, never followed links."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(dest):
            match = EXTRACT.match(entry.name)
            if match is None or int(match["pid"]) == os.getpid() or _alive(int(match["pid"])):
                continue
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(os.lstat(entry.path).st_mode):
                    shutil.rmtree(entry.path, ignore_errors=True)


def _extract(src: Source, archive: Path, dest: Path, check: bool, log: Log) -> None:
    """Extract the known members into a fresh directory, verify, then rename all; on failure remove all."""
    budget = [src.max_unpacked]  # bytes all members together may still unpack to
    too_many = DataError(f"{src.archive} lists more than {MAX_MEMBERS:,} entries; it is not the {src.name} archive "
                         "and was deleted")
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".txl-extract-{os.getpid()}-", dir=dest))
    except OSError as err:
        raise DataError(f"cannot extract {src.archive} into {dest}: {describe_os_error(err)}") from None
    try:
        done: list[tuple[Path, Path]] = []
        if src.kind == "zip":
            with open_regular(archive, what="downloaded archive") as raw, zipfile.ZipFile(raw) as zf:
                if len(zf.infolist()) > MAX_MEMBERS:
                    raise too_many
                names = {_normalize(n): n for n in zf.namelist()}
                for m in src.members:
                    if m.name not in names:
                        raise DataError(f"{src.archive} lacks {m.name}; it is not the {src.name} archive")
                    with zf.open(names[m.name]) as fin:
                        done.append(_copy_member(fin, staging, dest, m, check, budget, src))
        else:
            with bounded_tar(archive, name=src.archive) as tf:
                infos = {}
                for count, info in enumerate(tf, 1):  # one header at a time: a bomb of entries stops here
                    if count > MAX_MEMBERS:
                        raise too_many
                    if info.isfile():
                        infos[_normalize(info.name)] = info
                for m in src.members:
                    info = infos.get(m.name)
                    fin = tf.extractfile(info) if info is not None else None
                    if fin is None:
                        raise DataError(f"{src.archive} lacks {m.name}; it is not the {src.name} archive")
                    with fin:
                        done.append(_copy_member(fin, staging, dest, m, check, budget, src))
        for tmp, final in done:  # within one file system: each rename is atomic and replaces a link, never follows it
            os.replace(tmp, final)
        fsync_dir(dest)
        log(f"{src.name}: extracted {', '.join(final.name for _, final in done)}")
    except ArchiveError as err:
        archive.unlink(missing_ok=True)
        raise DataError(f"{err}; it was deleted") from None
    except DataError:
        archive.unlink(missing_ok=True)  # a wrong archive must not be resumed or reused
        raise
    except _WriteError as err:
        raise DataError(f"cannot extract {src.archive} into {dest}: {describe_os_error(err.error)}") from None
    except TxlError as err:  # txl.io's writer: the destination's disk
        raise DataError(f"cannot extract {src.archive} into {dest}: {err}") from None
    except (_ReadError, zipfile.BadZipFile, tarfile.TarError, EOFError, OSError, zlib.error) as err:
        archive.unlink(missing_ok=True)
        raise DataError(f"{src.archive} is corrupt ({err}); it was deleted, run the download again") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _copy_member(fin, staging: Path, dest: Path, m: Member, check: bool, budget: list[int],
                 src: Source) -> tuple[Path, Path]:
    """Copy one member out into `staging` (created by this run), stopping as soon as it passes its pinned
    size (when checked) or the archive's unpacked budget: a 1 MB archive that inflates to gigabytes
    writes no more than that. Returns (the file in staging, its final path in `dest`)."""
    digest = hashlib.sha256()
    size = 0
    limit = m.size if check and m.size is not None else budget[0]
    out = staging / m.dest
    with atomic_file(out) as fout:  # a fresh temporary (O_EXCL | O_NOFOLLOW), renamed to `out` when done
        while True:
            try:
                chunk = fin.read(1 << 20)
            except OSError as err:  # a damaged compressed stream (gzip raises OSError subclasses)
                raise _ReadError(err) from None
            if not chunk:
                break
            size += len(chunk)
            if size > limit or size > budget[0]:
                raise DataError(
                    f"{m.name} unpacks to more than {min(limit, budget[0]):,} bytes, the limit for {src.name}; "
                    "the archive is not the published one and was deleted"
                )
            digest.update(chunk)
            try:
                fout.write(chunk)
            except OSError as err:
                raise _WriteError(err) from None
        if check and m.size is not None and size != m.size:
            raise DataError(f"{m.name} has {size:,} bytes, expected {m.size:,}; the archive is not the published one")
        if check and m.sha256 is not None and digest.hexdigest() != m.sha256:
            raise DataError(
                f"checksum mismatch for {m.name}: expected sha256 {m.sha256}, got {digest.hexdigest()}; "
                f"nothing was extracted"
            )
    budget[0] -= size
    return out, dest / m.dest
