"""Padding inside the memory and per-row memory reset (issue 47 items 1-2, `txl.nn.memory.Memory.key_padding`
and `Memory.reset`).

A padded batch run segment by segment with memory gives each sequence the logits it gets run alone
(its real tokens only, in segments of its own lengths, with the same mem_len), within 1e-5, for the two
layouts that keep a row's real tokens one contiguous run: left padding at the start of a sequence (its
first segment) and right padding at its end (its last segment). Lengths 5, 17 and 32 padded to 32, over
three segments. Left padding equals "alone" only where the scores depend on the distance between a query
and a key (relative encodings with a q·k score); the absolute encodings and the feature-map kernels
(performer, linear) equal it for right padding only (docs/guide/data.md, "Padding inside the memory").
A row reset mid-batch gives what a fresh row gives, within 1e-6.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from txl import TransformerXLConfig
from txl.errors import UsageError
from txl.models.transformer_xl.model import TransformerXL
from txl.nn.attention import registry
from txl.nn.memory import Memory

SEG = 32
LENGTHS = (5, 17, 32)


@pytest.fixture(autouse=True)
def _quiet_flex():
    with warnings.catch_warnings():  # flex without torch.compile warns that it is unfused: the CPU tests mean it
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        yield


def build(**overrides) -> TransformerXL:
    base = dict(vocab_size=53, n_layer=2, d_model=32, n_head=4, d_head=8, d_inner=48, mem_len=SEG,
                dropout=0.0, dropatt=0.0)
    impl = overrides.get("attention_impl", "auto")
    base["backend"] = "reference" if impl == "eager" else "auto"  # eager: the plain-PyTorch reference memory too
    torch.manual_seed(0)
    return TransformerXL(TransformerXLConfig(**{**base, **overrides})).eval()


def padded_batch(layout: str, *, seed: int = 1):
    """Three rows holding sequences of 2·SEG + L tokens (L in LENGTHS) over three segments of SEG:
    "left" puts the padding before the sequence (its first segment holds L tokens), "right" after it
    (its last segment holds L tokens). Returns ids, mask (b, 3·SEG) and, per row, (tokens, segment lengths)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(LENGTHS), 3 * SEG, dtype=torch.long)
    mask = torch.zeros_like(ids)
    rows = []
    for r, length in enumerate(LENGTHS):
        n = 2 * SEG + length
        tokens = torch.randint(1, 53, (n,), generator=generator)
        where = slice(3 * SEG - n, None) if layout == "left" else slice(0, n)
        ids[r, where], mask[r, where] = tokens, 1
        rows.append((tokens, [length, SEG, SEG] if layout == "left" else [SEG, SEG, length]))
    return ids, mask, rows


def run_padded(model, ids, mask):
    memory, logits = None, []
    for k in range(3):
        part = slice(k * SEG, (k + 1) * SEG)
        out = model(ids[:, part], memory=memory, attention_mask=mask[:, part])
        memory = out.memory
        logits.append(out.logits)
    return torch.cat(logits, dim=1), memory


def run_alone(model, tokens, lengths):
    memory, logits, start = None, [], 0
    for n in lengths:
        out = model(tokens[None, start : start + n], memory=memory)
        memory, start = out.memory, start + n
        logits.append(out.logits[0])
    return torch.cat(logits)


def assert_each_row_alone(model, layout: str, *, atol: float = 1e-5):
    ids, mask, rows = padded_batch(layout)
    with torch.no_grad():
        padded, memory = run_padded(model, ids, mask)
        for r, (tokens, lengths) in enumerate(rows):
            alone = run_alone(model, tokens, lengths)
            torch.testing.assert_close(padded[r][mask[r].bool()], alone, atol=atol, rtol=0)
    return memory


IMPLS = ["eager", "fast", "sdpa", "flex"]


@pytest.mark.parametrize("layout", ["left", "right"])
@pytest.mark.parametrize("impl", IMPLS)
def test_full_attention_padded_rows_with_memory_equal_each_sequence_alone(impl, layout):
    memory = assert_each_row_alone(build(attention_impl=impl), layout)
    if layout == "right":  # the memory holds the padding after the shorter sequences
        assert memory.key_padding is not None and memory.key_padding.shape == (3, SEG)
    else:  # the left padding has left the memory window: the padding-free path again
        assert memory.key_padding is None


