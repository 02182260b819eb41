"""Byte ranges of corpus files (`Segment`): reading them (also inside zip archives) and finding the
line or character boundary nearest an offset, so that a split or a block never cuts a character."""

from __future__ import annotations

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
