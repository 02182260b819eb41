"""txl's data layer: corpora by spec, prepared once into memory-mapped arrays, and batch iterators.

    from txl.data import open_corpus, StreamIterator, EvalIterator
    corpus = open_corpus("ptb-word:data/ptb")     # prepares once (cached, fingerprinted), then maps
    train = StreamIterator(corpus.split("train"), batch_size=22, tgt_len=512)

The iterators need torch and are imported on first use, so `txl data ...` and everything else here
starts without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from txl.data.corpus import Corpus, open_corpus, prepare
from txl.data.spec import DataSpec, known_corpora, parse_spec
from txl.data.vocab import Vocab

if TYPE_CHECKING:
    from txl.data.fetch import download
    from txl.data.iterators import Batch, EvalIterator, ShuffledSentenceIterator, StreamIterator

_LAZY = {
    "Batch": "txl.data.iterators",
    "StreamIterator": "txl.data.iterators",
    "EvalIterator": "txl.data.iterators",
    "ShuffledSentenceIterator": "txl.data.iterators",
    "download": "txl.data.fetch",
}

__all__ = [
    "Batch",
    "Corpus",
    "DataSpec",
    "EvalIterator",
    "ShuffledSentenceIterator",
    "StreamIterator",
    "Vocab",
    "download",
    "known_corpora",
    "open_corpus",
    "parse_spec",
    "prepare",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'txl.data' has no attribute {name!r}")