@pytest.mark.parametrize("layout", ["left", "right"])
@pytest.mark.parametrize("pos", ["shaw", "rope", "alibi", "t5", "xpos"])
@pytest.mark.parametrize("impl", ["eager", "fast", "sdpa"])
def test_relative_encodings_padded_with_memory_equal_alone(impl, pos, layout):
    extra = {"position_options": {"max_distance": 6}} if pos == "shaw" else {}
    assert_each_row_alone(build(attention_impl=impl, pos_encoding=pos, **extra), layout)


# the kernels that take a padding mask and run causal with memory (no score term: rope)
PADDING_KERNELS = ["bigbird", "lsh", "routing", "synthesizer", "performer", "linear", "axial", "etc", "image-local"]
DISTANCE_ONLY = {"bigbird", "lsh", "routing", "synthesizer"}  # q·k scores: left padding shifts nothing


@pytest.mark.parametrize("impl", ["eager", "fast"])
@pytest.mark.parametrize("attention", PADDING_KERNELS)
def test_other_kernels_taking_padding_equal_alone(attention, impl):
    model = build(attention=attention, attention_impl=impl, pos_encoding="rope")
    assert_each_row_alone(model, "right")
    if attention in DISTANCE_ONLY:
        assert_each_row_alone(model, "left")


@pytest.mark.parametrize("layout", ["left", "right"])
@pytest.mark.parametrize("options", [dict(universal=True), dict(memory_source="same-layer"),
                                     dict(residual="gru-gate", pre_lnorm=True), dict(n_kv_head=2, qk_norm=True),
                                     dict(memory_tokens=2), dict(same_length=True)],
                         ids=["universal", "same-layer", "gru-gate", "gqa-qk-norm", "memory-tokens", "same-length"])
