"""Sequence-to-sequence data: pair corpora, their vocabularies and length-bucketed padded batches.

Three corpora (specs, `txl data list`):

- `pairs:FILE` or `pairs:DIR` — your own (source, target) pairs: TSV (source<TAB>target per line, an
  optional `source<TAB>target` header), JSONL (one object per line, columns `source`/`target` or named
  with `?source=COL&target=COL`), or CSV with a header (the Kaggle Inshorts CSV's `headlines` and
  `text` are recognised as target and source; seed 003's walkthrough reads the Excel file's `Headline`
  and `Short`). A FILE is split 90/5/5 by a hash of the source text, so
  a pair stays in its split when the file grows; a DIR holds `train.*` and optionally `valid.*`, `test.*`.
- `reverse` — the synthetic sanity task: reverse a random lower-case string.
- `pydoc-summaries` — function source -> first line of its docstring, from the standard library
  (`txl.data.pydoc`).

Vocabularies: characters or byte-level BPE (Hugging Face `tokenizers`, trained on the train split),
one shared by source and target or one each (`?shared=0`), each with three symbols of its own after
the base ids: padding, start and end. Length filtering (`?max_source_len=&max_target_len=`) drops the
pairs that are longer, counted in tokens. Pairs are held in memory (tens of MB for 100k summaries).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from txl.data.spec import DataSpec, parse_spec
from txl.data.vocab import Vocab, _require_tokenizers, bpe_pieces
from txl.errors import DataError, jsonl_rows
from txl.io import VOCAB_LIMIT, read_json, read_text, write_text

SPECIALS = ("<pad>", "<s>", "</s>")  # padding, start, end: the ids after the base vocabulary's
FORMAT = "txl-pair-vocab"
SUFFIXES = (".tsv", ".jsonl", ".csv")
SPLITS = ("train", "valid", "test")
PAIRS_LIMIT = 256 << 20  # a pairs file is held in memory, several times over once parsed (Inshorts: 20 MB)


class TokenVocab:
    """A base `Vocab` (chars or bpe) plus padding, start and end ids after its own."""

    def __init__(self, base: Vocab):
        self.base = base
        self.pad_id, self.bos_id, self.eos_id = base.size, base.size + 1, base.size + 2

    @property
    def size(self) -> int:
        return self.base.size + len(SPECIALS)

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.base.encode(text)]

    def decode(self, ids) -> str:
        """Text of ids, stopping at the end symbol and skipping padding and start symbols."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i < self.base.size:
                out.append(i)
        return self.base.decode(out)


class PairVocab:
    """The vocabularies of a pair corpus, saved as one JSON `vocab.json` (never pickled)."""

    def __init__(self, source: Vocab, target: Vocab | None = None):
        self.source = TokenVocab(source)
        self.target = self.source if target is None else TokenVocab(target)
        self.shared = target is None
        self.kind = f"pairs-{source.kind}"
        self.symbols = None

    @property
    def size(self) -> int:  # the model's vocab_size: the target's
        return self.target.size

    def __len__(self) -> int:
        return self.size

    def to_dict(self) -> dict[str, Any]:
        d = {"format": FORMAT, "version": 1, "specials": list(SPECIALS), "source": self.source.base.to_dict()}
        if not self.shared:
            d["target"] = self.target.base.to_dict()
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, sort_keys=True, separators=(",", ":"))

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()

    def save(self, path) -> None:
        write_text(Path(path), self.to_json() + "\n")

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "vocabulary") -> PairVocab:
        if not isinstance(d, dict) or d.get("format") != FORMAT or d.get("version") != 1:
            raise DataError(f"{source} is not a txl pair vocabulary (format {FORMAT!r}, version 1)")
        if d.get("specials") != list(SPECIALS) or set(d) - {"format", "version", "specials", "source", "target"}:
            raise DataError(f"{source}: unexpected keys or special symbols")
        src = Vocab.from_dict(d.get("source"), source=f"{source} (source)")
        tgt = Vocab.from_dict(d["target"], source=f"{source} (target)") if "target" in d else None
        return cls(src, tgt)

    @classmethod
    def load(cls, path, *, follow_links: bool = False) -> PairVocab:
        """A pair vocab.json: regular, at most `VOCAB_LIMIT` bytes, not a link unless `follow_links`."""
        data = read_json(Path(path), what="vocabulary file", limit=VOCAB_LIMIT, error=DataError,
                         follow_links=follow_links)
        return cls.from_dict(data, source=str(path))


def is_pair_vocab_file(path) -> bool:
    try:
        data = read_json(Path(path), what="vocabulary file", limit=VOCAB_LIMIT, error=DataError)
    except DataError:
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


