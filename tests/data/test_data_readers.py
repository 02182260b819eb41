"""Every reader round-trips its format: decode(concatenated splits) gives the source text back."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from txl_data_fixtures import (
    SHARED,
    enwik8_bytes,
    make_lm1b,
    make_ptb,
    make_wikitext,
    normalized,
    word_lines,
)

from txl.data import open_corpus, parse_spec
from txl.data import segment as segment_mod
from txl.data.readers import make_plan, proportional_split, stdlib_split
from txl.errors import DataError


def all_ids(corpus) -> np.ndarray:
    return np.concatenate([np.asarray(corpus.split(s)) for s in corpus.splits])


# ---- word level: PTB, WikiText -----------------------------------------------------------------


def test_ptb_word_round_trip_counts_and_vocab_order(tmp_path):
    root = make_ptb(tmp_path / "ptb")
    corpus = open_corpus(f"ptb-word:{root}")
    assert corpus.name == "ptb-word" and corpus.metric == "ppl"
    for split in ("train", "valid", "test"):
        text = (root / f"ptb.{split}.txt").read_text()
        assert corpus.vocab.decode(corpus.split(split)) == normalized(text)
        n_words = len(text.split())
        n_lines = text.count("\n")
        assert corpus.num_tokens(split) == n_words + n_lines
    # reference order: specials first, then by falling train frequency, ties in first-seen order
    vocab = corpus.vocab
    assert vocab.symbols[0] == "<eos>" and vocab.eos_id == 0
    train_words = (root / "ptb.train.txt").read_text().split()
    counts = {w: train_words.count(w) for w in set(train_words)}
    order = [counts[s] for s in vocab.symbols[1:]]
    assert order == sorted(order, reverse=True)
    first_seen = {w: train_words.index(w) for w in counts}
    for a, b in zip(vocab.symbols[1:], vocab.symbols[2:]):
        if counts[a] == counts[b]:
            assert first_seen[a] < first_seen[b]
    assert corpus.split("train").dtype == np.uint8  # 60-odd words fit in a byte


def test_ptb_word_unknown_valid_word_maps_to_unk(tmp_path):
    root = make_ptb(tmp_path / "ptb")
    with open(root / "ptb.valid.txt", "a") as f:
        f.write(" neverseenword the \n")
    corpus = open_corpus(f"ptb-word:{root}")
    tail = corpus.split("valid")[-3:]
    assert tail[0] == corpus.vocab.unk_id and tail[-1] == corpus.vocab.eos_id


def test_ptb_char_round_trip(tmp_path):
    root = make_ptb(tmp_path / "ptb")
    corpus = open_corpus(f"ptb-char:{root}")
    assert corpus.metric == "bpc"
    assert all(len(s) == 1 or s == "<eos>" for s in corpus.vocab.symbols)
    assert "_" in corpus.vocab.symbols
    for split in corpus.splits:
        text = (root / f"ptb.char.{split}.txt").read_text()
        assert corpus.vocab.decode(corpus.split(split)) == text  # generated files are already normalized


def test_ptb_char_symbol_missing_from_train_is_an_error(tmp_path):
    root = make_ptb(tmp_path / "ptb")
    (root / "ptb.char.test.txt").write_text("a b\nq Z\n")  # 'Z' never occurs in train
    with pytest.raises(DataError, match=r"ptb.char.test.txt: symbol 'Z' at byte offset 6"):
        open_corpus(f"ptb-char:{root}")


def test_wikitext_nested_layout_empty_lines_and_case(tmp_path):
    root = make_wikitext(tmp_path / "wt", "wikitext-103")
    corpus = open_corpus(f"wikitext103:{root}")
    text = (root / "wikitext-103" / "wiki.valid.tokens").read_text()
    ids = corpus.split("valid")
    assert corpus.vocab.decode(ids) == normalized(text)
    assert ids[0] == corpus.vocab.eos_id  # the leading empty line is a lone <eos>, as in the reference
    assert any(s[:1].isupper() for s in corpus.vocab.symbols)  # case kept
    root2 = make_wikitext(tmp_path / "wt2", "wikitext-2")
    assert open_corpus(f"wikitext2:{root2 / 'wikitext-2'}").vocab.size > 10


def test_words_long_lines_and_small_blocks_give_the_same_ids(tmp_path, monkeypatch):
    root = make_ptb(tmp_path / "ptb")
    long_line = " ".join(word_lines(3, 60, unk=False)) + "\n"
    (root / "ptb.train.txt").write_text((root / "ptb.train.txt").read_text() + long_line * 3 + "tail words")
    reference = np.asarray(open_corpus(f"ptb-word:{root}", cache_dir=tmp_path / "c1").split("train"))
    monkeypatch.setattr(segment_mod, "BLOCK", 16)  # forces cuts inside lines (8 blocks = 128 bytes)
    small = open_corpus(f"ptb-word:{root}", cache_dir=tmp_path / "c2")
    np.testing.assert_array_equal(np.asarray(small.split("train")), reference)
    assert small.vocab.decode(small.split("train")).endswith("tail words\n")


def test_non_utf8_in_word_corpus_names_file_and_offset(tmp_path):
    root = make_ptb(tmp_path / "ptb")
    data = (root / "ptb.valid.txt").read_bytes()
    bad_at = 37
    (root / "ptb.valid.txt").write_bytes(data[:bad_at] + b"\xff" + data[bad_at:])
    with pytest.raises(DataError) as err:
        open_corpus(f"ptb-word:{root}")
    msg = str(err.value)
    assert "ptb.valid.txt" in msg and f"byte offset {bad_at}" in msg and "\n" not in msg


# ---- bytes and characters: enwik8, text8 -------------------------------------------------------


def test_proportional_split_is_exact_for_1e8():
    assert proportional_split(100_000_000) == (90_000_000, 95_000_000)
    assert proportional_split(1000) == (900, 950)


@pytest.mark.parametrize("layout", ["file", "dir", "zip"])
def test_enwik8_all_byte_values_round_trip(tmp_path, layout):
    data = enwik8_bytes()
    assert set(data) == set(range(256))
    if layout == "zip":
        path = tmp_path / "enwik8.zip"
        with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            zf.writestr("enwik8", data)
    else:
        (tmp_path / "enwik8").write_bytes(data)
        path = tmp_path / "enwik8" if layout == "file" else tmp_path
    corpus = open_corpus(f"enwik8:{path}")
    assert corpus.vocab.size == 256 and corpus.metric == "bpc"
    a, b = proportional_split(len(data))
    assert [corpus.num_tokens(s) for s in corpus.splits] == [a, b - a, len(data) - b]
    assert corpus.vocab.decode_bytes(all_ids(corpus)) == data
    assert corpus.vocab.encode(corpus.vocab.decode(corpus.split("train"))).tobytes() == data[:a]
    assert data.count(b"\n") == int((all_ids(corpus) == 10).sum())  # newlines kept and scored


def test_enwik8_real_xml_excerpt_round_trip(tmp_path):
    src = SHARED / "enwiki-excerpt" / "enwiki-2016-shortened.xml"
    if not src.is_file():
        pytest.skip("enwiki excerpt not available")
    with open(src, "rb") as f:
        data = f.read(300_000)  # a slice is enough; the test must stay fast
    (tmp_path / "enwik8").write_bytes(data)
    corpus = open_corpus(f"enwik8:{tmp_path / 'enwik8'}")
    assert corpus.vocab.decode_bytes(all_ids(corpus)) == data
    assert corpus.vocab.decode(corpus.split("train")).startswith("<mediawiki")


def test_text8_chars_round_trip(tmp_path):
    rng = np.random.default_rng(3)
    text = "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz     "), size=20_000))
    (tmp_path / "text8").write_text(text)
    corpus = open_corpus(f"text8:{tmp_path}")
    assert "".join(corpus.vocab.symbols) == " abcdefghijklmnopqrstuvwxyz"
    assert corpus.vocab.decode(all_ids(corpus)) == text
    assert [corpus.num_tokens(s) for s in corpus.splits] == [18_000, 1_000, 1_000]


# ---- lm1b ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab_file", [False, True])
def test_lm1b_sentences_offsets_and_round_trip(tmp_path, vocab_file):
    root = make_lm1b(tmp_path / "lm1b", vocab_file=vocab_file)
    corpus = open_corpus(f"lm1b:{root}")
    base = root / "1-billion-word-language-modeling-benchmark-r13output"
    held = (base / "heldout-monolingual.tokenized.shuffled" / "news.en.heldout-00000-of-00050").read_text()
    ids = np.asarray(corpus.split("valid"))
    offsets = np.asarray(corpus.sentence_offsets("valid"))
    assert len(offsets) == held.count("\n") + 1 and offsets[-1] == len(ids)
    bos = corpus.vocab.bos_id
    assert (ids[offsets[:-1]] == bos).all() and (ids[offsets[1:] - 1] == bos).all()  # <S> w .. <S>
    unk = corpus.vocab.unk_id
    decoded = corpus.vocab.decode(ids)
    expected = normalized(held)
    if vocab_file:
        assert corpus.vocab.unk == "<UNK>"
    assert decoded == expected.replace("rareword", corpus.vocab.symbols[unk])
    np.testing.assert_array_equal(corpus.split("valid"), corpus.split("test"))  # as the reference
    shards = sorted((base / "training-monolingual.tokenized.shuffled").iterdir())
    train_text = "".join(p.read_text() for p in shards)
    assert corpus.vocab.decode(corpus.split("train")) == normalized(train_text)


def test_lm1b_min_freq_option_shrinks_vocab(tmp_path):
    root = make_lm1b(tmp_path / "lm1b")
    small = open_corpus(f"lm1b:{root}?min_freq=20")
    big = open_corpus(f"lm1b:{root}?min_freq=1")
    assert small.vocab.size < big.vocab.size


# ---- text: bytes | chars | words | bpe -------------------------------------------------------------


SAMPLE = "".join(
    f"line {i % 40}: caf\u00e9 \u65e5\u672c\u8a9e na\u00efve \U0001f600 {'x' * (i % 7)}\n" for i in range(600)
)


@pytest.mark.parametrize("tokenizer", ["bytes", "chars", "words", "bpe"])
def test_text_file_round_trip_each_tokenizer(tmp_path, tokenizer):
    pytest.importorskip("tokenizers") if tokenizer == "bpe" else None
    path = tmp_path / "my.txt"
    path.write_text(SAMPLE)
    opts = f"?tokenizer={tokenizer}" + ("&vocab_size=300" if tokenizer == "bpe" else "")
    corpus = open_corpus(f"text:{path}{opts}")
    assert corpus.metric == ("bpc" if tokenizer in ("bytes", "chars") else "ppl")
    decoded = [corpus.vocab.decode(corpus.split(s)) for s in corpus.splits]
    expected = normalized(SAMPLE) if tokenizer == "words" else SAMPLE
    assert "".join(decoded) == expected
    # the same text lands in each split whatever the tokenizer (cuts at line starts, by bytes)
    a, b = proportional_split(len(SAMPLE.encode()))
    raw = SAMPLE.encode()
    cut_a = raw.index(b"\n", a) + 1
    valid_text = raw[cut_a : raw.index(b"\n", b) + 1].decode()
    assert decoded[1] == (normalized(valid_text) if tokenizer == "words" else valid_text)


def test_text_bpe_is_deterministic_and_needs_tokenizers(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    path = tmp_path / "my.txt"
    path.write_text(SAMPLE)
    a = open_corpus(f"text:{path}?tokenizer=bpe&vocab_size=300", cache_dir=tmp_path / "a")
    b = open_corpus(f"text:{path}?tokenizer=bpe&vocab_size=300", cache_dir=tmp_path / "b")
    assert a.vocab.fingerprint == b.vocab.fingerprint and a.fingerprint == b.fingerprint
    monkeypatch.setitem(__import__("sys").modules, "tokenizers", None)
    with pytest.raises(DataError, match="optional dependency 'tokenizers'"):
        open_corpus(f"text:{path}?tokenizer=bpe&vocab_size=400")


def test_text_dir_with_split_files_and_words_vocab_options(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "train.txt").write_text("a a a b b c\nd\n")
    (d / "valid.txt").write_text("a z\n")
    corpus = open_corpus(f"text:{d}?tokenizer=words&vocab_size=4")
    assert corpus.splits == ("train", "valid")
    assert corpus.vocab.symbols == ("<eos>", "<unk>", "a", "b")
    assert corpus.vocab.decode(corpus.split("valid")) == "a <unk>\n"
    with pytest.raises(DataError, match="has no split 'test'; known splits: train, valid"):
        corpus.split("test")


# ---- builtin ----------------------------------------------------------------------------------


def test_builtin_python_stdlib(tmp_path):
    plan = make_plan(parse_spec("builtin:python-stdlib"))
    files = plan.sources
    assert files == sorted(files, key=lambda p: p.relative_to(plan.root).as_posix())
    assert not any(part in ("site-packages", "dist-packages") for p in files for part in p.parts)
    corpus = open_corpus("builtin:python-stdlib")
    assert corpus.vocab.size == 256 and corpus.metric == "bpc"
    per_split = {s: sum(seg.end for seg in plan.splits[s]) for s in plan.splits}
    assert {s: corpus.num_tokens(s) for s in corpus.splits} == per_split
    first = plan.splits["valid"][0]
    head = bytes(np.asarray(corpus.split("valid")[: first.end]))
    assert head == first.path.read_bytes()
    assert stdlib_split("os.py") == stdlib_split("os.py")
    frac = corpus.num_tokens("train") / sum(per_split.values())
    assert 0.75 < frac < 0.97


# ---- cache: prepare once, re-prepare on change ------------------------------------------------


def test_cache_reused_touch_tolerated_content_change_reprepared(tmp_path):
    root = make_ptb(tmp_path / "ptb")
    c1 = open_corpus(f"ptb-word:{root}")
    meta1 = json.loads((c1.path / "meta.json").read_text())
    c2 = open_corpus(f"ptb-word:{root}")
    assert json.loads((c2.path / "meta.json").read_text())["prepared_at"] == meta1["prepared_at"]
    assert c2.path == c1.path and c2.fingerprint == c1.fingerprint

    st = (root / "ptb.valid.txt").stat()
    os.utime(root / "ptb.valid.txt", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # same bytes, new mtime
    c3 = open_corpus(f"ptb-word:{root}")
    assert c3.fingerprint == c1.fingerprint
    meta3 = json.loads((c3.path / "meta.json").read_text())
    assert (
        meta3["prepare_seconds"] == meta1["prepare_seconds"] and meta3["prepared_at"] == meta1["prepared_at"]
    )

    with open(root / "ptb.valid.txt", "a") as f:
        f.write(" the end \n")
    c4 = open_corpus(f"ptb-word:{root}")
    assert c4.fingerprint != c1.fingerprint
    assert c4.num_tokens("valid") == c1.num_tokens("valid") + 3
    assert np.asarray(c1.split("train")).sum() >= 0  # the old memory map still reads after the swap


def test_option_change_prepares_separately_and_corrupt_meta_reprepares(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(SAMPLE)
    a = open_corpus(f"text:{path}?tokenizer=bytes")
    b = open_corpus(f"text:{path}?tokenizer=chars")
    assert a.path != b.path and a.fingerprint != b.fingerprint
    assert open_corpus(f"text:{path}").path == a.path  # the default option is the same corpus
    (a.path / "meta.json").write_text("{not json")
    c = open_corpus(f"text:{path}?tokenizer=bytes")
    assert c.fingerprint == a.fingerprint and json.loads((c.path / "meta.json").read_text())


def test_read_only_source_directory_is_fine(tmp_path):
    root = make_ptb(tmp_path / "ptb")
    os.chmod(root, 0o555)
    try:
        assert open_corpus(f"ptb-word:{root}").num_tokens("test") > 0
    finally:
        os.chmod(root, 0o755)


def test_failed_preparation_leaves_nothing_behind(tmp_path, cache_dir):
    root = make_ptb(tmp_path / "ptb")
    (root / "ptb.test.txt").write_bytes(b"ok words\n\xc3\x28 broken\n")  # test split fails after train
    with pytest.raises(DataError, match="invalid UTF-8"):
        open_corpus(f"ptb-word:{root}")
    leftovers = [p for p in (cache_dir / "corpora").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == []


def test_split_arrays_are_memory_maps_with_smallest_dtype(tmp_path):
    root = make_ptb(tmp_path / "ptb")
    corpus = open_corpus(f"ptb-word:{root}")
    arr = corpus.split("train")
    assert isinstance(arr, np.memmap) and not arr.flags.writeable
    stats = corpus.stats()
    assert stats["tokens"]["train"] == len(arr) and stats["vocab_size"] == corpus.vocab.size
    assert set(stats) >= {"tokens", "vocab_size", "metric", "source", "fingerprint"}
    assert Path(stats["cache"]).is_dir()


# ---- property: random Unicode through tiny blocks ---------------------------------------------------

_alphabet = st.sampled_from(list("ab c\n\t\u00e9\u65e5\U0001f600\x85\u2028_") + ["  ", "\n\n", "\r\n"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(_alphabet, min_size=1, max_size=200))
def test_text_readers_round_trip_random_unicode_through_small_blocks(tmp_path_factory, monkeypatch, parts):
    text = "".join(parts) + "ab"
    monkeypatch.setattr(segment_mod, "BLOCK", 7)  # blocks end inside characters and lines
    d = tmp_path_factory.mktemp("u")
    for split in ("train", "valid"):
        (d / f"{split}.txt").write_text(text, newline="")
    for tokenizer in ("chars", "words", "bytes"):
        corpus = open_corpus(f"text:{d}?tokenizer={tokenizer}", cache_dir=d / "c")
        decoded = corpus.vocab.decode(corpus.split("valid"))
        assert decoded == (normalized(text) if tokenizer == "words" else text)


def test_text_single_file_cut_falls_back_to_bytes_when_a_line_would_swallow_a_split(tmp_path):
    path = tmp_path / "two_lines.txt"
    path.write_text("a" * 195 + "\n" + "bbbbb")  # 201 bytes: nominal cuts at 181 and 191
    corpus = open_corpus(f"text:{path}?tokenizer=chars")
    assert [corpus.num_tokens(s) for s in corpus.splits] == [181, 15, 5]  # valid ends at the line start 196
