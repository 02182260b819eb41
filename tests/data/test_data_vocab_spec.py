"""Vocabularies round-trip and load safely; specs parse strictly."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from txl.data import Vocab, known_corpora, parse_spec
from txl.errors import DataError

# ---- vocabularies -------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=300))
def test_bytes_vocab_round_trips_any_bytes(data):
    vocab = Vocab("bytes")
    ids = vocab.encode(data)
    assert ids.dtype == np.uint8 and vocab.decode_bytes(ids) == data
    assert vocab.encode(vocab.decode(ids)).tobytes() == data  # str path via surrogateescape


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=200))
def test_chars_vocab_round_trips_text(text):
    vocab = Vocab("chars", sorted(set(text) | {"a"}))
    assert vocab.decode(vocab.encode(text)) == text


def test_chars_vocab_rejects_unknown_character():
    with pytest.raises(DataError, match="character 'z'"):
        Vocab("chars", ["a", "b"]).encode("abz")


def test_words_vocab_eos_unk_and_prompt_without_newline():
    vocab = Vocab("words", ["<eos>", "<unk>", "the", "cat"], eos="<eos>", unk="<unk>")
    assert vocab.encode("the cat\ncat").tolist() == [2, 3, 0, 3]
    assert vocab.decode([2, 3, 0, 3]) == "the cat\ncat"
    assert vocab.encode("the  dog \n").tolist() == [2, 1, 0]
    strict = Vocab("words", ["<eos>", "the"], eos="<eos>")
    with pytest.raises(DataError, match="word 'dog' is not in the vocabulary"):
        strict.encode("the dog")


def test_lm1b_style_bos_eos_decode():
    vocab = Vocab("words", ["<S>", "<unk>", "a", "b"], eos="<S>", bos="<S>", unk="<unk>")
    ids = vocab.encode("a b\nb\n")
    assert ids.tolist() == [0, 2, 3, 0, 0, 3, 0]
    assert vocab.decode(ids) == "a b\nb\n"


def test_json_round_trip_fingerprint_and_save_load(tmp_path):
    vocab = Vocab("words", ["<eos>", "<unk>", "x"], eos="<eos>", unk="<unk>")
    again = Vocab.from_json(vocab.to_json())
    assert again == vocab and again.fingerprint == vocab.fingerprint
    vocab.save(tmp_path / "vocab.json")
    assert Vocab.load(tmp_path / "vocab.json") == vocab
    assert Vocab("chars", ["a"]).fingerprint != Vocab("chars", ["b"]).fingerprint
    assert (
        Vocab("bytes").dtype == np.uint8 and Vocab("words", [str(i) for i in range(300)]).dtype == np.uint16
    )


@pytest.mark.parametrize(
    "payload, match",
    [
        (b"\x80\x04\x95" + pickle.dumps({"a": 1})[3:], "not valid JSON"),
        (pickle.dumps(["<eos>"]), "not valid JSON"),
        (b"[]", 'missing "format"'),
        (json.dumps({"format": "txl-vocab", "version": 9, "kind": "bytes"}).encode(), "version 9"),
        (json.dumps({"format": "txl-vocab", "version": 1, "kind": "exec"}).encode(), "kind 'exec'"),
        (
            json.dumps(
                {"format": "txl-vocab", "version": 1, "kind": "words", "symbols": ["a", "a"]}
            ).encode(),
            "duplicate",
        ),
        (
            json.dumps({"format": "txl-vocab", "version": 1, "kind": "words", "symbols": [1]}).encode(),
            "list of strings",
        ),
        (
            json.dumps(
                {"format": "txl-vocab", "version": 1, "kind": "words", "symbols": ["a"], "eos": "<eos>"}
            ).encode(),
            "eos symbol",
        ),
        (
            json.dumps({"format": "txl-vocab", "version": 1, "kind": "bytes", "size": 300}).encode(),
            "declared size 300",
        ),
        (
            json.dumps(
                {"format": "txl-vocab", "version": 1, "kind": "bytes", "__reduce__": "os.system"}
            ).encode(),
            "unknown keys",
        ),
        (
            json.dumps({"format": "txl-vocab", "version": 1, "kind": "chars", "symbols": ["ab"]}).encode(),
            "single characters",
        ),
    ],
)
def test_loading_a_strangers_vocab_file_is_safe(tmp_path, payload, match):
    path = tmp_path / "vocab.json"
    path.write_bytes(payload)
    with pytest.raises(DataError, match=match) as err:
        Vocab.load(path)
    assert "\n" not in str(err.value)


def test_missing_vocab_file():
    with pytest.raises(DataError, match="vocabulary file not found"):
        Vocab.load("/nonexistent/vocab.json")


def test_check_matches_names_both_sizes():
    vocab = Vocab("bytes")
    vocab.check_matches(256)
    with pytest.raises(DataError, match=r"checkpoint has 10000 ids but this corpus vocabulary has 256"):
        vocab.check_matches(10000)


def test_decode_rejects_out_of_range_ids():
    with pytest.raises(DataError, match="out of range"):
        Vocab("chars", ["a"]).decode([1])


# ---- specs --------------------------------------------------------------------------------------


def test_parse_spec_forms(tmp_path):
    s = parse_spec("text:my.txt?tokenizer=bpe&vocab_size=8000")
    assert (s.name, s.path, s.options["tokenizer"], s.options["vocab_size"]) == (
        "text",
        "my.txt",
        "bpe",
        8000,
    )
    assert parse_spec("text:C:/data/x.txt").path == "C:/data/x.txt"  # ':' inside the path
    assert parse_spec("builtin").path == "python-stdlib"
    assert parse_spec("builtin:python-stdlib").canonical() == "builtin:python-stdlib"
    assert parse_spec("enwik8").path.endswith("downloads/enwik8")  # default download location
    assert parse_spec("PTB-Word:x").name == "ptb-word"
    assert set(known_corpora()) == {
        "ptb-word",
        "ptb-char",
        "enwik8",
        "text8",
        "wikitext103",
        "wikitext2",
        "lm1b",
        "text",
        "builtin",
        "pairs",  # sequence-to-sequence pair corpora (txl.data.seq2seq)
        "reverse",
        "pydoc-summaries",
        "docs",  # collections of separate documents (txl.data.documents): classification, document-level LM
        "style",  # two files, one style each (txl.data.style): the Style Transformer
    }


@pytest.mark.parametrize(
    "spec, match",
    [
        ("wt103:x", r"unknown corpus 'wt103'.*known: ptb-word, ptb-char, enwik8"),
        ("", "empty data spec"),
        ("text:x?tokenizer=sentencepiece", "not one of bytes, chars, words, bpe"),
        ("text:x?vocab_size=lots", "not an integer"),
        ("text:x?color=red", "text has no option 'color'.*allowed options: tokenizer"),
        ("text:x?tokenizer", "has no value"),
        ("ptb-word:x?tokenizer=bytes", "allowed options: none"),
        ("builtin:perl-stdlib", "unknown builtin corpus 'perl-stdlib'"),
        ("text", "needs a path"),
    ],
)
def test_bad_specs(spec, match):
    with pytest.raises(DataError, match=match):
        parse_spec(spec)
