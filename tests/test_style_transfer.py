"""The Style Transformer (Dai et al. 2019; issue 48 item 6): the two-style corpus, the model's invariances
(soft decoding of one-hot distributions = hard decoding; cached decoding = teacher forcing; padding changes
nothing), the discriminators, the training schedule and which network each step updates, and the commands
(`txl train --preset style-transfer --data style:A,B`, `txl generate --style S`, `txl eval`)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from txl.data.style import BOS_ID, EOS_ID, PAD_ID, StyleBatches, open_style_corpus, tokenize
from txl.errors import ConfigError, DataError, UsageError
from txl.models.registry import build_model, config_from_dict, load_model
from txl.models.style.config import StyleTransformerConfig

A_LINES = ["To be, or not to be: that is the question.", "Whether 'tis nobler in the mind to suffer",
           "The slings and arrows of outrageous fortune,", "Or to take arms against a sea of troubles,",
           "And by opposing end them? To die: to sleep;", "No more; and by a sleep to say we end",
           "Hamlet:", "The heart-ache and the thousand natural shocks"] * 8
B_LINES = [" the company said it expects to report a loss of $ N million ",
           " mr. <unk> is chairman of <unk> n.v. the dutch publishing group ",
           " shares closed at N cents down N cents in new york stock exchange trading ",
           " the bank does n't plan to raise its dividend this year analysts said ",
           " a spokesman declined to comment on the <unk> "] * 8


@pytest.fixture
def styles(tmp_path):
    a, b = tmp_path / "verse.txt", tmp_path / "news.txt"
    a.write_text("\n".join(line if line.endswith(":") else f"{line} {i}" for i, line in enumerate(A_LINES)) + "\n")
    b.write_text("\n".join(f"{line} {i}" for i, line in enumerate(B_LINES)) + "\n")
    return f"style:{a},{b}?min_len=3&max_len=16"


def tiny(**overrides) -> StyleTransformerConfig:
    base = dict(arch="style-transformer", vocab_size=40, n_layer=2, n_encoder_layer=1, n_discriminator_layer=1,
                d_model=16, n_head=2, d_head=8, d_inner=32, max_length=7)
    return config_from_dict({**base, **overrides})


def sentences(batch=3, length=6, vocab=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, vocab, (batch, length), generator=g)
    lengths = torch.tensor([length, length - 2, length - 3][:batch])
    tokens[torch.arange(batch), lengths - 1] = EOS_ID
    tokens[torch.arange(length)[None] >= lengths[:, None]] = PAD_ID
    return tokens, lengths


# -- the corpus ----------------------------------------------------------------------------------------
def test_tokenize_reads_words_punctuation_and_unk():
    assert tokenize("Whether 'Tis nobler, <unk> don't!") == ["whether", "'", "tis", "nobler", ",", "<unk>", "don't", "!"]


def test_the_corpus_has_both_styles_every_split_and_the_specials_first(styles):
    corpus = open_style_corpus(styles)
    assert corpus.styles == ("verse", "news")
    assert corpus.vocab.symbols[:4] == ("<pad>", "<s>", "<eos>", "<unk>")
    assert (PAD_ID, BOS_ID, EOS_ID, corpus.vocab.unk_id) == (0, 1, 2, 3)
    train = corpus.sentences("train", 0)
    assert all(ids[-1] == EOS_ID and EOS_ID not in ids[:-1] for ids in train)
    texts = [t for style in corpus.texts.values() for per in style for t in per]
    assert "hamlet :" not in texts  # 2 tokens < min_len
    assert all(3 <= len(t.split()) <= 16 for t in texts)
    total = sum(len(corpus.texts[s][0]) for s in ("train", "valid", "test"))
    assert total == len(A_LINES) - 8  # every kept line in exactly one split
    assert corpus.vocab.stoi["<unk>"] == 3 and "n't" in corpus.vocab.stoi


def test_batches_are_half_each_style_and_resume_exactly(styles):
    corpus = open_style_corpus(styles)
    first = StyleBatches(corpus, batch_size=4, seed=3)
    it = iter(first)
    seen = [next(it) for _ in range(30)]  # several epochs of the smaller style
    assert all(b.styles.tolist() == [0, 0, 1, 1] for b in seen)
    assert [b.index for b in seen] == list(range(30))
    saver = StyleBatches(corpus, batch_size=4, seed=3)
    it = iter(saver)
    for _ in range(12):
        next(it)
    resumed = StyleBatches(corpus, batch_size=4, seed=3)
    resumed.load_state_dict(json.loads(json.dumps(saver.state_dict())))
    it = iter(resumed)
    assert all(torch.equal(a.tokens, next(it).tokens) for a in seen[12:20])
    with pytest.raises(DataError, match="batch_size"):
        StyleBatches(corpus, batch_size=6, seed=3).load_state_dict(saver.state_dict())
    with pytest.raises(DataError, match="multiple of the 2 styles"):
        StyleBatches(corpus, batch_size=5, seed=3)


@pytest.mark.parametrize("spec, match", [
    ("style:{a}", "at least two styles"),
    ("style:{a},{b}?names=x", "one non-empty name per file"),
    ("style:{a},{b}?names=x,x", "repeat"),
    ("style:{a},{b}?min_len=9&max_len=4", "min_len=9 is above max_len=4"),
    ("style:{a},{b}?min_len=10&max_len=12", "no training sentence"),
    ("style:{a},{b}?tokenizer=chars", "has no option 'tokenizer'"),
])
def test_bad_specs_are_one_data_error(tmp_path, spec, match):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("one two three four five\n" * 30)
    b.write_text("six seven eight nine ten\n" * 30)
    with pytest.raises(DataError, match=match):
        open_style_corpus(spec.format(a=a, b=b))


# -- the model -----------------------------------------------------------------------------------------
def test_soft_one_hot_inputs_give_the_hard_inputs_logits():
    """The expected embedding of a one-hot distribution is the token's own row: encoder, decoder and
    discriminator read soft sentences exactly as ids (what makes the cycle loss differentiable)."""
    torch.manual_seed(0)
    model = build_model(tiny()).eval()
    tokens, lengths = sentences()
    styles = torch.tensor([0, 1, 0])
    one_hot = F.one_hot(tokens, 40).float()
    hard = model.reconstruct(tokens, lengths, styles, tokens)
    soft = model.reconstruct(one_hot, lengths, styles, tokens)
    torch.testing.assert_close(soft, hard, atol=1e-5, rtol=0)
    d = model.discriminator
    torch.testing.assert_close(d(one_hot, lengths), d(tokens, lengths), atol=1e-5, rtol=0)


def test_cached_decoding_equals_teacher_forcing_and_soft_one_hot_steps():
    """decode_free (one token per step through the cache) scores each step as the teacher-forced pass over
    its own outputs; soft decoding at a temperature near 0 (one-hot steps) writes the same sentence."""
    torch.manual_seed(1)
    model = build_model(tiny()).eval()
    tokens, lengths = sentences()
    styles = torch.tensor([1, 0, 1])
    free = model.decode_free(tokens, lengths, styles, soft=False)  # (b, L, V)
    written = free.argmax(-1)
    forced = model.reconstruct(tokens, lengths, styles, written)
    torch.testing.assert_close(free, forced, atol=1e-5, rtol=0)
    cold = model.decode_free(tokens, lengths, styles, soft=True, temperature=1e-4)
    assert torch.equal(cold.argmax(-1), written)


def test_padding_changes_nothing_and_the_style_is_read():
    torch.manual_seed(2)
    model = build_model(tiny()).eval()
    tokens, lengths = sentences()
    styles = torch.tensor([0, 1, 1])
    batch = model.reconstruct(tokens, lengths, styles, tokens)
    for row in range(3):
        n = int(lengths[row])
        alone = model.reconstruct(tokens[row: row + 1, :n], lengths[row: row + 1], styles[row: row + 1],
                                  tokens[row: row + 1, :n])
        torch.testing.assert_close(alone[0], batch[row, :n], atol=1e-5, rtol=0)
    other = model.reconstruct(tokens, lengths, 1 - styles, tokens)
    assert (other - batch).abs().max() > 1e-3  # the style embedding reaches the output


@pytest.mark.parametrize("kind, classes", [("multi", 3), ("conditional", 2)])
def test_discriminators(kind, classes):
    model = build_model(tiny(discriminator=kind, n_styles=2))
    tokens, lengths = sentences()
    styles = torch.tensor([0, 1, 0])
    d = model.discriminator
    out = d(tokens, lengths, styles) if kind == "conditional" else d(tokens, lengths)
    assert out.shape == (3, classes)
    torch.testing.assert_close(out.exp().sum(-1), torch.ones(3))
    with pytest.raises(UsageError):
        d(tokens, lengths, None if kind == "conditional" else styles)


@pytest.mark.parametrize("overrides, match", [
    ({"n_styles": 1}, "n_styles must be >= 2"),
    ({"style_names": ["a"]}, "1 names for n_styles=2"),
    ({"style_names": ["a", "a"]}, "repeats"),
    ({"bos_id": 0}, "three different ids"),
    ({"eos_id": 40}, "outside vocab_size"),
    ({"temperature": 0.0}, "temperature must be > 0"),
    ({"word_drop": 1.0}, "word_drop"),
    ({"discriminator": "binary"}, "discriminator"),
    ({"mem_len": 4}, "mem_len"),
])
def test_impossible_configs_are_rejected_by_name(overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny(**overrides)


def test_styles_by_name_or_index():
    config = tiny(style_names=["verse", "news"])
    assert config.style_index("news") == 1 and config.style_index("0") == 0
    with pytest.raises(UsageError, match="knows verse, news"):
        config.style_index("poetry")


# -- the training schedule -----------------------------------------------------------------------------
def test_phases_follow_the_reference_schedule():
    from txl.train.style import phase

    config = tiny(pretrain_steps=3, discriminator_steps=2, generator_steps=1)
    assert [phase(i, config) for i in range(9)] == ["pretrain"] * 3 + ["d", "d", "f"] * 2


def test_word_drop_keeps_the_end_and_moves_words_left():
    from txl.train.style import word_drop

    tokens, lengths = sentences()
    torch.manual_seed(0)
    noisy, noisy_len = word_drop(tokens, lengths, 0.5, eos_id=EOS_ID, pad_id=PAD_ID)
    for row in range(3):
        kept = noisy[row, : noisy_len[row]].tolist()
        original = tokens[row, : lengths[row]].tolist()
        assert kept[-1] == EOS_ID and EOS_ID not in kept[:-1]
        it = iter(original)
        assert all(t in it for t in kept)  # a subsequence of the original
    assert torch.equal(word_drop(tokens, lengths, 0.0, eos_id=EOS_ID, pad_id=PAD_ID)[0], tokens)


@pytest.mark.parametrize("kind", ["multi", "conditional"])
def test_each_step_fills_only_its_own_networks_gradients(styles, kind):
    """A discriminator step leaves f's gradients None and an f step d's (Adam and the clip skip a None
    gradient: one optimiser updates each network as two would); pre-training has no adversarial term."""
    from types import SimpleNamespace

    from txl.train.style import StyleTransfer

    corpus = open_style_corpus(styles)
    config = tiny(vocab_size=corpus.vocab.size, discriminator=kind, pretrain_steps=1, discriminator_steps=1,
                  generator_steps=1, style_names=list(corpus.styles))
    torch.manual_seed(0)
    model = build_model(config)
    cfg = SimpleNamespace(grad_accum=1, batch_size=4, seed=0, eval_batch_size=8)
    dist = SimpleNamespace(world=1, device=torch.device("cpu"))
    objective = StyleTransfer(cfg, corpus, dist, vocab_size=config.vocab_size, precision="fp32",
                              scaler=torch.amp.GradScaler("cpu", enabled=False), ddp=model)
    generator = {id(p) for p in model.generator_parameters()}
    batches = iter(objective.batches())
    for expected in ("pretrain", "d", "f"):
        model.zero_grad(set_to_none=True)
        nll, count = objective.step(model, next(batches))
        filled = {id(p) for p in model.parameters() if p.grad is not None}
        if expected == "d":
            assert filled == {id(p) for p in model.discriminator.parameters()} and count == 0
            assert objective.last_losses["d"] > 0
        else:
            assert filled and filled <= generator and count > 0 and nll > 0
            assert ("adversarial" in objective.last_losses) == (expected == "f")
    result = objective.evaluate(model, "valid")
    assert result.tokens > 0 and result.loss > 0


# -- the commands ----------------------------------------------------------------------------------------
SMALL = ["--set", "model.n_layer=1", "--set", "model.n_encoder_layer=1", "--set", "model.n_discriminator_layer=1",
         "--set", "model.d_model=16", "--set", "model.d_head=8", "--set", "model.d_inner=32", "--set", "batch_size=4",
         "--set", "model.pretrain_steps=1", "--set", "model.discriminator_steps=1", "--set", "model.generator_steps=1",
         "--set", "log_interval=1", "--set", "eval_batch_size=8", "--threads", "1", "--quiet"]


def test_txl_train_and_generate_with_a_style(styles, tmp_path, capsys):
    """Three steps (pre-training, discriminator, generator), the run's end, `txl generate --style`, `txl eval`."""
    from txl.cli.main import main

    run = tmp_path / "run"
    assert main(["train", "--preset", "style-transfer", "--data", styles, "--out", str(run), *SMALL,
                 "--set", "max_steps=3", "--set", "eval_interval=3"]) == 0
    result = json.loads((run / "result.json").read_text())
    assert result["steps"] == 3 and result["parameters"] == load_model(run).num_parameters()
    assert load_model(run).config.style_names == ("verse", "news")
    transfers = result["final"]["valid"]["transfers"]
    assert {(t["from"], t["to"]) for t in transfers} == {("verse", "news"), ("news", "verse")}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3]
    capsys.readouterr()
    (tmp_path / "in.txt").write_text("to be or not to be\n\nthe company said\n")
    assert main(["generate", str(run), "--style", "news", "--input", str(tmp_path / "in.txt")]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    assert main(["generate", str(run), "--style", "1", "--prompt", "a sea of troubles", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["style"] == "news" and report["transfers"][0]["source"] == "a sea of troubles"
    assert main(["generate", str(run), "--style", "poetry", "--prompt", "x"]) != 0
    assert "unknown style 'poetry'" in capsys.readouterr().err
    assert main(["generate", str(run), "--style", "news", "--prompt", "x", "--top-k", "5"]) != 0
    assert "transfers greedily" in capsys.readouterr().err
    assert main(["generate", str(run), "--prompt", "x"]) != 0
    assert "--style S" in capsys.readouterr().err
    # txl eval: the paper's three measures of every direction beside copying, the tools on real sentences, samples
    assert main(["eval", str(run), "--split", "test", "--samples", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["split"] == "test" and report["styles"] == ["verse", "news"]
    assert [(r["from"], r["to"], r["system"]) for r in report["rows"]] == [
        ("verse", "news", "style transformer"), ("verse", "news", "copy (the input)"),
        ("news", "verse", "style transformer"), ("news", "verse", "copy (the input)")]
    assert all(r["self_bleu"] == 100 for r in report["rows"] if r["system"].startswith("copy"))
    assert [r["sentences"] for r in report["rows"]] == [report["real"][r["from"]]["sentences"] for r in report["rows"]]
    assert len(report["samples"]) == sum(min(2, v["sentences"]) for v in report["real"].values())
    assert main(["eval", str(run), "--max-sentences", "3", "--samples", "1"]) == 0
    out = capsys.readouterr().out
    assert "| verse -> news | style transformer | 3 |" in out and "samples, news -> verse:" in out
    assert "(valid: verse 3, news 3 sentences)" in out
    assert main(["eval", str(run), "--vanilla"]) == 2
    err = capsys.readouterr().err
    assert "--vanilla does not apply to a Style Transformer run" in err and len(err.strip().splitlines()) == 1
    assert main(["eval", str(run), "--split", "all"]) == 2
    assert "no split 'all'" in capsys.readouterr().err
    files, query = styles.removeprefix("style:").split("?")
    swapped = "style:" + ",".join(reversed(files.split(","))) + "?" + query  # style 0 would be scored as style 1
    assert main(["eval", str(run), "--data", swapped]) == 2
    err = capsys.readouterr().err.strip()
    assert "gives the styles (news, verse) but the run learned (verse, news), in that order" in err and "\n" not in err


def test_train_refuses_other_data_for_it_and_it_for_style_data(styles, tmp_path, capsys):
    from txl.cli.main import main

    assert main(["train", "--preset", "style-transfer", "--data", "builtin", "--out", str(tmp_path / "x"),
                 "--quiet"]) != 0
    err = capsys.readouterr().err
    assert "--data style:A_FILE,B_FILE" in err and "Traceback" not in err
    assert main(["train", "--preset", "tiny", "--data", styles, "--out", str(tmp_path / "y"), "--quiet"]) != 0
    err = capsys.readouterr().err
    assert "trains model.arch='style-transformer'" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.mark.slow
def test_the_study_end_to_end(styles, tmp_path):
    """experiments/style_transfer.py on a 3-step run: the three measures per direction beside the copy row,
    the tools on real sentences, ten samples each way (at most what the test split holds), the page written
    without this machine's paths, the finished run reused. Numbers are never asserted: results live in docs/."""
    import studies

    study = studies.load("style_transfer")
    argv = ["--data", styles, "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "docs"), "--max-test", "20",
            "--pretrain-steps", "1"]
    for s in ("train.max_steps=3", "model.n_layer=1", "model.n_encoder_layer=1", "model.n_discriminator_layer=1",
              "model.d_model=16", "model.d_head=8", "model.d_inner=32", "train.batch_size=4",
              "model.discriminator_steps=1", "model.generator_steps=1"):
        argv += ["--set", s]
    assert study.main(argv) == 0
    report = json.loads((tmp_path / "docs" / "style_transfer.json").read_text())
    assert [(r["from"], r["to"], r["system"]) for r in report["rows"]] == [
        ("verse", "news", "style transformer"), ("verse", "news", "copy (the input)"),
        ("news", "verse", "style transformer"), ("news", "verse", "copy (the input)")]
    for row in report["rows"]:
        assert 0 <= row["style_accuracy"] <= 1 and row["target_lm_ppl"] > 0 and 0 <= row["self_bleu"] <= 100
    assert all(r["self_bleu"] == 100 for r in report["rows"] if r["system"].startswith("copy"))
    assert report["training"]["steps"] == 3 and set(report["real_test"]) == {"verse", "news"}
    assert {(s["from"], s["to"]) for s in report["samples"]} == {("verse", "news"), ("news", "verse")}
    page = (tmp_path / "docs" / "style_transfer.md").read_text()
    assert str(tmp_path) not in page and "DIR/verse.txt" in page and "## Ten samples, news -> verse" in page
    mtime = (tmp_path / "runs" / "style" / "result.json").stat().st_mtime
    assert study.main(argv) == 0  # the finished run is reused
    assert (tmp_path / "runs" / "style" / "result.json").stat().st_mtime == mtime
