"""Token generation that reuses memory (what users asked the reference for in its issue #49): the one
decoder (`Decoder`) behind `model.generate`, `txl generate`, `sample_text` and `txl serve`.

The prompt is fed in segments to fill the memory; then tokens come one at a time, each step a forward
pass over one token that attends to the memory (the previous `mem_len` positions per layer) and
nothing else, so the cost per token is bounded by the attention length instead of growing with the
text. With relative positions this equals re-running the whole context every step as long as the
context fits in `mem_len` (tests/test_generate.py checks greedy decoding token for token).

With `mem_len = 0` there is nothing to carry, so each step re-runs a sliding window of the last
`segment_len` tokens instead: the vanilla Transformer's way (Al-Rfou et al. 2018), and the only
sensible one for a model trained without memory.

An absolute encoding (sinusoidal, learned) numbers every training segment's tokens from 0; the decoder
passes each token its place in the text, counted from the row's first real token and restarting every
`segment_len` tokens (`txl generate` and `txl serve` pass the run's tgt_len), where a token fed alone
would otherwise always be position 0.

The model is used only through its contract (`model(ids, memory=, mem_len=)` -> `.logits`, `.memory`),
so this package sits below `txl.models`. Tokens are picked by `txl.nn.sampling.pick_tokens`. Entry
points: `stream_tokens` (one prompt, tokens as they come), `sample` (a batch, stopping, log-probabilities),
`generate_tokens` (`model.generate`), `generate_rerun` (the uncached baseline). The text side (prompts,
detokenising, stop strings) is `txl.generate.text`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from txl.errors import UsageError
from txl.nn.memory import MemoryState, reset_rows
from txl.nn.options import MAX_LENGTH
from txl.nn.sampling import check_sampling, pick_tokens


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
    (B, t, V) output of a prompt's chunk), so a decoder holds no more than its state between calls.

    Rows of different lengths: `feed(ids, attention_mask=)` with prompts padded on the left (0 = padding);
    the memory keeps the padding (`txl.nn.memory.Memory.key_padding`) and every row gets what it gets
    alone. `reset(rows)` empties chosen rows, so a finished stream can be swapped for a new prompt in a
    running batch (its next feed starts as a fresh decoder's would; left-pad the other rows' ids with
    that feed's attention_mask, or feed every row)."""

    def __init__(self, model, *, mem_len: int | None = None, segment_len: int | None = None, lock=None):
        self.model = model
        self.mem_len, self.segment_len = check_lengths(model, mem_len, segment_len)
        self.device = next(model.parameters()).device
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.memory: MemoryState | None = None
        self.context: Tensor | None = None  # mem_len 0: the window of the last tokens (B, t)
        self.context_mask: Tensor | None = None  # mem_len 0 with padding or a reset: (B, t) bool, True = real
        self.logits: Tensor | None = None  # (B, V) of the next token
        # An absolute encoding (sinusoidal, learned) numbers a segment's tokens 0 … segment_len-1 in training; a
        # forward numbers its own tokens from 0, so a token fed alone would always be position 0. The decoder
        # passes each real token its place in the row's text instead, counted from the row's first token
        # (padding not counted) and restarting every segment_len tokens: (B,) real tokens so far, mod segment_len.
        self.absolute = bool(getattr(model, "takes_position_ids", False))
        self.seen: Tensor | None = None

    @torch.no_grad()
    def feed(self, ids: Tensor, *, before_chunk: Callable[[], object] | None = None,
             attention_mask: Tensor | None = None) -> Tensor:
        """ids (B, t) -> the logits (B, V) of the token after them. attention_mask (B, t): 1 for a token,
        0 for padding, which must come first in a row (left padding: the last column is each row's
        latest token)."""
        ids = ids.to(self.device)
        mask = None if attention_mask is None else self._padding(attention_mask, ids)
        if self.mem_len == 0:
            if before_chunk is not None:
                before_chunk()
            context = ids if self.context is None else torch.cat([self.context, ids], dim=1)
            if mask is not None or self.context_mask is not None:  # the window's padding (no memory: any mask)
                new = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask
                old = None if self.context is None else (
                    torch.ones_like(self.context, dtype=torch.bool) if self.context_mask is None else self.context_mask)
                window_mask = new if old is None else torch.cat([old, new], dim=1)
                self.context_mask = window_mask[:, -self.segment_len :].clone()
            # a slice of the longer [window ; ids] would keep all of it alive
            self.context = context[:, -self.segment_len :].clone() if context.shape[1] > self.segment_len else context
            extra = {} if self.context_mask is None else {"attention_mask": self.context_mask}
            if self.absolute and self.context_mask is not None:  # the window's real tokens from position 0
                extra["position_ids"] = self._positions(self.context_mask, None)
            with self.lock:
                logits = self.model(self.context, mem_len=0, **extra).logits
            self.logits = logits[:, -1].clone() if logits.shape[1] > 1 else logits[:, -1]
            return self.logits
        chunks = ids.split(self.segment_len, dim=1)
        masks = [None] * len(chunks) if mask is None else mask.split(self.segment_len, dim=1)
        for chunk, chunk_mask in zip(chunks, masks, strict=True):
            if before_chunk is not None:
                before_chunk()
            extra = {} if chunk_mask is None else {"attention_mask": chunk_mask}
            if self.absolute:
                real = torch.ones_like(chunk, dtype=torch.bool) if chunk_mask is None else chunk_mask
                extra["position_ids"] = self._positions(real, self.seen)
                self.seen = (real.sum(1) if self.seen is None else self.seen + real.sum(1)) % self.segment_len
            with self.lock:
                out = self.model(chunk, memory=self.memory, mem_len=self.mem_len, **extra)
            self.memory = out.memory
            self.logits = out.logits[:, -1].clone() if out.logits.shape[1] > 1 else out.logits[:, -1]
        return self.logits

    def step(self, tokens: Tensor) -> Tensor:
        """tokens (B,): one new token per stream -> the logits (B, V) of the next one."""
        return self.feed(tokens[:, None])

    def reset(self, rows) -> None:
        """Empty the chosen rows (row indices or a (B,) bool mask): each continues as a fresh decoder's row
        would start (the memory's `reset`; at mem_len 0 the rows' window is masked out). Their `logits`
        are stale until the next feed."""
        if self.mem_len == 0:
            if self.context is not None:
                chosen = reset_rows(rows, self.context.shape[0], device=self.context.device)
                real = torch.ones_like(self.context, dtype=torch.bool) if self.context_mask is None else self.context_mask
                self.context_mask = real & ~chosen[:, None]
        elif self.memory is not None:
            self.memory = self.memory.reset(rows)
            if self.seen is not None:  # the rows' next token is position 0 again
                self.seen = self.seen.masked_fill(reset_rows(rows, self.seen.shape[0], device=self.seen.device), 0)

    def _positions(self, real: Tensor, seen: Tensor | None) -> Tensor:
        """(B, t) positions of the absolute encoding: the real tokens (`real`, (B, t) bool) numbered on
        from `seen` ((B,) or None = 0), mod segment_len; padding gets position 0 (it is never attended)."""
        count = real.long().cumsum(1) - 1
        if seen is not None:
            count = count + seen[:, None]
        return count.clamp(min=0) % self.segment_len

    @staticmethod
    def _padding(attention_mask, ids: Tensor) -> Tensor:
        mask = torch.as_tensor(attention_mask).to(ids.device)
        if mask.shape != ids.shape:
            raise UsageError(f"attention_mask must have the shape of the ids {tuple(ids.shape)}, got {tuple(mask.shape)}")
        mask = mask != 0
        if not bool(mask[:, -1].all()):
            raise UsageError("pad prompts on the left (attention_mask 0 before a row's tokens): the last column "
                             "must be every row's latest token")
        return mask


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
    attention_mask: Tensor | None = None,
) -> Generation:
    """Generate for a batch of prompts (B, T) at once, with memory (one forward per new token for the
    whole batch). Prompts of different lengths: pad them on the left and pass `attention_mask` (B, T), 1
    for a token, 0 for padding; each row then gets what it gets alone. A row stops at `eos_token_id`
    (kept as its last token) or when `should_stop(row, token)` says so (the text layer's stop strings);
    generation ends when every row has stopped or after `max_new_tokens`. temperature 0 = greedy."""
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
        logits = decoder.feed(prompt, attention_mask=attention_mask)
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
    `pad_token_id` (default: the eos id). Keyword arguments as `sample` (`attention_mask` for
    left-padded prompts of different lengths)."""
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
