"""Readers: which source bytes form each split, and how they become token ids.

A reader turns a spec into a `Plan` (the files, the byte ranges of each split, the tokenizer and its
vocabulary rules) without reading any text; `build()` then streams those byte ranges through the
tokenizer into `.npy` files. Every published convention lives in the `plan_*` functions below, each
with its source:

- enwik8: the first 1e8 bytes, train/valid/test = 90M/5M/5M (Mahoney's file; split as
  `prep_enwik8.py` in salesforce/awd-lstm-lm, used by kimiyoung/transformer-xl). We keep every byte;
  the reference writes newline bytes as line breaks that its `add_eos=False` reader then drops.
- text8: 90M/5M/5M characters (`prep_text8.py`, same repositories); the reference also strips each
  part and maps ' ' to '_', which changes nothing we score except the two boundary spaces it drops.
- WikiText-103/2 and PTB word: whitespace words, `<eos>` after every line (including empty lines and an
  unterminated last line), vocabulary from train, specials first then by falling frequency with ties
  in first-seen order (`Vocab.build_vocab` + `Counter.most_common` in the reference), case kept.
- PTB char: the same reader on `ptb.char.*` (symbols are single characters, `_` marks word ends).
- lm1b: `<S> words <S>` per sentence (`add_double_eos`), train = `news.en-*` shards, valid = test =
  `news.en.heldout-00000-of-00050` as in the reference `data_utils.py`.

Files are read in blocks that end on a line (or character) boundary, so memory stays flat whatever
the corpus size; only a bounded list of ids per block ever exists in Python.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import zipfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from txl.data.cache import NpyWriter, TokenBuffer
from txl.data.spec import DataSpec
from txl.data.vocab import Vocab, _require_tokenizers, bpe_encode, bpe_pieces
from txl.errors import DataError, describe_os_error
from txl.io import open_regular

READER_VERSION = 1  # bump when any convention below changes: every cache then re-prepares
BLOCK = 1 << 20
SPLITS = ("train", "valid", "test")
ENWIK8_BYTES = 100_000_000
DEFAULT_BPE_SIZE = 8192

Log = Callable[[str], None]


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


@dataclass
class WordRules:
    """How a `words` vocabulary is built and applied (see the module docstring for the sources)."""

    specials: tuple[str, ...] = ("<eos>",)
    eos: str | None = "<eos>"
    bos: str | None = None
    unk: str | None = None  # symbol for out-of-vocabulary words, if the vocabulary holds it
    vocab_size: int = 0  # keep this many ids at most (0: all)
    min_freq: int = 1
    vocab_file: Path | None = None  # lm1b: the reference's fixed vocabulary, first field per line
    sentences: bool = False  # lm1b: also write sentence start offsets


@dataclass
class Plan:
    """Everything `build()` needs, resolved from a spec without reading any text."""

    spec: DataSpec
    root: Path  # source paths in the fingerprint are relative to this
    identity: str  # what names the source in the cache key (absolute location, interpreter, ...)
    sources: list[Path]  # files whose content the prepared arrays depend on
    splits: dict[str, list[Segment]]
    tokenizer: str  # bytes | chars | words | bpe
    metric: str
    words: WordRules | None = None
    bpe_size: int = DEFAULT_BPE_SIZE
    notes: list[str] = field(default_factory=list)  # conventions worth recording in meta.json


# ---- resolving specs into plans ---------------------------------------------------------------


def make_plan(spec: DataSpec) -> Plan:
    """Resolve a parsed spec into a `Plan`; raises `DataError` for missing or malformed sources."""
    return {
        "ptb-word": _plan_ptb_word,
        "ptb-char": _plan_ptb_char,
        "enwik8": _plan_enwik8,
        "text8": _plan_text8,
        "wikitext103": _plan_wikitext,
        "wikitext2": _plan_wikitext,
        "lm1b": _plan_lm1b,
        "text": _plan_text,
        "builtin": _plan_builtin,
    }[spec.name](spec)


def _download_hint(spec: DataSpec) -> str:
    if spec.info.download:
        return f"; fetch it with `txl data download {spec.info.download} --dest DIR`"
    return ""


def _existing(spec: DataSpec) -> Path:
    path = Path(spec.path or "")
    if not path.exists():
        raise DataError(f"{spec.name}: path not found: {path}{_download_hint(spec)}")
    if not (path.is_dir() or path.is_file()):  # a FIFO would block the reader, a device never ends
        raise DataError(f"{spec.name}: {path} is not a regular file or a directory (a FIFO, a device or a "
                        "socket); txl reads corpora from regular files only: copy the text into a file")
    return path.absolute()


def _find_files(spec: DataSpec, names: dict[str, str], subdirs: tuple[str, ...] = ("",)) -> tuple[Path, dict]:
    """Find a directory (the spec path or one of `subdirs` under it) holding all `names`."""
    root = _existing(spec)
    if not root.is_dir():
        raise DataError(
            f"{spec.name}: {root} is a file; pass the directory holding {', '.join(names.values())}"
        )
    for sub in subdirs:
        base = root / sub if sub else root
        found = {split: base / fname for split, fname in names.items()}
        if all(p.is_file() for p in found.values()):
            return base, found
    base = root
    missing = [fname for fname in names.values() if not (base / fname).is_file()]
    raise DataError(
        f"{spec.name}: directory {root} lacks {', '.join(missing)} (expects {', '.join(names.values())})"
        f"{_download_hint(spec)}"
    )


def _whole(path: Path) -> list[Segment]:
    return [Segment(path, 0, path.stat().st_size)]


def _check_nonempty(spec: DataSpec, files: dict[str, Path]) -> None:
    for path in files.values():
        if path.stat().st_size == 0:
            raise DataError(f"{spec.name}: empty corpus file {path}; it has no bytes to read")


def _plan_ptb_word(spec: DataSpec) -> Plan:
    names = {s: f"ptb.{s}.txt" for s in SPLITS}
    base, files = _find_files(spec, names, ("", "data", "simple-examples/data"))
    _check_nonempty(spec, files)
    return Plan(
        spec,
        base,
        str(base),
        list(files.values()),
        {s: _whole(p) for s, p in files.items()},
        "words",
        "ppl",
        WordRules(specials=("<eos>",), eos="<eos>", unk="<unk>"),
        notes=["<eos> after every line; vocabulary from train (the text already holds <unk>); case kept"],
    )


def _plan_ptb_char(spec: DataSpec) -> Plan:
    names = {s: f"ptb.char.{s}.txt" for s in SPLITS}
    base, files = _find_files(spec, names, ("", "data", "simple-examples/data"))
    _check_nonempty(spec, files)
    return Plan(
        spec,
        base,
        str(base),
        list(files.values()),
        {s: _whole(p) for s, p in files.items()},
        "words",
        "bpc",
        WordRules(specials=("<eos>",), eos="<eos>", unk=None),
        notes=[
            "space-separated characters, '_' between words kept as a symbol, one <eos> per line; "
            "bpc counts every symbol and every <eos>"
        ],
    )


def _plan_wikitext(spec: DataSpec) -> Plan:
    names = {s: f"wiki.{s}.tokens" for s in SPLITS}
    sub = "wikitext-103" if spec.name == "wikitext103" else "wikitext-2"
    base, files = _find_files(spec, names, ("", sub))
    _check_nonempty(spec, files)
    return Plan(
        spec,
        base,
        str(base),
        list(files.values()),
        {s: _whole(p) for s, p in files.items()},
        "words",
        "ppl",
        WordRules(specials=("<eos>",), eos="<eos>", unk="<unk>"),
        notes=["<eos> after every line, empty lines included; vocabulary from train; case kept"],
    )


def _single_archive_source(spec: DataSpec, member: str) -> tuple[Path, Segment]:
    """FILE, FILE.zip, or a DIR holding `member` or `member.zip` (enwik8, text8)."""
    path = _existing(spec)
    if path.is_dir():
        for candidate in (path / member, path / f"{member}.zip"):
            if candidate.is_file():
                path = candidate
                break
        else:
            raise DataError(
                f"{spec.name}: directory {path} lacks {member} (or {member}.zip){_download_hint(spec)}"
            )
    if path.suffix == ".zip":
        try:
            with open_regular(path, what=f"{spec.name} archive", follow_links=True) as raw, zipfile.ZipFile(raw) as zf:
                names = zf.namelist()
                name = member if member in names else (names[0] if len(names) == 1 else None)
                if name is None:
                    raise DataError(f"{spec.name}: archive {path} has no member {member!r}")
                size = zf.getinfo(name).file_size
        except ZIP_ERRORS as err:
            raise DataError(f"{spec.name}: {path} is not a valid zip archive ({err}); download it again") from None
        seg = Segment(path, 0, size, member=name)
    else:
        seg = Segment(path, 0, path.stat().st_size)
    if seg.end == 0:
        raise DataError(f"{spec.name}: empty corpus: {seg.label} has no bytes")
    return path, seg


def proportional_split(n: int) -> tuple[int, int]:
    """(train_end, valid_end) for n units split 90/5/5; exactly 90M/5M/5M when n = 1e8.

    valid and test get floor(n * 5 / 100) each (the reference's `num_test_chars = 5000000` scaled),
    train the rest, so a 1e8-unit corpus matches the published split to the byte.
    """
    part = n * 5 // 100
    return n - 2 * part, n - part


def _plan_enwik8(spec: DataSpec) -> Plan:
    path, seg = _single_archive_source(spec, "enwik8")
    n = min(seg.end, ENWIK8_BYTES)
    a, b = proportional_split(n)
    notes = [
        "bytes, byte vocabulary of 256; every byte is kept and scored, newline bytes included "
        "(the reference drops newlines)"
    ]
    if n < ENWIK8_BYTES:
        notes.append(f"source has {n} bytes < 1e8: split proportionally 90/5/5")
    splits = {
        "train": [Segment(seg.path, 0, a, seg.member)],
        "valid": [Segment(seg.path, a, b, seg.member)],
        "test": [Segment(seg.path, b, n, seg.member)],
    }
    return Plan(spec, path.parent, str(path), [path], splits, "bytes", "bpc", notes=notes)


def _plan_text8(spec: DataSpec) -> Plan:
    path, seg = _single_archive_source(spec, "text8")
    n = seg.end
    a, b = proportional_split(n)
    a, b = _char_boundary(seg, a), _char_boundary(seg, b)
    splits = {
        "train": [Segment(seg.path, 0, a, seg.member)],
        "valid": [Segment(seg.path, a, b, seg.member)],
        "test": [Segment(seg.path, b, n, seg.member)],
    }
    notes = ["characters, split 90/5/5 (90M/5M/5M for the real 1e8-character file); every character scored"]
    return Plan(spec, path.parent, str(path), [path], splits, "chars", "bpc", notes=notes)


def _plan_lm1b(spec: DataSpec) -> Plan:
    root = _existing(spec)
    if not root.is_dir():
        raise DataError(f"lm1b: {root} is a file; pass the directory of the One Billion Word benchmark")
    r13 = "1-billion-word-language-modeling-benchmark-r13output"
    base = root / r13 if (root / r13).is_dir() else root
    train_dir = base / "training-monolingual.tokenized.shuffled"
    heldout = base / "heldout-monolingual.tokenized.shuffled" / "news.en.heldout-00000-of-00050"
    shards = sorted(train_dir.glob("news.en-*")) if train_dir.is_dir() else []
    if not shards or not heldout.is_file():
        raise DataError(
            f"lm1b: {root} lacks training-monolingual.tokenized.shuffled/news.en-* or "
            f"heldout-monolingual.tokenized.shuffled/news.en.heldout-00000-of-00050 "
            f"(the {r13} layout)"
        )
    vocab_file = next(
        (p for p in (root / "1b_word_vocab.txt", base / "1b_word_vocab.txt") if p.is_file()), None
    )
    sources = [*shards, heldout] + ([vocab_file] if vocab_file else [])
    if all(p.stat().st_size == 0 for p in shards):
        raise DataError(f"lm1b: empty corpus: the training shards in {train_dir} have no bytes")
    splits = {
        "train": [s for p in shards for s in _whole(p)],
        "valid": _whole(heldout),
        "test": _whole(heldout),
    }
    rules = WordRules(
        specials=("<S>", "<unk>"),
        eos="<S>",
        bos="<S>",
        unk="<unk>",
        min_freq=int(spec.options["min_freq"]),
        vocab_file=vocab_file,
        sentences=True,
    )
    notes = [
        "<S> w1 .. wn <S> per sentence (reference add_double_eos); valid = test = heldout-00000 "
        "(as the reference)"
    ]
    return Plan(spec, base, str(base), sources, splits, "words", "ppl", rules, notes=notes)


def _plan_text(spec: DataSpec) -> Plan:
    root = _existing(spec)
    tokenizer = str(spec.options["tokenizer"])
    vocab_size = int(spec.options["vocab_size"])  # type: ignore[arg-type]
    metric = "bpc" if tokenizer in ("bytes", "chars") else "ppl"
    if root.is_dir():
        files = {s: root / f"{s}.txt" for s in SPLITS if (root / f"{s}.txt").is_file()}
        if "train" not in files:
            raise DataError(
                f"text: directory {root} lacks train.txt (expects train.txt, optionally valid.txt, test.txt)"
            )
        _check_nonempty(spec, files)
        splits = {s: _whole(p) for s, p in files.items()}
        base, sources, notes = root, list(files.values()), ["splits from train.txt/valid.txt/test.txt"]
    else:
        size = root.stat().st_size
        if size == 0:
            raise DataError(f"text: empty corpus: {root} has no bytes")
        seg = Segment(root, 0, size)
        a, b = proportional_split(size)
        # Each cut moves to the next line start unless that would swallow the next split (a file of
        # a few long lines): then it stays at the byte, moved to a character boundary.
        a_line, b_line = _line_boundary(seg, a), _line_boundary(seg, b)
        a = a_line if a_line <= b else _char_boundary(seg, a)
        b = b_line if b_line < size else _char_boundary(seg, b)
        splits = {
            "train": [Segment(root, 0, a)],
            "valid": [Segment(root, a, b)],
            "test": [Segment(root, b, size)],
        }
        base, sources = root.parent, [root]
        notes = [
            "single file split 90/5/5 by bytes, each cut moved to the next line start, so every "
            "tokenizer sees the same text in each split"
        ]
    rules = None
    if tokenizer == "words":
        rules = WordRules(
            specials=("<eos>", "<unk>"),
            eos="<eos>",
            unk="<unk>",
            vocab_size=vocab_size,
            min_freq=int(spec.options["min_freq"]),
        )  # type: ignore[arg-type]
    if tokenizer == "bpe":
        _require_tokenizers()
        if 0 < vocab_size < 256:
            raise DataError(
                f"text option vocab_size={vocab_size} is too small for byte-level BPE; use at least 256"
            )
    return Plan(
        spec,
        base,
        str(root),
        sources,
        splits,
        tokenizer,
        metric,
        rules,
        bpe_size=vocab_size or DEFAULT_BPE_SIZE,
        notes=notes,
    )


def stdlib_files() -> tuple[Path, list[Path]]:
    """The interpreter's standard-library `.py` files, sorted by relative POSIX path.

    site-packages / dist-packages hold third-party code that differs between machines, and
    `__pycache__` holds no sources, so all three are skipped.
    """
    root = Path(sysconfig.get_paths()["stdlib"]).absolute()
    if not root.is_dir():
        raise DataError(f"builtin: the standard library directory {root} does not exist in this interpreter")
    found: list[Path] = []
    skip = {"site-packages", "dist-packages", "__pycache__"}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    found = [p for p in found if p.is_file()]
    found.sort(key=lambda p: p.relative_to(root).as_posix())
    return root, found


def stdlib_split(relpath: str) -> str:
    """train / valid / test by sha256 of the relative path mod 100 (<90, <95, else): stable when
    files are added or removed, unlike a split by position in the file list."""
    bucket = int(hashlib.sha256(relpath.encode("utf-8")).hexdigest(), 16) % 100
    return "train" if bucket < 90 else "valid" if bucket < 95 else "test"


def _plan_builtin(spec: DataSpec) -> Plan:
    root, files = stdlib_files()
    splits: dict[str, list[Segment]] = {s: [] for s in SPLITS}
    for path in files:
        size = path.stat().st_size
        if size:
            splits[stdlib_split(path.relative_to(root).as_posix())].append(Segment(path, 0, size))
    if not files:
        raise DataError(f"builtin: no .py files under {root}")
    identity = f"python-stdlib:{root}:{sys.implementation.name}-{sys.version.split()[0]}"
    notes = [
        f"{len(files)} .py files of {root} (Python {sys.version.split()[0]}), bytes, sorted by path, "
        "split by sha256(relative path) % 100: <90 train, <95 valid, else test"
    ]
    return Plan(spec, root, identity, files, splits, "bytes", "bpc", notes=notes)


# ---- reading byte ranges ---------------------------------------------------------------------


# What zipfile raises for a damaged or unsupported archive: a bad CRC or header (BadZipFile), a corrupt
# deflate stream (zlib.error), a cut-off member (EOFError), an unknown compression method
# (NotImplementedError), an encrypted member (RuntimeError).
ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError)


def _read_failure(seg: Segment, err: BaseException) -> str:
    if isinstance(err, OSError):
        return describe_os_error(err, reading=True)
    return f"{err}; the archive is damaged, download it again"


class _SegmentReader:
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
            raise DataError(f"cannot read {seg.label}: {_read_failure(seg, err)}") from None
        except DataError:
            self._close_raw()
            raise

    def read(self, n: int = BLOCK) -> bytes:
        if self.remaining <= 0:
            return b""
        try:
            data = self._f.read(min(n, self.remaining))
        except (OSError, *ZIP_ERRORS) as err:
            raise DataError(f"cannot read {self.seg.label}: {_read_failure(self.seg, err)}") from None
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

    def __enter__(self) -> _SegmentReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_at(seg: Segment, offset: int, n: int) -> bytes:
    with _SegmentReader(Segment(seg.path, offset, min(seg.end, offset + n), seg.member)) as r:
        return r.read(n)


def _utf8_cut(data: bytes) -> int:
    """Largest prefix length of `data` that does not end inside a UTF-8 multi-byte sequence."""
    i = len(data) - 1
    while i >= 0 and len(data) - i < 4 and (data[i] & 0xC0) == 0x80:
        i -= 1
    if i < 0 or data[i] < 0x80:
        return len(data)
    need = 2 if data[i] < 0xE0 else 3 if data[i] < 0xF0 else 4
    return len(data) if len(data) - i >= need else i


def _char_boundary(seg: Segment, offset: int) -> int:
    """`offset` moved forward past UTF-8 continuation bytes (no-op for ASCII files like text8)."""
    data = _read_at(seg, offset, 4)
    k = 0
    while k < len(data) and (data[k] & 0xC0) == 0x80:
        k += 1
    return offset + k


def _line_boundary(seg: Segment, offset: int) -> int:
    """`offset` moved forward to just after the next '\\n' (or to a character boundary if none)."""
    pos = offset
    with _SegmentReader(Segment(seg.path, offset, seg.end, seg.member)) as r:
        while chunk := r.read(1 << 16):
            k = chunk.find(b"\n")
            if k >= 0:
                return pos + k + 1
            pos += len(chunk)
    return _char_boundary(seg, offset)


def _blocks(seg: Segment, *, lines: bool) -> Iterator[tuple[int, bytes, bool]]:
    """Yield (file offset, bytes, line_open) blocks of about BLOCK bytes.

    With `lines`, a block ends just after a '\\n', except when a single line outgrows 8 blocks: then
    it is cut after ASCII whitespace (never inside a word) and `line_open` says the line continues.
    Without `lines`, blocks end on a UTF-8 character boundary. The last block ends at the segment end.
    """
    pos = seg.start
    carry = b""
    with _SegmentReader(seg) as reader:
        while True:
            chunk = reader.read(BLOCK)
            if not chunk:
                if carry:
                    yield pos, carry, False
                return
            data = carry + chunk
            line_open = False
            if lines:
                cut = data.rfind(b"\n") + 1
                if cut == 0:
                    if len(data) < 8 * BLOCK:
                        carry = data
                        continue
                    cut = max(data.rfind(ws) for ws in (b" ", b"\t", b"\r", b"\x0b", b"\x0c")) + 1
                    if cut == 0:
                        cut = _utf8_cut(data)
                    line_open = True
            else:
                cut = _utf8_cut(data)
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
    splits: dict[str, dict] = {}
    for split, segments in plan.splits.items():
        say(f"{plan.spec.name}: tokenizing {split} ({sum(s.end - s.start for s in segments):,} bytes)")
        writer = NpyWriter(out / f"{split}.npy", vocab.dtype)
        offsets = (
            NpyWriter(out / f"{split}.offsets.npy", np.uint64)
            if plan.words and plan.words.sentences
            else None
        )
        try:
            _encode(plan, vocab, segments, writer, offsets)
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
            raise DataError(
                f"{plan.spec.name}: the {split} split has {n} token(s) (from {where}); "
                f"a split needs at least 2 tokens, use a larger corpus"
            )
        splits[split] = entry
    return {"splits": splits, "vocab_size": vocab.size, "vocab_fingerprint": vocab.fingerprint}


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
            with _SegmentReader(seg) as reader:
                while block := reader.read(BLOCK):
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
