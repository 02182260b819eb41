"""Vocabularies: the map between text and token ids, stored as JSON and never pickled.

Four kinds, one per tokenizer:

- `bytes`: 256 ids, id = byte value (enwik8, builtin, `text?tokenizer=bytes`). Encoding a `str` uses
  UTF-8 with `surrogateescape`, so `decode` then `encode` restores any byte sequence, even invalid
  UTF-8 (enwik8 holds some).
- `chars`: one id per character, symbols sorted by code point (text8, `text?tokenizer=chars`).
- `words`: whitespace-separated symbols (PTB word and char, WikiText, lm1b, `text?tokenizer=words`).
  An `eos` symbol stands for each line end, lm1b also puts a `bos` symbol at each line start, as the
  reference code does (`add_eos` / `add_double_eos` in kimiyoung/transformer-xl `vocabulary.py`).
  A words vocabulary may carry `text` rules (`txl.data.moses`): then `encode` tokenises raw text the
  WikiText-103 way (Moses, `@-@`, `@,@`) and `decode` detokenises, as for the published models that
  `txl import-hf` brings in. Corpus files are always read as whitespace-separated symbols.
- `bpe`: a byte-level BPE model from Hugging Face `tokenizers`, kept as its own JSON inside ours.

The reason for JSON only: a vocabulary travels with checkpoints, and loading a stranger's pickle runs
their code (the hole that got Hugging Face's TransfoXL deprecated, CVE-2023-6730). `from_json` checks
every field, so a malformed or hostile file ends in a `DataError`, nothing else.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from txl.data.cache import smallest_uint
from txl.errors import DataError, parse_json
from txl.io import VOCAB_LIMIT, read_bytes, write_text

FORMAT = "txl-vocab"
VERSION = 1
KINDS = ("bytes", "chars", "words", "bpe")
MAX_SYMBOLS = 1 << 31


def _require_tokenizers():
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise DataError(
            "BPE needs the optional dependency 'tokenizers': pip install 'txl[bpe]' (or tokenizers>=0.13)"
        ) from None
    import tokenizers

    return tokenizers


# Byte-level BPE training cost grows with the square of the longest pre-token (a run of letters, of
# digits, of other symbols, or of whitespace): one 160,000-letter word took 8.6 s, one of 2 MB did not
# finish in 5 minutes, and a 50 MB line aborted the process (issue 50). Runs longer than this are cut into pieces of this many
# characters before the tokenizer sees them, in training and encoding alike; the pieces' encodings
# concatenate back to the text (byte-level, no prefix space), and text without such runs is untouched.
BPE_RUN_LIMIT = 1000


@functools.lru_cache(maxsize=8)
def _long_run(limit: int) -> re.Pattern:
    return re.compile(rf"\S{{{limit + 1},}}|\s{{{limit + 1},}}")


def bpe_pieces(text: str, limit: int = BPE_RUN_LIMIT) -> Iterator[str]:
    """`text` cut inside every whitespace-free (or all-whitespace) run longer than `limit` characters,
    so no piece holds such a run; the pieces join back to `text`, and text without one is one piece."""
    pattern = _long_run(limit)
    if pattern.search(text) is None:
        yield text
        return
    start = 0
    for match in pattern.finditer(text):
        for cut in range(match.start() + limit, match.end(), limit):
            yield text[start:cut]
            start = cut
    yield text[start:]


def bpe_encode(tokenizer, text: str) -> list[int]:
    """Ids of `text` under a `tokenizers` BPE model, encoded piece by piece (`bpe_pieces`)."""
    ids: list[int] = []
    for piece in bpe_pieces(text):
        ids.extend(tokenizer.encode(piece).ids)
    return ids


class Vocab:
    """A vocabulary of one of the four kinds above; see the module docstring.

    `len(vocab)` / `vocab.size` is the number of ids; `vocab.dtype` the smallest unsigned dtype that
    holds them (what prepared arrays use); `vocab.fingerprint` a sha256 of the canonical JSON, so two
    vocabularies are the same exactly when their fingerprints are.
    """

    def __init__(
        self,
        kind: str,
        symbols: Sequence[str] | None = None,
        *,
        eos: str | None = None,
        bos: str | None = None,
        unk: str | None = None,
        bpe: str | None = None,
        text: dict[str, Any] | None = None,
    ):
        if kind not in KINDS:
            raise DataError(f"unknown vocabulary kind {kind!r}; known: {', '.join(KINDS)}")
        self.kind = kind
        self.eos, self.bos, self.unk = eos, bos, unk
        self._bpe_json = bpe
        self._tokenizer = None
        self.text_rules: dict[str, Any] | None = None
        self._text = None
        if text is not None:
            from txl.data.moses import MosesText

            if kind != "words":
                raise DataError(f"text rules apply to words vocabularies, not {kind}")
            self._text = MosesText(text)
            self.text_rules = self._text.rules
        if kind == "bytes":
            self.symbols: tuple[str, ...] | None = None
            self._size = 256
        elif kind == "bpe":
            if not isinstance(bpe, str):
                raise DataError("a bpe vocabulary needs its tokenizer JSON")
            self.symbols = None
            self._size = self._bpe().get_vocab_size(with_added_tokens=True)
        else:
            self.symbols = tuple(symbols or ())
            self._size = len(self.symbols)
            self._stoi = {s: i for i, s in enumerate(self.symbols)}
            if len(self._stoi) != len(self.symbols):
                raise DataError("vocabulary has duplicate symbols")
            try:  # JSON can spell lone surrogates ("\ud800"); they cannot be saved or fingerprinted
                "".join(self.symbols).encode("utf-8")
            except UnicodeEncodeError as err:
                raise DataError(f"vocabulary symbol holds {err.object[err.start]!r}, not valid Unicode text") from None
            for role, sym in (("eos", eos), ("bos", bos), ("unk", unk)):
                if sym is not None and sym not in self._stoi:
                    raise DataError(f"vocabulary {role} symbol {sym!r} is not among its symbols")
            if kind == "chars":
                if any(len(s) != 1 for s in self.symbols):
                    raise DataError("a chars vocabulary holds single characters only")
                cps = np.array([ord(s) for s in self.symbols], dtype=np.uint32)
                if len(cps) > 1 and not np.all(cps[1:] > cps[:-1]):
                    raise DataError("a chars vocabulary must be sorted by code point")
                self._cps = cps
        if self._size == 0:
            raise DataError("vocabulary is empty")
        self._fingerprint: str | None = None

    # ---- size and identity ------------------------------------------------------------------
    def __len__(self) -> int:
        return self._size

    @property
    def size(self) -> int:
        return self._size

    @property
    def dtype(self) -> np.dtype:
        return smallest_uint(self._size - 1)

    @property
    def eos_id(self) -> int | None:
        return None if self.eos is None else self._stoi[self.eos]

    @property
    def bos_id(self) -> int | None:
        return None if self.bos is None else self._stoi[self.bos]

    @property
    def unk_id(self) -> int | None:
        return None if self.unk is None else self._stoi[self.unk]

    def index(self, symbol: str) -> int:
        """Id of one symbol (words/chars kinds); `DataError` if absent."""
        if self.kind in ("bytes", "bpe"):
            raise DataError(f"a {self.kind} vocabulary has no symbol table; use encode()")
        try:
            return self._stoi[symbol]
        except KeyError:
            raise DataError(f"symbol {symbol!r} is not in the vocabulary") from None

    @property
    def stoi(self) -> dict[str, int]:
        """Symbol -> id (words/chars kinds). Used by the readers' fast encoding loop."""
        return self._stoi

    def check_matches(self, vocab_size: int) -> None:
        """Raise `DataError` if a checkpoint built for `vocab_size` ids cannot read this corpus."""
        if int(vocab_size) != self._size:
            raise DataError(
                f"vocabulary size mismatch: the checkpoint has {int(vocab_size)} ids but this corpus "
                f"vocabulary has {self._size}; evaluate on the corpus the model was trained on "
                f"(same spec and options)"
            )

    def check_same(self, other: Vocab, what: str = "the checkpoint") -> None:
        """Raise `DataError` unless `other` (e.g. a checkpoint's vocab.json) is this very vocabulary.

        Equal sizes are not enough: two word vocabularies of 10,000 ids can order words differently,
        and a model would then read every id as the wrong word.
        """
        if other.fingerprint != self.fingerprint:
            raise DataError(
                f"vocabulary mismatch: {what} has a {other.kind} vocabulary of {other.size} ids "
                f"(fingerprint {other.fingerprint[:12]}) but this corpus has a {self.kind} vocabulary of "
                f"{self.size} ids (fingerprint {self.fingerprint[:12]}); use the corpus spec the model was trained on"
            )

    # ---- encode / decode --------------------------------------------------------------------
    def encode(self, text: str | bytes) -> np.ndarray:
        """Token ids of `text` as a 1-D array of `self.dtype`.

        words: every '\\n' becomes `eos` (and starts a line with `bos` for lm1b); a last line without
        '\\n' gets no `eos`, so a prompt can be continued. (Corpus files differ in one respect, as in
        the reference: their unterminated last line also gets `eos`.) Unknown words map to `unk`, or
        raise `DataError` when the vocabulary has none. With `text` rules each line is tokenised by
        them (Moses, WikiText-103 style) instead of split at whitespace.
        """
        if self.kind == "bytes":
            data = text.encode("utf-8", "surrogateescape") if isinstance(text, str) else bytes(text)
            return np.frombuffer(data, dtype=np.uint8).copy()
        if isinstance(text, bytes | bytearray | memoryview):
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"text is not UTF-8 (byte offset {err.start}); a {self.kind} vocabulary needs UTF-8"
                ) from None
        if self.kind == "chars":
            return self._encode_chars(text)
        if self.kind == "bpe":
            return np.asarray(bpe_encode(self._bpe(), text), dtype=self.dtype)
        return self._encode_words(text)

    def _encode_chars(self, text: str) -> np.ndarray:
        cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
        ids = np.searchsorted(self._cps, cps)
        ids_clipped = np.minimum(ids, len(self._cps) - 1)
        bad = self._cps[ids_clipped] != cps
        if bad.any():
            first = int(np.argmax(bad))
            raise DataError(f"character {text[first]!r} (position {first}) is not in the vocabulary")
        return ids.astype(self.dtype)

    def _encode_words(self, text: str) -> np.ndarray:
        lines = text.split("\n")
        out: list[int] = []  # one prompt's worth of ids; corpora go through readers.py instead
        stoi, unk = self._stoi, self.unk_id
        for n, line in enumerate(lines):
            last = n == len(lines) - 1
            if last and not line:
                break
            if self.bos is not None:
                out.append(self._stoi[self.bos])
            for word in self._text.tokenize(line) if self._text is not None else line.split():
                idx = stoi.get(word, unk)
                if idx is None:
                    raise DataError(
                        f"word {word!r} is not in the vocabulary and it has no unknown-word symbol"
                    )
                out.append(idx)
            if not last and self.eos is not None:
                out.append(self._stoi[self.eos])
        return np.asarray(out, dtype=self.dtype)

    def unknown_words(self, text: str) -> list[str]:
        """The words of `text` this words vocabulary lacks, each once in order of appearance (what `encode`
        reads as `unk`, or refuses without one); [] for the other kinds, which report unknown characters
        themselves (chars) or have none (bytes, byte-level BPE)."""
        if self.kind != "words":
            return []
        unknown: dict[str, None] = {}
        for line in text.split("\n"):
            for word in self._text.tokenize(line) if self._text is not None else line.split():
                if word not in self._stoi:
                    unknown.setdefault(word)
        return list(unknown)

    def _ids(self, ids: Iterable[int] | np.ndarray) -> np.ndarray:
        arr = np.asarray(ids).reshape(-1)
        if arr.size and (
            not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0 or arr.max() >= self._size
        ):
            raise DataError(f"token ids out of range for a vocabulary of {self._size}")
        return arr.astype(np.int64)

    def decode_bytes(self, ids: Iterable[int] | np.ndarray) -> bytes:
        """Bytes of `ids` (bytes kind: exact; other kinds: UTF-8 of `decode`)."""
        if self.kind == "bytes":
            return self._ids(ids).astype(np.uint8).tobytes()
        return self.decode(ids).encode("utf-8", "surrogatepass")

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """Text of `ids`; inverse of `encode` (words: symbols joined by one space, or detokenised by the
        `text` rules, `eos` -> '\\n')."""
        arr = self._ids(ids)
        if self.kind == "bytes":
            return arr.astype(np.uint8).tobytes().decode("utf-8", "surrogateescape")
        if self.kind == "chars":
            return self._cps[arr].astype("<u4").tobytes().decode("utf-32-le", "surrogatepass")
        if self.kind == "bpe":
            return self._bpe().decode(arr.tolist(), skip_special_tokens=False)
        eos, bos = self.eos_id, self.bos_id
        join = self._text.detokenize if self._text is not None else " ".join
        parts: list[str] = []
        line: list[str] = []
        at_line_start = True
        for i in arr.tolist():
            if bos is not None and i == bos and at_line_start:
                at_line_start = False
                continue
            if eos is not None and i == eos:
                parts.append(join(line) + "\n")
                line, at_line_start = [], True
                continue
            at_line_start = False
            line.append(self.symbols[i])
        if line:
            parts.append(join(line))
        return "".join(parts)

    def _bpe(self):
        if self._tokenizer is None:
            tokenizers = _require_tokenizers()
            try:
                self._tokenizer = tokenizers.Tokenizer.from_str(self._bpe_json)
            except Exception as err:  # the Rust side raises plain Exception subclasses
                raise DataError(f"invalid BPE tokenizer JSON in vocabulary: {err}") from None
        return self._tokenizer

    # ---- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"format": FORMAT, "version": VERSION, "kind": self.kind, "size": self._size}
        if self.symbols is not None:
            d["symbols"] = list(self.symbols)
        for key in ("eos", "bos", "unk"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.kind == "bpe":
            d["bpe"] = self._bpe_json
        if self.text_rules is not None:
            d["text"] = self.text_rules
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False, sort_keys=True, separators=(",", ":"))

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()
        return self._fingerprint

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocab) and self.fingerprint == other.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        return f"Vocab(kind={self.kind!r}, size={self._size}, fingerprint={self.fingerprint[:12]})"

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "vocabulary JSON") -> Vocab:
        """Build a vocabulary from JSON, checking every field (safe on untrusted input)."""
        try:
            d = parse_json(text)
        except (ValueError, RecursionError) as err:  # also bad UTF-8, 5000-digit numbers, [[[[...
            raise DataError(f"{source} is not valid JSON ({err}); it must be a txl vocab.json") from None
        return cls.from_dict(d, source=source)

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "vocabulary") -> Vocab:
        def bad(why: str) -> DataError:
            return DataError(f"{source} is not a txl vocabulary: {why}")

        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise bad(f'missing "format": "{FORMAT}"')
        if d.get("version") != VERSION:
            raise bad(f"version {d.get('version')!r}, this txl reads version {VERSION}")
        kind = d.get("kind")
        if kind not in KINDS:
            raise bad(f"kind {kind!r} is not one of {', '.join(KINDS)}")
        unknown = set(d) - {"format", "version", "kind", "size", "symbols", "eos", "bos", "unk", "bpe", "text"}
        if unknown:
            raise bad(f"unknown keys {sorted(unknown)}")
        for key in ("eos", "bos", "unk"):
            if key in d and not isinstance(d[key], str):
                raise bad(f"{key} must be a string")
        symbols = None
        if kind in ("chars", "words"):
            symbols = d.get("symbols")
            if not isinstance(symbols, list) or not all(isinstance(s, str) for s in symbols):
                raise bad("symbols must be a list of strings")
            if len(symbols) > MAX_SYMBOLS:
                raise bad("too many symbols")
        if kind == "bpe" and not isinstance(d.get("bpe"), str):
            raise bad("bpe must hold the tokenizer JSON as a string")
        if kind == "bpe":
            why = bpe_json_problem(d["bpe"])
            if why:
                raise bad(f"its BPE tokenizer is not one txl writes ({why}); txl only loads byte-level BPE "
                          "without a normalizer, so no regex or normalizer from a file runs")
        try:
            vocab = cls(kind, symbols, eos=d.get("eos"), bos=d.get("bos"), unk=d.get("unk"), bpe=d.get("bpe"),
                        text=d.get("text"))
        except DataError as err:
            raise bad(str(err)) from None
        if "size" in d and d["size"] != vocab.size:
            raise bad(f"declared size {d['size']!r} but holds {vocab.size} ids")
        return vocab

    def save(self, path: str | os.PathLike) -> None:
        write_text(Path(path), self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike, *, follow_links: bool = False) -> Vocab:
        """A vocab.json: a regular file of at most `VOCAB_LIMIT` bytes (txl.io), not a link unless
        `follow_links` (a path the user typed; not an entry of a checkpoint or a cache)."""
        data = read_bytes(Path(path), what="vocabulary file", limit=VOCAB_LIMIT, error=DataError,
                          follow_links=follow_links)
        return cls.from_json(data, source=str(path))




