"""Two-style corpora for unpaired style transfer (the Style Transformer, Dai et al. 2019, arXiv 1905.05621).

    style:A_FILE,B_FILE[?names=a,b&max_len=20&min_len=5&vocab_size=10000&max_sentences=0]

Each FILE holds one style, one sentence per line (e.g. Tiny Shakespeare's lines against Penn Treebank's
sentences; style = the file a sentence came from). Nothing is paired: the model only ever learns which
style a sentence has. Reading a line: lower-cased, split into words and punctuation marks (`tokenize`:
`<unk>` stays one token, so PTB's unknown words read as the vocabulary's own), then kept when it has
`min_len` to `max_len` tokens (short lines are mostly Shakespeare's speaker names). Each style is split
90/5/5 by a hash of the sentence (a sentence stays in its split when a file grows); `max_sentences` keeps
the first N training sentences of each style (0 = all). The vocabulary: `<pad>`, `<s>`, `<eos>`, `<unk>`
(ids 0-3), then the `vocab_size` most frequent training words of both styles together (ties by first
appearance), an ordinary `words` vocabulary saved as vocab.json. Everything is held in memory: two
corpora of a few MB.

Batches (`StyleBatches`) hold `batch_size / n_styles` sentences of each style, as the reference
implementation concatenates a batch of each; each style's sentences are shuffled per epoch on their own.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from txl.data.spec import DataSpec, parse_spec
from txl.data.vocab import Vocab
from txl.errors import DataError
from txl.io import read_bytes

SPECIALS = ("<pad>", "<s>", "<eos>", "<unk>")  # ids 0, 1, 2, 3 (the style model's config fields say so too)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(len(SPECIALS))
SPLITS = ("train", "valid", "test")
FILE_LIMIT = 64 << 20  # one style's file is read into memory
MAX_STYLES = 16
_TOKEN = re.compile(r"<unk>|[^\W_]+(?:'[^\W_]+)*|[^\w\s]|_")


def tokenize(line: str) -> list[str]:
    """Lower-cased words and punctuation marks of one line (`don't` and `i'll` stay one word)."""
    return _TOKEN.findall(line.lower())


def _split_of(sentence: str) -> str:
    bucket = int.from_bytes(hashlib.sha256(sentence.encode("utf-8", "surrogatepass")).digest()[:4], "little") % 20
    return "valid" if bucket == 0 else "test" if bucket == 1 else "train"


def style_paths(spec: DataSpec) -> list[Path]:
    """The files of a `style:` spec (comma-separated, at least two)."""
    if spec.path is None:
        raise DataError("a style corpus needs its files: write style:A_FILE,B_FILE (one style per file, one "
                        "sentence per line)")
    paths = [Path(p.strip()) for p in spec.path.split(",") if p.strip()]
    if len(paths) < 2:
        raise DataError(f"{spec.text}: style transfer needs at least two styles, one file each: "
                        "style:A_FILE,B_FILE")
    if len(paths) > MAX_STYLES:
        raise DataError(f"{spec.text}: {len(paths)} styles; at most {MAX_STYLES} files")
    return paths


def style_names(spec: DataSpec, paths: list[Path]) -> tuple[str, ...]:
    given = str(spec.options.get("names") or "")
    names = tuple(n.strip() for n in given.split(",")) if given else tuple(p.stem for p in paths)
    if len(names) != len(paths) or not all(names):
        raise DataError(f"{spec.text}: names={given!r} must give one non-empty name per file ({len(paths)})")
    if len(set(names)) != len(names):
        raise DataError(f"{spec.text}: the style names {list(names)} repeat; give distinct ones with "
                        "?names=a,b")
    return names


def read_sentences(path: Path, *, min_len: int, max_len: int) -> list[list[str]]:
    """The tokenised lines of one style's file with min_len..max_len tokens, in file order."""
    data = read_bytes(path, what="style corpus file", limit=FILE_LIMIT, error=DataError, follow_links=True)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not UTF-8 text (byte {err.start})") from None
    out = []
    for line in text.splitlines():
        words = tokenize(line)
        if min_len <= len(words) <= max_len:
            out.append(words)
    return out


