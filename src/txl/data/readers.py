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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from txl.data.segment import (
    SNIFF,
    ZIP_ERRORS,
    Segment,
    char_boundary,
    check_utf8_text,
    line_boundary,
    read_at,
)
from txl.data.spec import DataSpec, default_data_root
from txl.data.vocab import _require_tokenizers
from txl.errors import DataError
from txl.io import open_regular

READER_VERSION = 1  # bump when any convention below changes: every cache then re-prepares
SPLITS = ("train", "valid", "test")
ENWIK8_BYTES = 100_000_000
DEFAULT_BPE_SIZE = 8192

Log = Callable[[str], None]


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
    planners = {
        "ptb-word": _plan_ptb_word,
        "ptb-char": _plan_ptb_char,
        "enwik8": _plan_enwik8,
        "text8": _plan_text8,
        "wikitext103": _plan_wikitext,
        "wikitext2": _plan_wikitext,
        "lm1b": _plan_lm1b,
        "text": _plan_text,
        "builtin": _plan_builtin,
    }
    if spec.name not in planners:  # pair corpora and document collections have their own readers
        raise DataError(f"{spec.text!r} is not a token stream for a language model: a pair corpus trains with "
                        "txl.data.seq2seq, a docs: collection with --objective classify (txl.data.documents), a "
                        "style: corpus the Style Transformer (txl.data.style, --preset style-transfer)")
    return planners[spec.name](spec)


def _not_found(spec: DataSpec, path: Path) -> str:
    """A missing corpus path. The spec may have been typed, or recorded by a run whose corpus has moved
    since (`txl eval RUN`, `txl train --resume RUN` read it from the run): both are mended by --data."""
    download = spec.info.download
    if download and path == default_data_root() / download:  # no PATH given: the download's default place
        return (f"{spec.name} is not downloaded (looked in {path}); fetch it with `txl data download {download}`, "
                f"or point txl at a copy: --data {spec.elsewhere('DIR')}")
    fetch = f" (or fetch it: `txl data download {download} --dest DIR`)" if download else ""
    return (f"{spec.name}: path not found: {path}; if the corpus moved, give its new place: "
            f"--data {spec.elsewhere('NEWPLACE')}{fetch}")


def _download_hint(spec: DataSpec) -> str:
    if spec.info.download:
        return f"; fetch it with `txl data download {spec.info.download} --dest DIR`"
    return ""


def _existing(spec: DataSpec) -> Path:
    path = Path(spec.path or "")
    if not path.exists():
        raise DataError(_not_found(spec, path))
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
    a, b = char_boundary(seg, a), char_boundary(seg, b)
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
        a_line, b_line = line_boundary(seg, a), line_boundary(seg, b)
        a = a_line if a_line <= b else char_boundary(seg, a)
        b = b_line if b_line < size else char_boundary(seg, b)
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
    if tokenizer != "bytes":  # a text tokenizer reads UTF-8; a UTF-16 file would fail at byte 0 (or train on NULs)
        for source in sources:
            check_utf8_text(source, read_at(Segment(source, 0, source.stat().st_size), 0, SNIFF),
                            f"the {tokenizer} tokenizer reads UTF-8")
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
