"""Text generation that reuses memory (what users asked the reference for in its issue #49).

The prompt is fed in segments to fill the memory; then tokens come one at a time, each step a forward
pass over one token that attends to the memory (the previous `mem_len` positions per layer) and
nothing else, so the cost per token is bounded by the attention length instead of growing with the
text. With relative positions this equals re-running the whole context every step as long as the
context fits in `mem_len` (tests/test_generate.py checks greedy decoding token for token).

With `mem_len = 0` there is nothing to carry, so each step re-runs a sliding window of the last
`segment_len` tokens instead: the vanilla Transformer's way (Al-Rfou et al. 2018), and the only
sensible one for a model trained without memory.

`generate_text` is the text-in, text-out face (`txl generate`): the prompt is encoded with the
checkpoint's vocabulary and the continuation is decoded and written as it is produced (`TextStream`).
"""

from __future__ import annotations

import codecs
import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from txl.errors import DataError, UsageError
from txl.nn.memory import MemoryState
from txl.nn.options import MAX_LENGTH
from txl.nn.sampling import check_sampling, check_seed, filter_logits, pick_tokens  # noqa: F401 (re-exported)


def check_causal(model) -> None:
    if not getattr(model, "config", None) or model.config.causal:
        return
    raise UsageError("this model is a bidirectional encoder (causal=false, e.g. trained with --objective mlm): "
                     "it predicts masked tokens and cannot generate text; use a causal LM")


def check_lengths(model, mem_len: int | None, segment_len: int | None) -> tuple[int, int]:
    """(mem_len, segment_len) of a decoder: mem_len defaults to the model's, segment_len (the prompt's
    chunk, and the window re-run at mem_len 0) to max(mem_len, 128); both checked."""
    mem_len = getattr(model, "mem_len", 0) if mem_len is None else mem_len
    if mem_len < 0:
        raise UsageError(f"mem_len must be >= 0, got {mem_len}")
    if mem_len > MAX_LENGTH:
        raise UsageError(f"mem_len must be <= {MAX_LENGTH:,}, got {mem_len:.3g}")
    segment_len = segment_len or max(mem_len, 128)
    if segment_len < 1:
        raise UsageError(f"segment_len must be >= 1, got {segment_len}")
    if segment_len > MAX_LENGTH:
        raise UsageError(f"segment_len must be <= {MAX_LENGTH:,}, got {segment_len:.3g}")
    return mem_len, segment_len


def prompt_batch(model, input_ids, *, name: str = "input_ids") -> Tensor:
    """`input_ids` as a (B, T) long tensor of ids in the model's vocabulary (a (T,) prompt is one row)."""
    prompt = torch.as_tensor(input_ids, dtype=torch.long)
    if prompt.dim() == 1:
        prompt = prompt[None]
    if prompt.numel() == 0 and name == "prompt":
        raise UsageError("the prompt is empty; give at least one token of text")
    if prompt.dim() != 2 or prompt.shape[0] == 0 or prompt.shape[1] == 0:
        raise UsageError(f"{name} must have shape (batch, length) with both >= 1, got {tuple(prompt.shape)}")
    vocab = model.config.vocab_size
    if int(prompt.max()) >= vocab or int(prompt.min()) < 0:
        raise UsageError(f"{name} has token ids outside the model's vocabulary [0, {vocab})")
    return prompt


