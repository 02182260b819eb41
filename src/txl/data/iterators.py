"""Batching a token stream for a recurrent-memory LM: ordered streams, evaluation, shuffled sentences.

Transformer-XL carries hidden states from one segment to the next, so row b of batch k+1 must
continue exactly where row b of batch k stopped: the split is cut into B contiguous streams, one per
row, read left to right (the reference's `LMOrderedIterator`, here batch-first). Batches are built by
indexing the memory-mapped split for just the tokens of that batch, then `np.asarray(..., int64)`:
the split itself is never loaded into RAM.

Three iterators:

- `StreamIterator`: training. B streams of floor(N / B) tokens each (the remainder, < B tokens at the
  end of the split, is not used for training); fixed or variable segment length; optional per-epoch
  random roll of each stream (NVIDIA's fork); exact resume via `state_dict()`.
- `EvalIterator`: evaluation. Every target of the split (tokens 1..N-1) is scored exactly once; each
  stream may start `warm_len` tokens early to give its first scored token full context.
- `ShuffledSentenceIterator`: lm1b. Sentences in a random order per epoch packed into B streams
  (the reference's `LMShuffledIterator`). With `boundaries=True` the sentences are documents that never
  see each other (issue 47): a row's document ends its segment (the rest is right padding, an
  `attention_mask` of 0) and the row's memory is reset (`Batch.reset`) before its next document.

Size: the three iterators share the stream layout and the checks of a saved position (`_check_state`);
kept together so that resume reads one file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from txl.errors import DataError

STATE_VERSION = 1


@dataclass
class Batch:
    """One segment of B streams, batch-first.

    inputs, targets: int64 [B, T]; targets[b, t] is the token after inputs[b, t] in stream b.
    score_mask: bool [B, T], True where the target counts toward the loss/metric; None = all count.
    positions: int64 [B, T], index in the split of each target token, -1 where not scored.
    attention_mask: int64 [B, T], 1 for a token and 0 for padding (documents: the end of a row's
        document pads the rest of its segment); pass it to the model. None = no padding.
    reset: bool [B], True for the rows whose memory must be emptied before this batch (their previous
        document ended: `memory.reset(batch.reset)`). None = carry every row's memory on.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    score_mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    epoch: int = 0
    step: int = 0  # batch index within the epoch
    attention_mask: torch.Tensor | None = None
    reset: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.inputs.shape[1])

    @property
    def num_scored(self) -> int:
        return self.inputs.numel() if self.score_mask is None else int(self.score_mask.sum())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return replace(
            self,
            inputs=move(self.inputs),
            targets=move(self.targets),
            score_mask=move(self.score_mask),
            positions=move(self.positions),
            attention_mask=move(self.attention_mask),
            reset=move(self.reset),
        )


