"""What `txl eval` scores: the corpus split of a checkpoint, read and checked against the checkpoint's
vocabulary (`open_eval_corpus`), or a text file encoded with it (`read_text_tokens`, `encode_text`), and
the metric of a checkpoint (`checkpoint_metric`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from txl.errors import CheckpointError, DataError, UsageError
from txl.io import read_bytes
from txl.models.checkpoint import LoadedCheckpoint

TEXT_LIMIT = 2**31  # `txl eval --text FILE` holds the whole file and its token ids in memory


def encode_text(vocab, text: str | bytes, *, what: str = "the text") -> np.ndarray:
    """Token ids of `text` with a checkpoint's vocabulary (not one rebuilt from the text), for any kind:
    bytes and byte-level BPE read everything; chars and words map an unknown symbol to `<unk>` when the
    vocabulary has one, else one `DataError` naming the first unknown symbol and where it is."""
    if vocab.kind == "words" and vocab.unk is None:
        body = text.decode("utf-8", "replace") if isinstance(text, bytes | bytearray) else text
        for number, line in enumerate(body.split("\n"), 1):
            for column, word in enumerate(line.split(), 1):
                if word not in vocab.stoi:
                    hint = ""
                    special = {vocab.eos, vocab.bos}
                    if all(len(s) == 1 for s in vocab.symbols if s not in special):
                        hint = ("; this vocabulary's words are single characters (PTB-char style): write the text as "
                                "space-separated characters with _ between words, e.g. 't h e _ c a t'")
                    raise DataError(f"{what}: word {word!r} (line {number}, word {column}) is not in the checkpoint's "
                                    f"vocabulary and it has no <unk> symbol{hint}")
    if vocab.kind == "chars" and vocab.unk is not None:
        body = text.decode("utf-8") if isinstance(text, bytes | bytearray) else text
        known = set(vocab.symbols)
        text = "".join(c if c in known else vocab.unk for c in body)
    try:
        return vocab.encode(text)
    except DataError as err:
        fix = "; the checkpoint's vocabulary has no <unk>: replace or remove it" if vocab.kind == "chars" else ""
        raise DataError(f"{what}: {err}{fix}") from None


def read_text_tokens(vocab, path: str | Path) -> np.ndarray:
    """A whole text file as token ids of the checkpoint's vocabulary (`txl eval --text FILE`)."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise DataError(f"{path} is a directory; --text takes one text file")
    # a path the user typed (links followed); a FIFO or device is refused, the size bounded
    data = read_bytes(path, what="text file", limit=TEXT_LIMIT, follow_links=True)
    tokens = encode_text(vocab, data, what=str(path))
    if len(tokens) < 2:
        raise DataError(f"{path} holds {len(tokens)} token(s) with the checkpoint's vocabulary; at least 2 are needed "
                        "to score one prediction")
    return tokens


def _text_file_of(spec_text: str | None) -> str | None:
    """The FILE of a `text:FILE[?...]` spec (scored with the checkpoint's vocabulary), else None."""
    if not spec_text:
        return None
    from txl.data import parse_spec

    spec = parse_spec(spec_text)
    if spec.name == "text" and spec.path and Path(spec.path).is_file():
        return spec.path
    return None


def open_eval_corpus(ckpt: LoadedCheckpoint, data: str | None, split: str, text: str | Path | None = None):
    """The corpus to score and its split tokens; its vocabulary must be the checkpoint's. A text file
    (`text`, or `data` = text:FILE with split "all") is read whole with the checkpoint's vocabulary
    instead: returns (None, tokens)."""
    from txl.data import open_corpus, parse_spec

    if text is None and split == "all":
        text = _text_file_of(data)
        if text is None:
            raise UsageError("--split all scores a whole text file with the checkpoint's vocabulary: give --text FILE "
                             "or --data text:FILE")
    if text is not None:
        if ckpt.vocab is None:
            raise CheckpointError(f"{ckpt.path} has no vocab.json; it is needed to turn text into token ids")
        return None, read_text_tokens(ckpt.vocab, text)
    spec = data or ckpt.data_spec
    if not spec:
        raise UsageError(f"{ckpt.path} does not record its training data; pass --data SPEC")
    if ckpt.vocab is not None and ckpt.vocab.text_rules is not None:
        return _fixed_vocab_corpus(ckpt, spec, split)
    # a fine-tuned run (run.json `init_from`) read its text with its checkpoint's vocabulary (issue 45)
    fixed = ckpt.vocab if isinstance(ckpt.run.get("init_from"), str) and ckpt.vocab is not None else None
    if parse_spec(spec).name == "docs":  # a document collection scored by a language model (issue 47)
        from txl.data.document_stream import open_document_stream

        corpus = open_document_stream(spec, vocab=ckpt.vocab)  # its documents' starts: sentence_offsets
    else:
        corpus = open_corpus(spec, vocab=fixed)
    if ckpt.vocab is not None:
        try:
            corpus.vocab.check_same(ckpt.vocab, what=f"the checkpoint {ckpt.path}")
        except DataError as err:
            if _text_file_of(spec) is None:
                raise
            raise DataError(f"{err}; to score this file with the checkpoint's own vocabulary use --text FILE "
                            "(or --split all)") from None
    else:
        corpus.vocab.check_matches(ckpt.model.config.vocab_size)
        print(f"note: {ckpt.path} has no vocab.json; only the vocabulary size was checked against {spec}",
              file=sys.stderr)
    tokens = corpus.split(split)
    # Prepared arrays are unsigned, so only an id >= vocab_size can be wrong (a damaged cache): one pass
    # over the split here instead of an IndexError deep inside the embedding (as the trainer does).
    largest = int(tokens.max()) if len(tokens) else 0
    if largest >= ckpt.model.config.vocab_size:
        raise DataError(f"token id {largest} in the {split} split of {spec!r} is outside the vocabulary "
                        f"({ckpt.model.config.vocab_size} ids): the prepared cache is damaged; run "
                        f"`txl data prepare {spec} --force`")
    return corpus, tokens


@dataclass
class FixedVocabCorpus:
    """A split read with the checkpoint's own vocabulary (what `open_eval_corpus` returns for it)."""

    metric: str
    vocab: Any
    fingerprint: str


def _fixed_vocab_corpus(ckpt: LoadedCheckpoint, spec: str, split: str):
    """A published model's vocabulary (imported, with text rules) is fixed: the corpus is read with it
    instead of with a vocabulary built from its train split (which would number words differently)."""
    import hashlib

    from txl.data import parse_spec
    from txl.data.encode import encode_split

    tokens, metric = encode_split(parse_spec(spec), split, ckpt.vocab)
    digest = hashlib.sha256(ckpt.vocab.fingerprint.encode() + tokens.tobytes()).hexdigest()
    return FixedVocabCorpus(metric=metric, vocab=ckpt.vocab, fingerprint=digest), tokens


def checkpoint_metric(ckpt: LoadedCheckpoint) -> str:
    """bpc or ppl: what the run reported, else by vocabulary kind (bytes and characters: bpc)."""
    metric = ckpt.state.get("metric") or ckpt.run.get("metric")
    if metric in ("bpc", "ppl"):
        return metric
    return "bpc" if ckpt.vocab is not None and ckpt.vocab.kind in ("bytes", "chars") else "ppl"

