"""Text in, text out: prompts encoded with a checkpoint's vocabulary, continuations decoded to text as
they are produced, stop strings. The tokens come from `txl.generate.decoder` (the one decoder and the
one token picker); this module never calls the model itself.

`generate_text` continues one prompt and streams its text (`txl generate`, `TextStream`); `sample_text`
draws several samples of several prompts with stop strings, `<eos>` and log-probabilities (`txl generate
--num-samples/--stop/--json`, the sample a training run writes at its end).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from txl.errors import DataError, UsageError
from txl.generate.decoder import sample, stream_tokens
from txl.nn.sampling import check_sampling


def boundary_ids(vocab) -> list[int]:
    """The prompt of unconditional generation: the corpus's boundary symbol (`<eos>` of a word
    vocabulary, else a newline), so the model starts as at the beginning of a line or document."""
    if vocab.eos_id is not None:
        return [vocab.eos_id]
    try:
        ids = [int(i) for i in vocab.encode("\n")]
    except DataError:
        ids = []
    return ids or [0]


CLITICS = ("n't", "'s", "'re", "'ve", "'ll", "'d", "'m", "'")  # split off as words of their own by PTB's tokenizer


def _spelled_as_known(vocab, word: str) -> str | None:
    """How a word the vocabulary lacks may be spelled in it: lower-cased (PTB and other lower-case corpora),
    with a clitic split off as PTB does ("Bob's" -> "bob 's", "Don't" -> "do n't"); None when no such
    spelling is known."""
    for spelling in dict.fromkeys((word.lower(), word)):
        if spelling != word and spelling in vocab.stoi:
            return spelling
        for clitic in CLITICS:
            stem = spelling[: -len(clitic)]
            if spelling.endswith(clitic) and stem in vocab.stoi and clitic in vocab.stoi:
                return f"{stem} {clitic}"
    return None


def _unknown_words_text(vocab, words: list[str]) -> str:
    """The unknown words named (at most 8), and how to spell those the vocabulary knows otherwise."""
    named = ", ".join(map(repr, words[:8])) + (f" and {len(words) - 8} more" if len(words) > 8 else "")
    hints = [f"{spelling!r} for {word!r}" for word in words[:8] if (spelling := _spelled_as_known(vocab, word))]
    if not hints:
        return f"{named}; use words of the training text"
    # PTB: lower-case, but for its number token N and the specials
    lower = not any(s != s.lower() for s in vocab.symbols[:2000] if len(s) > 1 and not s.startswith("<"))
    return f"{named}; {'the vocabulary is lower-case: ' if lower else ''}write {', '.join(hints)}"


def prompt_notice(vocab, prompt: str) -> str | None:
    """One line about the words of `prompt` that a words vocabulary lacks and reads as its <unk> (issue 45:
    they were replaced silently), naming them with a hint when the vocabulary spells them otherwise
    (lower-case PTB: 'The' -> 'the'); None when the vocabulary reads the whole prompt. `txl generate` prints
    it as a warning on stderr; `txl serve` may show it beside the text. A vocabulary without <unk> refuses
    such a prompt instead (`encode_prompt`)."""
    unknown = vocab.unknown_words(prompt) if prompt else []
    if not unknown or vocab.unk is None:
        return None
    count = f"{len(unknown)} word{'s' if len(unknown) > 1 else ''} of the prompt {'are' if len(unknown) > 1 else 'is'}"
    return f"{count} not in the vocabulary and read as {vocab.unk}: {_unknown_words_text(vocab, unknown)}"


def encode_prompt(vocab, prompt: str) -> list[int]:
    """The prompt's ids with the checkpoint's vocabulary; one clear error when it cannot be encoded (a
    words vocabulary without <unk>: every word it lacks named). Words read as <unk>: `prompt_notice`.
    An empty prompt means unconditional generation (`boundary_ids`)."""
    if not prompt:
        return boundary_ids(vocab)
    unknown = vocab.unknown_words(prompt) if vocab.unk is None else []
    special = {vocab.eos, vocab.bos, vocab.unk}
    if unknown and not all(len(s) == 1 for s in vocab.symbols if s not in special):
        raise DataError(f"the prompt has words the vocabulary lacks, and it has no <unk> to read them as: "
                        f"{_unknown_words_text(vocab, unknown)}")
    try:
        ids = [int(i) for i in vocab.encode(prompt)]
    except DataError as err:
        special = {vocab.eos, vocab.bos, vocab.unk}
        if vocab.kind == "words" and all(len(s) == 1 for s in vocab.symbols if s not in special):
            raise DataError(f"{err}; this vocabulary's words are single characters (PTB-char style): write the "
                            "prompt as space-separated characters with _ between words, e.g. 't h e _ c a t'") from None
        raise
    if not ids:
        raise UsageError(f"the prompt {prompt!r} encodes to no tokens with this {vocab.kind} vocabulary; "
                         "give some text, or an empty prompt to generate unconditionally")
    return ids


def generate_text(
    model,
    vocab,
    prompt: str,
    *,
    max_new_tokens: int,
    write: Callable[[str], object] | None = None,
    **kwargs,
) -> str:
    """Continue `prompt` (text; "" = unconditional) and return the new text; `write` receives it piece by
    piece as tokens are produced. The prompt is encoded with `vocab` exactly like corpus text
    (`Vocab.encode`: for word vocabularies unknown words become `<unk>`, or a `DataError` when there is
    none). Keyword arguments go to `stream_tokens` (temperature, top_k, top_p, mem_len, segment_len,
    generator). For several samples, stop strings and log-probabilities use `sample_text`."""
    check_sampling(max_new_tokens, kwargs.get("temperature", 1.0), kwargs.get("top_k", 0), kwargs.get("top_p", 1.0))
    ids = encode_prompt(vocab, prompt)
    pieces: list[str] = []

    def collect(text: str) -> None:
        pieces.append(text)
        if write is not None:
            write(text)

    stream = TextStream(vocab, collect, prefix=ids)
    for token in stream_tokens(model, ids, max_new_tokens=max_new_tokens, **kwargs):
        stream.push(token)
    stream.close()
    return "".join(pieces)


# ---------------------------------------------------------------------------------------------
# Batches, stopping and log-probabilities


@dataclass
class TextSample:
    """One generated continuation: the prompt as given, the new text (bytes that are not UTF-8 shown as
    U+FFFD; the ids are exact), the new token ids with their log-probabilities, and why it stopped."""

    prompt: str
    text: str
    ids: list[int]
    logprobs: list[float]
    stopped_by: str
    prompt_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        from txl.data.display import json_text

        return {"prompt": json_text(self.prompt), "text": json_text(self.text), "prompt_ids": self.prompt_ids,
                "ids": self.ids, "logprobs": self.logprobs, "nll": -sum(self.logprobs),
                "stopped_by": self.stopped_by}


def sample_text(
    model,
    vocab,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    num_samples: int = 1,
    stop: Sequence[str] = (),
    stop_at_eos: bool = False,
    on_text: Callable[[int, str], object] | None = None,
    **kwargs,
) -> list[TextSample]:
    """`num_samples` continuations of each prompt ("" = unconditional), as `TextSample`s in prompt
    order. A sample ends at the first stop string (not included in its text), at the vocabulary's
    `<eos>` when `stop_at_eos`, or after `max_new_tokens`. `on_text(i, piece)` receives sample i's text
    as it is produced (stop strings already cut). The samples of one prompt are one batch."""
    if num_samples < 1:
        raise UsageError(f"num_samples must be >= 1, got {num_samples}")
    if any(not s for s in stop):
        raise UsageError("a stop string is empty; give at least one character")
    eos = vocab.eos_id if stop_at_eos else None
    if stop_at_eos and eos is None:
        raise UsageError(f"this {vocab.kind} vocabulary has no <eos> symbol to stop at; use --stop STRING instead")
    out: list[TextSample] = []
    for prompt in prompts:
        ids = encode_prompt(vocab, prompt)
        rows = [_Row(vocab, ids, stop, on_text, len(out) + row) for row in range(num_samples)]

        def should_stop(row: int, token: int, rows=rows) -> bool:
            rows[row].stream.push(token)
            return rows[row].stop.stopped

        # every token goes through its row's text path as it is produced (so `on_text` streams); the
        # <eos> that ends a row is kept in its ids but not in its text
        result = sample(model, [ids] * num_samples, max_new_tokens=max_new_tokens, eos_token_id=eos,
                        should_stop=should_stop, **kwargs)
        for row, sink in enumerate(rows):
            if not sink.stop.stopped:
                sink.stream.close()
            sink.stop.close()
            out.append(TextSample(prompt=prompt, text="".join(sink.pieces), ids=result.ids[row],
                                  logprobs=result.logprobs[row], stopped_by=result.stopped_by[row], prompt_ids=ids))
    return out


class _Row:
    """One sample's text path: tokens -> TextStream -> StopFilter -> collected pieces (+ on_text)."""

    def __init__(self, vocab, prompt_ids: list[int], stops: Sequence[str], on_text, index: int):
        self.pieces: list[str] = []
        self.on_text, self.index = on_text, index
        self.stop = StopFilter(stops, self.emit)
        self.stream = TextStream(vocab, self.stop.push, prefix=prompt_ids)

    def emit(self, text: str) -> None:
        if text:
            self.pieces.append(text)
            if self.on_text is not None:
                self.on_text(self.index, text)


