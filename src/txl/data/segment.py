"""Byte ranges of corpus files (`Segment`): reading them (also inside zip archives) and finding the
line or character boundary nearest an offset, so that a split or a block never cuts a character."""

from __future__ import annotations

import shlex
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from txl.errors import DataError, describe_os_error
from txl.io import open_regular

BLOCK = 1 << 20  # bytes per read: memory stays flat whatever the corpus size

@dataclass(frozen=True)
class Segment:
    """Bytes [start, end) of one file (or of one member of a zip archive)."""

    path: Path
    start: int
    end: int
    member: str | None = None

    @property
    def label(self) -> str:
        return f"{self.path}!{self.member}" if self.member else str(self.path)


ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError)


def read_failure(seg: Segment, err: BaseException) -> str:
    if isinstance(err, OSError):
        return describe_os_error(err, reading=True)
    return f"{err}; the archive is damaged, download it again"


class SegmentReader:
    """Sequential reads confined to one `Segment` (zip members are decompressed on the fly)."""

    def __init__(self, seg: Segment):
        self.seg = seg
        self.remaining = seg.end - seg.start
        self._zip = None
        try:
            # A user's corpus path may be a link; a FIFO or a device is refused before it can block
            self._raw = open_regular(seg.path, what="corpus file", follow_links=True)
            if seg.member is not None:
                self._zip = zipfile.ZipFile(self._raw)
                self._f = self._zip.open(seg.member)
                skip = seg.start
                while skip:
                    got = self._f.read(min(skip, BLOCK))
                    if not got:
                        break
                    skip -= len(got)
            else:
                self._f = self._raw
                self._f.seek(seg.start)
        except (OSError, *ZIP_ERRORS) as err:
            self._close_raw()
            raise DataError(f"cannot read {seg.label}: {read_failure(seg, err)}") from None
        except DataError:
            self._close_raw()
            raise

    def read(self, n: int = BLOCK) -> bytes:
        if self.remaining <= 0:
            return b""
        try:
            data = self._f.read(min(n, self.remaining))
        except (OSError, *ZIP_ERRORS) as err:
            raise DataError(f"cannot read {self.seg.label}: {read_failure(self.seg, err)}") from None
        self.remaining -= len(data)
        return data

    def _close_raw(self) -> None:
        raw = getattr(self, "_raw", None)
        if raw is not None:
            raw.close()

    def close(self) -> None:
        self._f.close()
        if self._zip is not None:
            self._zip.close()
        self._close_raw()

    def __enter__(self) -> SegmentReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_at(seg: Segment, offset: int, n: int) -> bytes:
    with SegmentReader(Segment(seg.path, offset, min(seg.end, offset + n), seg.member)) as r:
        return r.read(n)


def utf8_cut(data: bytes) -> int:
    """Largest prefix length of `data` that does not end inside a UTF-8 multi-byte sequence."""
    i = len(data) - 1
    while i >= 0 and len(data) - i < 4 and (data[i] & 0xC0) == 0x80:
        i -= 1
    if i < 0 or data[i] < 0x80:
        return len(data)
    need = 2 if data[i] < 0xE0 else 3 if data[i] < 0xF0 else 4
    return len(data) if len(data) - i >= need else i


# Byte-order marks, longest first (the UTF-32LE mark begins with the UTF-16LE one). iconv reads the mark
# itself and drops it, so the plain names are what `iconv -f` takes for a file that has one.
_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
         (b"\xfe\xff", "UTF-16"))
SNIFF = 4096  # bytes of a file's head that `wide_encoding` looks at


def wide_encoding(head: bytes) -> str | None:
    """The encoding `head` (a file's first bytes) is in when it is UTF-16 or UTF-32 rather than UTF-8, as
    `iconv -f` names it, else None. A byte-order mark decides; without one, text in a Latin script has a
    NUL in every other byte (UTF-16) or in three bytes of four (UTF-32), which UTF-8 text never has."""
    for bom, name in _BOMS:
        if head.startswith(bom):
            return name
    n = len(head) // 4 * 4
    if n < 16:
        return None
    by_lane = [head[k:n:4].count(0) / (n // 4) for k in range(4)]  # share of NUL bytes at position k mod 4
    for lanes, name in (((1, 2, 3), "UTF-32LE"), ((0, 1, 2), "UTF-32BE")):
        other = ({0, 1, 2, 3} - set(lanes)).pop()
        if min(by_lane[k] for k in lanes) > 0.5 and by_lane[other] < 0.05:
            return name
    even, odd = (by_lane[0] + by_lane[2]) / 2, (by_lane[1] + by_lane[3]) / 2
    if odd > 0.25 and even < odd / 8:
        return "UTF-16LE"
    if even > 0.25 and odd < even / 8:
        return "UTF-16BE"
    return None


def check_utf8_text(path: Path, head: bytes, why: str) -> None:
    """One `DataError` for a text file in UTF-16 or UTF-32 (`wide_encoding`): it would be reported as
    invalid UTF-8 at byte 0, or (UTF-16 without a mark) read as text with a NUL after every letter."""
    encoding = wide_encoding(head)
    if encoding is not None:
        converted = path.with_name(f"{path.stem}.utf8{path.suffix}")
        raise DataError(f"{path} looks like {encoding} text, not UTF-8 ({why}); convert it: "
                        f"iconv -f {encoding} -t UTF-8 {shlex.quote(str(path))} > {shlex.quote(str(converted))}")


def char_boundary(seg: Segment, offset: int) -> int:
    """`offset` moved forward past UTF-8 continuation bytes (no-op for ASCII files like text8)."""
    data = read_at(seg, offset, 4)
    k = 0
    while k < len(data) and (data[k] & 0xC0) == 0x80:
        k += 1
    return offset + k


def line_boundary(seg: Segment, offset: int) -> int:
    """`offset` moved forward to just after the next '\\n' (or to a character boundary if none)."""
    pos = offset
    with SegmentReader(Segment(seg.path, offset, seg.end, seg.member)) as r:
        while chunk := r.read(1 << 16):
            k = chunk.find(b"\n")
            if k >= 0:
                return pos + k + 1
            pos += len(chunk)
    return char_boundary(seg, offset)
