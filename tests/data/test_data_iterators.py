"""Batching invariants: streams reassemble the split, evaluation scores every target exactly once."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from txl.data import Batch, EvalIterator, ShuffledSentenceIterator, StreamIterator
from txl.errors import DataError


def tokens_of(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, size=n).astype(np.uint16)


# ---- StreamIterator -----------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(n=st.integers(4, 400), b=st.integers(1, 8), t=st.integers(1, 40))
def test_streams_concatenated_give_the_split_back(n, b, t):
    tokens = tokens_of(n)
    if n // b < 2:
        with pytest.raises(DataError, match="too few"):
            StreamIterator(tokens, b, t)
        return
    it = StreamIterator(tokens, batch_size=b, tgt_len=t)
    batches = list(it.epoch())
    assert len(batches) == it.steps_per_epoch
    inputs = torch.cat([x.inputs for x in batches], dim=1)
    targets = torch.cat([x.targets for x in batches], dim=1)
    L = n // b
    streams = torch.cat([inputs, targets[:, -1:]], dim=1)  # (B, L): each stream whole
    assert streams.shape == (b, L)
    np.testing.assert_array_equal(streams.reshape(-1).numpy(), tokens[: b * L])  # nothing lost or duplicated
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets = inputs shifted by one
    for x in batches[:-1]:
        assert x.inputs.shape == (b, t) and x.inputs.dtype == torch.int64
    assert batches[-1].seq_len == (L - 1) - t * (len(batches) - 1)  # last batch is the short remainder


def test_consecutive_batches_continue_each_stream():
    tokens = tokens_of(1000)
    it = StreamIterator(tokens, batch_size=4, tgt_len=16)
    first, second = next(iter(it)), next(iter(it))
    assert torch.equal(first.targets[:, -1], second.inputs[:, 0])
    np.testing.assert_array_equal(second.positions[:, 0].numpy() - 1, first.positions[:, -1].numpy())
    assert (first.step, second.step) == (0, 1)


def test_epoch_resumes_after_break_and_rolls_over():
    it = StreamIterator(tokens_of(500), batch_size=2, tgt_len=20)
    seen = []
    for k, batch in enumerate(it.epoch()):
        seen.append(batch)
        if k == 3:
            break
    rest = list(it.epoch())
    assert len(seen) + len(rest) == it.steps_per_epoch and rest[0].step == 4
    assert it.epoch_index == 0
    nxt = list(it.epoch())
    assert it.epoch_index == 1 and torch.equal(nxt[0].inputs, seen[0].inputs)


def test_state_dict_is_json_and_resumes_exactly():
    tokens = tokens_of(3000)
    kwargs = dict(batch_size=3, tgt_len=24, varlen=True, roll=True, seed=7)
    it = StreamIterator(tokens, **kwargs)
    stream = iter(it)
    for _ in range(60):  # crosses an epoch boundary (about 41 steps per epoch)
        next(stream)
    state = json.loads(json.dumps(it.state_dict()))
    expected = [next(stream) for _ in range(30)]
    fresh = StreamIterator(tokens, **kwargs)
    fresh.load_state_dict(state)
    got = [b for b, _ in zip(iter(fresh), range(30))]
    for a, b in zip(expected, got):
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
        assert (a.epoch, a.step) == (b.epoch, b.step)
    with pytest.raises(DataError, match="batch_size=3 but this iterator has batch_size=4"):
        StreamIterator(tokens, **{**kwargs, "batch_size": 4}).load_state_dict(state)


def test_roll_rotates_each_stream_per_epoch():
    tokens = np.arange(400, dtype=np.uint32)
    it = StreamIterator(tokens, batch_size=4, tgt_len=7, roll=True, seed=1)
    epochs = []
    for _ in range(3):
        batches = list(it.epoch())
        inputs = torch.cat([b.inputs for b in batches], 1)
        epochs.append(torch.cat([inputs, batches[-1].targets[:, -1:]], 1).numpy())
    for rows in epochs:
        for b, row in enumerate(rows):
            stream = tokens[b * 100 : (b + 1) * 100]
            shift = int(row[0] - stream[0])
            np.testing.assert_array_equal(row, np.roll(stream, -shift))  # a rotation of its own stream
    assert not np.array_equal(epochs[0], epochs[1])


def test_varlen_lengths_follow_the_reference_rule_and_cover_the_stream():
    it = StreamIterator(tokens_of(20_000), batch_size=2, tgt_len=40, varlen=True, seed=3)
    lengths = [b.seq_len for b in it.epoch()]
    assert sum(lengths) == it.pairs_per_stream
    assert all(5 <= n <= 55 for n in lengths[:-1])
    assert min(lengths[:-1]) < 30  # the T/2 branch (probability 0.05) shows up over ~250 draws
    assert len(set(lengths)) > 5


def test_drop_last_keeps_shapes_fixed():
    it = StreamIterator(tokens_of(1000), batch_size=4, tgt_len=16, drop_last=True)
    shapes = {b.inputs.shape for b in it.epoch()}
    assert shapes == {torch.Size([4, 16])} and it.steps_per_epoch == 249 // 16


def test_batch_to_device_keeps_fields():
    b = next(iter(EvalIterator(tokens_of(50), 2, 8, warm_len=3)))
    moved = b.to("cpu")
    assert (
        isinstance(moved, Batch)
        and torch.equal(moved.score_mask, b.score_mask)
        and moved.num_scored == b.num_scored
    )


# ---- EvalIterator -------------------------------------------------------------------------------


def check_eval(tokens: np.ndarray, b: int, t: int, m: int) -> None:
    ev = EvalIterator(tokens, batch_size=b, tgt_len=t, warm_len=m)
    n = len(tokens)
    scored = []
    rows_last_pos = np.full(b, -1)
    first_scored_context = {}
    for batch in ev:
        mask = batch.score_mask.numpy()
        pos = batch.positions.numpy()
        assert batch.inputs.shape == batch.targets.shape == mask.shape == pos.shape
        assert batch.inputs.shape[0] == b and 1 <= batch.seq_len <= t
        np.testing.assert_array_equal(batch.targets.numpy()[mask], tokens[pos[mask]].astype(np.int64))
        np.testing.assert_array_equal(batch.inputs.numpy()[mask], tokens[pos[mask] - 1].astype(np.int64))
        assert (pos[~mask] == -1).all()
        for r in range(b):
            row = pos[r][mask[r]]
            if len(row):
                assert (np.diff(row) == 1).all() and row[0] > rows_last_pos[r]  # corpus order within a row
                if rows_last_pos[r] >= 0:
                    assert row[0] == rows_last_pos[r] + 1  # the row continues its stream
                first_scored_context.setdefault(r, ev.warm[r])
                rows_last_pos[r] = row[-1]
        scored.append(pos[mask])
    allpos = np.concatenate(scored) if scored else np.zeros(0, int)
    np.testing.assert_array_equal(np.sort(allpos), np.arange(1, n))  # every target exactly once
    assert ev.scored_tokens == n - 1
    for r, warm in first_scored_context.items():  # rows after the first get M tokens of warm-up
        assert warm == (0 if r == 0 else min(m, ev.score_start[r] - 1))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 300), b=st.integers(1, 9), t=st.integers(1, 30), m=st.integers(0, 40))
def test_eval_scores_every_target_exactly_once(n, b, t, m):
    check_eval(tokens_of(n, seed=n), b, t, m)


def test_eval_more_streams_than_targets_and_describe():
    check_eval(tokens_of(3), 8, 4, 2)
    ev = EvalIterator(tokens_of(100), 4, 10, warm_len=5)
    assert ev.describe() == {
        "mode": "warm",
        "warm_len": 5,
        "batch_size": 4,
        "tgt_len": 10,
        "scored_tokens": 99,
    }
    assert EvalIterator(tokens_of(100), 4, 10).describe()["mode"] == "reference"
    with pytest.raises(DataError, match="nothing to score"):
        EvalIterator(tokens_of(1), 1, 1)


def test_eval_warm_up_inputs_precede_first_scored_token():
    tokens = np.arange(1000, dtype=np.uint32)
    ev = EvalIterator(tokens, batch_size=4, tgt_len=50, warm_len=30)
    first = next(iter(ev))
    row = 2
    k = int(np.argmax(first.score_mask[row].numpy()))
    assert k == 30
    p = int(first.positions[row, k])
    np.testing.assert_array_equal(first.inputs[row, : k + 1].numpy(), np.arange(p - 31, p))


# ---- ShuffledSentenceIterator --------------------------------------------------------------------


def sentences(seed=0, n=50):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 12, size=n)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.uint64)
    tokens = rng.integers(1, 500, size=int(offsets[-1])).astype(np.uint16)
    tokens[offsets[:-1].astype(int)] = 0  # <S> at each start
    tokens[(offsets[1:] - 1).astype(int)] = 0  # and each end
    return tokens, offsets


def test_shuffled_sentences_eval_mode_scores_each_in_sentence_pair_once():
    tokens, offsets = sentences()
    it = ShuffledSentenceIterator(tokens, offsets, batch_size=3, tgt_len=7, shuffle=False)
    got = []
    for batch in it.epoch():
        mask = batch.score_mask.numpy()
        pos = batch.positions.numpy()
        np.testing.assert_array_equal(batch.targets.numpy()[mask], tokens[pos[mask]])
        got.append(pos[mask])
    got = np.sort(np.concatenate(got))
    starts = set(offsets[:-1].astype(int).tolist())
    expected = [
        i for i in range(1, len(tokens)) if i not in starts
    ]  # a sentence's first token is never a target
    np.testing.assert_array_equal(got, expected)


def test_shuffled_sentences_training_order_seeded_and_resumable():
    tokens, offsets = sentences(1, 200)
    make = lambda seed: ShuffledSentenceIterator(tokens, offsets, batch_size=4, tgt_len=5, seed=seed)  # noqa: E731
    a, b, c = make(0), make(0), make(1)
    first_a = [x.inputs for x in a.epoch()]
    assert all(torch.equal(x, y.inputs) for x, y in zip(first_a, b.epoch()))
    assert not all(torch.equal(x, y.inputs) for x, y in zip(first_a, c.epoch()))
    assert all(x.shape == (4, 5) for x in first_a)  # drop_last in training: full batches only
    it = make(0)
    stream = iter(it)
    for _ in range(len(first_a) + 5):  # into the second epoch
        next(stream)
    state = json.loads(json.dumps(it.state_dict()))
    expected = [next(stream).inputs for _ in range(10)]
    fresh = make(0)
    fresh.load_state_dict(state)
    assert all(torch.equal(x, next(iter(fresh)).inputs) for x in expected)


def test_iterators_validate_their_arguments():
    with pytest.raises(DataError, match="batch_size must be >= 1"):
        StreamIterator(tokens_of(10), 0, 4)
    with pytest.raises(DataError, match="tgt_len must be >= 1"):
        EvalIterator(tokens_of(10), 1, 0)
    with pytest.raises(DataError, match="1-D"):
        StreamIterator(np.zeros((2, 5), dtype=np.uint8), 1, 2)
    with pytest.raises(DataError, match="sentence offsets"):
        ShuffledSentenceIterator(tokens_of(10), np.array([0, 5]), 1, 2)


# ---- memory: a 1e8-token split is never loaded ------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_iterating_a_1e8_token_memmap_does_not_load_it(tmp_path):
    path = tmp_path / "big.npy"
    big = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint16, shape=(100_000_000,))  # sparse file
    big[-5:] = [1, 2, 3, 4, 5]
    big.flush()
    del big
    tokens = np.load(path, mmap_mode="r")  # 200 MB on disk
    before = _rss_bytes()
    train = StreamIterator(tokens, batch_size=16, tgt_len=256, roll=True)
    for _, batch in zip(range(20), train):
        assert batch.inputs.shape == (16, 256)
    ev = EvalIterator(tokens, batch_size=16, tgt_len=256, warm_len=512)
    last = None
    for k, batch in enumerate(ev):
        if k == 5:
            break
        last = batch
    assert last is not None and len(ev) > 24_000
    grown = _rss_bytes() - before
    assert grown < 40 * 2**20, f"RSS grew by {grown / 2**20:.1f} MB"