# ---------------------------------------------------------------------------------------------
# Reading pairs


def _columns(header: list[str], source: str, target: str, where: str) -> tuple[int, int]:
    lowered = [h.strip().lower() for h in header]

    def find(wanted: str, defaults: tuple[str, ...], fallback: int) -> int:
        for name in ((wanted,) if wanted else defaults):
            if name.lower() in lowered:
                return lowered.index(name.lower())
        if wanted:
            raise DataError(f"{where} has no column {wanted!r} (columns: {', '.join(header)})")
        return fallback

    return (find(source, ("source", "text", "short", "document", "article"), 0),
            find(target, ("target", "headlines", "headline", "summary"), 1))


def read_pairs(path: Path, *, source: str = "", target: str = "") -> list[tuple[str, str]]:
    """The (source, target) pairs of one file (TSV, JSONL or CSV); a bad line is one DataError naming it."""
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise DataError(f"{path}: pairs are read from .tsv, .jsonl or .csv files, not {suffix or 'no suffix'!r}")
    # A user's path (a link is fine); a FIFO, a device or a file beyond PAIRS_LIMIT is one line
    text = read_text(path, what="pairs file", limit=PAIRS_LIMIT, follow_links=True)
    pairs: list[tuple[str, str]] = []
    if suffix == ".jsonl":
        for n, row in jsonl_rows(text, path):
            if not isinstance(row, dict):
                raise DataError(f"{path}:{n} is not a JSON object")
            src_key, tgt_key = source or "source", target or "target"
            if not isinstance(row.get(src_key), str) or not isinstance(row.get(tgt_key), str):
                raise DataError(f"{path}:{n} needs string fields {src_key!r} and {tgt_key!r} "
                                "(name others with ?source=COL&target=COL)")
            pairs.append((row[src_key], row[tgt_key]))
        return pairs
    rows = list(csv.reader(io.StringIO(text), delimiter="\t" if suffix == ".tsv" else ",",
                           quoting=csv.QUOTE_NONE if suffix == ".tsv" else csv.QUOTE_MINIMAL))
    rows = [r for r in rows if r and any(c.strip() for c in r)]
    if not rows:
        return pairs
    header = rows[0]
    has_header = suffix == ".csv" or [h.strip().lower() for h in header[:2]] == ["source", "target"] or bool(
        source or target)
    s_col, t_col = _columns(header, source, target, str(path)) if has_header else (0, 1)
    for n, row in enumerate(rows[1:] if has_header else rows, 2 if has_header else 1):
        if len(row) <= max(s_col, t_col):
            raise DataError(f"{path}: row {n} has {len(row)} column(s); expected source and target "
                            f"(columns {s_col + 1} and {t_col + 1})")
        pairs.append((row[s_col], row[t_col]))
    return pairs


def _split_of(text: str) -> str:
    """90/5/5 by a hash of the source: stable across runs, machines and file growth."""
    bucket = int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:4], "little") % 100
    return "valid" if bucket < 5 else "test" if bucket < 10 else "train"


def pairs_from_path(spec: DataSpec) -> dict[str, list[tuple[str, str]]]:
    path = Path(spec.path)
    opts = spec.options
    if path.is_dir():
        out = {}
        for split in SPLITS:
            found = [path / f"{split}{s}" for s in SUFFIXES if (path / f"{split}{s}").is_file()]
            if found:
                out[split] = read_pairs(found[0], source=opts["source"], target=opts["target"])
        if "train" not in out:
            raise DataError(f"{path} holds no train.tsv, train.jsonl or train.csv; put the training pairs there")
        return out
    if not path.exists():
        raise DataError(f"pairs file or directory not found: {path}")
    out = {s: [] for s in SPLITS}
    for pair in read_pairs(path, source=opts["source"], target=opts["target"]):
        out[_split_of(pair[0])].append(pair)
    return out


def reverse_pairs(spec: DataSpec) -> dict[str, list[tuple[str, str]]]:
    """Random lower-case strings and their reversals; held-out strings never occur in train."""
    o = spec.options
    if o["min_len"] > o["max_len"]:
        raise DataError(f"reverse option min_len={o['min_len']} is above max_len={o['max_len']}")
    rng = random.Random(o["seed"])
    letters = "abcdefghijklmnopqrstuvwxyz"
    seen: set[str] = set()
    out: dict[str, list[tuple[str, str]]] = {}
    for split, count in (("valid", 1000), ("test", 1000), ("train", o["size"])):
        rows = []
        for _ in range(count * 20):
            if len(rows) == count:
                break
            text = "".join(rng.choice(letters) for _ in range(rng.randint(o["min_len"], o["max_len"])))
            if text in seen:
                continue
            seen.add(text)
            rows.append((text, text[::-1]))
        out[split] = rows
    return out


