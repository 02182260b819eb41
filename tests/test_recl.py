"""RECL (Dai et al. 2019, appendix C): the metric on hand-made losses, and `txl recl` end to end in both
ways of realising a context length, with its cache and its bad inputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from txl import TransformerXLConfig
from txl.cli.main import main
from txl.cli.recl import parse_contexts
from txl.data import Vocab
from txl.errors import UsageError
from txl.eval.recl import choose_positions, compute_recl, recl_markdown, top_r
from txl.eval.vanilla import context_nll, evaluate_vanilla
from txl.models.transformer_xl.model import TransformerXL


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from threads, and on a shared 2-core machine they lose 10× to contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _cache_env(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TXL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "txl-cache"))


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# -- the metric ---------------------------------------------------------------------------------------

A = {10: [1.0, 2.0, 3.0, 4.0], 20: [0.9, 1.8, 2.0, 3.0], 30: [0.9, 1.8, 1.99, 2.99]}
B = {10: [1.5, 1.0, 3.5, 5.0], 20: [1.5, 1.0, 3.5, 4.5], 30: [1.5, 1.0, 3.5, 4.5]}


def as_arrays(losses):
    return {c: np.asarray(v) for c, v in losses.items()}


def test_recl_follows_the_appendix_c_definition_by_hand():
    result = compute_recl({"A": as_arrays(A), "B": as_arrays(B)}, [10, 20, 30], [0.5, 1.0])
    # r = 0.5, c = 10: b = [1, 1, 3, 4]; T = the two hardest = positions 3, 2; f(c, c) = 3.5
    # A at 20: min(b, l) over T = [3, 2] -> 2.5, g = 1 - e^-1; B at 20 never beats the baseline -> g = 0
    assert result.gains["A"][0.5][0] == pytest.approx(1 - math.exp(-1.0))
    assert result.gains["B"][0.5][0] == 0.0
    # c = 20: b = [0.9, 1.0, 2.0, 3.0]; T = positions 3, 2; A at 30 gains 0.01 nats: g = 1 - e^-0.01 < 0.01
    assert result.gains["A"][0.5][1] == pytest.approx(1 - math.exp(-0.01))
    assert result.recl["A"][0.5] == 20 and result.recl["B"][0.5] == 10
    # r = 1: every position; A's first step gains 1 - e^-0.525, its second only 1 - e^-0.005
    assert result.gains["A"][1.0][0] == pytest.approx(1 - math.exp(-0.525))
    assert result.gains["A"][1.0][1] == pytest.approx(1 - math.exp(-0.005))
    assert result.recl["A"][1.0] == 20 and result.recl["B"][1.0] == 10
    assert not any(result.censored[m][r] for m in "AB" for r in (0.5, 1.0))
    assert result.mean_loss["A"][0] == pytest.approx(2.5)


def test_a_model_still_gaining_at_the_last_context_is_censored():
    still = {10: [1.0, 2.0, 3.0, 4.0], 20: [0.5, 1.0, 1.5, 2.0], 30: [0.2, 0.5, 0.7, 1.0]}
    result = compute_recl({"A": as_arrays(still), "B": as_arrays(B)}, [10, 20, 30], [0.1])
    assert result.recl["A"][0.1] == 30 and result.censored["A"][0.1]
    assert "| A | >= 30 |" in recl_markdown(result)


def test_gains_only_count_improvements_below_the_group_baseline():
    rng = np.random.default_rng(0)
    losses = {name: {c: rng.gamma(2.0, 1.0, 500) for c in (8, 16, 32, 64)} for name in "ABC"}
    result = compute_recl(losses, [8, 16, 32, 64], [0.1, 0.5, 1.0])
    for name in "ABC":
        for r in result.rs:
            assert all(0.0 <= g < 1.0 for g in result.gains[name][r])
    # a model whose longer contexts are worse than everyone's short ones gains nothing
    losses["D"] = {c: np.full(500, 50.0) for c in (8, 16, 32, 64)}
    assert compute_recl(losses, [8, 16, 32, 64], [0.5]).recl["D"][0.5] == 8


def test_top_r_and_positions():
    b = np.array([0.1, 5.0, 3.0, 5.0, 1.0])
    assert top_r(b, 0.4).tolist() == [1, 3]  # ceil(0.4 × 5) = 2, ties in position order
    assert sorted(top_r(b, 1.0).tolist()) == [0, 1, 2, 3, 4]
    assert top_r(np.zeros(1000), 0.1).size == 100  # no float surprise: 0.1 × 1000 is 100, not 101
    assert choose_positions(100, 16).tolist() == list(range(16, 100))
    picked = choose_positions(10_000, 100, 50)
    assert len(picked) == 50 and picked[0] == 100 and picked[-1] == 9999
    assert parse_contexts("100:400:100") == [100, 200, 300, 400]
    with pytest.raises(UsageError, match="too few"):
        choose_positions(50, 64)


# -- end to end ----------------------------------------------------------------------------------------


def save_model(path: Path, seed: int, mem_len: int) -> Path:
    torch.manual_seed(seed)
    config = TransformerXLConfig(vocab_size=256, n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64,
                                 mem_len=mem_len, dropout=0.0, init_std=0.2)
    TransformerXL(config).save_pretrained(path)
    Vocab("bytes").save(path / "vocab.json")
    return path


@pytest.fixture(scope="module")
def group(tmp_path_factory) -> tuple[Path, Path, str]:
    base = tmp_path_factory.mktemp("recl")
    corpus = base / "corpus.txt"
    corpus.write_text("the memory of a segment attends to the previous segment\n" * 80)
    return save_model(base / "no-memory", 0, 0), save_model(base / "with-memory", 1, 16), f"text:{corpus}"


@pytest.mark.parametrize("mode", ["window", "memory"])
@pytest.mark.slow
def test_recl_cli_end_to_end_and_its_cache(group, tmp_path, capsys, mode):
    a, b, spec = group
    argv = ["recl", a, b, "--data", spec, "--contexts", "4,8,16", "--r", "0.1,1.0", "--mode", mode,
            "--positions", 40, "--tgt-len", 8, "--cache", tmp_path / "cache", "--json"]
    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    first = json.loads(out)
    assert first["names"] == ["no-memory", "with-memory"] and first["contexts"] == [4, 8, 16]
    assert first["positions"] == 40 and first["mode"] == mode
    assert set(first["recl"]["no-memory"]) == {"0.1", "1.0"}
    assert all(first["recl"][n][r] in (4, 8, 16) for n in first["names"] for r in ("0.1", "1.0"))
    cached = sorted((tmp_path / "cache").glob(f"losses-{mode}-*.npy"))
    assert len(cached) == 6  # 2 models × 3 contexts
    code, out, err = run_cli(capsys, *argv)  # second run: read back, same answer
    assert code == 0 and json.loads(out)["recl"] == first["recl"]
    cached[0].write_bytes(cached[0].read_bytes()[:100])  # a damaged entry is named, never trusted
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and str(cached[0]) in err and "delete" in err and len(err.strip().splitlines()) == 1
    cached[0].unlink()
    code, out, err = run_cli(capsys, *argv)  # recomputed
    assert code == 0 and json.loads(out)["mean_loss"] == first["mean_loss"]
    code, out, err = run_cli(capsys, *argv[:-1], "--out", tmp_path / "docs" / "recl")
    assert code == 0 and "| model | RECL r = 0.1 | RECL r = 1 |" in out
    assert (tmp_path / "docs" / "recl.png").read_bytes()[:4] == b"\x89PNG"
    assert "no-memory" in (tmp_path / "docs" / "recl.md").read_text()


def test_window_losses_are_fresh_windows_of_exactly_c_tokens(group):
    a, _, spec = group
    from txl.data import open_corpus

    tokens = np.asarray(open_corpus(spec).split("valid"))
    model = TransformerXL.from_pretrained(a)
    positions = choose_positions(len(tokens), 16, 30)
    losses = context_nll(model, tokens, positions, context_len=16, batch_size=7)
    per_token = np.zeros(len(tokens) - 1, np.float32)
    evaluate_vanilla(model, tokens, metric="bpc", attn_len=16, per_token=per_token)
    np.testing.assert_allclose(losses, per_token[positions - 1], atol=2e-5)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--contexts", "16,8"], "increasing"),
        (["--contexts", "8"], "at least two"),
        (["--contexts", "4,8", "--r", "0"], "(0, 1]"),
        (["--contexts", "4,8", "--names", "x"], "1 labels for 2 checkpoints"),
        (["--contexts", "4,8", "--threshold", "2"], "--threshold"),
        (["--contexts", "4,100000"], "too few"),
        (["--contexts", "4,8", "--split", "nope"], "no split 'nope'"),
    ],
)
def test_bad_inputs_end_in_one_line(group, capsys, extra, expected):
    a, b, spec = group
    code, out, err = run_cli(capsys, "recl", a, b, "--data", spec, *extra)
    assert code == 2, (out, err)
    assert expected in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_models_with_different_vocabularies_are_refused(group, tmp_path, capsys):
    a, _, spec = group
    other = tmp_path / "chars"
    torch.manual_seed(0)
    TransformerXL(TransformerXLConfig(vocab_size=3, n_layer=1, d_model=16, n_head=2, d_head=8, d_inner=32,
                                      mem_len=4)).save_pretrained(other)
    Vocab("chars", ["a", "b", "c"]).save(other / "vocab.json")
    code, _, err = run_cli(capsys, "recl", a, other, "--data", spec, "--contexts", "4,8")
    assert code == 2 and "vocabulary mismatch" in err and len(err.strip().splitlines()) == 1


def test_a_vanilla_transformer_reads_at_most_its_training_length(group):
    """Absolute positions + no memory: a fixed window (the paper's vanilla RECL = its training length);
    relative positions, memory or a recurrent model: no cap."""
    from txl.eval.recl import context_losses, fixed_context

    vanilla = TransformerXLConfig(vocab_size=256, n_layer=1, d_model=16, n_head=2, d_head=8, d_inner=32, mem_len=0,
                                  pos_encoding="sinusoidal")
    assert fixed_context(vanilla, 64) == 64
    assert fixed_context(vanilla.replace(pos_encoding="learned"), 32) == 32
    assert fixed_context(vanilla.replace(pos_encoding="xl"), 64) is None  # relative positions extrapolate
    assert fixed_context(vanilla.replace(mem_len=16), 64) is None  # memory: a Transformer-XL
    assert fixed_context(vanilla, None) is None  # no training length known
    torch.manual_seed(0)
    model = TransformerXL(vanilla).eval()
    _, _, spec = group
    from txl.data import open_corpus

    tokens = np.asarray(open_corpus(spec).split("valid"))
    positions = choose_positions(len(tokens), 32, 20)
    capped = context_losses(model, tokens, positions, [4, 8, 16, 32], max_context=8)
    assert capped[16] is capped[8] and capped[32] is capped[8]
    np.testing.assert_allclose(capped[8], context_nll(model, tokens, positions, context_len=8), atol=1e-6)
    full = context_losses(model, tokens, positions, [8, 32])
    assert not np.allclose(full[32], capped[8])  # without the cap the longer window is read whole


@pytest.mark.parametrize(("fields", "words"), [
    ({"arch": "encoder-decoder", "n_encoder_layer": 1},
     "is a sequence-to-sequence model (encoder-decoder): txl recl measures a language model's context"),
    ({"num_labels": 2}, "is a document classifier: txl recl measures a language model's context"),
    ({"causal": False, "mem_len": 0, "pos_encoding": "rope"}, "is a bidirectional (masked-LM) model"),
], ids=["encoder-decoder", "classifier", "masked-lm"])
def test_a_model_that_is_not_a_causal_lm_is_refused_in_one_line(tmp_path, fields, words):
    """The encoder-decoder ended in an AttributeError traceback; the classifier and the masked LM were scored as if
    they predicted the next token."""
    import contextlib
    import io

    from txl.models.registry import build_model, config_from_dict

    config = config_from_dict({"vocab_size": 32, "n_layer": 1, "d_model": 16, "n_head": 2, "d_head": 8,
                               "d_inner": 32, **fields})
    build_model(config).save_pretrained(tmp_path / "ckpt")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["recl", str(tmp_path / "ckpt"), "--contexts", "8,16", "--data", "builtin"])
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1 and words in lines[0], err.getvalue()
