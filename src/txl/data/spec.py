"""Data specs: `NAME[:PATH][?key=value&key=value]`, the one string that names a corpus everywhere.

A spec is what a user types on the command line and writes in a config, so it is parsed and checked
here, before anything touches the disk: an unknown name lists the known ones, an unknown option lists
the allowed ones, and a bad option value names the key. Which files a PATH must hold is the readers'
business (`txl.data.readers`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from txl.errors import DataError


@dataclass(frozen=True)
class OptionSpec:
    """One `?key=value` option a corpus accepts: its type, default and (for strings) its choices."""

    kind: type  # int or str
    default: object
    choices: tuple[str, ...] = ()
    minimum: int | None = None
    help: str = ""
    maximum: int | None = None  # every number has a ceiling: a spec may come from a stranger's config


@dataclass(frozen=True)
class CorpusInfo:
    """What `txl data list` prints and what a spec needs: description, default location, options."""

    name: str
    description: str
    metric: str  # "bpc" or "ppl"; `text` decides by tokenizer
    download: str | None = None  # the `txl data download NAME` that fetches it, if any
    options: dict[str, OptionSpec] = field(default_factory=dict)
    path_required: bool = True  # False: PATH may be omitted (default download location or builtin)


_TEXT_OPTIONS = {
    "tokenizer": OptionSpec(
        str, "bytes", ("bytes", "chars", "words", "bpe"), help="bytes | chars | words | bpe (HF tokenizers)"
    ),
    "vocab_size": OptionSpec(
        int, 0, minimum=0, help="words: keep the N most frequent (0 = all); bpe: target size (default 8192)",
        maximum=1 << 24,
    ),
    "min_freq": OptionSpec(int, 1, minimum=1, help="words: drop words seen fewer times in train", maximum=1 << 62),
}

_PAIR_OPTIONS = {
    "tokenizer": OptionSpec(str, "bpe", ("chars", "bpe"), help="chars | bpe (byte-level, HF tokenizers)"),
    "vocab_size": OptionSpec(int, 8000, minimum=0, help="bpe: target size of each vocabulary", maximum=1 << 20),
    "shared": OptionSpec(int, 1, minimum=0, help="1: one vocabulary for source and target; 0: one each", maximum=1),
    "source": OptionSpec(str, "", help="source column (default: source, else text, else the first)"),
    "target": OptionSpec(str, "", help="target column (default: target, else headlines, else the second)"),
    "max_source_len": OptionSpec(int, 0, minimum=0, help="drop pairs whose source has more tokens (0 = keep all)",
                                 maximum=1 << 20),
    "max_target_len": OptionSpec(int, 0, minimum=0, help="drop pairs whose target has more tokens (0 = keep all)",
                                 maximum=1 << 20),
    "truncate": OptionSpec(int, 0, minimum=0, help="1: cut sources to max_source_len tokens instead of dropping "
                                                    "the pair (the seed's truncating='post')", maximum=1),
}
# The `reverse` corpus is generated in memory (a string, its reversal and their ids per pair): its
# training pairs times the longest string is bounded, about 1 GB of Python objects at the bound.
REVERSE_MAX_PAIRS = 1_000_000
REVERSE_MAX_LEN = 4096
REVERSE_MAX_CHARS = 50_000_000
SEQ2SEQ_CORPORA = ("pairs", "reverse", "pydoc-summaries")

KNOWN: dict[str, CorpusInfo] = {
    info.name: info
    for info in [
        CorpusInfo(
            "ptb-word",
            "Penn Treebank, word level (Mikolov): ptb.{train,valid,test}.txt, <eos> per line, 10k vocab",
            "ppl",
            download="ptb",
        ),
        CorpusInfo(
            "ptb-char",
            "Penn Treebank, character level: ptb.char.{train,valid,test}.txt, '_' between words",
            "bpc",
            download="ptb",
        ),
        CorpusInfo(
            "enwik8",
            "first 1e8 bytes of an English Wikipedia XML dump, bytes, split 90M/5M/5M",
            "bpc",
            download="enwik8",
        ),
        CorpusInfo(
            "text8", "1e8 characters of cleaned Wikipedia (a-z and space), 90M/5M/5M", "bpc", download="text8"
        ),
        CorpusInfo(
            "wikitext103",
            "WikiText-103, word level: wiki.{train,valid,test}.tokens, <eos> per line, case kept",
            "ppl",
            download="wikitext103",
        ),
        CorpusInfo(
            "wikitext2",
            "WikiText-2, word level: wiki.{train,valid,test}.tokens, <eos> per line, case kept",
            "ppl",
            download="wikitext2",
        ),
        CorpusInfo(
            "lm1b",
            "One Billion Word benchmark: shuffled sentences wrapped in <S> ... <S>",
            "ppl",
            options={
                "min_freq": OptionSpec(int, 3, minimum=1, help="vocabulary cut when no vocab file is given")
            },
        ),
        CorpusInfo(
            "text",
            "your own text: FILE (split 90/5/5) or DIR with train.txt [valid.txt test.txt]",
            "bpc",
            options=_TEXT_OPTIONS,
        ),
        CorpusInfo(
            "pairs",
            "your own sequence-to-sequence pairs: FILE (.tsv, .jsonl or the Inshorts .csv; split 90/5/5) or DIR "
            "with train.* [valid.* test.*] (txl.models.seq2seq)",
            "ppl",
            options=_PAIR_OPTIONS,
        ),
        CorpusInfo(
            "reverse",
            "synthetic sequence-to-sequence sanity task: reverse a random lower-case string (no download)",
            "ppl",
            options={
                "size": OptionSpec(int, 20000, minimum=10, help="training pairs (valid and test: 1000 each)",
                                   maximum=REVERSE_MAX_PAIRS),
                "min_len": OptionSpec(int, 4, minimum=1, help="shortest string", maximum=REVERSE_MAX_LEN),
                "max_len": OptionSpec(int, 16, minimum=1, help="longest string", maximum=REVERSE_MAX_LEN),
                "seed": OptionSpec(int, 0, minimum=0, help="the generator's seed", maximum=2**63 - 1),
            },
            path_required=False,
        ),
        CorpusInfo(
            "pydoc-summaries",
            "function source -> first line of its docstring, from this interpreter's standard library "
            "(split by module; no download)",
            "ppl",
            options={**_PAIR_OPTIONS, "max_source_len": OptionSpec(int, 400, minimum=0, help=_PAIR_OPTIONS[
                "max_source_len"].help, maximum=1 << 20), "max_target_len": OptionSpec(int, 48, minimum=0, help=_PAIR_OPTIONS[
                "max_target_len"].help, maximum=1 << 20)},
            path_required=False,
        ),
        CorpusInfo(
            "docs",
            "your own documents, one per file or JSONL record: DIR/LABEL/* (one sub-folder per label), DIR/* "
            "(unlabelled) or FILE.jsonl with text [label]; DIR/train, valid, test give the splits (else 90/5/5); "
            "read by txl.data.documents (`--objective classify`)",
            "ppl",
            options={
                **{k: v for k, v in _TEXT_OPTIONS.items() if k != "tokenizer"},
                "tokenizer": OptionSpec(str, "bytes", ("bytes", "chars", "words"), help="bytes | chars | words"),
                "max_tokens": OptionSpec(int, 0, minimum=0, help="cut each document to its first N tokens (0 = whole)",
                                         maximum=1 << 40),
            },
        ),
        CorpusInfo(
            "style",
            "two or more styles of unpaired sentences for style transfer: A_FILE,B_FILE (one style per file, one "
            "sentence per line; split 90/5/5; txl.data.style, arch style-transformer)",
            "ppl",
            options={
                "names": OptionSpec(str, "", help="the styles' names, comma-separated (default: the file stems)"),
                "min_len": OptionSpec(int, 5, minimum=1, help="drop sentences of fewer tokens", maximum=1 << 10),
                "max_len": OptionSpec(int, 20, minimum=1, help="drop sentences of more tokens", maximum=1 << 10),
                "vocab_size": OptionSpec(int, 10000, minimum=0, help="keep the N most frequent training words "
                                                                    "(0 = all)", maximum=1 << 20),
                "max_sentences": OptionSpec(int, 0, minimum=0, help="training sentences kept per style (0 = all)",
                                            maximum=1 << 30),
            },
        ),
        CorpusInfo(
            "builtin",
            "builtin:python-stdlib, this interpreter's standard-library .py sources as bytes (no download)",
            "bpc",
            path_required=False,
        ),
    ]
}

BUILTIN_NAMES = ("python-stdlib",)


def known_corpora() -> dict[str, str]:
    """Known spec names and a one-line description of each (what `txl data list` prints)."""
    return {name: info.description for name, info in KNOWN.items()}


@dataclass(frozen=True)
class DataSpec:
    """A parsed spec. `options` holds every option of the corpus, defaults filled in, typed."""

    name: str
    path: str | None
    options: dict[str, object]
    text: str

    @property
    def info(self) -> CorpusInfo:
        return KNOWN[self.name]

    def canonical(self) -> str:
        """The spec with an absolute path and only non-default options: stable across working dirs."""
        if self.path is None:
            return self.elsewhere(None)
        if self.name == "style":  # one file per style
            return self.elsewhere(",".join(str(Path(p).absolute()) for p in self.path.split(",")))
        return self.elsewhere(self.path if self.name == "builtin" else str(Path(self.path).absolute()))

    def elsewhere(self, path: str | None) -> str:
        """The same corpus and options at another PATH (what a message tells a user to type when a corpus
        moved or was fetched by hand): `elsewhere("DIR")` of `text:a.txt?tokenizer=chars` is
        `text:DIR?tokenizer=chars`."""
        out = self.name if path is None else f"{self.name}:{path}"
        extra = {k: v for k, v in self.options.items() if v != self.info.options[k].default}
        if extra:
            out += "?" + "&".join(f"{k}={v}" for k, v in sorted(extra.items()))
        return out


def default_data_root() -> Path:
    """Where `txl data download` puts archives when `--dest` is omitted: `<cache>/downloads`."""
    from txl.data.cache import cache_root

    return cache_root(None) / "downloads"


def parse_spec(spec: str | DataSpec) -> DataSpec:
    """Parse `NAME[:PATH][?key=value&...]` into a `DataSpec`, checking the name and every option.

    PATH may itself contain ':' (everything after the first ':' is the path); options start at the
    last '?'. A PATH left out means the default download location for that corpus
    (`<cache>/downloads/<download name>`), so `txl data download enwik8` then `enwik8` just works.
    """
    if isinstance(spec, DataSpec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise DataError("empty data spec; write NAME[:PATH], e.g. ptb-word:data/ptb (see `txl data list`)")
    text = spec.strip()
    body, sep, query = text.rpartition("?") if "?" in text else (text, "", "")
    name, colon, path = body.partition(":")
    name = name.strip().lower()
    if name not in KNOWN:
        raise DataError(_unknown_corpus(name, body.strip(), text))
    info = KNOWN[name]
    path_value: str | None = path.strip() if colon else None
    if path_value == "":
        path_value = None

    options: dict[str, object] = {key: opt.default for key, opt in info.options.items()}
    if sep:
        for item in filter(None, query.split("&")):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq:
                raise DataError(f"option {item!r} in spec {text!r} has no value; write key=value")
            if key not in info.options:
                allowed = ", ".join(info.options) or "none"
                raise DataError(f"{name} has no option {key!r} (spec {text!r}); allowed options: {allowed}")
            options[key] = _convert(name, key, value.strip(), info.options[key])

    if name == "reverse" and (options["size"] + 2000) * options["max_len"] > REVERSE_MAX_CHARS:  # type: ignore[operator]
        raise DataError(f"reverse: size={options['size']} pairs of up to max_len={options['max_len']} characters "
                        f"is too large to generate in memory: (size + 2000) * max_len must be at most "
                        f"{REVERSE_MAX_CHARS:,}; lower size or max_len")
    if name == "builtin":
        path_value = path_value or "python-stdlib"
        if path_value not in BUILTIN_NAMES:
            raise DataError(f"unknown builtin corpus {path_value!r}; known: {', '.join(BUILTIN_NAMES)}")
    elif path_value is None and not info.path_required and info.download is None:
        pass  # generated (reverse, pydoc-summaries): nothing to point at
    elif path_value is None:
        if info.download is None:
            raise DataError(f"spec {text!r} needs a path: write {name}:PATH")
        path_value = str(default_data_root() / info.download)
    else:
        path_value = os.path.expanduser(path_value)
    return DataSpec(name=name, path=path_value, options=options, text=text)


def _unknown_corpus(name: str, body: str, text: str) -> str:
    """The message for a spec whose NAME is no corpus: a file or folder given bare (`--data notes.txt`, the
    most common first try) gets the `text:` spec that reads it; a misspelt name the nearest known names."""
    import difflib

    try:
        local = Path(os.path.expanduser(body))
        kind = "a file" if local.is_file() else "a folder" if local.is_dir() else None
    except (OSError, ValueError):  # a name too long for a path, or with a NUL: no file of ours
        kind = None
    if kind is not None:
        holds = "" if kind == "a file" else " (it reads train.txt, and valid.txt and test.txt when there)"
        return f"{body!r} is {kind}, not a corpus name: for your own text write the spec text:{text}{holds}"
    close = difflib.get_close_matches(name, KNOWN, n=2, cutoff=0.6)
    if close:
        return (f"unknown corpus {name!r} in spec {text!r}; did you mean {' or '.join(map(repr, close))}? "
                f"(known: {', '.join(KNOWN)})")
    looks_like_path = "/" in body or "." in body
    own = "; for a text file of your own write text:FILE" if looks_like_path else ""
    return f"unknown corpus {name!r} in spec {text!r}{own}; known: {', '.join(KNOWN)}"


def _convert(name: str, key: str, value: str, opt: OptionSpec) -> object:
    if opt.kind is int:
        try:
            number = int(value)
        except ValueError:
            raise DataError(f"{name} option {key}={value!r} is not an integer") from None
        if opt.minimum is not None and number < opt.minimum:
            raise DataError(f"{name} option {key}={number} is below its minimum {opt.minimum}")
        if opt.maximum is not None and number > opt.maximum:
            raise DataError(f"{name} option {key}={number} is too large: it must be at most {opt.maximum:,}")
        return number
    if opt.choices and value not in opt.choices:
        raise DataError(f"{name} option {key}={value!r} is not one of {', '.join(opt.choices)}")
    return value