class Decoder:
    """A batch of B streams decoded together: `feed` ids, read `logits` (B, V) of the next token, `step`
    one token per stream. The model is used only through its contract, `model(ids, memory=, mem_len=)`
    returning `.logits` (B, t, V) and `.memory`, so every causal model decodes here (Transformer-XL,
    LSTM / SHA-RNN).

    With mem_len > 0 the memory is carried: a feed goes through the model in chunks of `segment_len`
    tokens on top of the memory, and a step is one forward of one token. With mem_len 0 there is
    nothing to carry, and every feed re-runs the window of the last `segment_len` tokens. `lock` (a
    context manager) is held around each forward (`txl serve` interleaves streams on one model);
    `before_chunk()` runs before each chunk of a feed (serve stops a cancelled request there).

    The logits and the window are copies when they would otherwise be views into a longer buffer (the
    (B, t, V) output of a prompt's chunk), so a decoder holds no more than its state between calls."""

    def __init__(self, model, *, mem_len: int | None = None, segment_len: int | None = None, lock=None):
        self.model = model
        self.mem_len, self.segment_len = check_lengths(model, mem_len, segment_len)
        self.device = next(model.parameters()).device
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.memory: MemoryState | None = None
        self.context: Tensor | None = None  # mem_len 0: the window of the last tokens (B, t)
        self.logits: Tensor | None = None  # (B, V) of the next token

    @torch.no_grad()
    def feed(self, ids: Tensor, *, before_chunk: Callable[[], object] | None = None) -> Tensor:
        """ids (B, t) -> the logits (B, V) of the token after them."""
        ids = ids.to(self.device)
        if self.mem_len == 0:
            if before_chunk is not None:
                before_chunk()
            context = ids if self.context is None else torch.cat([self.context, ids], dim=1)
            # a slice of the longer [window ; ids] would keep all of it alive
            self.context = context[:, -self.segment_len :].clone() if context.shape[1] > self.segment_len else context
            with self.lock:
                logits = self.model(self.context, mem_len=0).logits
            self.logits = logits[:, -1].clone() if logits.shape[1] > 1 else logits[:, -1]
            return self.logits
        for chunk in ids.split(self.segment_len, dim=1):
            if before_chunk is not None:
                before_chunk()
            with self.lock:
                out = self.model(chunk, memory=self.memory, mem_len=self.mem_len)
            self.memory = out.memory
            self.logits = out.logits[:, -1].clone() if out.logits.shape[1] > 1 else out.logits[:, -1]
        return self.logits

    def step(self, tokens: Tensor) -> Tensor:
        """tokens (B,): one new token per stream -> the logits (B, V) of the next one."""
        return self.feed(tokens[:, None])


@contextlib.contextmanager
def eval_mode(model):
    """Dropout off while decoding; the model's mode restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@torch.no_grad()
def stream_tokens(
    model,
    prompt: Sequence[int] | Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    mem_len: int | None = None,
    segment_len: int | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[int]:
    """Yield new token ids one by one (one prompt: `sample` for one row, yielded as they come). temperature
    0 = greedy."""
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    check_causal(model)
    prompt = prompt_batch(model, torch.as_tensor(prompt, dtype=torch.long).flatten(), name="prompt")
    decoder = Decoder(model, mem_len=mem_len, segment_len=segment_len)
    with eval_mode(model):
        logits = decoder.feed(prompt)
        for i in range(max_new_tokens):
            token = pick_tokens(logits.float(), temperature=temperature, top_k=top_k, top_p=top_p,
                                generator=generator)
            yield int(token[0])
            if i + 1 < max_new_tokens:
                logits = decoder.step(token)


def generate(model, prompt, *, max_new_tokens: int, **kwargs) -> list[int]:
    return list(stream_tokens(model, prompt, max_new_tokens=max_new_tokens, **kwargs))


def generate_rerun(model, prompt, *, max_new_tokens: int) -> list[int]:
    """Greedy decoding that re-runs the whole context every step, without memory: the baseline that
    memory reuse must reproduce (and beat in speed). A `Decoder` at mem_len 0 whose window holds the
    whole text."""
    check_sampling(max_new_tokens, 0.0, 0, 1.0)
    prompt = torch.as_tensor(prompt, dtype=torch.long).flatten()[None]
    decoder = Decoder(model, mem_len=0, segment_len=prompt.shape[1] + max_new_tokens)
    logits = decoder.feed(prompt)
    new = []
    for i in range(max_new_tokens):
        token = pick_tokens(logits, temperature=0.0)
        new.append(int(token[0]))
        if i + 1 < max_new_tokens:
            logits = decoder.step(token)
    return new


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


def encode_prompt(vocab, prompt: str) -> list[int]:
    """The prompt's ids with the checkpoint's vocabulary; one clear error when it cannot be encoded.
    An empty prompt means unconditional generation (`boundary_ids`)."""
    if not prompt:
        return boundary_ids(vocab)
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
class Generation:
    """New tokens of each row, the model's log-probability of each (its own distribution at temperature
    1, before top-k/top-p: the token's negative NLL), and why each row stopped."""

    ids: list[list[int]]
    logprobs: list[list[float]]
    stopped_by: list[str]  # "max_new_tokens" | "eos" | "stop"


