"""Masked-LM training from the CLI (`txl train --objective mlm`) and its evaluation (`txl eval` on a
bidirectional checkpoint: masked-token loss, bpc/ppl and accuracy)."""

from __future__ import annotations

import json

import pytest
import torch

import helpers
from helpers import finish, train_losses, txl, write_config
from tiny_models import build
from txl.data.masking import mask_tokens
from txl.errors import ConfigError, UsageError
from txl.eval.mlm import evaluate_mlm
from txl.models.pretrained import load_tensors
from txl.train import LAST
from txl.train.config import build_run_config

corpus, cache_dir = helpers.corpus, helpers.cache_dir  # fixtures

MLM_SETS = ["--objective", "mlm", "--set", "attention=linformer", "--set", "linformer_k=8",
            "--set", "linformer_max_len=64"]


def test_mlm_run_config_makes_an_encoder_with_a_mask_token():
    run = build_run_config(preset="tiny", flags={"objective": "mlm", "sample_tokens": 0})
    config = run.model_config(vocab_size=100)
    assert (config.causal, config.mem_len, config.same_length, config.vocab_size) == (False, 0, False, 101)
    assert config.pos_encoding == "rope"  # xl is causal-only; rope runs with every kernel
    # Objective and kernel given together (in any order) are checked together.
    run = build_run_config(preset="tiny", sets=["attention=linformer", "objective=mlm", "sample_tokens=0"])
    assert run.model_config(vocab_size=10).attention == "linformer"


@pytest.mark.parametrize(("sets", "match"), [
    (["objective=mlm", "sample_tokens=0", "causal=true"], "remove model.causal=true"),
    (["objective=mlm", "sample_tokens=0", "mask_prob=0"], "train.mask_prob"),
    (["objective=mlm", "sample_tokens=10"], "train.sample_tokens"),
    (["objective=mlm", "sample_tokens=0", "attention=sparse"], "causal=false"),
])
def test_impossible_mlm_settings_name_the_key(sets, match):
    with pytest.raises(ConfigError, match=match):
        build_run_config(preset="tiny", sets=sets)


def test_mlm_evaluation_masks_the_same_positions_at_any_batch_size_and_counts_accuracy():
    model = build(causal=False, mem_len=0, pos_encoding="rope", vocab_size=62)  # 61 ids + the mask token
    tokens = torch.randint(0, 61, (300,), generator=torch.Generator().manual_seed(0)).numpy()
    one = evaluate_mlm(model, tokens, metric="bpc", batch_size=1, tgt_len=32, seed=3)
    many = evaluate_mlm(model, tokens, metric="bpc", batch_size=7, tgt_len=32, seed=3)
    assert one.tokens == many.tokens and one.accuracy == many.accuracy
    assert one.loss == pytest.approx(many.loss, rel=1e-6)
    # By hand: the same windows and draws, every masked position scored once.
    g = torch.Generator().manual_seed(3)
    ids = torch.as_tensor(tokens)
    total = hits = count = 0
    with torch.no_grad():
        for start in range(0, 300, 32):
            inputs, labels = mask_tokens(ids[None, start:start + 32], mask_id=61, vocab_size=62, generator=g)
            out = model(inputs, labels=labels)
            scored = labels != -100
            total += float(out.nll.sum())
            count += int(scored.sum())
            hits += int((out.logits.argmax(-1) == labels)[scored].sum())
    assert one.tokens == count
    assert one.accuracy == hits / count
    assert one.loss == pytest.approx(total / count, rel=1e-5)
    halves = [evaluate_mlm(model, tokens, metric="bpc", tgt_len=32, seed=3, shard=(r, 2)) for r in range(2)]
    assert sum(h.tokens for h in halves) == count
    assert sum(h.accuracy * h.tokens for h in halves) == pytest.approx(hits)
    with pytest.raises(UsageError, match="bidirectional"):
        evaluate_mlm(build(), tokens, metric="bpc")


