"""experiments/claims.py (issue 19): parameter matching, the paired standard error, the report's tables."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest

import helpers
import studies

claims = studies.load("claims")

corpus, cache_dir = helpers.corpus, helpers.cache_dir  # fixtures


def test_paired_difference_is_in_bits_with_batch_means_error():
    rng = np.random.default_rng(0)
    base = rng.exponential(1.0, size=1000).astype(np.float32)
    # a difference that is constant inside each of 10 blocks: batch means see its spread exactly
    step = np.repeat(np.linspace(-0.5, 0.4, 10), 100).astype(np.float32)
    diff, se = claims.paired(base + step, base, blocks=10)
    block_means = np.linspace(-0.5, 0.4, 10) / math.log(2)
    assert diff == pytest.approx(block_means.mean(), abs=1e-6)
    assert se == pytest.approx(block_means.std(ddof=1) / math.sqrt(10), rel=1e-5)
    # a uniform shift has no spread: error 0, difference exactly the shift in bits
    diff, se = claims.paired(base + 0.25, base, blocks=10)
    assert diff == pytest.approx(0.25 / math.log(2), rel=1e-5)
    assert se == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("variant", ["shaw", "vanilla", "xl-m32"])
def test_d_inner_matching_keeps_parameters_within_two_percent(variant):
    target = claims.parameter_count([], vocab_size=65)
    spec = claims.VARIANTS[variant]
    sets = [f"model.{s}" for s in spec.sets]
    size, count = claims.match_size(spec, sets, target, vocab_size=65)
    assert count == claims.parameter_count([*sets, *spec.size_sets(size)], vocab_size=65)
    assert abs(count - target) / target < 0.02
    # the closest: one step either way is no closer
    for other in (size - 1, size + 1):
        assert abs(claims.parameter_count([*sets, *spec.size_sets(other)], 65) - target) >= abs(count - target)


def _fake_run(tmp_path, corpus_name, variant, seed, nll_by_mode):
    run_dir = tmp_path / corpus_name / f"{variant}-s{seed}"
    run_dir.mkdir(parents=True)
    (run_dir / "result.json").write_text(json.dumps({"tokens": 1000, "steps": 10, "tokens_per_second": 100.0}))
    for name, values in nll_by_mode.items():
        np.save(run_dir / f"claims_nll_{name}.npy", values)
    return {"name": f"{corpus_name}/{variant}-s{seed}", "corpus": corpus_name, "variant": variant, "seed": seed,
            "size": "d_inner 512", "parameters": 1000, "trained_mem": {"xl": 64, "shaw": 64}.get(variant, 0), "ablation_mem": 64, "command": f"txl train {variant} {seed}", "peak_rss_mb": 1.0,
            "run_dir": str(run_dir)}


def test_report_tables_rank_the_ablation_and_pair_the_sweep(tmp_path):
    rng = np.random.default_rng(1)
    base = rng.exponential(1.0, size=400).astype(np.float32)
    plan, evals = [], {}
    bpc = {"xl": 1.0, "shaw": 1.1, "xl-mem0": 1.2, "vanilla": 1.3}
    for seed in (1, 2):
        for variant, value in bpc.items():
            if variant == "vanilla":
                item = _fake_run(tmp_path, "c", variant, seed, {"window": base})
                evals[item["name"]] = {"mems": {}, "window": value + seed / 100}
            else:
                longer = base - 0.01  # evaluation at mem 128 is better by 0.01 nats on every token
                item = _fake_run(tmp_path, "c", variant, seed, {"mem64": base, "mem128": longer, "mem0": base + 0.1})
                evals[item["name"]] = {"mems": {"0": value + 0.1, "64": value + seed / 100, "128": value - 0.01},
                                       "window": None}
            plan.append(item)
    args = argparse.Namespace(corpora=[("c", "text:x")], steps=10, seeds=(1, 2), eval_tokens=400,
                              eval_mems=(0, 64, 128), blocks=4)
    report = claims.build_report(args, plan, evals, recl={})
    ablation = report["ablation"]["c"]
    assert [row["variant"] for row in ablation["rows"]] == ["xl", "shaw", "xl-mem0", "vanilla"]
    assert ablation["rank_per_seed"] == [["xl", "shaw", "xl-mem0", "vanilla"]] * 2
    assert ablation["rows"][0]["mean"] == pytest.approx(1.015)
    xl = next(row for row in report["sweep"]["c"] if row["variant"] == "xl" and row["seed"] == 1)
    cell = next(c for c in xl["cells"] if c["mem"] == 128)
    assert cell["diff"] == pytest.approx(-0.01 / math.log(2), rel=1e-4)
    assert "diff" not in next(c for c in xl["cells"] if c["mem"] == 64)  # the training memory itself
    mem0 = next(row for row in report["sweep"]["c"] if row["variant"] == "xl-mem0")
    assert mem0["trained_mem"] == 0
    text = claims.markdown(report)
    assert "xl < shaw < xl-mem0 < vanilla" in text
    assert "| xl | mem 64 |" in text


@pytest.mark.slow
def test_claims_without_a_corpus_is_one_clear_line(tmp_path):
    code, text = helpers.finish(studies.script("claims", "--out", str(tmp_path / "o"), cwd=tmp_path))
    assert code == 2
    assert "Traceback" not in text
    assert text.strip().splitlines()[-1].startswith(
        "python experiments/claims.py: error: python experiments/claims.py needs at least one --corpus")
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_claims_end_to_end_on_a_small_corpus(tmp_path, corpus):
    """Train two tiny variants, evaluate, RECL, report; a second call reuses everything."""
    args = ("--corpus", f"c=text:{corpus}", "--variants", "xl,vanilla", "--seeds", "1",
            "--steps", "3", "--eval-tokens", "400", "--eval-mems", "0,8", "--contexts", "4,8,16",
            "--recl-positions", "10", "--blocks", "2", "--jobs", "1", "--runs", str(tmp_path / "runs"),
            "--out", str(tmp_path / "out"), "--set", "train.tgt_len=8", "--set", "train.batch_size=2",
            "--set", "model.n_layer=1", "--set", "model.d_model=32", "--set", "model.n_head=2",
            "--set", "model.d_head=16", "--set", "model.mem_len=8")
    code, text = helpers.finish(studies.script("claims", *args, cwd=tmp_path), timeout=600)
    assert code == 0, text
    report = json.loads((tmp_path / "out" / "claims.json").read_text())
    assert [row["variant"] for row in report["ablation"]["c"]["rows"]] == ["xl", "vanilla"]
    assert report["max_param_gap"] < 0.02
    vanilla = next(r for r in report["runs"] if r["variant"] == "vanilla")
    assert vanilla["eval"]["window"] is not None and set(vanilla["eval"]["mems"]) == {"0", "8"}
    recl = report["recl"]["c/s1"]
    assert recl["fixed_context"] == {"vanilla": 8}  # absolute positions, no memory: its training length
    assert all(value <= 8 for value in recl["recl"]["vanilla"].values())
    assert (tmp_path / "out" / "claims_c.png").read_bytes()[:4] == b"\x89PNG"
    assert "### Ablation" in (tmp_path / "out" / "claims_tables.md").read_text()
    stamp = (tmp_path / "runs" / "c" / "xl-s1" / "claims_eval.json").stat().st_mtime_ns
    code, text = helpers.finish(studies.script("claims", *args, cwd=tmp_path), timeout=600)
    assert code == 0, text
    assert "started" not in text  # nothing retrained
    assert (tmp_path / "runs" / "c" / "xl-s1" / "claims_eval.json").stat().st_mtime_ns == stamp  # nor re-evaluated