@torch.no_grad()
def sample(
    model,
    input_ids: Tensor | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    mem_len: int | None = None,
    segment_len: int | None = None,
    generator: torch.Generator | None = None,
    eos_token_id: int | None = None,
    should_stop: Callable[[int, int], bool] | None = None,
) -> Generation:
    """Generate for a batch of equal-length prompts (B, T) at once, with memory (one forward per new
    token for the whole batch). A row stops at `eos_token_id` (kept as its last token) or when
    `should_stop(row, token)` says so (the text layer's stop strings); generation ends when every row
    has stopped or after `max_new_tokens`. temperature 0 = greedy."""
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    check_causal(model)
    prompt = prompt_batch(model, input_ids)
    vocab = model.config.vocab_size
    if eos_token_id is not None and not 0 <= eos_token_id < vocab:
        raise UsageError(f"eos_token_id {eos_token_id} is outside the model's vocabulary [0, {vocab})")
    decoder = Decoder(model, mem_len=mem_len, segment_len=segment_len)
    rows = prompt.shape[0]
    ids: list[list[int]] = [[] for _ in range(rows)]
    logprobs: list[list[float]] = [[] for _ in range(rows)]
    stopped_by = ["max_new_tokens"] * rows
    live = [True] * rows
    with eval_mode(model):
        logits = decoder.feed(prompt)
        for i in range(max_new_tokens):
            logits = logits.float()
            tokens = pick_tokens(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
            chosen = logits.log_softmax(-1).gather(1, tokens[:, None].to(logits.device))[:, 0].tolist()
            for row, token in enumerate(tokens.tolist()):
                if not live[row]:
                    continue
                ids[row].append(token)
                logprobs[row].append(chosen[row])
                if eos_token_id is not None and token == eos_token_id:
                    live[row], stopped_by[row] = False, "eos"
                elif should_stop is not None and should_stop(row, token):
                    live[row], stopped_by[row] = False, "stop"
            if not any(live) or i + 1 == max_new_tokens:
                break
            logits = decoder.step(tokens)
    return Generation(ids=ids, logprobs=logprobs, stopped_by=stopped_by)


def generate_tokens(model, input_ids: Tensor, max_new_tokens: int, *, pad_token_id: int | None = None,
                    **kwargs) -> Tensor:
    """`TransformerXL.generate`: `input_ids` (B, T) (or (T,)) followed by up to `max_new_tokens` new
    tokens, as one (B, T + n) tensor. Rows that stop early (at `eos_token_id`) are padded with
    `pad_token_id` (default: the eos id). Keyword arguments as `sample`."""
    prompt = torch.as_tensor(input_ids, dtype=torch.long)
    flat = prompt.dim() == 1
    result = sample(model, prompt[None] if flat else prompt, max_new_tokens=max_new_tokens, **kwargs)
    width = max(len(r) for r in result.ids)
    pad = kwargs.get("eos_token_id") if pad_token_id is None else pad_token_id
    new = torch.full((len(result.ids), width), pad if pad is not None else 0, dtype=torch.long)
    for row, tokens in enumerate(result.ids):
        new[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    out = torch.cat([prompt.reshape(len(result.ids), -1).cpu(), new], dim=1)
    return out[0] if flat else out


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
