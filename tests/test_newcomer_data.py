"""Issue 45's newcomer messages, the parts below the command line: which bytes look like UTF-16 or UTF-32
(`txl.data.segment.wide_encoding`, the check behind the "convert it: iconv ..." line), and the spec a
moved corpus is re-pointed with (`DataSpec.elsewhere`). The one-line messages themselves are cases in
tests/cases_newcomer.py."""

from __future__ import annotations

import random

import pytest

from txl.data import parse_spec
from txl.data.segment import SNIFF, wide_encoding

TEXT = "Une ligne de texte, with a few words, 12 numbers and an accent: é.\n" * 80


@pytest.mark.parametrize(("encoding", "expected"), [
    ("utf-16", "UTF-16"), ("utf-16-le", "UTF-16LE"), ("utf-16-be", "UTF-16BE"),
    ("utf-32", "UTF-32"), ("utf-32-le", "UTF-32LE"), ("utf-32-be", "UTF-32BE"),
])
def test_wide_encodings_are_named_as_iconv_takes_them(encoding, expected):
    assert wide_encoding(TEXT.encode(encoding)[:SNIFF]) == expected


@pytest.mark.parametrize("data", [
    TEXT.encode(), "\ufeff".encode() + TEXT.encode(),  # UTF-8, with and without its mark
    "日本語のテキスト、漢字と仮名。\n".encode() * 100, b"", b"ab", bytes(range(256)) * 16,
    bytes(random.Random(0).randrange(256) for _ in range(SNIFF)),
])
def test_utf8_text_and_arbitrary_bytes_are_not_taken_for_utf16(data):
    assert wide_encoding(data[:SNIFF]) is None


def test_a_moved_corpus_keeps_its_options_at_the_new_place():
    spec = parse_spec("text:/old/notes.txt?tokenizer=chars")
    assert spec.elsewhere("NEWPLACE") == "text:NEWPLACE?tokenizer=chars"
    assert parse_spec("ptb-word:/data/ptb").elsewhere("DIR") == "ptb-word:DIR"
    assert spec.canonical() == "text:/old/notes.txt?tokenizer=chars"
