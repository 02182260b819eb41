"""Text for people: what generated or sampled text looks like on a terminal and inside JSON files.

A byte-level model can produce any byte, and `Vocab.decode` keeps bytes that are not UTF-8 as lone
surrogates (`surrogateescape`), so the exact bytes can still be written to a file. Two other places
need something else:

- a terminal: raw control bytes (ESC, BEL, backspace, ...) would be executed by the terminal, so they
  are shown escaped (`\\x1b`); newlines and tabs stay as they are;
- JSON: a lone surrogate is not valid UTF-8 (`json.load(...)["sample"].encode()` fails), so bytes that
  are not text become `\\xNN` escapes (the token ids are stored next to the text for the exact bytes).
"""

from __future__ import annotations

import re

# C0 controls except tab and newline, DEL, C1 controls; and lone surrogates (undecodable bytes)
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def _escape(match: re.Match) -> str:
    char = match.group()
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8, kept by surrogateescape
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def json_text(text: str) -> str:
    """`text` with bytes that are not UTF-8 as `\\xNN` escapes: always encodable as UTF-8."""
    return re.sub("[\ud800-\udfff]", _escape, text)


def terminal_text(text: str) -> str:
    """`text` safe to print on a terminal: control characters and undecodable bytes escaped."""
    return _UNSAFE.sub(_escape, text)


def for_stream(text: str, stream) -> str:
    """What to write to `stream`: control characters escaped on a terminal; elsewhere (a log file, a
    pipe) the text as it is except bytes that are not UTF-8, as escapes (the exact bytes are in the
    files a run writes)."""
    isatty = getattr(stream, "isatty", None)
    return terminal_text(text) if isatty is not None and isatty() else json_text(text)