# ---------------------------------------------------------------------------------------------
# Vocabularies and the corpus


def _train_vocab(texts: list[str], tokenizer: str, size: int) -> Vocab:
    if tokenizer == "chars":
        return Vocab("chars", sorted(set("".join(texts)) or {" "}))
    tk = _require_tokenizers()
    if size < 256 + len(SPECIALS):
        raise DataError(f"option vocab_size={size} is too small for byte-level BPE; use at least 300")
    bpe = tk.Tokenizer(tk.models.BPE())
    bpe.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=size - len(SPECIALS), show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator((piece for text in texts for piece in bpe_pieces(text)), trainer=trainer)
    return Vocab("bpe", bpe=bpe.to_str())


@dataclass
class PairCorpus:
    """A pair corpus in memory: its vocabularies, per split the token ids and the texts."""

    spec: str
    name: str
    vocab: PairVocab
    texts: dict[str, list[tuple[str, str]]]
    ids: dict[str, list[tuple[list[int], list[int]]]] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)  # pairs over the length limits, per split
    metric: str = "ppl"

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(s for s in SPLITS if self.ids.get(s))

    def pairs(self, split: str) -> list[tuple[list[int], list[int]]]:
        if split not in self.splits:
            raise DataError(f"{self.name} has no split {split!r}; known splits: {', '.join(self.splits)}")
        return self.ids[split]

    @property
    def fingerprint(self) -> str:
        """sha256 of the pairs kept in every split (what a resume must find again)."""
        h = hashlib.sha256(self.spec.encode("utf-8"))
        for split in SPLITS:
            for src, tgt in self.texts.get(split, []):
                h.update(f"{split}\0{src}\0{tgt}\0".encode("utf-8", "surrogatepass"))
        return h.hexdigest()

    def references(self, split: str) -> list[tuple[str, str]]:
        self.pairs(split)
        return self.texts[split]


def open_pair_corpus(spec_text: str | DataSpec, *, vocab: PairVocab | None = None) -> PairCorpus:
    """Read (or generate) the pairs of a spec, train or take the vocabularies, encode and filter them."""
    spec = parse_spec(spec_text)
    if spec.name == "reverse":
        texts = reverse_pairs(spec)
    elif spec.name == "pydoc-summaries":
        from txl.data.pydoc import pydoc_pairs

        texts = pydoc_pairs()
    elif spec.name == "pairs":
        texts = pairs_from_path(spec)
    else:
        raise DataError(f"{spec.name} is not a sequence-to-sequence corpus (pairs, reverse, pydoc-summaries)")
    if not texts.get("train"):
        raise DataError(f"{spec.text}: the train split holds no pairs")
    opts = spec.options
    tokenizer = opts.get("tokenizer", "chars")
    if vocab is None:
        train = texts["train"]
        size = opts.get("vocab_size", 0)
        if opts.get("shared", 1):
            vocab = PairVocab(_train_vocab([t for pair in train for t in pair], tokenizer, size))
        else:
            vocab = PairVocab(_train_vocab([s for s, _ in train], tokenizer, size),
                              _train_vocab([t for _, t in train], tokenizer, size))
    max_src, max_tgt = opts.get("max_source_len", 0), opts.get("max_target_len", 0)
    corpus = PairCorpus(spec=spec.canonical(), name=spec.name, vocab=vocab, texts={})
    for split, rows in texts.items():
        kept_text, kept_ids, dropped = [], [], 0
        for src, tgt in rows:
            try:
                s_ids, t_ids = vocab.source.encode(src), vocab.target.encode(tgt)
            except DataError as err:
                if split == "train":
                    raise
                raise DataError(f"{split} pair {src[:40]!r}: {err} (the vocabulary comes from the train split; "
                                "use tokenizer=bpe, which reads any text)") from None
            if max_src and opts.get("truncate", 0):
                s_ids = s_ids[:max_src]
            if not s_ids or (max_src and len(s_ids) > max_src) or (max_tgt and len(t_ids) + 1 > max_tgt):
                dropped += 1
                continue
            kept_text.append((src, tgt))
            kept_ids.append((s_ids, t_ids))
        corpus.texts[split], corpus.ids[split], corpus.dropped[split] = kept_text, kept_ids, dropped
    if not corpus.ids.get("train"):
        raise DataError(f"{spec.text}: every training pair is longer than max_source_len/max_target_len or has "
                        "an empty source; raise the limits")
    return corpus