def test_recurrence_variants_and_block_options_padded_with_memory_equal_alone(options, layout):
    assert_each_row_alone(build(**options), layout)


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_padded_training_gradients_equal_the_sum_over_sequences_alone(backend):
    """With autograd (the fast backend's projection without the memory rows' gradient too): the gradient of
    the padded batch's summed NLL equals the sum of each sequence's own, within 1e-4."""
    impl = "eager" if backend == "reference" else "auto"
    model = build(attention_impl=impl).train()
    ids, mask, rows = padded_batch("left")

    def nll_sum(inputs, memory, **kwargs):
        out = model(inputs[:, :-1], memory=memory, labels=inputs[:, 1:], **kwargs)
        return out.nll.sum(), out.memory

    model.zero_grad()
    memory, total = None, 0
    for k in range(2):  # two segments of SEG + 1 columns (inputs and shifted labels)
        part = slice(k * SEG, (k + 1) * SEG + 1)
        attention = mask[:, part][:, :-1]
        loss, memory = nll_sum(ids[:, part].masked_fill(mask[:, part] == 0, 0), memory, attention_mask=attention)
        loss.backward()
        total += float(loss.detach())
    padded = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    alone_total = 0
    for tokens, lengths in rows:
        memory, start, last = None, 0, 2 * SEG + 1 - (3 * SEG - len(tokens))  # the tokens of the first two segments
        for n in [lengths[0], SEG]:
            stop = min(start + n + 1, last)
            if stop - start < 2:
                break
            loss, memory = nll_sum(tokens[None, start:stop], memory)
            loss.backward()
            alone_total += float(loss.detach())
            start += n
    assert total == pytest.approx(alone_total, rel=1e-5)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(padded[name], p.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pos", ["sinusoidal", "learned"])
def test_absolute_encodings_equal_alone_with_right_padding_only(pos):
    """Absolute positions restart in every segment and count its padding: right padding shifts nothing,
    left padding shifts the first segment's positions (documented, not refused)."""
    model = build(pos_encoding=pos)
    assert_each_row_alone(model, "right")
    with pytest.raises(AssertionError):
        assert_each_row_alone(model, "left")


@pytest.mark.parametrize("attention", ["sliding", "sparse"])
def test_kernels_without_padding_refuse_in_one_line(attention):
    model = build(attention=attention)
    ids, mask, _ = padded_batch("left")
    with pytest.raises(UsageError, match=f"attention='{attention}' does not take a padding mask") as caught:
        model(ids[:, :SEG], attention_mask=mask[:, :SEG])
    assert "\n" not in str(caught.value)


def test_padding_between_real_tokens_is_refused_and_reset_allows_a_new_sequence():
    model = build()
    ids = torch.randint(1, 53, (2, SEG))
    mask = torch.ones_like(ids)
    mask[0, 20:] = 0  # row 0's sequence ends inside the first segment
    with torch.no_grad():
        memory = model(ids, attention_mask=mask).memory
        with pytest.raises(UsageError, match=r"row\(s\) \[0\] have padding between real tokens") as caught:
            model(ids, memory=memory)
        assert "\n" not in str(caught.value)
        gap = torch.ones_like(ids)
        gap[1, 3:5] = 0
        with pytest.raises(UsageError, match="padding between real tokens"):
            model(ids, attention_mask=gap)  # inside one segment, with mem_len > 0
        out = model(ids, memory=memory.reset([0]))  # row 0 starts a new sequence: allowed
        fresh = model(ids[:1])
        torch.testing.assert_close(out.logits[0], fresh.logits[0], atol=1e-6, rtol=0)
        # without memory (mem_len=0) any mask is taken, as before
        model(ids, attention_mask=gap, mem_len=0)


def test_compressive_memory_refuses_padding():
    model = build(cmem_len=4, cmem_ratio=2)
    ids = torch.randint(1, 53, (2, 8))
    with pytest.raises(UsageError, match="compressive memory"):
        model(ids, attention_mask=torch.ones_like(ids))


def test_padded_labels_are_not_scored_and_all_real_memory_drops_its_mask():
    model = build()
    ids = torch.randint(1, 53, (2, SEG))
    mask = torch.ones_like(ids)
    mask[0, :10] = 0
    with torch.no_grad():
        out = model(ids, labels=ids, attention_mask=mask)
        assert (out.nll[0, :10] == 0).all() and out.memory.key_padding is not None
        # once the padding has left the memory window, the memory is all real again: the padding-free path
        later = model(ids, memory=out.memory)
        assert later.memory.key_padding is None
    assert build()(ids, labels=ids).memory.key_padding is None  # no mask, no padding: the code as before


# ---------------------------------------------------------------------------------------------
# Per-row reset


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_a_row_reset_mid_batch_gives_what_a_fresh_row_gives(backend):
    torch.manual_seed(0)
    model = TransformerXL(TransformerXLConfig(vocab_size=53, n_layer=2, d_model=32, n_head=4, d_head=8, d_inner=48,
                                              mem_len=12, dropout=0.0, dropatt=0.0, backend=backend)).eval()
    ids = torch.randint(1, 53, (3, 30))
    with torch.no_grad():
        memory = model(ids[:, :10]).memory
        memory = model(ids[:, 10:20], memory=memory).memory
        kept = model(ids[:, 20:], memory=memory)
        reset = memory.reset(torch.tensor([False, True, False]))
        out = model(ids[:, 20:], memory=reset)
        fresh = model(ids[1:2, 20:])  # the same tokens as a new row (memory=None)
        torch.testing.assert_close(out.logits[1], fresh.logits[0], atol=1e-6, rtol=0)
        for r in (0, 2):  # the other rows are untouched
            torch.testing.assert_close(out.logits[r], kept.logits[r], atol=1e-6, rtol=0)
        # and the next segment too: the reset row's memory holds only what it saw since
        after = model(ids[:, :10], memory=out.memory)
        fresh_after = model(ids[1:2, :10], memory=fresh.memory)
        torch.testing.assert_close(after.logits[1], fresh_after.logits[0], atol=1e-6, rtol=0)
        # token by token (the fast backend's projection cache): the same
        step_memory = reset
        for t in range(20, 23):
            step = model(ids[:, t : t + 1], memory=step_memory)
            step_memory = step.memory
        torch.testing.assert_close(step.logits[1, 0], fresh.logits[0, 2], atol=1e-6, rtol=0)


def test_reset_takes_indices_or_a_mask_and_refuses_bad_rows():
    memory = Memory.zeros(2, 3, 4, 8).reset([])
    assert memory.key_padding is None  # nothing reset: the same memory
    hidden = tuple(torch.randn(3, 4, 8) for _ in range(2))
    reset = Memory(hidden).reset(2)
    assert reset.key_padding[2].eq(False).all() and reset.key_padding[:2].all()
    assert reset.hidden[0][2].eq(0).all() and torch.equal(reset.hidden[0][:2], hidden[0][:2])
    with pytest.raises(UsageError, match="outside the batch"):
        Memory(hidden).reset([3])
    with pytest.raises(UsageError, match="bool mask"):
        Memory(hidden).reset(torch.tensor([True, False]))
    with pytest.raises(UsageError, match="compressive memory"):
        Memory(hidden, compressed=hidden).reset([0])


def test_padding_mask_survives_select_cat_truncate_and_state_dict():
    hidden = tuple(torch.randn(3, 4, 8) for _ in range(2))
    memory = Memory(hidden).reset([1])
    parts = [memory.select(0), memory.select(slice(1, 3))]
    assert torch.equal(Memory.cat(parts).key_padding, memory.key_padding)
    assert torch.equal(Memory.cat([Memory(hidden).select(0), parts[1]]).key_padding, memory.key_padding)
    assert memory.truncate(2).key_padding.shape == (3, 2)
    back = Memory.from_state_dict(memory.state_dict())
    assert torch.equal(back.key_padding, memory.key_padding)
    assert "memory_padding" not in Memory(hidden).state_dict()  # a memory without padding saves as before


def test_refusal_list_matches_the_registry():
    """The kernels this file runs with padding and memory, and the ones it expects to refuse, cover every
    causal kernel that has a padding answer (a new kernel must be added to one list)."""
    registry.load_builtin_kernels()
    causal = {name for name, spec in registry.SPECS.items() if spec.causal}
    assert causal == {"full", *PADDING_KERNELS, "sliding", "sparse", "sinkhorn", "compressed"}


# ---------------------------------------------------------------------------------------------
# Generation: left-padded prompts and row reset (txl.generate.decoder)


@pytest.mark.parametrize("mem_len", [16, 0])
def test_left_padded_prompts_generate_what_each_prompt_generates_alone(mem_len):
    from txl.generate.decoder import sample

    model = build(mem_len=16)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 53, (n,), generator=generator) for n in (3, 9, 20)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :], mask[r, width - len(p) :] = p, 1
    batched = sample(model, ids, attention_mask=mask, max_new_tokens=6, temperature=0.0, mem_len=mem_len,
                     segment_len=8)
    for r, p in enumerate(prompts):
        alone = sample(model, p[None], max_new_tokens=6, temperature=0.0, mem_len=mem_len, segment_len=8)
        assert batched.ids[r] == alone.ids[0]
        assert batched.logprobs[r] == pytest.approx(alone.logprobs[0], abs=1e-5)
    with pytest.raises(UsageError, match="pad prompts on the left"):
        sample(model, ids, attention_mask=mask.flip(1), max_new_tokens=1, mem_len=mem_len)


