"""Encoding: the byte ranges of a `Plan` (txl.data.readers) streamed through the tokenizer into `.npy`
token arrays, and the vocabulary built from the training split.

Files are read in blocks of about BLOCK bytes (txl.data.segment) that end on a line (or character)
boundary, so memory stays flat whatever the corpus size; only a bounded list of ids per block ever
exists in Python.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from txl.data import segment
from txl.data.cache import NpyWriter, TokenBuffer
from txl.data.readers import Log, Plan, WordRules, make_plan
from txl.data.segment import Segment, SegmentReader, utf8_cut
from txl.data.spec import DataSpec
from txl.data.vocab import Vocab, _require_tokenizers, bpe_encode, bpe_pieces
from txl.errors import DataError


def _blocks(seg: Segment, *, lines: bool) -> Iterator[tuple[int, bytes, bool]]:
    """Yield (file offset, bytes, line_open) blocks of about BLOCK bytes.

    With `lines`, a block ends just after a '\\n', except when a single line outgrows 8 blocks: then
    it is cut after ASCII whitespace (never inside a word) and `line_open` says the line continues.
    Without `lines`, blocks end on a UTF-8 character boundary. The last block ends at the segment end.
    """
    pos = seg.start
    carry = b""
    with SegmentReader(seg) as reader:
        while True:
            chunk = reader.read(segment.BLOCK)
            if not chunk:
                if carry:
                    yield pos, carry, False
                return
            data = carry + chunk
            line_open = False
            if lines:
                cut = data.rfind(b"\n") + 1
                if cut == 0:
                    if len(data) < 8 * segment.BLOCK:
                        carry = data
                        continue
                    cut = max(data.rfind(ws) for ws in (b" ", b"\t", b"\r", b"\x0b", b"\x0c")) + 1
                    if cut == 0:
                        cut = utf8_cut(data)
                    line_open = True
            else:
                cut = utf8_cut(data)
            if cut == 0:
                carry = data
                continue
            yield pos, data[:cut], line_open
            pos += cut
            carry = data[cut:]


def _decode(seg: Segment, offset: int, data: bytes, why: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(
            f"{seg.label}: invalid UTF-8 at byte offset {offset + err.start}; {why} "
            f"(fix the file, or use text:FILE?tokenizer=bytes for arbitrary bytes)"
        ) from None


def _texts(seg: Segment, *, lines: bool, why: str) -> Iterator[tuple[int, str, bool]]:
    for offset, data, line_open in _blocks(seg, lines=lines):
        yield offset, _decode(seg, offset, data, why), line_open


# ---- building: vocabulary, then token arrays -------------------------------------------------


def build(plan: Plan, out: Path, log: Log | None = None) -> dict:
    """Prepare `plan` into directory `out`: `<split>.npy`, `vocab.json` (+ lm1b `<split>.offsets.npy`).

    Returns the per-split part of `meta.json`. Raises `DataError` for bad content (invalid UTF-8 in a
    text corpus, an unknown symbol without `<unk>`, an empty split).
    """
    say = log or (lambda _msg: None)
    say(f"{plan.spec.name}: building the {plan.tokenizer} vocabulary")
    vocab = _build_vocab(plan)
    vocab.save(out / "vocab.json")
    splits = write_splits(plan, out, vocab, log)
    return {"splits": splits, "vocab_size": vocab.size, "vocab_fingerprint": vocab.fingerprint}


Encoder = Callable[[Plan, Vocab, list[Segment], NpyWriter, "NpyWriter | None"], None]


def write_splits(plan: Plan, out: Path, vocab: Vocab, log: Log | None = None, *, encode: Encoder | None = None,
                 given_vocab: bool = False) -> dict[str, dict]:
    """Encode every split of `plan` with `vocab` into `out/<split>.npy` (+ `.offsets.npy` for sentence
    corpora) through `encode` (default: the plan's tokenizer). A split that fails leaves no file
    behind; one with fewer than 2 tokens is a `DataError`. `given_vocab`: the vocabulary came from
    elsewhere (fine-tuning), which the messages say. Returns the per-split entries of `meta.json`."""
    say = log or (lambda _msg: None)
    encode = encode or _encode
    splits: dict[str, dict] = {}
    for split, segments in plan.splits.items():
        how = (f"with the given {vocab.kind} vocabulary" if given_vocab
               else f"({sum(s.end - s.start for s in segments):,} bytes)")
        say(f"{plan.spec.name}: tokenizing {split} {how}")
        writer = NpyWriter(out / f"{split}.npy", vocab.dtype)
        offsets = (
            NpyWriter(out / f"{split}.offsets.npy", np.uint64)
            if plan.words and plan.words.sentences
            else None
        )
        try:
            encode(plan, vocab, segments, writer, offsets)
            n = writer.close()
            entry = {"file": f"{split}.npy", "tokens": n, "dtype": vocab.dtype.name}
            if offsets is not None:
                offsets.close()
                entry["offsets"] = f"{split}.offsets.npy"
                entry["sentences"] = offsets.count - 1
        except BaseException:
            writer.abort()
            if offsets is not None:
                offsets.abort()
            raise
        if n < 2:
            where = ", ".join(sorted({s.label for s in segments})) or str(plan.root)
            source = "with the given vocabulary" if given_vocab else f"(from {where})"
            raise DataError(
                f"{plan.spec.name}: the {split} split has {n} token(s) {source}; "
                f"a split needs at least 2 tokens, use a larger corpus"
            )
        splits[split] = entry
    return splits


def _build_vocab(plan: Plan) -> Vocab:
    if plan.tokenizer == "bytes":
        return Vocab("bytes")
    if plan.tokenizer == "chars":
        return _char_vocab(plan)
    if plan.tokenizer == "bpe":
        return _bpe_vocab(plan)
    return _word_vocab(plan)


def _char_vocab(plan: Plan) -> Vocab:
    """Characters seen in any split, sorted by code point.

    The character inventory is part of the file format, not a statistic learned from train (the
    char-rnn / nanoGPT convention); taking it from every split means no `<unk>` is ever needed.
    """
    seen = np.zeros(0, dtype=np.uint32)
    for segments in plan.splits.values():
        for seg in segments:
            for _off, text, _open in _texts(seg, lines=False, why="a character-level corpus must be UTF-8"):
                cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
                seen = np.union1d(seen, np.unique(cps))
    return Vocab("chars", [chr(c) for c in seen.tolist()])


def _word_vocab(plan: Plan) -> Vocab:
    rules = plan.words
    assert rules is not None
    if rules.vocab_file is not None:
        symbols = _read_vocab_file(rules.vocab_file)
        # The Google lm1b vocabulary spells the unknown word <UNK>; the reference looks it up by that name.
        unk = "<UNK>" if "<UNK>" in symbols else rules.unk
        for sym in {rules.eos, rules.bos, unk} - {None}:
            if sym not in symbols:
                raise DataError(
                    f"{plan.spec.name}: vocabulary file {rules.vocab_file} lacks the symbol {sym}"
                )
        return Vocab("words", symbols, eos=rules.eos, bos=rules.bos, unk=unk)
    counter: Counter[str] = Counter()
    for seg in plan.splits["train"]:
        for _off, text, _open in _texts(seg, lines=True, why="a word-level corpus must be UTF-8 text"):
            counter.update(text.split())
    symbols = list(rules.specials)
    special = set(symbols)
    # most_common sorts by count with a stable sort: ties stay in first-seen order, as in the reference.
    for word, count in counter.most_common():
        if count < rules.min_freq or (rules.vocab_size and len(symbols) >= rules.vocab_size):
            break
        if word not in special:
            symbols.append(word)
    unk = rules.unk if rules.unk in symbols else None
    return Vocab("words", symbols, eos=rules.eos, bos=rules.bos, unk=unk)


def _read_vocab_file(path: Path) -> list[str]:
    symbols: list[str] = []
    seen: set[str] = set()
    seg = Segment(path, 0, path.stat().st_size)
    for _off, text, _open in _texts(seg, lines=True, why="a vocabulary file must be UTF-8"):
        for line in text.split("\n"):
            fields = line.split()
            if fields and fields[0] not in seen:
                seen.add(fields[0])
                symbols.append(fields[0])
    if not symbols:
        raise DataError(f"vocabulary file {path} is empty")
    return symbols


def _bpe_vocab(plan: Plan) -> Vocab:
    """Byte-level BPE (GPT-2 style, lossless on any UTF-8 text) trained on the train split only."""
    tk = _require_tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=plan.bpe_size,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )

    def texts() -> Iterator[str]:
        for seg in plan.splits["train"]:
            for _off, text, _open in _texts(seg, lines=True, why="a BPE corpus must be UTF-8 text"):
                yield from bpe_pieces(text)  # no run longer than BPE_RUN_LIMIT reaches the trainer

    tokenizer.train_from_iterator(texts(), trainer=trainer)
    return Vocab("bpe", bpe=tokenizer.to_str())


def _encode(
    plan: Plan, vocab: Vocab, segments: list[Segment], writer: NpyWriter, offsets: NpyWriter | None
) -> None:
    if plan.tokenizer == "bytes":
        for seg in segments:
            with SegmentReader(seg) as reader:
                while block := reader.read(segment.BLOCK):
                    writer.write(np.frombuffer(block, dtype=np.uint8))
    elif plan.tokenizer == "chars":
        for seg in segments:
            for _off, text, _open in _texts(seg, lines=False, why="a character-level corpus must be UTF-8"):
                writer.write(vocab.encode(text))
    elif plan.tokenizer == "bpe":
        tokenizer = vocab._bpe()
        for seg in segments:
            for _off, text, _open in _texts(seg, lines=True, why="a BPE corpus must be UTF-8 text"):
                writer.write(np.asarray(bpe_encode(tokenizer, text), dtype=vocab.dtype))
    else:
        _encode_words(plan, vocab, segments, writer, offsets)


def _encode_words(
    plan: Plan, vocab: Vocab, segments: list[Segment], writer: NpyWriter, offsets: NpyWriter | None
) -> None:
    """Whitespace symbols, `eos` after each line (and `bos` before it for lm1b).

    An unterminated last line still gets `eos`, as `for line in f` + `add_eos` gives in the reference,
    so PTB counts match the published 929,589 / 73,760 / 82,430. Empty lines give a lone `eos`.
    """
    stoi = vocab.stoi
    unk, eos, bos = vocab.unk_id, vocab.eos_id, vocab.bos_id
    buffer = TokenBuffer(writer)
    starts = TokenBuffer(offsets) if offsets is not None else None
    for seg in segments:
        continuing = False  # the previous block was cut inside an over-long line
        for offset, text, block_open in _texts(seg, lines=True, why="a word-level corpus must be UTF-8 text"):
            lines = text.split("\n")
            # After the last '\n': empty, unless the block was cut mid-line (block_open) or this is an
            # unterminated last line at the end of the file (which is closed with eos like any other).
            tail = lines.pop()
            ids: list[int] = []  # this block's ids only, so bounded by the block size
            block_starts: list[int] = []
            base = buffer.count
            pieces = [(line, True) for line in lines]
            if tail or block_open:
                pieces.append((tail, not block_open))
            for k, (line, closes) in enumerate(pieces):
                if bos is not None and not (k == 0 and continuing):
                    block_starts.append(base + len(ids))
                    ids.append(bos)
                words = line.split()
                if unk is None:
                    try:
                        ids.extend([stoi[w] for w in words])
                    except KeyError as err:
                        raise _unknown_symbol(seg, offset, [*lines, tail], k, err.args[0]) from None
                else:
                    ids.extend([stoi.get(w, unk) for w in words])
                if closes and eos is not None:
                    ids.append(eos)
            continuing = block_open
            if starts is not None and block_starts:
                starts.extend(np.asarray(block_starts, dtype=np.uint64))
            buffer.extend(np.asarray(ids, dtype=vocab.dtype))
    buffer.flush()
    if starts is not None:
        starts.extend(np.asarray([buffer.count], dtype=np.uint64))  # sentinel: offsets[i+1] - offsets[i]
        starts.flush()


def _unknown_symbol(seg: Segment, offset: int, lines: list[str], k: int, word: str) -> DataError:
    line_start = offset + len("\n".join(lines[:k]).encode("utf-8")) + (1 if k else 0)
    col = lines[k].index(word)
    at = line_start + len(lines[k][:col].encode("utf-8"))
    return DataError(
        f"{seg.label}: symbol {word!r} at byte offset {at} is not in the vocabulary built from train, "
        f"and this corpus has no <unk>; the valid/test files must only use training symbols"
    )


# ---- one split with a fixed vocabulary (a published model's) ------------------------------------


class _ArrayWriter:
    """The `NpyWriter` interface, collecting into memory (one split of a word corpus)."""

    def __init__(self, dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        self.count = 0
        self.chunks: list[np.ndarray] = []

    def write(self, ids: np.ndarray) -> None:
        self.chunks.append(np.array(ids, dtype=self.dtype))
        self.count += len(ids)

    def array(self) -> np.ndarray:
        return np.concatenate(self.chunks) if self.chunks else np.zeros(0, dtype=self.dtype)


def encode_split(spec: DataSpec, split: str, vocab: Vocab) -> tuple[np.ndarray, str]:
    """Token ids of one split of a word-level corpus read with `vocab` instead of one built from train,
    and the corpus metric. This is how a published model (`txl import-hf`) is scored: its vocabulary is
    fixed, the corpus files are whitespace-split as they are, `<eos>` after every line, unknown words
    `unk`. Nothing is cached: only the split is read (WikiText-103 test is 1.3 MB)."""
    plan = make_plan(spec)
    if plan.tokenizer != "words" or vocab.kind != "words":
        raise DataError(f"{spec.text} is read as {plan.tokenizer}, but the checkpoint's vocabulary is a {vocab.kind} "
                        "vocabulary of a published model; evaluate it on a word-level corpus such as "
                        "wikitext103:DIR")
    if split not in plan.splits:
        raise DataError(f"{spec.text} has no split {split!r}; splits: {', '.join(plan.splits)}")
    rules = plan.words or WordRules()
    if rules.eos is not None and vocab.eos != rules.eos:
        raise DataError(f"{spec.text} ends lines with {rules.eos}, which the checkpoint's vocabulary lacks")
    writer = _ArrayWriter(vocab.dtype)
    _encode_words(plan, vocab, plan.splits[split], writer, None)  # type: ignore[arg-type]
    return writer.array(), plan.metric