# ---------------------------------------------------------------------------------------------
# Batches


@dataclass
class PairBatch:
    """One padded batch. source (b, s) and attention_mask (b, s) 1 = token; decoder_input (b, t) starts
    with the start symbol (teacher forcing); labels (b, t) the next target token, the end symbol
    last, -100 on padding. `step`: the batch's index in its epoch."""

    step: int
    source: Tensor
    attention_mask: Tensor
    decoder_input: Tensor
    labels: Tensor

    @property
    def tokens(self) -> int:
        return int((self.labels != -100).sum())


def collate(pairs: list[tuple[list[int], list[int]]], vocab: PairVocab, *, step: int = 0) -> PairBatch:
    """Pad a list of (source ids, target ids) on the right into one `PairBatch`."""
    s_len = max(len(s) for s, _ in pairs)
    t_len = max(len(t) for _, t in pairs) + 1
    n = len(pairs)
    source = np.full((n, s_len), vocab.source.pad_id, dtype=np.int64)
    mask = np.zeros((n, s_len), dtype=np.int64)
    dec = np.full((n, t_len), vocab.target.pad_id, dtype=np.int64)
    labels = np.full((n, t_len), -100, dtype=np.int64)
    for row, (s, t) in enumerate(pairs):
        source[row, : len(s)] = s
        mask[row, : len(s)] = 1
        dec[row, : len(t) + 1] = [vocab.target.bos_id, *t]
        labels[row, : len(t) + 1] = [*t, vocab.target.eos_id]
    return PairBatch(step, torch.from_numpy(source), torch.from_numpy(mask), torch.from_numpy(dec),
                     torch.from_numpy(labels))


class PairBatches:
    """Endless training batches of `batch_size` pairs, bucketed by length to waste little padding.

    Each epoch shuffles the pairs (seeded by seed and epoch), sorts every pool of 100 batches by
    source then target length, cuts it into batches and shuffles the batches. The position (epoch,
    batch) is the whole state, so a resumed run sees exactly the batches it would have seen."""

    POOL = 100

    def __init__(self, pairs, vocab: PairVocab, *, batch_size: int, seed: int):
        if not pairs:
            raise DataError("no training pairs")
        self.pairs, self.vocab, self.batch_size, self.seed = pairs, vocab, batch_size, seed
        self.epoch, self.position = 0, 0

    def _epoch_order(self, epoch: int) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.pairs))
        pool = self.batch_size * self.POOL
        batches = []
        for start in range(0, len(order), pool):
            chunk = sorted(order[start: start + pool].tolist(),
                           key=lambda i: (len(self.pairs[i][0]), len(self.pairs[i][1])))
            batches += [chunk[i: i + self.batch_size] for i in range(0, len(chunk), self.batch_size)]
        return [batches[i] for i in rng.permutation(len(batches))]

    def __iter__(self):
        while True:
            order = self._epoch_order(self.epoch)
            while self.position < len(order):
                index = order[self.position]
                step = self.position
                self.position += 1
                yield collate([self.pairs[i] for i in index], self.vocab, step=step)
            self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"kind": "pairs", "epoch": self.epoch, "position": self.position, "pairs": len(self.pairs),
                "batch_size": self.batch_size, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("kind") != "pairs":
            raise DataError("the saved data position is not a pair corpus's")
        for key in ("batch_size", "seed"):
            if state.get(key) != getattr(self, key):
                raise DataError(f"the saved data position has {key}={state.get(key)!r}, this run {getattr(self, key)!r}")
        if state.get("pairs") != len(self.pairs):
            raise DataError(f"the saved data position is for {state.get('pairs')!r} training pairs, the corpus "
                            f"now has {len(self.pairs)}")
        epoch, position = state.get("epoch"), state.get("position")
        if not (isinstance(epoch, int) and isinstance(position, int) and epoch >= 0 and position >= 0):
            raise DataError("the saved data position is damaged")
        self.epoch, self.position = epoch, position


def eval_batches(pairs, vocab: PairVocab, *, batch_size: int):
    """Batches over `pairs` in order of length (padding-efficient), with the original indices."""
    order = sorted(range(len(pairs)), key=lambda i: (len(pairs[i][0]), len(pairs[i][1])))
    for start in range(0, len(order), batch_size):
        index = order[start: start + batch_size]
        yield index, collate([pairs[i] for i in index], vocab)


__all__ = ["PairVocab", "TokenVocab", "PairCorpus", "PairBatch", "PairBatches", "open_pair_corpus", "collate",
           "eval_batches", "read_pairs", "is_pair_vocab_file"]
