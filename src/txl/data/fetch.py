"""`txl data download NAME`: fetch a benchmark archive, verify it, extract the files the readers need.

Safety rules, in the order they apply:

1. The archive streams into `<dest>/<archive>.part`. A dropped connection is retried with an HTTP
   `Range` request from the bytes already on disk (a server that ignores Range gets a restart);
   after `retries` failures the `.part` stays, and the same command later resumes it.
2. The whole archive is checked against its pinned sha256 (or `--sha256`). On a mismatch the `.part`
   is deleted, so a corrupt download can neither be resumed nor mistaken for a good one.
3. Only the known members are extracted, each to `<name>.part`, checked against its own pin where we
   have one, and renamed into place only once all of them passed. Member names in the archive are
   never used as output paths, so a hostile archive cannot write outside `dest`.

Pins (see the report in docs/data.md, "Download"): the archive sha256 values were cross-checked
against several independent public projects that pin the same files; nobody could download the
archives from this build machine, so treat them as corroborated, not measured here. The PTB archive
has no pin we could corroborate; its six extracted files are pinned instead (sha256 measured on the
copies in the shared data directory, the word-level ones also match public pins).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import math
import os
import tarfile
import time
import urllib.error
import urllib.request
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from txl.data.cache import ensure_dir, fsync_dir
from txl.errors import DataError, describe_os_error

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
    for flag, value in (("--deadline", deadline), ("--min-rate", min_rate), ("--rate-window", rate_window)):
        if not 0 <= value < math.inf:
            raise DataError(f"{flag} must be a finite number >= 0, got {value}")
    if max_bytes is not None and not 0 < max_bytes <= 1 << 50:
        raise DataError(f"--max-bytes must be in [1, 2**50], got {max_bytes}")
    if dest is None:
        from txl.data.spec import default_data_root

        dest = default_data_root() / name
    dest = ensure_dir(Path(dest).expanduser().absolute(), "destination directory")
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
        _fetch_any(
            (url,) if url else src.urls, part, retries=retries, timeout=timeout, backoff=backoff, log=say,
            limits=limits,
        )

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
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _fetch_any(urls: tuple[str, ...], part: Path, **kwargs) -> None:
    errors = []
    for url in urls:
        try:
            _fetch(url, part, **kwargs)
            return
        except DataError as err:
            errors.append(str(err))
    raise DataError(errors[0] if len(errors) == 1 else " | ".join(errors))


def _fetch(url: str, part: Path, *, retries: int, timeout: float, backoff: float, log: Log, limits: Limits) -> None:
    """Stream `url` into `part`, resuming with HTTP Range after a dropped connection."""
    limits.url = url
    failures = 0
    while True:
        have = part.stat().st_size if part.exists() else 0
        if have > limits.max_bytes:
            raise limits.fail(part, f"{part.name} already holds {have:,} bytes, more than the {limits.max_bytes:,} "
                                    "allowed")
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
                    mode, total = "ab", _content_length(resp, have)
                elif resp.status == 206:  # a range we did not ask for: start again from zero
                    part.unlink(missing_ok=True)
                    continue
                else:  # 200: the server sent the whole file (no Range support): restart cleanly
                    have, mode, total = 0, "wb", _content_length(resp, 0)
                    if resp.status != 200:
                        raise DataError(f"download of {url} failed: unexpected HTTP {resp.status}")
                if total is not None and total > limits.max_bytes:
                    raise limits.fail(part, f"the server announces {total:,} bytes, more than the "
                                            f"{limits.max_bytes:,} allowed for this corpus (--max-bytes)")
                _stream(resp, part, mode, have, limits)
            size = part.stat().st_size
            if total is not None and size != total:
                raise ConnectionError(f"connection closed after {size:,} of {total:,} bytes")
            return
        except urllib.error.HTTPError as err:
            if err.code == 416 and have:  # our .part is not a prefix of what the server has: restart
                part.unlink(missing_ok=True)
                continue
            raise DataError(
                f"download of {url} failed: HTTP {err.code} {err.reason}; check the URL"
            ) from None
        except _WriteError as err:  # our disk, not the connection
            part.unlink(missing_ok=True)
            raise DataError(f"cannot write {part}: {describe_os_error(err.error)}; the partial file was "
                            "deleted") from None
        except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
            failures += 1
            got = part.stat().st_size if part.exists() else 0
            reason = getattr(err, "reason", None) or err
            if time.monotonic() >= limits.deadline:
                raise limits.fail(part, f"it was not done within {limits.seconds:g} s (--deadline; {reason})") from None
            if failures > retries:
                raise DataError(
                    f"download of {url} interrupted after {got:,} bytes ({reason}); run the same command "
                    f"again to resume from {part.name}"
                ) from None
            log(f"connection problem after {got:,} bytes ({reason}); resuming ({failures}/{retries})")
            time.sleep(backoff * failures)


class _WriteError(Exception):
    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


def _stream(resp, part: Path, mode: str, have: int, limits: Limits) -> None:
    """Copy the body into `part` as it arrives (read1: whatever the socket has, so a trickle cannot hide
    behind a full-buffer read), checking size, deadline and rate before every write."""
    try:
        f = open(part, mode)  # noqa: SIM115 (closed below)
    except OSError as err:
        raise _WriteError(err) from None
    with f:
        size = have
        window_start, window_bytes = time.monotonic(), size
        while True:
            chunk = resp.read1(CHUNK) if hasattr(resp, "read1") else resp.read(CHUNK)
            if not chunk:
                break
            size += len(chunk)
            now = time.monotonic()
            if size > limits.max_bytes:
                f.close()
                raise limits.fail(part, f"the body passed {limits.max_bytes:,} bytes, the limit for this corpus "
                                        "(--max-bytes)")
            if now >= limits.deadline:
                f.close()
                raise limits.fail(part, f"it was not done within {limits.seconds:g} s (--deadline)")
            if limits.window and now - window_start >= limits.window:
                rate = (size - window_bytes) / (now - window_start)
                if rate < limits.min_rate:
                    f.close()
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


def _extract(src: Source, archive: Path, dest: Path, check: bool, log: Log) -> None:
    """Extract the known members to `.part` files, verify, then rename all; on failure remove all."""
    parts: list[tuple[Path, Path]] = []
    budget = [src.max_unpacked]  # bytes all members together may still unpack to
    too_many = DataError(f"{src.archive} lists more than {MAX_MEMBERS:,} entries; it is not the {src.name} archive "
                         "and was deleted")
    try:
        if src.kind == "zip":
            with zipfile.ZipFile(archive) as zf:
                if len(zf.infolist()) > MAX_MEMBERS:
                    raise too_many
                names = {_normalize(n): n for n in zf.namelist()}
                for m in src.members:
                    if m.name not in names:
                        raise DataError(f"{src.archive} lacks {m.name}; it is not the {src.name} archive")
                    with zf.open(names[m.name]) as fin:
                        parts.append(_copy_member(fin, dest, m, check, budget, src))
        else:
            with tarfile.open(archive, "r:*") as tf:
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
                        parts.append(_copy_member(fin, dest, m, check, budget, src))
        for tmp, final in parts:
            os.replace(tmp, final)
        fsync_dir(dest)
        log(f"{src.name}: extracted {', '.join(final.name for _, final in parts)}")
    except DataError:
        archive.unlink(missing_ok=True)  # a wrong archive must not be resumed or reused
        raise
    except _WriteError as err:
        raise DataError(f"cannot extract {src.archive} into {dest}: {describe_os_error(err.error)}") from None
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError, zlib.error) as err:
        archive.unlink(missing_ok=True)
        raise DataError(f"{src.archive} is corrupt ({err}); it was deleted, run the download again") from None
    finally:
        for tmp, _final in parts:
            tmp.unlink(missing_ok=True)


def _copy_member(fin, dest: Path, m: Member, check: bool, budget: list[int], src: Source) -> tuple[Path, Path]:
    """Copy one member out, stopping as soon as it passes its pinned size (when checked) or the
    archive's unpacked budget: a 1 MB archive that inflates to gigabytes writes no more than that."""
    final = dest / m.dest
    tmp = dest / (m.dest + ".part")
    digest = hashlib.sha256()
    size = 0
    limit = m.size if check and m.size is not None else budget[0]
    try:
        try:
            fout = open(tmp, "wb")  # noqa: SIM115 (closed below)
        except OSError as err:
            raise _WriteError(err) from None
        with fout:
            while chunk := fin.read(1 << 20):
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
            try:
                fout.flush()
                os.fsync(fout.fileno())
            except OSError as err:
                raise _WriteError(err) from None
        budget[0] -= size
        if check and m.size is not None and size != m.size:
            raise DataError(
                f"{m.name} has {size:,} bytes, expected {m.size:,}; the archive is not the published one"
            )
        if check and m.sha256 is not None and digest.hexdigest() != m.sha256:
            raise DataError(
                f"checksum mismatch for {m.name}: expected sha256 {m.sha256}, got {digest.hexdigest()}; "
                f"nothing was extracted"
            )
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp, final
