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
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from txl.errors import CheckpointError, DataError, UsageError
from txl.nn.memory import Memory
from txl.nn.options import MAX_LENGTH


def filter_logits(logits: Tensor, *, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Mask all but the top-k tokens and the smallest nucleus with probability >= top_p."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens before it already reach top_p (the top token always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


# Below these, logits / temperature overflows float32 and the nucleus test underflows: both would turn
# the probabilities into NaN. A temperature this small is greedy decoding in all but name.
MIN_TEMPERATURE = 1e-3
MIN_TOP_P = 1e-6
MAX_NEW_TOKENS = 1 << 24


def check_sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    if max_new_tokens < 1:
        raise UsageError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if max_new_tokens > MAX_NEW_TOKENS:
        raise UsageError(f"max_new_tokens must be <= {MAX_NEW_TOKENS:,}, got {max_new_tokens:.3g}")
    if temperature < 0:
        raise UsageError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not (temperature == 0 or MIN_TEMPERATURE <= temperature < math.inf):  # also NaN
        raise UsageError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {temperature}")
    if top_k < 0:
        raise UsageError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0.0 < top_p <= 1.0:  # also rejects NaN
        raise UsageError(f"top_p must be in (0, 1], got {top_p}")
    if top_p < MIN_TOP_P:
        raise UsageError(f"top_p must be >= {MIN_TOP_P} (a smaller nucleus underflows; use --greedy), got {top_p}")


def check_seed(seed: int | None) -> None:
    if seed is not None and not 0 <= seed < 2**63:
        raise UsageError(f"seed must be in [0, 2**63), got {seed:.3g}" if seed >= 10**15 else
                         f"seed must be in [0, 2**63), got {seed}")


def check_causal(model) -> None:
    if not getattr(model, "config", None) or model.config.causal:
        return
    raise UsageError("this model is a bidirectional encoder (causal=false, e.g. trained with --objective mlm): "
                     "it predicts masked tokens and cannot generate text; use a causal LM")


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
    """Yield new token ids one by one. temperature 0 = greedy."""
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    check_causal(model)
    prompt = torch.as_tensor(prompt, dtype=torch.long).flatten()
    if prompt.numel() == 0:
        raise UsageError("the prompt is empty; give at least one token of text")
    vocab = model.config.vocab_size
    if int(prompt.max()) >= vocab or int(prompt.min()) < 0:
        raise UsageError(f"prompt has token ids outside the model's vocabulary [0, {vocab})")
    device = next(model.parameters()).device
    mem_len = model.mem_len if mem_len is None else mem_len
    if mem_len < 0:
        raise UsageError(f"mem_len must be >= 0, got {mem_len}")
    if mem_len > MAX_LENGTH:
        raise UsageError(f"mem_len must be <= {MAX_LENGTH:,}, got {mem_len:.3g}")
    segment_len = segment_len or max(mem_len, 128)
    if segment_len < 1:
        raise UsageError(f"segment_len must be >= 1, got {segment_len}")
    if segment_len > MAX_LENGTH:
        raise UsageError(f"segment_len must be <= {MAX_LENGTH:,}, got {segment_len:.3g}")
    was_training = model.training
    model.eval()
    try:
        if mem_len == 0:
            yield from _stream_window(model, prompt.to(device), max_new_tokens=max_new_tokens, window=segment_len,
                                      temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
            return
        memory: Memory | None = None
        logits = None
        for chunk in prompt.to(device).split(segment_len):
            out = model(chunk[None], memory=memory, mem_len=mem_len)
            memory, logits = out.memory, out.logits[0, -1]
        for _ in range(max_new_tokens):
            token = _pick(logits.float(), temperature, top_k, top_p, generator)
            yield token
            out = model(torch.tensor([[token]], device=device), memory=memory, mem_len=mem_len)
            memory, logits = out.memory, out.logits[0, -1]
    finally:
        model.train(was_training)


def _stream_window(model, prompt: Tensor, *, max_new_tokens: int, window: int, temperature: float, top_k: int,
                   top_p: float, generator) -> Iterator[int]:
    """mem_len = 0: every step re-runs the last `window` tokens without memory."""
    context = prompt[-window:][None]  # (1, t)
    for _ in range(max_new_tokens):
        logits = model(context, mem_len=0).logits[0, -1]
        token = _pick(logits.float(), temperature, top_k, top_p, generator)
        yield token
        context = torch.cat([context, context.new_tensor([[token]])], dim=1)[:, -window:]


def _check_finite_scores(logits: Tensor) -> None:
    """Sampling from NaN probabilities is a torch error deep inside multinomial; say what it means."""
    if not bool(torch.isfinite(logits).all()):
        raise CheckpointError("the model's scores for the next token are not finite (NaN or Inf): its weights are "
                              "damaged or were trained into overflow; use another checkpoint")


def _pick(logits: Tensor, temperature: float, top_k: int, top_p: float, generator) -> int:
    _check_finite_scores(logits)
    if temperature == 0:
        return int(logits.argmax())
    logits = filter_logits(logits / temperature, top_k=top_k, top_p=top_p)
    probs = logits.softmax(-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


def generate(model, prompt, *, max_new_tokens: int, **kwargs) -> list[int]:
    return list(stream_tokens(model, prompt, max_new_tokens=max_new_tokens, **kwargs))


@torch.no_grad()
def generate_rerun(model, prompt, *, max_new_tokens: int) -> list[int]:
    """Greedy decoding that re-runs the whole context every step, without memory: the baseline that
    memory reuse must reproduce (and beat in speed)."""
    check_sampling(max_new_tokens, 0.0, 0, 1.0)
    device = next(model.parameters()).device
    context = torch.as_tensor(prompt, dtype=torch.long, device=device).flatten()[None]
    new = []
    for _ in range(max_new_tokens):
        logits = model(context, mem_len=0).logits[0, -1]
        token = int(logits.argmax())
        new.append(token)
        context = torch.cat([context, torch.tensor([[token]], device=device)], dim=1)
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
    prompt = torch.as_tensor(input_ids, dtype=torch.long)
    if prompt.dim() == 1:
        prompt = prompt[None]
    if prompt.dim() != 2 or prompt.shape[0] == 0 or prompt.shape[1] == 0:
        raise UsageError(f"input_ids must have shape (batch, length) with both >= 1, got {tuple(prompt.shape)}")
    vocab = model.config.vocab_size
    if int(prompt.max()) >= vocab or int(prompt.min()) < 0:
        raise UsageError(f"input_ids has token ids outside the model's vocabulary [0, {vocab})")
    if eos_token_id is not None and not 0 <= eos_token_id < vocab:
        raise UsageError(f"eos_token_id {eos_token_id} is outside the model's vocabulary [0, {vocab})")
    device = next(model.parameters()).device
    mem_len = model.mem_len if mem_len is None else mem_len
    if mem_len < 0:
        raise UsageError(f"mem_len must be >= 0, got {mem_len}")
    segment_len = segment_len or max(mem_len, 128)
    rows = prompt.shape[0]
    ids: list[list[int]] = [[] for _ in range(rows)]
    logprobs: list[list[float]] = [[] for _ in range(rows)]
    stopped_by = ["max_new_tokens"] * rows
    live = [True] * rows
    was_training = model.training
    model.eval()
    try:
        prompt = prompt.to(device)
        memory: Memory | None = None
        context = prompt[:, -segment_len:]
        if mem_len == 0:
            logits = model(context, mem_len=0).logits[:, -1]
        else:
            for chunk in prompt.split(segment_len, dim=1):
                out = model(chunk, memory=memory, mem_len=mem_len)
                memory, logits = out.memory, out.logits[:, -1]
        for _ in range(max_new_tokens):
            logits = logits.float()
            tokens = pick_tokens(logits, temperature, top_k, top_p, generator)
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
            if not any(live):
                break
            step = tokens[:, None].to(device)
            if mem_len == 0:
                context = torch.cat([context, step], dim=1)[:, -segment_len:]
                logits = model(context, mem_len=0).logits[:, -1]
            else:
                out = model(step, memory=memory, mem_len=mem_len)
                memory, logits = out.memory, out.logits[:, -1]
    finally:
        model.train(was_training)
    return Generation(ids=ids, logprobs=logprobs, stopped_by=stopped_by)


def pick_tokens(logits: Tensor, temperature: float, top_k: int, top_p: float, generator) -> Tensor:
    """One token per row of `logits` (rows, vocab): the argmax at temperature 0, else a draw from the
    top-k / top-p filtered distribution (the random draws `sample` makes, for callers that must match it)."""
    _check_finite_scores(logits)
    if temperature == 0:
        return logits.argmax(-1).cpu()
    probs = filter_logits(logits / temperature, top_k=top_k, top_p=top_p).softmax(-1).cpu()
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


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
