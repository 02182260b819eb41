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

import torch
from torch import Tensor

from txl.config import MAX_LENGTH
from txl.errors import CheckpointError, DataError, UsageError
from txl.memory import Memory


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
    if not (temperature == 0 or MIN_TEMPERATURE <= temperature < math.inf):
        raise UsageError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {temperature}")
    if top_k < 0:
        raise UsageError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not MIN_TOP_P <= top_p <= 1.0:  # also rejects NaN
        raise UsageError(f"top_p must be in [{MIN_TOP_P}, 1], got {top_p}")


def check_seed(seed: int | None) -> None:
    if seed is not None and not 0 <= seed < 2**63:
        raise UsageError(f"seed must be in [0, 2**63), got {seed:.3g}" if seed >= 10**15 else
                         f"seed must be in [0, 2**63), got {seed}")


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


def _pick(logits: Tensor, temperature: float, top_k: int, top_p: float, generator) -> int:
    if not bool(torch.isfinite(logits).all()):
        raise CheckpointError("the model's scores for the next token are not finite (NaN or Inf): its weights are "
                              "damaged or were trained into overflow; use another checkpoint")
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


def generate_text(
    model,
    vocab,
    prompt: str,
    *,
    max_new_tokens: int,
    write: Callable[[str], object] | None = None,
    **kwargs,
) -> str:
    """Continue `prompt` (text) and return the new text; `write` receives it piece by piece as tokens
    are produced. The prompt is encoded with `vocab` exactly like corpus text (`Vocab.encode`: for
    word vocabularies unknown words become `<unk>`, or a `DataError` when there is none). Keyword
    arguments go to `stream_tokens` (temperature, top_k, top_p, mem_len, segment_len, generator)."""
    check_sampling(max_new_tokens, kwargs.get("temperature", 1.0), kwargs.get("top_k", 0), kwargs.get("top_p", 1.0))
    if not prompt:
        raise UsageError("the prompt is empty; give at least one token of text")
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
                         "give some text")
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


class TextStream:
    """Decode token ids to text incrementally and `write` each new piece.

    Byte vocabularies decode bytes incrementally (a UTF-8 character may span tokens). Other kinds
    re-decode `prefix` + the new ids and write what was added, so words get the separator they need
    after the prompt; `prefix` (e.g. the prompt's ids) is never written itself. A BPE text that ends
    in an incomplete UTF-8 character is held back until the character is complete.
    """

    PREFIX_TOKENS = 16  # enough prompt tokens to decide spacing and finish a split character

    def __init__(self, vocab, write: Callable[[str], object], prefix: Sequence[int] = ()):
        self.vocab = vocab
        self.write = write
        self.byte_level = getattr(vocab, "kind", None) == "bytes"
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.prefix = [int(t) for t in prefix][-self.PREFIX_TOKENS :]
        self.ids: list[int] = []
        self.shown = len(vocab.decode(self.prefix)) if self.prefix and not self.byte_level else 0

    def push(self, token: int) -> None:
        if self.byte_level:
            self.write(self.decoder.decode(bytes([token])))
            return
        self.ids.append(token)
        text = self.vocab.decode(self.prefix + self.ids)
        if getattr(self.vocab, "kind", None) == "bpe":
            text = text.rstrip("\ufffd")
        if len(text) > self.shown:
            self.write(text[self.shown :])
            self.shown = len(text)

    def close(self) -> None:
        if self.byte_level:
            self.write(self.decoder.decode(b"", final=True))
        elif getattr(self.vocab, "kind", None) == "bpe":
            text = self.vocab.decode(self.prefix + self.ids)
            self.write(text[self.shown :])
