"""Prepared corpora: tokenize once into a cache directory, then memory-map on every use.

Layout of one prepared corpus, `<cache>/corpora/<name>-<key>/`:

    train.npy valid.npy test.npy   token ids, 1-D, smallest unsigned dtype (np.load(mmap_mode="r"))
    <split>.offsets.npy            lm1b only: sentence starts (uint64) plus an end sentinel
    vocab.json                     the `Vocab` (JSON, never pickle)
    meta.json                      spec, options, per-split counts, source fingerprint; written last

`<key>` hashes the spec name, the absolute source location and the options, so a changed option
prepares into a new directory. Whether the *content* of the sources changed is decided by the
fingerprint in meta.json:

- At preparation we record, per source file, its size, mtime and full sha256 (we read every byte
  anyway, so the hash costs one more sequential read: ~0.2 s for enwik8, seconds for lm1b).
- On open, if every file's (size, mtime_ns) still matches, the cache is used without reading the
  sources (milliseconds even for lm1b). If a stat differs, we re-hash only those files: same sha256
  (a copy, a `touch`, a re-download) -> keep the cache and refresh the stats; different -> re-prepare.

A sampled hash would be cheaper but can miss an edit that keeps the size, and a stale cache means
silently wrong results; a full hash only when the stat changed costs nothing in the common case.
The corpus `fingerprint` combines the content hashes (with paths relative to the source root), the
options and the reader version, so it is the same on every machine holding the same files.
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
    cache_root,
    ensure_dir,
    file_lock,
    load_npy,
    remove_stale_dirs,
    replace_dir,
    sha256_file,
)
from txl.data.encode import build
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
        self.fingerprint: str = meta["fingerprint"]
        self.source: str = meta["source"]
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


def cache_key(plan: Plan) -> str:
    blob = json.dumps(
        {"name": plan.spec.name, "source": plan.identity, "options": plan.spec.options}, sort_keys=True
    )
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
    blob = json.dumps(
        {
            "reader_version": READER_VERSION,
            "name": plan.spec.name,
            "options": plan.spec.options,
            "sources": [(s["path"], s["size"], s["sha256"]) for s in sources],
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _valid_meta(plan: Plan, directory: Path) -> dict[str, Any] | None:
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
    return isinstance(meta.get("notes", []), list)


def open_corpus(
    spec: str | DataSpec,
    cache_dir: str | os.PathLike | None = None,
    *,
    force: bool = False,
    log: Log | None = None,
) -> Corpus:
    """Open a corpus by spec, preparing it first if the cache is missing or stale.

    `cache_dir` defaults to `$TXL_CACHE_DIR` or `~/.cache/txl`. `force=True` re-prepares even a valid
    cache. Raises `DataError` (one line: the cause and the fix) for anything a user can get wrong.
    """
    parsed = parse_spec(spec)
    plan = make_plan(parsed)
    root = cache_root(cache_dir) / "corpora"
    directory = root / cache_key(plan)
    remove_stale_dirs(root)  # what killed preparations left, of corpora nobody is preparing now
    meta = None if force else _valid_meta(plan, directory)
    if meta is None:
        ensure_dir(root)
        with file_lock(root / f".{directory.name}.lock"):
            remove_stale_dirs(root, held=directory.name)
            meta = None if force else _valid_meta(plan, directory)  # another process may have finished
            if meta is None:
                meta = _prepare(plan, directory, log)
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


def _prepare(plan: Plan, directory: Path, log: Log | None) -> dict[str, Any]:
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
        built = build(plan, tmp, log)
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
