"""The encoder-decoder (txl.models.seq2seq): padding invariance, cached = uncached decoding, beam search
against greedy, and the errors a user can cause."""

from __future__ import annotations

import pytest
import torch

from txl import ConfigError, EncoderDecoderConfig, TransformerXLConfig, UsageError
from txl.generate.seq2seq import beam_search, greedy, length_penalty, sample
from txl.models.seq2seq import EncoderDecoder

pytestmark = pytest.mark.usefixtures("one_thread")

BOS, EOS, PAD = 1, 2, 0


def config(**overrides) -> EncoderDecoderConfig:
    base = dict(vocab_size=23, n_layer=2, n_encoder_layer=3, d_model=32, n_head=4,
                d_head=8, d_inner=48, pos_encoding="sinusoidal", dropout=0.0)
    return EncoderDecoderConfig(**{**base, **overrides})


def build(seed=0, **overrides) -> EncoderDecoder:
    torch.manual_seed(seed)
    model = EncoderDecoder(config(**overrides)).eval()
    with torch.no_grad():  # non-trivial biases and LayerNorm shifts, and sharper distributions
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def padded(rows, pad=PAD):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


VARIANTS = [dict(), dict(pre_lnorm=True), dict(pos_encoding="rope"), dict(pos_encoding="learned"),
            dict(share_embeddings=False, source_vocab_size=31, tie_weight=False), dict(backend="reference")]


