"""The RNN encoder-decoder with attention (txl.models.rnn_seq2seq, arch = "rnn-seq2seq"): the alignment
functions and both step orders against a hand-written reference of the formulas (Luong et al. 2015, Bahdanau
et al. 2015), padding invariance, cached = uncached decoding, beam search against greedy, the parameter count,
the errors a user can cause, and `txl train` / `txl eval` / `txl generate` on a pair corpus."""

from __future__ import annotations

import json

import pytest
import torch

from txl import ConfigError, UsageError
from txl.generate.seq2seq import beam_search, greedy, length_penalty, sample
from txl.models.registry import build_model, config_from_dict, is_seq2seq, load_model
from txl.models.rnn_seq2seq import RNNEncoderDecoder, RNNSeq2SeqConfig
from txl.models.rnn_seq2seq.model import RNNDecoderCache

pytestmark = pytest.mark.usefixtures("one_thread")

BOS, EOS, PAD = 1, 2, 0
ALIGNMENTS = ["dot", "general", "additive"]
FLOWS = ["luong", "bahdanau"]


def config(**overrides) -> RNNSeq2SeqConfig:
    base = dict(vocab_size=23, n_layer=2, n_encoder_layer=2, d_model=12, d_hidden=16, dropout=0.0)
    return RNNSeq2SeqConfig(**{**base, **overrides})


def build(seed=0, **overrides) -> RNNEncoderDecoder:
    torch.manual_seed(seed)
    model = RNNEncoderDecoder(config(**overrides)).eval()
    with torch.no_grad():  # sharper distributions than the ±0.1 init gives
        for p in model.parameters():
            p.mul_(4.0)
    return model


def padded(rows, pad=PAD):
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


VARIANTS = [dict(alignment=a, decoder_flow=f) for f in FLOWS for a in ALIGNMENTS] + [
    dict(cell="gru"), dict(cell="gru", decoder_flow="bahdanau", alignment="additive"), dict(bidirectional=False),
    dict(n_layer=1, n_encoder_layer=3), dict(share_embeddings=False, source_vocab_size=31, tie_weight=False)]


def variant_id(overrides: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in overrides.items()) or "default"


# -- the formulas --------------------------------------------------------------------------------------
def reference_logits(model: RNNEncoderDecoder, source: list[int], target: list[int]) -> torch.Tensor:
    """One pair, no padding, one decoder layer: the published equations written out step by step with the
    model's weights (an LSTM cell by its gate equations, the scores by their formulas, one source position at
    a time)."""
    cfg = model.config
    assert cfg.n_layer == 1 and cfg.cell == "lstm" and cfg.bidirectional
    enc = model.encode(torch.tensor([source]))[0]  # (s, H): the encoder is torch's own LSTM
    half = cfg.d_hidden // 2
    summary = torch.cat([enc[-1, :half], enc[0, half:]])  # forward state at the end, backward at the start
    h = torch.tanh(model.bridge_h.weight @ summary + model.bridge_h.bias)
    c = model.bridge_c.weight @ summary + model.bridge_c.bias
    rnn = model.decoder
    w_ih, w_hh, b = rnn.weight_ih_l0, rnn.weight_hh_l0, rnn.bias_ih_l0 + rnn.bias_hh_l0
    align = model.alignment

    def lstm_cell(x, h, c):
        i, f, g, o = (w_ih @ x + w_hh @ h + b).chunk(4)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c

    def score(query, s):
        if cfg.alignment == "dot":
            return query @ s
        if cfg.alignment == "general":
            return query @ (align.w_a.weight @ s)
        return align.v.weight[0] @ torch.tanh(align.w_q.weight @ query + align.w_q.bias + align.w_k.weight @ s)

    def context(query):
        scores = torch.stack([score(query, enc[j]) for j in range(len(source))])
        weights = torch.exp(scores - scores.max()) / torch.exp(scores - scores.max()).sum()
        return (weights[:, None] * enc).sum(0)

    feed = torch.zeros(cfg.d_model)
    rows = []
    for token in target:
        y = model.target_embed.weight[token]
        if cfg.decoder_flow == "luong":  # h_t = LSTM([y; h~_{t-1}]), c_t from h_t, h~_t = tanh(W_c [c_t; h_t])
            h, c = lstm_cell(torch.cat([y, feed]), h, c)
            ctx = context(h)
            feed = torch.tanh(model.combine.weight @ torch.cat([ctx, h]) + model.combine.bias)
        else:  # c_t from h_{t-1}, h_t = LSTM([y; c_t]), h~_t = tanh(W_c [c_t; h_t; y])
            ctx = context(h)
            h, c = lstm_cell(torch.cat([y, ctx]), h, c)
            feed = torch.tanh(model.combine.weight @ torch.cat([ctx, h, y]) + model.combine.bias)
        rows.append(model.target_embed.weight @ feed + model.head_bias)
    return torch.stack(rows)


