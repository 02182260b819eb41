"""Document collections: the one reader of a corpus made of separate documents (issue 47).

A collection is read from one of three layouts, each document optionally labelled:

- a folder with one sub-folder per label (`DIR/LABEL/*`): every regular file is one labelled document
  (long-document classification: `txl train --objective classify --data docs:DIR`);
- a flat folder of files (`DIR/*`, no sub-folders): unlabelled documents;
- a JSONL file, one object per line with a string `text` field and an optional `label` (a string or an
  integer, read as its decimal string).

Splits: a folder holding `train/` (and optionally `valid/`, `test/`) or `train.jsonl` (`valid.jsonl`,
`test.jsonl`) gives them; otherwise every document goes to train, valid or test by a hash of its text
(90/5/5, stable across machines and file growth, as the pair corpora split). Hidden entries (a name
starting with ".") are skipped.

Everything is read through `txl.io`'s bounded reader and refused in one `DataError` line: a symbolic
link inside the folder (the path the user typed may be one), a file that is not regular, a document over
`DOCUMENT_LIMIT` bytes, more than `MAX_DOCUMENTS` documents, text that is not UTF-8, a JSONL line that is
not an object with a string `text`. Empty documents are skipped and counted (`DocumentSet.skipped`).

`open_documents(spec)` turns a `docs:` spec into a `DocumentCorpus`: the documents' token ids under a
vocabulary built from the train split the way the stream corpora build theirs (bytes, chars, words;
`txl.data.vocab`), or under a given one (fine-tuning a language model's vocabulary with `--init-from`).
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from txl.data.spec import DataSpec, parse_spec
from txl.data.vocab import Vocab
from txl.errors import DataError, jsonl_rows
from txl.io import read_text

SPLITS = ("train", "valid", "test")
DOCUMENT_LIMIT = 64 << 20  # one document file, held in memory while it is encoded
JSONL_LIMIT = 1 << 30  # a JSONL collection is read whole
MAX_DOCUMENTS = 10_000_000
MAX_LABELS = 100_000
MAX_LABEL_CHARS = 200
WORD_SPECIALS = ("<unk>",)


@dataclass(frozen=True)
class Document:
    """One document: its text, its label (None: unlabelled) and where it came from (path or path:line)."""

    text: str
    label: str | None
    source: str


@dataclass
class DocumentSet:
    """The documents of a collection per split, and how many empty ones were skipped."""

    path: str
    splits: dict[str, list[Document]]
    skipped: int = 0

    @property
    def labels(self) -> tuple[str, ...]:
        """The label names, sorted (the class ids are their positions); () for unlabelled documents."""
        return tuple(sorted({d.label for docs in self.splits.values() for d in docs if d.label is not None}))

    @property
    def labelled(self) -> bool:
        return all(d.label is not None for docs in self.splits.values() for d in docs)


# ---------------------------------------------------------------------------------------------
# Reading


def split_of(text: str) -> str:
    """90/5/5 by a hash of the text: stable across runs, machines and file growth."""
    bucket = int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:4], "little") % 100
    return "valid" if bucket < 5 else "test" if bucket < 10 else "train"


def read_documents(path: str | Path) -> DocumentSet:
    """The documents at `path` (a folder of label sub-folders, a flat folder, a JSONL file, or a folder of
    train/valid/test in either form), per split. One `DataError` line for anything it cannot read."""
    path = Path(os.path.expanduser(str(path)))
    try:
        st = os.stat(path)  # the path the user typed may be a link
    except FileNotFoundError:
        raise DataError(f"document collection not found: {path} (a folder with one sub-folder per label, a folder "
                        "of files, or a .jsonl file)") from None
    except OSError as err:
        raise DataError(f"cannot read the document collection {path}: {err.strerror or err}") from None
    counter = _Counter()
    if stat.S_ISREG(st.st_mode):
        docs = _read_jsonl(path, counter, follow_links=True)
        splits = _hash_split(docs)
    elif stat.S_ISDIR(st.st_mode):
        given = _given_splits(path)
        if given:
            if "train" not in given:
                raise DataError(f"{path} holds {', '.join(sorted(given))} but no train split (train/ or train.jsonl)")
            splits = {s: _read_any(p, counter) for s, p in given.items()}
        else:
            splits = _hash_split(_read_folder(path, counter))
    else:
        raise DataError(f"the document collection {path} is neither a folder nor a .jsonl file")
    out = DocumentSet(str(path), {s: splits.get(s, []) for s in SPLITS}, skipped=counter.skipped)
    if not out.splits["train"]:
        raise DataError(f"{path} holds no non-empty training document")
    labelled = [d.label is not None for docs in out.splits.values() for d in docs]
    if any(labelled) and not all(labelled):
        raise DataError(f"{path} mixes labelled and unlabelled documents; give every document a label or none")
    if len(out.labels) > MAX_LABELS:
        raise DataError(f"{path} has {len(out.labels):,} labels, more than the {MAX_LABELS:,} txl reads")
    return out


class _Counter:
    def __init__(self):
        self.documents = 0
        self.skipped = 0

    def add(self, docs: list[Document], doc: Document) -> None:
        if not doc.text.strip():
            self.skipped += 1
            return
        self.documents += 1
        if self.documents > MAX_DOCUMENTS:
            raise DataError(f"more than {MAX_DOCUMENTS:,} documents (at {doc.source}); txl reads at most that many")
        docs.append(doc)


def _given_splits(path: Path) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for split in SPLITS:
        for candidate in (path / split, path / f"{split}.jsonl"):
            if os.path.lexists(candidate):
                if split in found:
                    raise DataError(f"{path} holds both {split}/ and {split}.jsonl; keep one")
                found[split] = candidate
    return found


def _read_any(path: Path, counter: _Counter) -> list[Document]:
    _refuse_link(path)
    if path.suffix == ".jsonl" and not path.is_dir():
        return _read_jsonl(path, counter, follow_links=False)
    return _read_folder(path, counter)


def _refuse_link(path: Path) -> None:
    if os.path.islink(path):
        raise DataError(f"{path} is a symbolic link; txl does not follow links inside a folder it reads (it could "
                        "read files elsewhere): replace the link with the file or folder")


def _entries(folder: Path) -> list[Path]:
    try:
        names = sorted(n for n in os.listdir(folder) if not n.startswith("."))
    except OSError as err:
        raise DataError(f"cannot list {folder}: {err.strerror or err}") from None
    return [folder / n for n in names]


def _read_folder(folder: Path, counter: _Counter) -> list[Document]:
    """A folder of label sub-folders (labelled) or of files (unlabelled); not both."""
    entries = _entries(folder)
    for entry in entries:
        _refuse_link(entry)
    subdirs = [e for e in entries if e.is_dir()]
    files = [e for e in entries if not e.is_dir()]
    if subdirs and files:
        raise DataError(f"{folder} holds both files ({files[0].name}) and sub-folders ({subdirs[0].name}); a "
                        "labelled collection has one sub-folder per label and its documents in them")
    docs: list[Document] = []
    if not subdirs:
        for f in files:
            counter.add(docs, Document(_read_file(f), None, str(f)))
        return docs
    for sub in subdirs:
        label = sub.name
        if len(label) > MAX_LABEL_CHARS:
            raise DataError(f"label folder {sub} has a name longer than {MAX_LABEL_CHARS} characters")
        for entry in _entries(sub):
            _refuse_link(entry)
            if entry.is_dir():
                raise DataError(f"{entry} is a folder inside the label folder {sub}; a label folder holds files "
                                "only (one document each)")
            counter.add(docs, Document(_read_file(entry), label, str(entry)))
    return docs


def _read_file(path: Path) -> str:
    return read_text(path, what="document", limit=DOCUMENT_LIMIT, follow_links=False)


def _read_jsonl(path: Path, counter: _Counter, *, follow_links: bool) -> list[Document]:
    if path.suffix.lower() != ".jsonl":
        raise DataError(f"{path}: a document file must be .jsonl (one {{\"text\": ..., \"label\": ...}} object per "
                        "line); for plain text files give the folder that holds them")
    text = read_text(path, what="documents file", limit=JSONL_LIMIT, follow_links=follow_links)
    docs: list[Document] = []
    for n, row in jsonl_rows(text, path):
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise DataError(f"{path}:{n} needs a string field 'text' (and optionally 'label')")
        label = row.get("label")
        if isinstance(label, bool) or not (label is None or isinstance(label, (str, int))):
            raise DataError(f"{path}:{n}: 'label' must be a string or an integer, not {type(label).__name__}")
        if label is not None:
            label = str(label)
            if not label or len(label) > MAX_LABEL_CHARS:
                raise DataError(f"{path}:{n}: 'label' must be 1 to {MAX_LABEL_CHARS} characters")
        counter.add(docs, Document(row["text"], label, f"{path}:{n}"))
    return docs


def _hash_split(docs: list[Document]) -> dict[str, list[Document]]:
    out: dict[str, list[Document]] = {s: [] for s in SPLITS}
    for doc in docs:
        out[split_of(doc.text)].append(doc)
    return out


# ---------------------------------------------------------------------------------------------
# Vocabulary and encoding: the tokenizers of the stream corpora (txl.data.vocab)


def build_vocab(documents: list[Document], *, tokenizer: str, vocab_size: int = 0, min_freq: int = 1) -> Vocab:
    """bytes: the 256 byte values; chars: every character of the given documents, sorted by code point;
    words: whitespace-separated words of the given documents, most frequent first (vocab_size, min_freq),
    with `<unk>` for the rest."""
    if tokenizer == "bytes":
        return Vocab("bytes")
    if tokenizer == "chars":
        return Vocab("chars", sorted({c for d in documents for c in d.text}) or [" "])
    if tokenizer == "words":
        counts: Counter[str] = Counter()
        for d in documents:
            counts.update(d.text.split())
        symbols = list(WORD_SPECIALS)
        for word, count in counts.most_common():
            if count < min_freq or (vocab_size and len(symbols) >= vocab_size):
                break
            if word not in WORD_SPECIALS:
                symbols.append(word)
        return Vocab("words", symbols, unk="<unk>")
    raise DataError(f"docs: tokenizer={tokenizer!r} is not one of bytes, chars, words")


@dataclass
class DocumentCorpus:
    """A document collection encoded for a model: per split the token ids of each document and its class id
    (-1 for an unlabelled document). `labels[i]` is the name of class i."""

    spec: str
    name: str
    vocab: Vocab
    labels: tuple[str, ...]
    ids: dict[str, list[np.ndarray]]
    targets: dict[str, list[int]]
    sources: dict[str, list[str]] = field(default_factory=dict)
    skipped: int = 0
    truncated: int = 0  # documents cut to max_tokens
    unknown: dict[str, int] = field(default_factory=dict)  # symbols a given vocabulary read as <unk>
    metric: str = "ppl"  # the classifier's loss is a cross-entropy in nats (exp: a per-document perplexity)

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(s for s in SPLITS if self.ids.get(s))

    def documents(self, split: str) -> tuple[list[np.ndarray], list[int]]:
        """(token ids per document, class id per document) of `split`."""
        if split not in self.splits:
            raise DataError(f"{self.name} has no split {split!r}; known splits: {', '.join(self.splits)}")
        return self.ids[split], self.targets[split]

    @property
    def fingerprint(self) -> str:
        """sha256 of the encoded documents and labels of every split (what a resume must find again)."""
        h = hashlib.sha256(self.spec.encode("utf-8"))
        h.update("\0".join(self.labels).encode("utf-8"))
        for split in SPLITS:
            for ids, target in zip(self.ids.get(split, []), self.targets.get(split, [])):
                h.update(f"{split}\0{target}\0{len(ids)}\0".encode())
                h.update(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
        return h.hexdigest()


def open_documents(spec_text: str | DataSpec, *, vocab: Vocab | None = None) -> DocumentCorpus:
    """Read a `docs:PATH` spec and encode it: its own vocabulary from the train split, or `vocab` (a
    checkpoint's). Symbols `vocab` lacks read as its `<unk>` (counted in `unknown`); without one they are a
    `txl.data.corpus.UnknownSymbols` error."""
    spec = parse_spec(spec_text)
    if spec.name != "docs":
        raise DataError(f"{spec.text!r} is not a document collection; write docs:PATH")
    opts = spec.options
    docs = read_documents(spec.path)
    if vocab is None:
        vocab = build_vocab(docs.splits["train"], tokenizer=str(opts["tokenizer"]), vocab_size=int(opts["vocab_size"]),
                            min_freq=int(opts["min_freq"]))
        unknown: dict[str, int] = {}
    else:
        unknown = _check_vocab(spec, docs, vocab)
    labels = docs.labels
    index = {name: i for i, name in enumerate(labels)}
    max_tokens = int(opts["max_tokens"])
    ids: dict[str, list[np.ndarray]] = {}
    targets: dict[str, list[int]] = {}
    sources: dict[str, list[str]] = {}
    truncated = 0
    for split, split_docs in docs.splits.items():
        ids[split], targets[split], sources[split] = [], [], []
        for doc in split_docs:
            encoded = np.asarray(vocab.encode(doc.text), dtype=np.int64)
            if max_tokens and len(encoded) > max_tokens:
                encoded = encoded[:max_tokens]
                truncated += 1
            if not len(encoded):
                continue
            ids[split].append(encoded)
            targets[split].append(-1 if doc.label is None else index[doc.label])
            sources[split].append(doc.source)
    return DocumentCorpus(spec=spec.canonical(), name=f"docs:{spec.path}", vocab=vocab, labels=labels, ids=ids,
                          targets=targets, sources=sources, skipped=docs.skipped, truncated=truncated, unknown=unknown)


def _check_vocab(spec: DataSpec, docs: DocumentSet, vocab: Vocab) -> dict[str, int]:
    """Symbols of the documents that `vocab` lacks: {} for bytes; counted for a vocabulary with <unk>;
    else an `UnknownSymbols` error (the fine-tuning path names them, `txl.train.rundir`)."""
    from txl.data.corpus import OtherTokenizer, UnknownSymbols

    tokenizer = spec.options["tokenizer"]
    if vocab.kind != tokenizer and spec.options["tokenizer"] != spec.info.options["tokenizer"].default:
        raise OtherTokenizer(f"docs: tokenizer={tokenizer} but the vocabulary is {vocab.kind}", tokenizer=str(tokenizer),
                             fix=f"write {spec.elsewhere(spec.path).split('?')[0]}?tokenizer={vocab.kind}")
    if vocab.kind in ("bytes", "bpe"):
        return {}
    counts: Counter[str] = Counter()
    for split_docs in docs.splits.values():
        for doc in split_docs:
            pieces = doc.text if vocab.kind == "chars" else doc.text.split()
            counts.update(p for p in pieces if p not in vocab.stoi)
    if counts and vocab.unk is None:
        from txl.data.corpus import describe_symbols

        raise UnknownSymbols(f"{spec.text} holds {len(counts):,} symbol(s) the {vocab.kind} vocabulary lacks and it has no "
                             f"<unk> ({describe_symbols(dict(counts))}); read them with the vocabulary they were "
                             "trained with, or use tokenizer=bytes", dict(counts))
    return dict(counts)


# ---------------------------------------------------------------------------------------------
# Batches: documents of equal segment counts together (the classifier's exact batching, see
# txl.models.transformer_xl.classify)


@dataclass
class DocumentBatch:
    """Right-padded documents of one segment count: input_ids (b, n) int64, lengths (b,), labels (b,);
    `step` is the batch's position in its epoch (0: an epoch starts)."""

    input_ids: object  # torch.Tensor
    lengths: object
    labels: object
    step: int = 0
    epoch: int = 0


def segments_of(length: int, tgt_len: int) -> int:
    return max(-(-length // tgt_len), 1)


def bucket_batches(lengths: list[int], *, tgt_len: int, batch_size: int, order: list[int] | None = None
                   ) -> list[list[int]]:
    """Document indices grouped into batches of at most `batch_size` whose segment counts at `tgt_len` are
    equal, in `order` (default: as given) within each count; batches of fewer segments first."""
    order = list(range(len(lengths))) if order is None else order
    buckets: dict[int, list[int]] = {}
    for i in order:
        buckets.setdefault(segments_of(lengths[i], tgt_len), []).append(i)
    return [group[k : k + batch_size] for _, group in sorted(buckets.items()) for k in range(0, len(group), batch_size)]


def collate(ids: list[np.ndarray], targets: list[int], rows: list[int], *, step: int = 0, epoch: int = 0,
            max_len: int = 0) -> DocumentBatch:
    """The documents `rows`, right-padded with id 0 (never read: see the module docstring of classify);
    `max_len` > 0 cuts each to its first max_len tokens."""
    import torch

    docs = [ids[r][:max_len] if max_len else ids[r] for r in rows]
    width = max(len(d) for d in docs)
    out = np.zeros((len(docs), width), dtype=np.int64)
    for i, d in enumerate(docs):
        out[i, : len(d)] = d
    return DocumentBatch(torch.from_numpy(out), torch.tensor([len(d) for d in docs], dtype=torch.long),
                         torch.tensor([targets[r] for r in rows], dtype=torch.long), step=step, epoch=epoch)


class DocumentBatches:
    """Endless training batches of a split's documents: each epoch shuffles them (seed + epoch), buckets them
    by segment count and shuffles the batches. `max_len` > 0 reads only each document's first max_len tokens
    (the first-segment baseline). Its position is a checkpoint's `state_dict`."""

    def __init__(self, ids: list[np.ndarray], targets: list[int], *, batch_size: int, tgt_len: int, seed: int = 0,
                 max_len: int = 0):
        if not ids:
            raise DataError("no documents to train on")
        self.ids, self.targets = ids, targets
        self.batch_size, self.tgt_len, self.seed, self.max_len = batch_size, tgt_len, seed, max_len
        self.epoch, self.position = 0, 0

    def _plan(self, epoch: int) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, epoch])
        lengths = [min(len(d), self.max_len) if self.max_len else len(d) for d in self.ids]
        batches = bucket_batches(lengths, tgt_len=self.tgt_len, batch_size=self.batch_size,
                                 order=rng.permutation(len(self.ids)).tolist())
        return [batches[i] for i in rng.permutation(len(batches)).tolist()]

    def __iter__(self):
        while True:
            plan = self._plan(self.epoch)
            while self.position < len(plan):
                rows = plan[self.position]
                batch = collate(self.ids, self.targets, rows, step=self.position, epoch=self.epoch,
                                max_len=self.max_len)
                self.position += 1
                yield batch
            self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"kind": "documents", "epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("kind") != "documents" or state.get("seed") != self.seed:
            raise DataError("the saved position is not one of a document iterator with this seed")
        epoch, position = state.get("epoch"), state.get("position")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (epoch, position)):
            raise DataError("the saved document position is not two counts")
        self.epoch, self.position = epoch, position