@pytest.mark.parametrize("overrides", VARIANTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_padded_batch_equals_each_pair_alone(overrides):
    model = build(**overrides)
    torch.manual_seed(1)
    src_vocab = model.config.source_vocab_size or model.config.vocab_size
    sources = [torch.randint(3, src_vocab, (n,)).tolist() for n in (7, 3, 5)]
    targets = [torch.randint(3, 23, (n,)).tolist() for n in (4, 6, 1)]
    src, src_mask = padded(sources)
    dec, _ = padded([[BOS, *t] for t in targets])
    labels, label_mask = padded([[*t, EOS] for t in targets])
    labels = labels.masked_fill(label_mask == 0, -100)
    with torch.no_grad():
        batch_out = model(src, src_mask, dec, labels)
        total_nll = 0.0
        for i, (s, t) in enumerate(zip(sources, targets)):
            alone = model(torch.tensor([s]), None, torch.tensor([[BOS, *t]]), torch.tensor([[*t, EOS]]))
            n_src, n_tgt = len(s), len(t) + 1
            torch.testing.assert_close(batch_out.encoded[i, :n_src], alone.encoded[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(batch_out.logits[i, :n_tgt], alone.logits[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(batch_out.nll[i, :n_tgt], alone.nll[0], atol=1e-5, rtol=0)
            assert (batch_out.nll[i, n_tgt:] == 0).all()
            total_nll += float(alone.nll.sum())
    count = sum(len(t) + 1 for t in targets)
    assert abs(float(batch_out.loss) - total_nll / count) < 1e-5


@pytest.mark.parametrize("overrides", [dict(), dict(pre_lnorm=True), dict(pos_encoding="rope"),
                                       dict(pos_encoding="learned"), dict(backend="reference")],
                         ids=["default", "pre_lnorm", "rope", "learned", "reference"])
def test_cached_decoding_equals_uncached(overrides):
    model = build(**overrides)
    src, mask = padded([[5, 6, 7, 8, 9, 10], [11, 12], [3, 4, 5, 6]])
    cached = greedy(model, src, mask, bos=BOS, eos=EOS, max_len=12, use_cache=True)
    uncached = greedy(model, src, mask, bos=BOS, eos=EOS, max_len=12, use_cache=False)
    assert cached.tokens == uncached.tokens
    assert max(len(t) for t in cached.tokens) >= 4  # the test decodes more than a token or two
    for a, b in zip(cached.scores, uncached.scores):
        assert abs(a - b) < 1e-4
    beams = [beam_search(model, src, mask, bos=BOS, eos=EOS, max_len=12, beam_size=3, use_cache=flag)
             for flag in (True, False)]
    assert beams[0].tokens == beams[1].tokens


@pytest.mark.parametrize("overrides", [dict(), dict(position_options={"merge": "mul"}),
                                       dict(position_options={"merge": "zero"}),
                                       dict(pos_encoding="learned", position_options={"merge": "mul"})],
                         ids=["add", "sinusoidal-mul", "sinusoidal-zero", "learned-mul"])
def test_cached_logits_equal_the_full_pass(overrides):
    """Token by token with the cache = one pass, for every way the absolute positions join the tokens (the
    offset rows are merged as the encoding merges: adding the rows of zeros was right for add only)."""
    model = build(**overrides)
    src, mask = padded([[5, 6, 7, 8], [9, 10]])
    target = torch.tensor([[BOS, 4, 5, 6, 7], [BOS, 8, 9, 10, 11]])
    with torch.no_grad():
        full = model(src, mask, target).logits
        cache = __import__("txl.models.seq2seq.model", fromlist=["DecoderCache"]).DecoderCache.empty(model.config.n_layer)
        encoded = model.encode(src, mask)
        steps = [model(src, mask, target[:, t: t + 1], encoded=encoded, cache=cache).logits for t in range(5)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


def test_beam_size_one_is_greedy():
    model = build(seed=3)
    src, mask = padded([[5, 6, 7, 8, 9], [4, 4, 4], [20, 21, 22, 3]])
    g = greedy(model, src, mask, bos=BOS, eos=EOS, max_len=10)
    b = beam_search(model, src, mask, bos=BOS, eos=EOS, max_len=10, beam_size=1)
    assert (b.tokens, b.scores, b.finished) == (g.tokens, g.scores, g.finished)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_beam_never_scores_below_greedy(alpha):
    better = 0
    for seed in range(6):
        model = build(seed=seed)
        torch.manual_seed(100 + seed)
        src, mask = padded([torch.randint(3, 23, (n,)).tolist() for n in (5, 2, 8, 4)])
        g = greedy(model, src, mask, bos=BOS, eos=EOS, max_len=8)
        for beam_size in (2, 4):
            b = beam_search(model, src, mask, bos=BOS, eos=EOS, max_len=8, beam_size=beam_size, alpha=alpha)
            for tg, sg, fg, tb, sb, fb in zip(g.tokens, g.scores, g.finished, b.tokens, b.scores, b.finished):
                ranked_g = sg / length_penalty(len(tg) + fg, alpha)
                ranked_b = sb / length_penalty(len(tb) + fb, alpha)
                assert ranked_b >= ranked_g - 1e-9
                better += ranked_b > ranked_g + 1e-6
    assert better > 0  # beam search does find better hypotheses than greedy here, not only greedy's


def test_beam_scores_are_the_model_scores():
    """A returned score is the model's log-probability of the returned tokens (teacher-forced)."""
    model = build(seed=2)
    src, mask = padded([[5, 6, 7, 8, 9], [4, 4, 4]])
    out = beam_search(model, src, mask, bos=BOS, eos=EOS, max_len=6, beam_size=3)
    for i, (tokens, score, ended) in enumerate(zip(out.tokens, out.scores, out.finished)):
        n = int(mask[i].sum())
        target = tokens + ([EOS] if ended else [])
        with torch.no_grad():
            res = model(src[i: i + 1, :n], None, torch.tensor([[BOS, *target[:-1]]]), torch.tensor([target]))
        assert abs(-float(res.nll.sum()) - score) < 1e-4


def test_fully_padded_source_row_is_an_error_not_nan():
    model = build()
    src, mask = padded([[5, 6, 7], [9]])
    mask[1] = 0
    dec = torch.tensor([[BOS, 4], [BOS, 5]])
    with pytest.raises(UsageError, match="source row 1 is all padding"):
        model(src, mask, dec)
    with pytest.raises(UsageError, match="all padding"):
        greedy(model, src, mask, bos=BOS, eos=EOS, max_len=3)
    with pytest.raises(UsageError, match="empty"):
        model(torch.zeros(2, 0, dtype=torch.long), None, dec)


def test_bad_inputs_name_the_cause():
    model = build()
    src = torch.tensor([[5, 6, 7]])
    with pytest.raises(UsageError, match="outside the vocabulary"):
        model(torch.tensor([[5, 99]]), None, torch.tensor([[BOS]]))
    with pytest.raises(UsageError, match="decoder_input_ids is required"):
        model(src)
    with pytest.raises(UsageError, match="labels must have the shape"):
        model(src, None, torch.tensor([[BOS, 4]]), torch.tensor([[4]]))
    with pytest.raises(UsageError, match="beam_size"):
        beam_search(model, src, bos=BOS, eos=EOS, max_len=3, beam_size=0)
    with pytest.raises(UsageError, match="temperature"):
        sample(model, src, bos=BOS, eos=EOS, max_len=3, temperature=0)


@pytest.mark.parametrize("overrides, match", [
    (dict(mem_len=16), "mem_len must be 0"),
    (dict(pos_encoding="xl"), "causal distances only"),
    (dict(attention="sliding"), "cannot run the bidirectional encoder"),
    (dict(share_embeddings=True, source_vocab_size=40), "share_embeddings needs one vocabulary"),
    (dict(cutoffs=[10]), "adaptive softmax"),
])
def test_impossible_configs_are_rejected_by_name(overrides, match):
    with pytest.raises(ConfigError, match=match):
        config(**overrides)


def test_decoder_only_rejects_encoder_fields():
    with pytest.raises(ConfigError, match="n_encoder_layer only applies"):
        TransformerXLConfig(n_encoder_layer=2)


def test_shared_and_tied_parameters_and_round_trip(tmp_path):
    shared = build()
    separate = build(share_embeddings=False, source_vocab_size=31, tie_weight=False)
    assert shared.source_embedding is shared.target_embed and shared.head is None
    assert separate.source_embedding is not separate.target_embed and separate.head is not None
    shared.save_pretrained(tmp_path / "m")
    loaded = EncoderDecoder.from_pretrained(tmp_path / "m")
    src, mask = padded([[5, 6, 7], [8]])
    dec = torch.tensor([[BOS, 4], [BOS, 5]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(src, mask, dec).logits, shared(src, mask, dec).logits)
    assert "head_bias" in loaded.state_dict() and "head.weight" not in loaded.state_dict()


def test_training_step_learns_a_copy_task():
    torch.manual_seed(0)
    model = EncoderDecoder(config(n_encoder_layer=1, n_layer=1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):
        src = torch.randint(3, 23, (16, 5))
        dec = torch.cat([torch.full((16, 1), BOS), src], dim=1)
        labels = torch.cat([src, torch.full((16, 1), EOS)], dim=1)
        loss = model(src, None, dec, labels, label_smoothing=0.1).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    src = torch.randint(3, 23, (8, 5))
    out = greedy(model, src, bos=BOS, eos=EOS, max_len=8)
    assert sum(t == s for t, s in zip(out.tokens, src.tolist())) >= 6


def test_bf16_autocast_forward_and_backward():
    model = build()
    model.train()
    src, mask = padded([[5, 6, 7], [8]])
    dec = torch.tensor([[BOS, 4, 5], [BOS, 6, PAD]])
    labels = torch.tensor([[4, 5, EOS], [6, EOS, -100]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(src, mask, dec, labels, label_smoothing=0.1)
    out.loss.backward()
    assert torch.isfinite(out.loss) and out.nll.dtype == torch.float32
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