class StopFilter:
    """Pass text on until a stop string appears; the stop string and what follows are dropped. The last
    len(longest stop) - 1 characters are held back until they cannot be the start of a stop string."""

    def __init__(self, stops: Sequence[str], write: Callable[[str], object]):
        self.stops = list(stops)
        self.write = write
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buffer = ""
        self.stopped = False

    def push(self, text: str) -> None:
        if self.stopped:
            return
        self.buffer += text
        cut = min((i for i in (self.buffer.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.write(self.buffer[:cut])
            self.buffer, self.stopped = "", True
            return
        ready = len(self.buffer) - self.hold
        if ready > 0:
            self.write(self.buffer[:ready])
            self.buffer = self.buffer[ready:]

    def close(self) -> None:
        if not self.stopped and self.buffer:
            self.write(self.buffer)
        self.buffer = ""


class TextStream:
    """Decode token ids to text incrementally and `write` each new piece, in O(1) decoding work per
    token (re-decoding everything each step made 32k words cost 24 s of decoding).

    Byte vocabularies decode bytes incrementally (a UTF-8 character may span tokens). Other kinds decode
    a bounded window: the last tokens of `prefix` (e.g. the prompt, never written itself, so words get
    the separator they need after it) and the new ids, dropping the oldest half of the window when it
    is full and the rest of the text is a suffix of the whole (true for chars and words; checked, so a
    tokenizer without that property just keeps a longer window). A BPE text that ends in an
    incomplete UTF-8 character is held back until the character is complete. A vocabulary that
    detokenises (WikiText-103 rules: `state @-@ of` -> `state-of`, `23 @,@ 000` -> `23,000`) can join a
    token to its neighbours, so its text is written up to the last space before the newest `LAG` tokens.
    """

    PREFIX_TOKENS = 16  # enough prompt tokens to decide spacing and finish a split character
    WINDOW = 64  # tokens decoded per step at most (about)
    LAG = 2  # detokenising vocabularies: tokens held back (a joiner such as @-@ and the word after it)

    def __init__(self, vocab, write: Callable[[str], object], prefix: Sequence[int] = ()):
        self.vocab = vocab
        self.write = write
        self.byte_level = getattr(vocab, "kind", None) == "bytes"
        self.bpe = getattr(vocab, "kind", None) == "bpe"
        self.detokenizing = getattr(vocab, "text_rules", None) is not None
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.window = [int(t) for t in prefix][-self.PREFIX_TOKENS :]
        self.shown = len(vocab.decode(self.window)) if self.window and not self.byte_level else 0

    def push(self, token: int) -> None:
        if self.byte_level:
            self.write(self.decoder.decode(bytes([token])))
            return
        self.window.append(int(token))
        full = self.vocab.decode(self.window)
        if self.detokenizing:
            stable = self.vocab.decode(self.window[: -self.LAG])
            # up to the last word and the space before it: a joiner there (@,@) can eat that space
            text = stable[: max(stable.rfind(" "), stable.rfind("\n"), 0)]
        else:
            text = full.rstrip("\ufffd") if self.bpe else full
        if len(text) > self.shown:
            self.write(text[self.shown :])
            self.shown = len(text)
        if len(self.window) >= 2 * self.WINDOW:
            self._trim(full)

    def _trim(self, full: str) -> None:
        rest = self.window[self.WINDOW :]
        rest_text = self.vocab.decode(rest)
        dropped = len(full) - len(rest_text)
        if full.endswith(rest_text) and 0 <= dropped <= self.shown:
            self.window, self.shown = rest, self.shown - dropped
        elif len(self.window) > 16 * self.WINDOW:  # never unbounded: give up exactness of spacing only
            self.window, self.shown = rest, len(rest_text)

    def close(self) -> None:
        if self.byte_level:
            self.write(self.decoder.decode(b"", final=True))
        elif self.bpe or self.detokenizing:  # what was held back
            text = self.vocab.decode(self.window)
            if len(text) > self.shown:
                self.write(text[self.shown :])