def _as_tokens(tokens: Any) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    if arr.ndim != 1:
        raise DataError(f"a token array must be 1-D, got shape {tuple(arr.shape)}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"token ids must be integers, got dtype {arr.dtype}")
    return arr


def _check_sizes(batch_size: int, tgt_len: int) -> None:
    if int(batch_size) < 1:
        raise DataError(f"batch_size must be >= 1, got {batch_size}")
    if int(tgt_len) < 1:
        raise DataError(f"tgt_len must be >= 1, got {tgt_len}")


def _gather(tokens: np.ndarray, index: np.ndarray) -> np.ndarray:
    """tokens[index] as int64: a fancy index on a memmap reads only the pages it touches."""
    return np.asarray(tokens[index.reshape(-1)], dtype=np.int64).reshape(index.shape)


def _check_state(state: Any, kind: str, expected: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(state, dict) or state.get("kind") != kind or state.get("version") != STATE_VERSION:
        raise DataError(
            f"not a {kind} iterator state (version {STATE_VERSION}); it cannot resume this iterator"
        )
    for key, value in expected.items():
        if state.get(key) != value:
            raise DataError(
                f"iterator state was saved with {key}={state.get(key)!r} but this iterator has {key}={value!r}; "
                f"resume with the same data and batch settings"
            )
    return state


def _state_int(state: dict[str, Any], key: str) -> int:
    value = state.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise DataError(f"iterator state is damaged: {key!r} is {value!r}, expected an integer >= 0")
    return value


class StreamIterator:
    """Training batches from B contiguous streams (reference `LMOrderedIterator`, batch-first).

    Stream b holds tokens[b*L : (b+1)*L] with L = len(tokens) // B; the last len(tokens) - B*L
    (< B) tokens are not used. A stream of L tokens gives L - 1 (input, target) pairs, consumed T at a
    time; the last batch of an epoch is shorter (L - 1 mod T columns) unless `drop_last`.

    varlen: each segment length is drawn as in the reference `get_varlen_iter`: T with probability
    0.95, else T / 2, plus normal noise (std `std`), clamped to [min_len, T + 3 std].
    roll: at the start of every epoch each stream is rotated by its own random offset (NVIDIA's
    fork), so the segment boundaries differ between epochs; offsets depend only on (seed, epoch).

    Iterating continues from the current position: `epoch()` yields the rest of the current epoch,
    `iter(it)` runs forever across epochs. `state_dict()` after batch k resumes at batch k + 1.
    """

    def __init__(
        self,
        tokens: Any,
        batch_size: int,
        tgt_len: int,
        *,
        varlen: bool = False,
        roll: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        min_len: int = 5,
        std: float = 5.0,
    ):
        _check_sizes(batch_size, tgt_len)
        self.tokens = _as_tokens(tokens)
        self.batch_size, self.tgt_len = int(batch_size), int(tgt_len)
        self.varlen, self.roll, self.seed, self.drop_last = (
            bool(varlen),
            bool(roll),
            int(seed),
            bool(drop_last),
        )
        self.min_len, self.std = int(min_len), float(std)
        self.max_len = int(self.tgt_len + 3 * self.std)  # reference: bptt + max_deviation * std
        self.stream_len = len(self.tokens) // self.batch_size
        if self.stream_len < 2:
            raise DataError(
                f"{len(self.tokens)} tokens are too few for batch_size={self.batch_size}: each stream needs "
                f"at least 2 tokens; use a smaller batch size or a larger split"
            )
        self.starts = np.arange(self.batch_size, dtype=np.int64) * self.stream_len
        self._rng = np.random.default_rng(self.seed)
        self._epoch = 0
        self._pos = 0  # column of the next input within each (rolled) stream
        self._step = 0
        self._shifts = self._roll_shifts(0)

    @property
    def pairs_per_stream(self) -> int:
        return self.stream_len - 1

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch (exact for fixed length; for varlen, the count at the mean length T)."""
        n = self.pairs_per_stream
        return n // self.tgt_len if self.drop_last else math.ceil(n / self.tgt_len)

    def __len__(self) -> int:
        return self.steps_per_epoch

    @property
    def epoch_index(self) -> int:
        return self._epoch

    def _roll_shifts(self, epoch: int) -> np.ndarray:
        if not self.roll:
            return np.zeros(self.batch_size, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch]).integers(0, self.stream_len, size=self.batch_size)

    def _next_len(self) -> int:
        if not self.varlen:
            return self.tgt_len
        mean = self.tgt_len if self._rng.random() < 0.95 else self.tgt_len / 2.0
        return int(min(self.max_len, max(self.min_len, int(self._rng.normal(mean, self.std)))))

    def _advance_epoch(self) -> None:
        self._epoch += 1
        self._pos = 0
        self._step = 0
        self._shifts = self._roll_shifts(self._epoch)

    def _take(self) -> Batch | None:
        remaining = self.pairs_per_stream - self._pos
        seq_len = self._next_len()
        if seq_len > remaining:
            if self.drop_last:
                self._pos = self.pairs_per_stream
                return None
            seq_len = remaining
        cols = self._pos + np.arange(seq_len + 1, dtype=np.int64)
        index = self.starts[:, None] + (cols[None, :] + self._shifts[:, None]) % self.stream_len  # (B, T+1)
        window = _gather(self.tokens, index)
        batch = Batch(
            inputs=torch.from_numpy(np.ascontiguousarray(window[:, :-1])),
            targets=torch.from_numpy(np.ascontiguousarray(window[:, 1:])),
            positions=torch.from_numpy(np.ascontiguousarray(index[:, 1:])),
            epoch=self._epoch,
            step=self._step,
        )
        self._pos += seq_len
        self._step += 1
        return batch

    def epoch(self):
        """Yield the remaining batches of the current epoch (all of them when it has not started)."""
        if self._pos >= self.pairs_per_stream:
            self._advance_epoch()
        while self._pos < self.pairs_per_stream:
            batch = self._take()
            if batch is None:
                return
            yield batch

    def __iter__(self):
        while True:
            yield from self.epoch()

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able position: epoch, next column, step, and the varlen RNG state."""
        return {
            "kind": "stream",
            "version": STATE_VERSION,
            "num_tokens": int(len(self.tokens)),
            "batch_size": self.batch_size,
            "tgt_len": self.tgt_len,
            "varlen": self.varlen,
            "roll": self.roll,
            "seed": self.seed,
            "epoch": self._epoch,
            "position": self._pos,
            "step": self._step,
            "rng": self._rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expected = {
            "num_tokens": int(len(self.tokens)),
            "batch_size": self.batch_size,
            "tgt_len": self.tgt_len,
            "varlen": self.varlen,
            "roll": self.roll,
            "seed": self.seed,
        }
        state = _check_state(state, "stream", expected)
        epoch, position, step = (_state_int(state, key) for key in ("epoch", "position", "step"))
        if not 0 <= position <= self.pairs_per_stream:
            raise DataError(
                f"iterator state position {position} is outside the stream length {self.stream_len}"
            )
        rng = np.random.default_rng(self.seed)
        try:  # numpy checks the bit generator's name and key; anything else is a damaged state
            rng.bit_generator.state = state.get("rng")
        except (TypeError, ValueError, KeyError) as err:
            raise DataError(f"iterator state has an unusable random-number state ({err})") from None
        self._epoch, self._pos, self._step, self._rng = epoch, position, step, rng
        self._shifts = self._roll_shifts(self._epoch)


class EvalIterator:
    """Evaluation batches in which every target of the split is scored exactly once.

    The targets are tokens 1..N-1 (token 0 has no context, so it is only ever an input). They are
    divided into B contiguous chunks whose sizes differ by at most one (the first (N-1) mod B chunks
    get the extra token): nothing is dropped, unlike the reference, which discards the N mod B tail.

    warm_len = M > 0: stream b (b > 0) starts M tokens before its first scored target; those M
    warm-up targets are fed (filling the model's memory) with score_mask False, so every scored token
    sees at least M tokens of real context (stream 0 starts at the beginning of the split, where no
    context exists). warm_len = 0 scores from each stream's first token, as the reference does.

    Streams differ in length by at most M + 1 columns; the shorter ones are padded at the END (pad
    id 0, score_mask False, position -1), where causal attention keeps the padding invisible to every
    scored token. Row b is always stream b, so memory can be carried across batches. The last batch is
    shorter than T when the longest stream's length is not a multiple of T. Re-iterating restarts.
    """

    def __init__(self, tokens: Any, batch_size: int, tgt_len: int, warm_len: int = 0):
        _check_sizes(batch_size, tgt_len)
        if int(warm_len) < 0:
            raise DataError(f"warm_len must be >= 0, got {warm_len}")
        self.tokens = _as_tokens(tokens)
        self.batch_size, self.tgt_len, self.warm_len = int(batch_size), int(tgt_len), int(warm_len)
        n = len(self.tokens)
        if n < 2:
            raise DataError(f"a split of {n} token(s) has nothing to score; it needs at least 2 tokens")
        n_targets = n - 1
        q, r = divmod(n_targets, self.batch_size)
        sizes = np.full(self.batch_size, q, dtype=np.int64)
        sizes[:r] += 1
        self.score_start = 1 + np.concatenate([[0], np.cumsum(sizes)[:-1]])  # first scored target index
        self.score_len = sizes
        self.warm = np.where(sizes > 0, np.minimum(self.warm_len, self.score_start - 1), 0)
        self.first_input = self.score_start - 1 - self.warm
        self.length = self.score_len + self.warm  # columns (input, target pairs) in each stream
        self.num_columns = int(self.length.max())

    @property
    def scored_tokens(self) -> int:
        return int(self.score_len.sum())

    def __len__(self) -> int:
        return math.ceil(self.num_columns / self.tgt_len)

    def describe(self) -> dict[str, Any]:
        """What to record next to an evaluation result, so numbers are compared like with like."""
        return {
            "mode": "warm" if self.warm_len else "reference",
            "warm_len": self.warm_len,
            "batch_size": self.batch_size,
            "tgt_len": self.tgt_len,
            "scored_tokens": self.scored_tokens,
        }

    def __iter__(self):
        for step in range(len(self)):
            lo = step * self.tgt_len
            cols = lo + np.arange(min(self.tgt_len, self.num_columns - lo), dtype=np.int64)
            valid = cols[None, :] < self.length[:, None]  # (B, T)
            in_idx = self.first_input[:, None] + cols[None, :]
            safe = np.where(valid, in_idx, 0)
            inputs = np.where(valid, _gather(self.tokens, safe), 0)
            targets = np.where(valid, _gather(self.tokens, safe + valid), 0)
            scored = valid & (cols[None, :] >= self.warm[:, None])
            positions = np.where(scored, in_idx + 1, -1)
            yield Batch(
                inputs=torch.from_numpy(inputs),
                targets=torch.from_numpy(targets),
                score_mask=torch.from_numpy(scored),
                positions=torch.from_numpy(positions),
                step=step,
            )


def separator_offsets(tokens: Any, separator: int) -> np.ndarray:
    """Document offsets of a token stream whose documents each end with the token `separator` (e.g. an
    `<eos>` id written after every document): each document's start, then the token count (the
    `ShuffledSentenceIterator` layout). A tail after the last separator is a document too."""
    tokens = _as_tokens(tokens)
    ends = np.flatnonzero(np.asarray(tokens) == int(separator)) + 1
    starts = np.concatenate([[0], ends[ends < len(tokens)]])
    return np.concatenate([starts, [len(tokens)]]).astype(np.int64)


def document_offsets(lengths: Any) -> np.ndarray:
    """Offsets (each start, then the total) of documents of these token counts laid end to end."""
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))]).astype(np.int64)