@dataclass
class StyleCorpus:
    """Sentences of each style per split, as text (tokens joined by a space) and as ids ending in <eos>."""

    spec: str
    styles: tuple[str, ...]
    vocab: Vocab
    texts: dict[str, list[list[str]]]  # split -> per style, its sentences
    ids: dict[str, list[list[list[int]]]] = field(default_factory=dict)
    max_len: int = 20  # the longest sentence kept, in tokens (without <eos>)
    name: str = "style"
    metric: str = "ppl"

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(s for s in SPLITS if self.ids.get(s) and all(self.ids[s]))

    def sentences(self, split: str, style: int) -> list[list[int]]:
        if split not in self.splits:
            raise DataError(f"{self.spec}: no split {split!r} holding sentences of every style; known: "
                            f"{', '.join(self.splits)}")
        return self.ids[split][style]

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256("\0".join(self.styles).encode("utf-8"))
        for split in SPLITS:
            for style, sentences in enumerate(self.texts.get(split, [])):
                for sentence in sentences:
                    h.update(f"{split}\0{style}\0{sentence}\n".encode("utf-8", "surrogatepass"))
        return h.hexdigest()

    def encode(self, line: str, *, max_len: int | None = None) -> list[int]:
        """Ids of a new sentence (tokenised as the corpus, unknown words read as <unk>), ending in <eos>."""
        return encode_sentence(self.vocab, line, max_len=max_len)


def encode_sentence(vocab: Vocab, line: str, *, max_len: int | None = None) -> list[int]:
    stoi, unk = vocab.stoi, vocab.unk_id
    words = tokenize(line)[: max_len]
    return [stoi.get(w, unk) for w in words] + [vocab.eos_id]


def build_vocab(sentences: list[list[str]], size: int) -> Vocab:
    counts = Counter(w for words in sentences for w in words)
    for special in SPECIALS:
        counts.pop(special, None)
    ranked = sorted(counts, key=lambda w: -counts[w])  # stable: ties keep their first appearance
    words = ranked[:size] if size else ranked
    return Vocab("words", list(SPECIALS) + words, eos="<eos>", unk="<unk>")


def open_style_corpus(spec_text: str | DataSpec, *, vocab: Vocab | None = None) -> StyleCorpus:
    """Read the styles' files, split them, build (or take) the vocabulary and encode every sentence."""
    spec = parse_spec(spec_text)
    if spec.name != "style":
        raise DataError(f"{spec.text} is not a style corpus (style:A_FILE,B_FILE)")
    paths = style_paths(spec)
    names = style_names(spec, paths)
    opts = spec.options
    min_len, max_len = int(opts["min_len"]), int(opts["max_len"])
    if min_len > max_len:
        raise DataError(f"{spec.text}: min_len={min_len} is above max_len={max_len}")
    texts: dict[str, list[list[str]]] = {s: [] for s in SPLITS}
    for path, name in zip(paths, names):
        per_split: dict[str, list[str]] = {s: [] for s in SPLITS}
        for words in read_sentences(path, min_len=min_len, max_len=max_len):
            sentence = " ".join(words)
            per_split[_split_of(sentence)].append(sentence)
        if opts["max_sentences"]:
            per_split["train"] = per_split["train"][: int(opts["max_sentences"])]
        if not per_split["train"]:
            raise DataError(f"{path}: no training sentence of {min_len}-{max_len} tokens for style {name!r}")
        for split in SPLITS:
            texts[split].append(per_split[split])
    if vocab is None:
        vocab = build_vocab([s.split(" ") for style in texts["train"] for s in style], int(opts["vocab_size"]))
    elif vocab.kind != "words" or vocab.symbols[: len(SPECIALS)] != SPECIALS:
        raise DataError(f"the given vocabulary is not a style corpus's (words, starting {', '.join(SPECIALS)})")
    corpus = StyleCorpus(spec=spec.canonical(), styles=names, vocab=vocab, texts=texts, max_len=max_len)
    corpus.ids = {split: [[encode_sentence(vocab, s) for s in style] for style in texts[split]] for split in SPLITS}
    return corpus


@dataclass
class StyleBatch:
    """tokens (b, t): each sentence's ids ending in <eos>, padded with <pad>; lengths (b,) with the <eos>;
    styles (b,) the style index of each row; index: the batch's number in the run (the phase schedule)."""

    tokens: Tensor
    lengths: Tensor
    styles: Tensor
    index: int
    step: int = 0