# What `txl data prepare` writes for a BPE vocabulary (encode._bpe_vocab): a byte-level BPE model with
# the ByteLevel pre-tokenizer (its regex is the built-in GPT-2 one; a `Split` pre-tokenizer from a file
# would carry its own regex, which the Rust library compiles and can panic on) and no normalizer,
# post-processor, truncation or padding (a normalizer from a file can expand text without bound).
_BPE_TOP = {"version", "truncation", "padding", "added_tokens", "normalizer", "pre_tokenizer", "post_processor",
            "decoder", "model"}
_BYTE_LEVEL = {"type", "add_prefix_space", "trim_offsets", "use_regex"}
_BPE_MODEL = {"type", "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk",
              "byte_fallback", "ignore_merges", "vocab", "merges"}
_ADDED_TOKEN = {"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"}


def bpe_json_problem(text: str) -> str | None:
    """Why a tokenizer JSON is not the byte-level BPE txl writes, or None when it is."""
    try:
        d = parse_json(text)
    except (ValueError, RecursionError) as err:
        return f"invalid JSON: {str(err)[:80]}"
    if not isinstance(d, dict):
        return "not a JSON object"
    extra = sorted(set(d) - _BPE_TOP)
    if extra:
        return f"unknown key {extra[0][:40]!r}"
    for key in ("truncation", "padding", "normalizer", "post_processor"):
        if d.get(key) is not None:
            kind = d[key].get("type") if isinstance(d[key], dict) else None
            return f"it has a {key}" + (f" ({str(kind)[:40]})" if kind else "")
    for key in ("pre_tokenizer", "decoder"):
        part = d.get(key)
        if key == "decoder" and part is None:
            continue
        if not (isinstance(part, dict) and part.get("type") == "ByteLevel" and set(part) <= _BYTE_LEVEL
                and all(isinstance(part.get(k, True), bool) for k in _BYTE_LEVEL - {"type"})):
            kind = part.get("type") if isinstance(part, dict) else part
            return f"its {key} is {str(kind)[:40]!r}, not ByteLevel"
    model = d.get("model")
    if not (isinstance(model, dict) and model.get("type") == "BPE" and set(model) <= _BPE_MODEL):
        return "its model is not BPE"
    for key in ("continuing_subword_prefix", "end_of_word_suffix", "unk_token"):
        if model.get(key) is not None and not isinstance(model[key], str):
            return f"model.{key} is not a string"
    dropout = model.get("dropout")
    if dropout is not None and not (isinstance(dropout, int | float) and 0 <= dropout <= 1):
        return "model.dropout is not in [0, 1]"
    vocab, merges = model.get("vocab"), model.get("merges")
    if not isinstance(vocab, dict) or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_SYMBOLS
                                              for v in vocab.values()):
        return "model.vocab is not a table of ids"
    if len(vocab) > MAX_SYMBOLS or not isinstance(merges, list) or len(merges) > MAX_SYMBOLS:
        return "model.vocab or model.merges is missing or too large"
    if not all(isinstance(m, str) or (isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) for x in m))
               for m in merges):
        return "model.merges is not a list of pairs"
    added = d.get("added_tokens", [])
    if not isinstance(added, list) or len(added) > 1024 or not all(
            isinstance(t, dict) and set(t) <= _ADDED_TOKEN and isinstance(t.get("content"), str)
            and len(t["content"]) <= 1024 and isinstance(t.get("id"), int) for t in added):
        return "added_tokens are malformed"
    return None
