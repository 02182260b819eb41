"""Prepared corpora: tokenize once into a cache directory, then memory-map on every use.

Layout of one prepared corpus, `<cache>/corpora/<name>-<key>/`:

    train.npy valid.npy test.npy   token ids, 1-D, smallest unsigned dtype (np.load(mmap_mode="r"))
    <split>.offsets.npy            lm1b only: sentence starts (uint64) plus an end sentinel
    vocab.json                     the `Vocab` (JSON, never pickle)
    meta.json                      spec, options, per-split counts, source fingerprint; written last

`<key>` hashes the spec name, the absolute source location and the options, so a changed option
prepares into a new directory; a corpus read with a vocabulary given from outside (`open_corpus(...,
vocab=)`: a fine-tuning run reads its new text with its checkpoint's vocabulary) adds that vocabulary's
fingerprint, so it never shares a directory with the same files' own preparation. Whether the *content* of
the sources changed is decided by the per-file hashes in meta.json:

- At preparation we record, per source file, its size, mtime and full sha256 (we read every byte
  anyway, so the hash costs one more sequential read: ~0.2 s for enwik8, seconds for lm1b).
- On open, if every file's (size, mtime_ns) still matches, the cache is used without reading the
  sources (milliseconds even for lm1b). If a stat differs, we re-hash only those files: same sha256
  (a copy, a `touch`, a re-download) -> keep the cache and refresh the stats; different -> re-prepare.

A sampled hash would be cheaper but can miss an edit that keeps the size, and a stale cache means
silently wrong results; a full hash only when the stat changed costs nothing in the common case.
The corpus `fingerprint` combines the content hashes, how the splits are cut from them, the options and
the reader version, and no file name or path (issue 45: renaming a corpus file must not make a run's
resume refuse it as "different content"), so it is the same for the same text wherever it lies.
Fingerprints written before that hashed the paths relative to the source root; `Corpus.legacy_fingerprint`
recomputes that form from meta.json, so runs saved with it still resume on their unchanged corpus
(`fingerprint_matches`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from txl.data.cache import (
    NpyWriter,
    cache_root,
    ensure_dir,
    file_lock,
    load_npy,
    remove_stale_dirs,
    replace_dir,
    sha256_file,
)
from txl.data.encode import _encode, _texts, build, write_splits
from txl.data.readers import READER_VERSION, Log, Plan, make_plan
from txl.data.spec import DataSpec, parse_spec
from txl.data.vocab import Vocab
from txl.errors import DataError, TxlError, describe_os_error
from txl.io import CONFIG_LIMIT, fsync_dir, read_json, write_json

META_FORMAT = "txl-prepared-corpus"
META_VERSION = 1


class Corpus:
    """A prepared corpus: vocabulary, memory-mapped splits and the facts needed to report results.

    Build with `open_corpus(spec)`. Splits are memory-mapped, never read whole: slicing one loads only
    the touched pages, which is what lets a 1e8-token corpus (or lm1b's 0.8e9) train on a small machine.
    """

    def __init__(self, path: Path, meta: dict[str, Any], spec_text: str):
        self.path = Path(path)
        self.meta = meta
        self.spec = spec_text
        self.name: str = meta["name"]
        self.metric: str = meta["metric"]
        self.fingerprint: str = meta["fingerprint"]  # content only (open_corpus sets it; see the module docstring)
        self.legacy_fingerprint: str | None = meta.get("legacy_fingerprint")  # the path-hashing form of old runs
        self.source: str = meta["source"]
        # symbols of the text that a vocabulary given from outside lacks: {symbol: count}, read as <unk>
        self.unknown: dict[str, int] = dict(meta.get("unknown") or {})
        try:
            self.vocab = Vocab.load(self.path / "vocab.json", follow_links=False)
        except DataError as err:
            raise DataError(f"the prepared cache {self.path} is damaged ({err}); run `txl data prepare "
                            f"{spec_text} --force`") from None
        self._arrays: dict[str, np.memmap] = {}

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(s for s in ("train", "valid", "test") if s in self.meta["splits"])

    def _check_split(self, split: str) -> dict:
        if split not in self.meta["splits"]:
            raise DataError(f"{self.name} has no split {split!r}; known splits: {', '.join(self.splits)}")
        return self.meta["splits"][split]

    def split(self, split: str) -> np.memmap:
        """The token ids of `split` as a read-only 1-D memory map (dtype: the vocabulary's)."""
        entry = self._check_split(split)
        if split not in self._arrays:
            self._arrays[split] = _load_memmap(self.path / entry["file"], entry["tokens"], self.spec)
        return self._arrays[split]

    def sentence_offsets(self, split: str) -> np.memmap | None:
        """lm1b: start index of each sentence in `split(split)`, plus a final end sentinel; else None."""
        entry = self._check_split(split)
        if "offsets" not in entry:
            return None
        return _load_memmap(self.path / entry["offsets"], entry["sentences"] + 1, self.spec)

    def num_tokens(self, split: str) -> int:
        return int(self._check_split(split)["tokens"])

    def stats(self) -> dict[str, Any]:
        """Token counts per split, vocabulary size, metric, source and fingerprint (JSON-able)."""
        out: dict[str, Any] = {
            "spec": self.spec,
            "name": self.name,
            "metric": self.metric,
            "vocab_size": self.vocab.size,
            "tokens": {s: int(self.meta["splits"][s]["tokens"]) for s in self.splits},
            "dtype": self.vocab.dtype.name,
            "source": self.source,
            "fingerprint": self.fingerprint,
            "vocab_fingerprint": self.vocab.fingerprint,
            "cache": str(self.path),
        }
        sentences = {s: e["sentences"] for s, e in self.meta["splits"].items() if "sentences" in e}
        if sentences:
            out["sentences"] = sentences
        if self.meta.get("notes"):
            out["notes"] = list(self.meta["notes"])
        return out

    def __repr__(self) -> str:
        counts = ", ".join(f"{s}={self.num_tokens(s):,}" for s in self.splits)
        return f"Corpus({self.name!r}, vocab={self.vocab.size}, {counts})"


def _load_memmap(path: Path, expected: int, spec: str = "SPEC") -> np.memmap:
    fix = f"run `txl data prepare {spec} --force`"
    arr = load_npy(path, fix=fix)  # regular, header and size checked before mapping (txl.data.cache)
    if arr.shape[0] != expected:
        raise DataError(f"prepared array {path} has shape {arr.shape}, expected ({expected},); {fix}")
    return arr


def cache_key(plan: Plan, vocab: Vocab | None = None) -> str:
    """The cache directory's name: the spec name, the source's location and options, and the vocabulary
    when one is given (a corpus read with a checkpoint's vocabulary holds other ids than its own)."""
    identity: dict[str, Any] = {"name": plan.spec.name, "source": plan.identity, "options": plan.spec.options}
    if vocab is not None:
        identity["vocab"] = vocab.fingerprint
    blob = json.dumps(identity, sort_keys=True)
    return f"{plan.spec.name}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def _relpath(plan: Plan, path: Path) -> str:
    try:
        return path.relative_to(plan.root).as_posix()
    except ValueError:
        return path.name


def _stat_sources(plan: Plan) -> list[dict[str, Any]]:
    out = []
    for path in plan.sources:
        st = path.stat()
        out.append({"path": _relpath(plan, path), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def _fingerprint(plan: Plan, sources: list[dict[str, Any]]) -> str:
    """What the corpus's token ids depend on and nothing else: each source's size and sha256 (in the
    reader's order), which bytes of which source each split reads, the options and the reader version.
    No file name or path: the same text renamed or moved has the same fingerprint."""
    index = {path: n for n, path in enumerate(plan.sources)}
    splits = {name: [(index.get(seg.path, -1), seg.member, seg.start, seg.end) for seg in segments]
              for name, segments in plan.splits.items()}
    blob = json.dumps(
        {
            "reader_version": READER_VERSION,
            "name": plan.spec.name,
            "options": plan.spec.options,
            "sources": [(s["size"], s["sha256"]) for s in sources],
            "splits": splits,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _legacy_fingerprint(meta: dict[str, Any]) -> str | None:
    """The fingerprint as written before issue 45 (it hashed each source's path relative to the source
    root), recomputed from meta.json; None when meta.json lacks what it needs."""
    try:
        sources = [(s["path"], s["size"], s["sha256"]) for s in meta["sources"]]
    except (KeyError, TypeError):
        return None
    blob = json.dumps({"reader_version": meta.get("reader_version"), "name": meta.get("name"),
                       "options": meta.get("options"), "sources": sources}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def fingerprint_matches(corpus, saved: str) -> bool:
    """Whether a fingerprint a run saved names this corpus's text: today's content fingerprint, or the
    path-hashing form written before issue 45 while the corpus files keep the names they had (a run saved
    with it that renamed them cannot be told from one whose text changed, and is refused as before)."""
    return saved == corpus.fingerprint or saved == getattr(corpus, "legacy_fingerprint", None)


def _valid_meta(plan: Plan, directory: Path, vocab: Vocab | None = None) -> dict[str, Any] | None:
    """The cache's meta.json if it is complete and its sources are unchanged; None if stale (missing,
    unfinished or damaged: prepare again). An entry no crash leaves (a link, a FIFO, a file above the
    size of any meta.json) is refused in one line instead: reading it could block or exhaust memory."""
    path = directory / "meta.json"
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size > CONFIG_LIMIT:
        try:
            read_json(path, what="the prepared cache's meta.json", error=DataError)
        except DataError as err:
            raise DataError(f"{err}; run `txl data prepare {plan.spec.text} --force` to prepare it again") from None
    try:
        meta = read_json(path, what="the prepared cache's meta.json", error=DataError)
    except DataError:
        return None
    if (
        not isinstance(meta, dict)
        or meta.get("format") != META_FORMAT
        or meta.get("version") != META_VERSION
        or meta.get("reader_version") != READER_VERSION
        or meta.get("options") != plan.spec.options
        or (vocab is not None and meta.get("vocab_fingerprint") != vocab.fingerprint)
        or not (directory / "vocab.json").is_file()
        or not _well_formed(meta)  # damaged by hand or by a disk: prepare again rather than fail later
    ):
        return None
    recorded = meta.get("sources")
    current = _stat_sources(plan)
    if not isinstance(recorded, list) or not all(isinstance(s, dict) for s in recorded):
        return None
    # No tokenizer makes more than two tokens per source byte (lm1b's <S> before and after a line is the
    # most), so a meta.json claiming more was not written by `_prepare` for these sources: a damaged or
    # planted cache (a sparse 3 GiB array for an 8 KB corpus) is prepared again rather than mapped.
    most = 2 * sum(s["size"] for s in current) + 2 * sum(len(v) for v in plan.splits.values()) + 16
    if any(entry["tokens"] > most for entry in meta["splits"].values()):
        return None
    if [s.get("path") for s in recorded] != [s["path"] for s in current]:
        return None
    refreshed = False
    for old, new, path in zip(recorded, current, plan.sources):
        if (old.get("size"), old.get("mtime_ns")) == (new["size"], new["mtime_ns"]):
            continue
        if old.get("size") != new["size"] or sha256_file(path) != old.get("sha256"):
            return None
        old["mtime_ns"] = new["mtime_ns"]  # same bytes, new timestamp (copy, touch, re-download)
        refreshed = True
    for entry in meta["splits"].values():
        if not (directory / entry["file"]).is_file():
            return None
    if refreshed:
        # a read-only cache still serves; the re-hash then just happens again next time
        with contextlib.suppress(OSError, TxlError):
            write_json(directory / "meta.json", meta)
    return meta


def _well_formed(meta: dict[str, Any]) -> bool:
    """Every meta.json field `Corpus` reads is there with its type; split files are plain names."""
    if not all(isinstance(meta.get(k), str) for k in ("name", "metric", "fingerprint", "source")):
        return False
    splits = meta.get("splits")
    if not isinstance(splits, dict) or "train" not in splits:
        return False

    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    def plain(name) -> bool:
        return isinstance(name, str) and name.endswith(".npy") and "/" not in name and "\\" not in name

    for entry in splits.values():
        if not isinstance(entry, dict) or not plain(entry.get("file")) or not count(entry.get("tokens")):
            return False
        if "offsets" in entry and not (plain(entry["offsets"]) and count(entry.get("sentences"))
                                       and entry["sentences"] <= entry["tokens"]):
            return False
    unknown = meta.get("unknown", {})  # a corpus read with a given vocabulary: {symbol: count}
    if not isinstance(unknown, dict) or not all(isinstance(k, str) and count(v) for k, v in unknown.items()):
        return False
    return isinstance(meta.get("notes", []), list)


def open_corpus(
    spec: str | DataSpec,
    cache_dir: str | os.PathLike | None = None,
    *,
    force: bool = False,
    log: Log | None = None,
    vocab: Vocab | None = None,
) -> Corpus:
    """Open a corpus by spec, preparing it first if the cache is missing or stale.

    `cache_dir` defaults to `$TXL_CACHE_DIR` or `~/.cache/txl`. `force=True` re-prepares even a valid
    cache. `vocab`: read the text with this vocabulary instead of one built from it (fine-tuning reads new
    text with its checkpoint's); symbols it lacks become its `<unk>` (counted in `Corpus.unknown`), or
    `UnknownSymbols` names them when it has none. Raises `DataError` (one line: the cause and the fix) for
    anything a user can get wrong.
    """
    parsed = parse_spec(spec)
    plan = make_plan(parsed)
    if vocab is not None and vocab.kind != plan.tokenizer:
        fix = (f"--data {parsed.canonical().partition('?')[0]}?tokenizer={vocab.kind}" if "tokenizer" in parsed.options
               else f"a corpus read as {vocab.kind}")
        raise OtherTokenizer(f"{parsed.text} makes a {plan.tokenizer} vocabulary, but the vocabulary to read it with "
                             f"is a {vocab.kind} vocabulary; give {fix}", tokenizer=plan.tokenizer, fix=fix)
    root = cache_root(cache_dir) / "corpora"
    directory = root / cache_key(plan, vocab)
    remove_stale_dirs(root)  # what killed preparations left, of corpora nobody is preparing now
    meta = None if force else _valid_meta(plan, directory, vocab)
    if meta is None:
        ensure_dir(root)
        with file_lock(root / f".{directory.name}.lock"):
            remove_stale_dirs(root, held=directory.name)
            meta = None if force else _valid_meta(plan, directory, vocab)  # another process may have finished
            if meta is None:
                meta = _prepare(plan, directory, log, vocab)
    # computed here, not read from meta.json: caches prepared before issue 45 hold the path-hashing form
    meta = {**meta, "fingerprint": _fingerprint(plan, meta["sources"]), "legacy_fingerprint": _legacy_fingerprint(meta)}
    return Corpus(directory, meta, parsed.text)


def prepare(
    spec: str | DataSpec,
    cache_dir: str | os.PathLike | None = None,
    *,
    force: bool = False,
    log: Log | None = None,
) -> Corpus:
    """Same as `open_corpus`; the name says what `txl data prepare` is for."""
    return open_corpus(spec, cache_dir, force=force, log=log)


def _prepare(plan: Plan, directory: Path, log: Log | None, vocab: Vocab | None = None) -> dict[str, Any]:
    say = log or (lambda _msg: None)
    say(f"{plan.spec.name}: hashing {len(plan.sources)} source file(s)")
    sources = _stat_sources(plan)
    for entry, path in zip(sources, plan.sources):
        entry["sha256"] = sha256_file(path)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}-{os.urandom(3).hex()}")
    try:
        tmp.mkdir(parents=True)
    except OSError as err:
        raise DataError(f"cannot write the prepared cache of {plan.spec.name} in {directory.parent}: "
                        f"{describe_os_error(err)} (or set TXL_CACHE_DIR)") from None
    started = time.time()
    try:
        built = build(plan, tmp, log) if vocab is None else _build_with_vocab(plan, tmp, vocab, log)
        after = _stat_sources(plan)
        if [(s["size"], s["mtime_ns"]) for s in after] != [(s["size"], s["mtime_ns"]) for s in sources]:
            raise DataError(f"{plan.spec.name}: a source file changed while it was being prepared; run again")
        meta = {
            "format": META_FORMAT,
            "version": META_VERSION,
            "reader_version": READER_VERSION,
            "name": plan.spec.name,
            "spec": plan.spec.canonical(),
            "options": plan.spec.options,
            "metric": plan.metric,
            "tokenizer": plan.tokenizer,
            "source": plan.identity,
            "sources": sources,
            "fingerprint": _fingerprint(plan, sources),
            "notes": plan.notes,
            "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "prepare_seconds": round(time.time() - started, 3),
            "python": sys.version.split()[0],
            **built,
        }
        write_json(tmp / "meta.json", meta)  # written last: its presence marks a complete cache
        fsync_dir(tmp)
        replace_dir(tmp, directory)
    except OSError as err:  # the cache's disk (full, quota, read-only); the unfinished cache is removed
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(f"cannot write the prepared cache of {plan.spec.name} in {directory.parent}: "
                        f"{describe_os_error(err)} (or set TXL_CACHE_DIR)") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"{plan.spec.name}: prepared in {meta['prepare_seconds']:.1f} s -> {directory}")
    return meta


# ---- a corpus read with a given vocabulary (fine-tuning: the checkpoint's) ------------------------


class OtherTokenizer(DataError):
    """The spec reads its text with another tokenizer than the given vocabulary's kind."""

    def __init__(self, message: str, *, tokenizer: str, fix: str):
        super().__init__(message)
        self.tokenizer, self.fix = tokenizer, fix


class UnknownSymbols(DataError):
    """The text holds symbols a given vocabulary lacks, and it has no `<unk>` to read them as."""

    def __init__(self, message: str, counts: dict[str, int]):
        super().__init__(message)
        self.counts = counts


def describe_symbols(counts: dict[str, int], most: int = 5) -> str:
    """The most frequent symbols of `counts` with their counts: "'é' ×7, 'ß' ×2 and 3 more"."""
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    text = ", ".join(f"{symbol!r} ×{count:,}" for symbol, count in ranked[:most])
    return text + (f" and {len(ranked) - most:,} more" if len(ranked) > most else "")


def _unknown_symbols(plan: Plan, vocab: Vocab) -> dict[str, int]:
    """How often each symbol the vocabulary lacks occurs in any split (bytes and byte-level BPE lack none)."""
    counts: dict[str, int] = {}
    if vocab.kind == "chars":
        known = np.array([ord(c) for c in vocab.symbols], dtype=np.uint32)
        for segments in plan.splits.values():
            for seg in segments:
                for _off, text, _open in _texts(seg, lines=False, why="a character-level corpus must be UTF-8"):
                    cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
                    missing, times = np.unique(cps[~np.isin(cps, known)], return_counts=True)
                    for cp, n in zip(missing.tolist(), times.tolist()):
                        counts[chr(cp)] = counts.get(chr(cp), 0) + n
    elif vocab.kind == "words":
        stoi = vocab.stoi
        for segments in plan.splits.values():
            for seg in segments:
                for _off, text, _open in _texts(seg, lines=True, why="a word-level corpus must be UTF-8 text"):
                    for word in text.split():
                        if word not in stoi:
                            counts[word] = counts.get(word, 0) + 1
    return counts


def _build_with_vocab(plan: Plan, out: Path, vocab: Vocab, log: Log | None) -> dict:
    """`txl.data.encode.build` with a given vocabulary: every split encoded with it (symbols it lacks as its
    `<unk>`), the vocabulary saved as the corpus's. Returns the per-split part of meta.json."""
    unknown = _unknown_symbols(plan, vocab)
    if unknown and vocab.unk is None:
        total = sum(unknown.values())
        raise UnknownSymbols(f"{plan.spec.text} holds {len(unknown):,} symbol(s) the vocabulary lacks ({total:,} "
                             f"occurrences: {describe_symbols(unknown)}) and the vocabulary has no <unk> to read "
                             "them as", unknown)
    vocab.save(out / "vocab.json")

    def encode(plan: Plan, vocab: Vocab, segments: list, writer: NpyWriter, offsets: NpyWriter | None) -> None:
        if vocab.kind == "chars" and unknown:  # the vocabulary's <unk> (a built one never has one)
            for seg in segments:
                for _off, text, _open in _texts(seg, lines=False, why="a character-level corpus must be UTF-8"):
                    writer.write(vocab.encode("".join(vocab.unk if c in unknown else c for c in text)))
        else:
            _encode(plan, vocab, segments, writer, offsets)  # words: stoi.get(word, unk)

    splits = write_splits(plan, out, vocab, log, encode=encode, given_vocab=True)
    return {"splits": splits, "vocab_size": vocab.size, "vocab_fingerprint": vocab.fingerprint, "unknown": unknown}