class ShuffledSentenceIterator:
    """lm1b batches: sentences in random order per epoch, packed into B streams (`LMShuffledIterator`).

    Each row takes the next sentence from one shared order whenever its current sentence runs out, as
    the reference does: a sentence of n tokens gives its n - 1 (input, target) pairs, so the first
    `<S>` of a sentence is only an input, and the jump from one sentence's end to the next sentence is
    never a target. Memory flows on across sentence boundaries within a row.

    drop_last (default: = shuffle): the final batch of an epoch, where the sentences run out before
    every row is full, is dropped (reference behaviour for training). With drop_last False it is
    emitted with score_mask False on the empty places, and rows keep being emitted until every
    sentence is consumed, so an evaluation scores every pair exactly once.

    boundaries: the offsets are documents that must not see each other. A row's document fills its
    segments from column 0; where it ends, the rest of that segment is padding (`attention_mask` 0,
    score_mask False: right padding at a sequence's end, which the memory holds as padding), and the
    next batch starts the row's next document at column 0 with `reset[b]` True: the caller empties that
    row's memory (`Memory.reset`), so the document is read as it would be alone (tests/test_document_boundaries.py).
    """

    def __init__(
        self,
        tokens: Any,
        offsets: Any,
        batch_size: int,
        tgt_len: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool | None = None,
        boundaries: bool = False,
    ):
        _check_sizes(batch_size, tgt_len)
        self.boundaries = bool(boundaries)
        self.tokens = _as_tokens(tokens)
        self.offsets = _as_tokens(offsets)
        if len(self.offsets) < 2 or int(self.offsets[-1]) != len(self.tokens):
            raise DataError("sentence offsets must list each sentence start and end with the token count")
        self.batch_size, self.tgt_len = int(batch_size), int(tgt_len)
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.drop_last = self.shuffle if drop_last is None else bool(drop_last)
        self.num_sentences = len(self.offsets) - 1
        self._epoch = 0
        self._reset_epoch_state()

    @classmethod
    def from_corpus(
        cls, corpus: Any, split: str, batch_size: int, tgt_len: int, **kwargs: Any
    ) -> ShuffledSentenceIterator:
        offsets = corpus.sentence_offsets(split)
        if offsets is None:
            raise DataError(
                f"{corpus.name} has no sentence boundaries; use StreamIterator for ordered corpora"
            )
        return cls(corpus.split(split), offsets, batch_size, tgt_len, **kwargs)

    def _reset_epoch_state(self) -> None:
        self._cursor = 0
        self._step = 0
        self._rows = np.full((self.batch_size, 2), -1, dtype=np.int64)  # (sentence, offset) per row
        self._done = False
        self._order = self._make_order(self._epoch)

    def _make_order(self, epoch: int) -> np.ndarray | None:
        if not self.shuffle:
            return None
        dtype = np.uint32 if self.num_sentences < 2**32 else np.uint64
        order = np.arange(self.num_sentences, dtype=dtype)  # in place: 4 bytes per sentence
        np.random.default_rng([self.seed, epoch]).shuffle(order)
        return order

    @property
    def steps_per_epoch(self) -> int:
        """Estimated batches per epoch: (tokens - sentences) pairs / (B * T)."""
        pairs = len(self.tokens) - self.num_sentences
        return max(1, math.ceil(pairs / (self.batch_size * self.tgt_len)))

    def _sentence(self, k: int) -> int:
        return int(self._order[k]) if self._order is not None else k

    def _take(self) -> Batch | None:
        B, T = self.batch_size, self.tgt_len
        in_idx = np.full((B, T), -1, dtype=np.int64)
        reset = np.zeros(B, dtype=bool)
        exhausted = False
        for b in range(B):
            sid, off = self._rows[b]
            filled = 0
            while filled < T:
                if sid < 0 or int(self.offsets[sid + 1]) - int(self.offsets[sid]) - off <= 1:
                    if self.boundaries and filled:  # a document ends its segment: right padding after it
                        sid = -1
                        break
                    if self._cursor >= self.num_sentences:
                        sid, exhausted = -1, True
                        break
                    reset[b] |= self.boundaries
                    sid, off = self._sentence(self._cursor), 0
                    self._cursor += 1
                start = int(self.offsets[sid]) + off
                n_new = min(int(self.offsets[sid + 1]) - start - 1, T - filled)
                in_idx[b, filled : filled + n_new] = np.arange(start, start + n_new)
                off += n_new
                filled += n_new
            self._rows[b] = (sid, off)
        if exhausted and (self.drop_last or not (in_idx >= 0).any()):
            self._done = True
            return None
        mask = in_idx >= 0
        safe = np.where(mask, in_idx, 0)
        batch = Batch(
            inputs=torch.from_numpy(np.where(mask, _gather(self.tokens, safe), 0)),
            targets=torch.from_numpy(np.where(mask, _gather(self.tokens, safe + 1), 0)),
            score_mask=torch.from_numpy(mask),
            positions=torch.from_numpy(np.where(mask, in_idx + 1, -1)),
            epoch=self._epoch,
            step=self._step,
            attention_mask=torch.from_numpy(mask.astype(np.int64)) if self.boundaries else None,
            reset=torch.from_numpy(reset) if self.boundaries else None,
        )
        self._step += 1
        if exhausted:
            self._done = not (self._rows[:, 0] >= 0).any()
        return batch

    def epoch(self):
        """Yield the remaining batches of the current epoch; the next call starts a new epoch."""
        if self._done:
            self._epoch += 1
            self._reset_epoch_state()
        while not self._done:
            batch = self._take()
            if batch is None:
                return
            yield batch

    def __iter__(self):
        while True:
            yield from self.epoch()

    def state_dict(self) -> dict[str, Any]:
        return {
            **({"boundaries": True} if self.boundaries else {}),
            "kind": "sentences",
            "version": STATE_VERSION,
            "num_tokens": int(len(self.tokens)),
            "num_sentences": self.num_sentences,
            "batch_size": self.batch_size,
            "tgt_len": self.tgt_len,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "epoch": self._epoch,
            "cursor": self._cursor,
            "step": self._step,
            "done": self._done,
            "rows": self._rows.tolist(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expected = {
            "num_tokens": int(len(self.tokens)),
            "num_sentences": self.num_sentences,
            "batch_size": self.batch_size,
            "tgt_len": self.tgt_len,
            "shuffle": self.shuffle,
            "seed": self.seed,
            **({"boundaries": True} if self.boundaries else {}),
        }
        state = _check_state(state, "sentences", expected)
        epoch, cursor, step = (_state_int(state, key) for key in ("epoch", "cursor", "step"))
        if cursor > self.num_sentences or not isinstance(state.get("done"), bool):
            raise DataError(f"iterator state is damaged: cursor {cursor} of {self.num_sentences} sentences")
        try:
            rows = np.asarray(state.get("rows"), dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            rows = np.zeros(0, dtype=np.int64)
        if rows.shape != (self.batch_size, 2) or (rows[:, 0] >= self.num_sentences).any() or (rows < -1).any():
            raise DataError("iterator state rows do not match batch_size and the sentences; the state is damaged")
        self._epoch, self._cursor, self._step, self._done = epoch, cursor, step, state["done"]
        self._order = self._make_order(self._epoch)
        self._rows = rows