@pytest.mark.parametrize("mem_len", [16, 0])
def test_decoder_reset_swaps_a_finished_row_for_a_fresh_one(mem_len):
    from txl.generate.decoder import Decoder

    model = build(mem_len=16)
    ids = torch.randint(1, 53, (3, 12))
    more = torch.randint(1, 53, (3, 5))
    with torch.no_grad():
        kept = Decoder(model, mem_len=mem_len, segment_len=8)
        kept.feed(ids)
        kept_logits = kept.feed(more).clone()
        decoder = Decoder(model, mem_len=mem_len, segment_len=8)
        decoder.feed(ids)
        decoder.reset([1])
        logits = decoder.feed(more)
        fresh = Decoder(model, mem_len=mem_len, segment_len=8).feed(more[1:2])
        torch.testing.assert_close(logits[1], fresh[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(logits[[0, 2]], kept_logits[[0, 2]], atol=1e-6, rtol=0)
        step = decoder.step(torch.tensor([4, 5, 6]))  # and token by token after it
        fresh_decoder = Decoder(model, mem_len=mem_len, segment_len=8)
        fresh_decoder.feed(more[1:2])
        torch.testing.assert_close(step[1], fresh_decoder.step(torch.tensor([5]))[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("mem_len", [16, 0])
def test_a_serve_session_restart_reads_its_next_prompt_as_a_fresh_session(mem_len):
    from types import SimpleNamespace

    from txl.serve.engine import Decoder as SessionDecoder
    from txl.serve.engine import ServedRun

    run = ServedRun(name="t", ckpt=SimpleNamespace(model=build(mem_len=16)), card={}, tgt_len=16, window=16,
                    eval_mem_len=16)
    session = SessionDecoder(run, mem_len=mem_len, window=16)
    session.feed(list(range(1, 30)))
    session.restart()
    session.feed([5, 6, 7])
    fresh = SessionDecoder(run, mem_len=mem_len, window=16)
    fresh.feed([5, 6, 7])
    torch.testing.assert_close(session.logits, fresh.logits, atol=1e-6, rtol=0)
    assert session.length == 3 and session.tail == [5, 6, 7]