def collate(sentences: list[list[int]], styles: list[int], *, index: int = 0) -> StyleBatch:
    width = max(len(s) for s in sentences)
    tokens = torch.full((len(sentences), width), PAD_ID, dtype=torch.long)
    for row, ids in enumerate(sentences):
        tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return StyleBatch(tokens=tokens, lengths=torch.tensor([len(s) for s in sentences]),
                      styles=torch.tensor(styles, dtype=torch.long), index=index)


class StyleBatches:
    """Endless training batches, `batch_size / n_styles` sentences of each style. Each style walks its own
    shuffled order (seeded by seed, style and that style's epoch); the positions and the batch count are
    the whole state, so a resumed run sees the batches it would have seen."""

    def __init__(self, corpus: StyleCorpus, *, batch_size: int, seed: int):
        n = len(corpus.styles)
        if batch_size % n:
            raise DataError(f"train.batch_size={batch_size} must be a multiple of the {n} styles (an equal share "
                            "of each per batch)")
        self.corpus, self.batch_size, self.seed = corpus, batch_size, seed
        self.per_style = batch_size // n
        self.epochs, self.positions, self.index = [0] * n, [0] * n, 0

    def _order(self, style: int) -> np.ndarray:
        count = len(self.corpus.sentences("train", style))
        return np.random.default_rng([self.seed, style, self.epochs[style]]).permutation(count)

    def _take(self, style: int) -> list[list[int]]:
        sentences = self.corpus.sentences("train", style)
        out = []
        order = self._order(style)
        while len(out) < self.per_style:
            if self.positions[style] >= len(order):
                self.epochs[style] += 1
                self.positions[style] = 0
                order = self._order(style)
            out.append(sentences[order[self.positions[style]]])
            self.positions[style] += 1
        return out

    def __iter__(self):
        while True:
            sentences, styles = [], []
            for style in range(len(self.corpus.styles)):
                sentences += self._take(style)
                styles += [style] * self.per_style
            batch = collate(sentences, styles, index=self.index)
            batch.step = self.index
            self.index += 1
            yield batch

    def state_dict(self) -> dict:
        return {"kind": "style", "epochs": list(self.epochs), "positions": list(self.positions), "index": self.index,
                "batch_size": self.batch_size, "seed": self.seed,
                "sentences": [len(self.corpus.sentences("train", s)) for s in range(len(self.corpus.styles))]}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("kind") != "style":
            raise DataError("the saved data position is not a style corpus's")
        for key in ("batch_size", "seed"):
            if state.get(key) != getattr(self, key):
                raise DataError(f"the saved data position has {key}={state.get(key)!r}, this run {getattr(self, key)!r}")
        if state.get("sentences") != self.state_dict()["sentences"]:
            raise DataError("the saved data position is for other training sentences than the corpus holds now")
        epochs, positions, index = state.get("epochs"), state.get("positions"), state.get("index")
        n = len(self.corpus.styles)
        if not (isinstance(index, int) and index >= 0 and isinstance(epochs, list) and isinstance(positions, list)
                and len(epochs) == len(positions) == n
                and all(isinstance(v, int) and v >= 0 for v in epochs + positions)):
            raise DataError("the saved data position is damaged")
        self.epochs, self.positions, self.index = list(epochs), list(positions), index


def eval_batches(corpus: StyleCorpus, split: str, *, batch_size: int, max_sentences: int = 0):
    """(style, batch) over the split's sentences of each style in order (the first `max_sentences` of each
    when given)."""
    for style in range(len(corpus.styles)):
        sentences = corpus.sentences(split, style)
        if max_sentences:
            sentences = sentences[:max_sentences]
        for start in range(0, len(sentences), batch_size):
            chunk = sentences[start: start + batch_size]
            yield style, collate(chunk, [style] * len(chunk))


__all__ = ["BOS_ID", "EOS_ID", "PAD_ID", "SPECIALS", "UNK_ID", "StyleBatch", "StyleBatches", "StyleCorpus",
           "collate", "encode_sentence", "eval_batches", "open_style_corpus", "tokenize"]