@pytest.mark.slow
def test_train_mlm_from_the_cli_then_eval_reports_masked_accuracy(tmp_path, corpus):
    config = write_config(tmp_path, corpus, steps=12, eval_interval=6, varlen="false")
    code, log = finish(txl("train", "--config", str(config), "--out", str(tmp_path / "run"), "--quiet", *MLM_SETS))
    assert code == 0, log
    assert "txl generate" not in log  # an encoder: no generation hint
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in records if r["split"] == "valid"]
    assert len(valid) == 2 and all(0 <= r["accuracy"] <= 1 for r in valid)
    train = [r for r in records if r["split"] == "train"]
    assert train[-1]["tokens"] == 12 * 4 * 16  # every token processed counts, not only the masked ones
    saved = json.loads((tmp_path / "run" / "best" / "config.json").read_text())
    assert saved["causal"] is False and saved["vocab_size"] == 256 + 1  # bytes + the mask token
    results = []
    for _ in range(2):
        code, out = finish(txl("eval", str(tmp_path / "run"), "--json", "--max-tokens", "500"))
        assert code == 0, out
        results.append(json.loads(out[out.index("{"):]))
    assert results[0]["mode"] == "mlm" and 0 <= results[0]["accuracy"] <= 1 and results[0]["bpc"] > 0
    assert results[0] == {**results[1], "seconds": results[0]["seconds"],
                          "tokens_per_second": results[0]["tokens_per_second"]}  # the same positions masked
    code, out = finish(txl("eval", str(tmp_path / "run"), "--vanilla"))
    assert code != 0 and "bidirectional (masked-LM) model" in out and "Traceback" not in out
    proc = txl("generate", str(tmp_path / "run"), "--prompt", "the", "--max-new-tokens", "3")
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0 and stdout == "" and "cannot generate text" in stderr


@pytest.mark.slow
def test_mlm_resume_is_exact(tmp_path, corpus):
    config = write_config(tmp_path, corpus, steps=8, dropout=0.0)
    sets = [*MLM_SETS, "--set", "schedule=constant"]  # the same learning rates whatever max_steps
    code, log = finish(txl("train", "--config", str(config), "--out", str(tmp_path / "a"), "--quiet", *sets))
    assert code == 0, log
    code, log = finish(txl("train", "--config", str(config), "--out", str(tmp_path / "b"), "--quiet", "--max-steps",
                           "4", *sets))
    assert code == 0, log
    code, log = finish(txl("train", "--resume", str(tmp_path / "b"), "--max-steps", "8", "--quiet"))
    assert code == 0, log
    assert train_losses(tmp_path / "a") == train_losses(tmp_path / "b")
    wa, _ = load_tensors(tmp_path / "a" / LAST / "model.safetensors")
    wb, _ = load_tensors(tmp_path / "b" / LAST / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    code, log = finish(txl("train", "--resume", str(tmp_path / "b"), "--objective", "lm"))
    assert code != 0 and "--resume continues the saved configuration" in log


@pytest.mark.slow
def test_train_bidirectional_sliding_mlm_from_the_cli_then_eval(tmp_path, corpus):
    """The bidirectional sliding encoder (window on both sides) trains and evaluates like the other
    masked-LM kernels; its checkpoint keeps the kernel and the direction."""
    config = write_config(tmp_path, corpus, steps=6, eval_interval=6, varlen="false")
    sets = ["--objective", "mlm", "--set", "attention=sliding", "--set", "sliding_window=4"]
    code, log = finish(txl("train", "--config", str(config), "--out", str(tmp_path / "run"), "--quiet", *sets))
    assert code == 0, log
    saved = json.loads((tmp_path / "run" / "best" / "config.json").read_text())
    assert (saved["attention"], saved["causal"], saved["attention_options"]["window"]) == ("sliding", False, 4)
    code, out = finish(txl("eval", str(tmp_path / "run"), "--json", "--max-tokens", "300"))
    assert code == 0, out
    result = json.loads(out[out.index("{"):])
    assert result["mode"] == "mlm" and 0 <= result["accuracy"] <= 1 and result["bpc"] > 0
