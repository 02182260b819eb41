"""A document collection read for language modelling (issue 47): `docs:PATH` (a folder of files, or JSONL
with a `text` field, read by `txl.data.documents`, the one reader of collections) as a token stream that
knows where each document starts.

A `docs:` collection is not prepared into the corpus cache: `DocumentStream` lays each split's documents end
to end in memory and records their starts (`sentence_offsets`, the lm1b layout of `txl.data.corpus`), which
`train.document_boundaries = true` reads so that no document sees another (`ShuffledSentenceIterator(
boundaries=True)`); without it the documents are one stream, as any corpus.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from txl.data.documents import open_documents
from txl.data.spec import DataSpec
from txl.data.vocab import Vocab


class DocumentStream:
    """A document collection (`docs:PATH`: a folder of files or JSONL with a `text` field, read by
    `txl.data.documents`, the one reader of collections) as a corpus for language modelling: each split is
    its documents end to end, and `sentence_offsets` says where each starts (as lm1b's sentences), which
    `train.document_boundaries = true` uses so that no document sees another (issue 47; without it the
    documents are one stream, as any corpus). Held in memory: collections are bounded by their reader."""

    def __init__(self, documents: Any):
        self.documents_corpus = documents
        self.spec, self.name, self.vocab = documents.spec, documents.name, documents.vocab
        self.metric = "bpc" if self.vocab.kind in ("bytes", "chars") else "ppl"
        self.fingerprint = documents.fingerprint
        self.unknown: dict[str, int] = dict(documents.unknown)
        self._tokens: dict[str, np.ndarray] = {}

    @property
    def splits(self) -> tuple[str, ...]:
        return self.documents_corpus.splits

    def split(self, split: str) -> np.ndarray:
        if split not in self._tokens:
            ids, _ = self.documents_corpus.documents(split)
            self._tokens[split] = np.concatenate(ids).astype(self.vocab.dtype, copy=False)
        return self._tokens[split]

    def sentence_offsets(self, split: str) -> np.ndarray:
        """Each document's start in `split(split)`, then the token count."""
        ids, _ = self.documents_corpus.documents(split)
        return np.concatenate([[0], np.cumsum([len(d) for d in ids])]).astype(np.int64)

    def num_tokens(self, split: str) -> int:
        return int(len(self.split(split)))

    def stats(self) -> dict[str, Any]:
        return {"spec": self.spec, "name": self.name, "metric": self.metric, "vocab_size": self.vocab.size,
                "tokens": {s: self.num_tokens(s) for s in self.splits},
                "documents": {s: len(self.documents_corpus.documents(s)[0]) for s in self.splits},
                "fingerprint": self.fingerprint, "vocab_fingerprint": self.vocab.fingerprint}

    def __repr__(self) -> str:
        counts = ", ".join(f"{s}={self.num_tokens(s):,}" for s in self.splits)
        return f"DocumentStream({self.name!r}, vocab={self.vocab.size}, {counts})"


def open_document_stream(spec: str | DataSpec, *, vocab: Vocab | None = None) -> DocumentStream:
    """A `docs:` collection read for language modelling (`DocumentStream`)."""
    return DocumentStream(open_documents(spec, vocab=vocab))