@pytest.mark.parametrize("flow", FLOWS)
@pytest.mark.parametrize("alignment", ALIGNMENTS)
def test_logits_equal_the_written_out_equations(alignment, flow):
    model = build(n_layer=1, alignment=alignment, decoder_flow=flow)
    source, target = [5, 6, 7, 8, 9], [BOS, 4, 10, 11]
    with torch.no_grad():
        logits = model(torch.tensor([source]), None, torch.tensor([target])).logits[0]
        expected = reference_logits(model, source, target)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("alignment", ALIGNMENTS)
def test_attention_weights_are_a_distribution_over_real_tokens(alignment):
    model = build(alignment=alignment)
    src, mask = padded([[5, 6, 7, 8], [9, 10]])
    weights = model.attention_weights(src, torch.tensor([[BOS, 4, 5], [BOS, 6, 7]]), mask)
    assert weights.shape == (2, 3, 4)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3), atol=1e-6, rtol=0)
    assert (weights[1, :, 2:] == 0).all() and (weights[1, :, :2] > 0).all()


# -- padding, caching, decoding --------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", VARIANTS, ids=variant_id)
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


@pytest.mark.parametrize("overrides", [dict(), dict(decoder_flow="bahdanau", alignment="additive"), dict(cell="gru")],
                         ids=variant_id)
def test_cached_logits_equal_the_full_pass(overrides):
    model = build(**overrides)
    src, mask = padded([[5, 6, 7, 8], [9, 10]])
    target = torch.tensor([[BOS, 4, 5, 6, 7], [BOS, 8, 9, 10, 11]])
    with torch.no_grad():
        full = model(src, mask, target).logits
        cache, encoded = model.new_cache(), model.encode(src, mask)
        steps = [model(src, mask, target[:, t: t + 1], encoded=encoded, cache=cache).logits for t in range(5)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    assert cache.length == 5


@pytest.mark.parametrize("overrides", [dict(), dict(decoder_flow="bahdanau", alignment="dot"), dict(cell="gru")],
                         ids=variant_id)
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


def test_cache_select_and_reorder_pick_rows():
    model = build()
    src, mask = padded([[5, 6, 7], [8, 9], [10]])
    cache = model.new_cache()
    with torch.no_grad():
        model(src, mask, torch.tensor([[BOS, 4]] * 3), cache=cache)
    index = torch.tensor([2, 0])
    picked = cache.select(index)
    assert isinstance(picked, RNNDecoderCache) and picked.length == 2 and cache.feed.shape[0] == 3
    torch.testing.assert_close(picked.state[0], cache.state[0][:, index])
    torch.testing.assert_close(picked.keys, cache.keys[index])
    cache.reorder(index)
    torch.testing.assert_close(cache.feed, picked.feed)


def test_beam_size_one_is_greedy():
    model = build(seed=3)
    src, mask = padded([[5, 6, 7, 8, 9], [4, 4, 4], [20, 21, 22, 3]])
    g = greedy(model, src, mask, bos=BOS, eos=EOS, max_len=10)
    b = beam_search(model, src, mask, bos=BOS, eos=EOS, max_len=10, beam_size=1)
    assert (b.tokens, b.scores, b.finished) == (g.tokens, g.scores, g.finished)


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_beam_never_scores_below_greedy_and_scores_are_the_model_scores(alpha):
    better = 0
    for seed in range(4):
        model = build(seed=seed, alignment=ALIGNMENTS[seed % 3])
        torch.manual_seed(100 + seed)
        src, mask = padded([torch.randint(3, 23, (n,)).tolist() for n in (5, 2, 8, 4)])
        g = greedy(model, src, mask, bos=BOS, eos=EOS, max_len=8)
        b = beam_search(model, src, mask, bos=BOS, eos=EOS, max_len=8, beam_size=4, alpha=alpha)
        for i, (tg, sg, fg, tb, sb, fb) in enumerate(zip(g.tokens, g.scores, g.finished, b.tokens, b.scores,
                                                         b.finished)):
            assert sb / length_penalty(len(tb) + fb, alpha) >= sg / length_penalty(len(tg) + fg, alpha) - 1e-9
            better += sb / length_penalty(len(tb) + fb, alpha) > sg / length_penalty(len(tg) + fg, alpha) + 1e-6
            target = tb + ([EOS] if fb else [])
            n = int(mask[i].sum())
            with torch.no_grad():  # the returned score is the teacher-forced log-probability of the tokens
                res = model(src[i: i + 1, :n], None, torch.tensor([[BOS, *target[:-1]]]), torch.tensor([target]))
            assert abs(-float(res.nll.sum()) - sb) < 1e-4
    assert better > 0  # beam search finds better hypotheses than greedy here


def test_sampling_is_reproducible_with_a_generator():
    model = build()
    src, mask = padded([[5, 6, 7], [8]])
    runs = [sample(model, src, mask, bos=BOS, eos=EOS, max_len=6, temperature=1.0,
                   generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens


# -- config, parameters, errors --------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", VARIANTS, ids=variant_id)
def test_parameter_estimate_is_exact(overrides):
    model = build(**overrides)
    assert model.config.num_parameters_estimate() == model.num_parameters(exclude_embeddings=True)


@pytest.mark.parametrize("overrides, match", [
    (dict(d_hidden=15), "d_hidden must be even with bidirectional"),
    (dict(alignment="cosine"), "alignment"),
    (dict(decoder_flow="gnmt"), "decoder_flow"),
    (dict(cell="rnn"), "cell"),
    (dict(dropout=1.0), "dropout must be in"),
    (dict(init_range=0.0), "init_range must be > 0"),
    (dict(n_layer=0), "n_layer must be >= 1"),
    (dict(share_embeddings=True, source_vocab_size=40), "share_embeddings needs one vocabulary"),
    (dict(n_head=4), "n_head only applies to arch='decoder'"),
    (dict(mem_len=16), "mem_len only applies to"),
    (dict(attention="sliding"), "attention only applies to"),
])
def test_impossible_configs_are_rejected_by_name(overrides, match):
    with pytest.raises(ConfigError, match=match):
        config(**overrides)


def test_registry_builds_it_and_a_checkpoint_round_trips(tmp_path):
    cfg = config_from_dict({"arch": "rnn-seq2seq", "vocab_size": 23, "n_layer": 1, "d_model": 8, "d_hidden": 8})
    assert isinstance(cfg, RNNSeq2SeqConfig) and is_seq2seq(cfg) and is_seq2seq("encoder-decoder")
    assert not is_seq2seq("lstm")
    model = build_model(cfg).eval()
    model.save_pretrained(tmp_path / "m")
    loaded = RNNEncoderDecoder.from_pretrained(tmp_path / "m")
    assert isinstance(load_model(tmp_path / "m"), RNNEncoderDecoder) and loaded.config == cfg
    src, mask = padded([[5, 6, 7], [8]])
    dec = torch.tensor([[BOS, 4], [BOS, 5]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(src, mask, dec).logits, model(src, mask, dec).logits)
    assert "head_bias" in loaded.state_dict() and "head.weight" not in loaded.state_dict()


def test_bad_inputs_name_the_cause():
    model = build()
    src = torch.tensor([[5, 6, 7]])
    with pytest.raises(UsageError, match="outside the vocabulary"):
        model(torch.tensor([[5, 99]]), None, torch.tensor([[BOS]]))
    with pytest.raises(UsageError, match="decoder_input_ids is required"):
        model(src)
    with pytest.raises(UsageError, match="labels must have the shape"):
        model(src, None, torch.tensor([[BOS, 4]]), torch.tensor([[4]]))
    with pytest.raises(UsageError, match="source row 1 is all padding"):
        model(torch.tensor([[5, 6], [7, 8]]), torch.tensor([[1, 1], [0, 0]]), torch.tensor([[BOS], [BOS]]))
    with pytest.raises(UsageError, match="right padding"):
        model(torch.tensor([[5, 6], [7, 8]]), torch.tensor([[1, 1], [0, 1]]), torch.tensor([[BOS], [BOS]]))
    with pytest.raises(UsageError, match="empty"):
        model(torch.zeros(1, 0, dtype=torch.long), None, torch.tensor([[BOS]]))
    with pytest.raises(UsageError, match="beam_size"):
        beam_search(model, src, bos=BOS, eos=EOS, max_len=3, beam_size=0)


# -- training ---------------------------------------------------------------------------------------------
def test_training_learns_a_copy_task():
    torch.manual_seed(0)
    model = RNNEncoderDecoder(config(n_layer=1, n_encoder_layer=1, d_model=24, d_hidden=32, alignment="dot"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(200):
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


SMALL = ["--set", "model.n_layer=1", "--set", "model.n_encoder_layer=1", "--set", "model.d_model=16",
         "--set", "model.d_hidden=16", "--set", "batch_size=16", "--set", "eval_batch_size=50",
         "--set", "log_interval=1", "--set", "max_minutes=0", "--set", "warmup_steps=1", "--set", "beam_size=2",
         "--quiet"]


def test_txl_train_eval_generate_three_steps(tmp_path, capsys):
    """The same commands as the Transformer encoder-decoder: three training steps on a pair corpus, the final
    greedy and beam decodings, `txl eval` (teacher-forced and decoded) and `txl generate --input`."""
    from txl.cli.main import main

    run = tmp_path / "run"
    assert main(["train", "--preset", "seq2seq-reverse-rnn", "--data", "reverse?size=100&max_len=6", "--out",
                 str(run), *SMALL, "--set", "max_steps=3", "--set", "eval_interval=3",
                 "--set", "final_max_tokens=40"]) == 0
    result = json.loads((run / "result.json").read_text())
    assert result["steps"] == 3 and result["parameters"] == build_model(
        load_model(run).config).num_parameters()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r and r.get("step")]
    assert len(losses) >= 3 and all(v == v and v < 10 for v in losses)  # finite training losses, every step
    decoded = result["final"]["test"]["decoded"]
    assert [d["method"] for d in decoded] == ["greedy", "beam2"]
    capsys.readouterr()
    assert main(["eval", str(run), "--split", "test", "--max-pairs", "10", "--beam-size", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pairs"] == 10 and 0 <= report["token_accuracy"] <= 1 and len(report["decoded"]) == 2
    (tmp_path / "in.txt").write_text("abc\n\nxyz\n")
    assert main(["generate", str(run), "--input", str(tmp_path / "in.txt"), "--max-new-tokens", "8"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    assert main(["generate", str(run), "--prompt", "abc"]) != 0
    assert "--input FILE" in capsys.readouterr().err


def test_train_refuses_a_text_corpus_for_it(tmp_path, capsys):
    from txl.cli.main import main

    assert main(["train", "--preset", "seq2seq-reverse-rnn", "--data", "builtin", "--out", str(tmp_path / "x"),
                 "--quiet"]) != 0
    err = capsys.readouterr().err
    assert "model.arch='rnn-seq2seq' trains on a pair corpus" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_the_comparison_study_end_to_end(tmp_path):
    """experiments/rnn_vs_transformer.py on a 2-step budget: both models on reverse, the alignment ablation,
    the tables and JSON written, finished runs reused (numbers are never asserted: results live in docs/)."""
    import studies

    study = studies.load("rnn_vs_transformer")
    argv = ["--tasks", "reverse", "--seeds", "1", "--ablation-seeds", "1", "--runs", str(tmp_path / "runs"),
            "--out", str(tmp_path / "docs")]
    for s in ("train.data=reverse?size=60&max_len=5", "train.max_steps=2", "train.eval_interval=2",
              "train.final_max_tokens=20", "train.warmup_steps=0", "model.n_layer=1", "model.n_encoder_layer=1"):
        argv += ["--set", s]
    assert study.main(argv) == 0
    report = json.loads((tmp_path / "docs" / "rnn_vs_transformer.json").read_text())
    assert {(r["model"], r["steps"]) for r in report["runs"]} == {("transformer", 2), ("rnn", 2)}
    assert len(report["alignment_ablation"]) == 6
    assert {(r["alignment"], r["decoder_flow"]) for r in report["alignment_ablation"]} == set(study.ABLATION)
    assert all(r["load_before"] != "not recorded" for r in report["runs"])
    text = (tmp_path / "docs" / "rnn_vs_transformer.md").read_text()
    assert "| reverse | RNN encoder-decoder + attention |" in text and "| additive | bahdanau |" in text
    trained = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(trained) == 7  # general + luong is the preset's own run, trained once
    mtimes = {p: (p / "result.json").stat().st_mtime for p in (tmp_path / "runs").iterdir()}
    assert study.main(argv) == 0  # everything reused
    assert mtimes == {p: (p / "result.json").stat().st_mtime for p in (tmp_path / "runs").iterdir()}
    assert study.main(["--seeds", "1", "1"]) == 2


def test_resume_is_exact(tmp_path):
    """Training 4 steps in one go or 2 + 2 with --resume gives the same weights (the trainer's exact resume
    holds for the RNN encoder-decoder: no memory to carry, the RNG and optimiser state restored)."""
    from safetensors.torch import load_file

    from txl.cli.main import main

    common = ["--data", "reverse?size=100&max_len=6", *SMALL, "--set", "eval_interval=2", "--set", "final_splits=[]",
              "--set", "model.dropout=0.1", "--set", "schedule=inv_sqrt"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main(["train", "--preset", "seq2seq-reverse-rnn", "--out", str(straight), *common,
                 "--set", "max_steps=4"]) == 0
    assert main(["train", "--preset", "seq2seq-reverse-rnn", "--out", str(split), *common,
                 "--set", "max_steps=2"]) == 0
    assert main(["train", "--resume", str(split), "--max-steps", "4", "--quiet"]) == 0
    a, b = (load_file(run / "last" / "model.safetensors") for run in (straight, split))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
