"""A damaged state never replaces a good checkpoint (issue 50, build item 2), and a run's own records are
read bounded and checked (items 1 and 6 for run directories). Each test here failed on 775862b.

- optimizer state is checked against the run's configuration on resume: hyper-parameters equal to the
  config's (Adam betas 0.999 -> 9.999 in last/optimizer.json), tensors of the parameter's dtype and shape,
  finite; the refused resume exits 2 with one line and leaves `last/` byte-identical;
- files txl wrote carry their digest: a missing or renamed `txl_sha256` key under last/ or best/ (or in any
  file that names itself txl's) is refused, not skipped; a stranger's plain weights without one still load;
- weights and optimizer state are checked finite before any checkpoint is written: a run that became
  non-finite stops with one line, keeping the last good `last/`;
- the progress in trainer_state.json (iterator position, step, token counts) is covered by a digest;
- a non-finite training loss is recorded as null in metrics.jsonl, never as 0.0;
- FIFOs and oversized files among a run's records end in one line instead of hanging or being read.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import helpers
from helpers import TINY, call, hang_guard, one_error_line
from txl.errors import TrainingError
from txl.models.pretrained import load_tensors, save_tensors

corpus, cache_dir = helpers.corpus, helpers.cache_dir  # fixtures
pytestmark = pytest.mark.usefixtures("one_thread")


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}




@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus) -> Path:
    """A finished tiny run (last/ at step 2, best/, run.json, metrics.jsonl)."""
    root = tmp_path_factory.mktemp("trained")
    config = helpers.write_config(root, corpus, steps=2, varlen="false")
    code, err = call("train", "--config", str(config), "--out", str(root / "run"), "--quiet", *TINY)
    assert code == 0, err
    return root / "run"


@pytest.fixture
def run(trained, tmp_path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(trained, target)
    (target / ".txl-lock").unlink(missing_ok=True)
    return target


def resume(run: Path, steps: int = 3) -> tuple[int, str]:
    return call("train", "--resume", str(run), "--max-steps", str(steps), "--quiet")


def refused_keeping_last(run: Path, *words: str, steps: int = 3) -> str:
    """`--resume` exits 2 with one line holding `words`, and `last/` is byte-identical afterwards."""
    before = files(run / "last")
    code, err = resume(run, steps)
    line = one_error_line(err)
    assert code == 2, err
    for word in words:
        assert word in line, line
    assert files(run / "last") == before
    return line


# ---------------------------------------------------------------------------------------------
# safetensors headers, edited in place


def read_st(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_st(path: Path, header: dict, data: bytes) -> None:
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def flip_data_bit(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x10
    path.write_bytes(bytes(raw))


# ---------------------------------------------------------------------------------------------
# Optimizer state against the run's configuration


def test_edited_adam_betas_are_refused_and_last_stays_byte_identical(run):
    path = run / "last" / "optimizer.json"
    text = path.read_text()
    assert "0.999" in text
    path.write_text(text.replace("0.999", "9.999"))  # one character: the review's edit
    refused_keeping_last(run, "optimizer.json", "betas", "9.999")


@pytest.mark.parametrize("key, value", [("eps", 1.0), ("weight_decay", 0.5), ("amsgrad", True), ("lr", float("inf"))])
def test_other_edited_hyperparameters_are_refused(run, key, value):
    path = run / "last" / "optimizer.json"
    plain = json.loads(path.read_text())
    plain["param_groups"][0][key] = value
    path.write_text(json.dumps(plain))
    refused_keeping_last(run, "optimizer.json", key)


def test_a_retyped_optimizer_tensor_with_a_valid_digest_is_refused(run):
    """Written by txl's own writer (so its digest holds): the dtype must still be the parameter's."""
    path = run / "last" / "optimizer.safetensors"
    tensors, metadata = load_tensors(path)
    name = next(k for k in sorted(tensors) if k.endswith("exp_avg_sq"))
    tensors[name] = tensors[name].to(torch.float16)
    save_tensors(path, tensors, {"txl_kind": metadata["txl_kind"]})
    refused_keeping_last(run, "optimizer", "float16")


@pytest.mark.parametrize("poison", ["nan", "negative"])
def test_non_finite_or_negative_optimizer_moments_are_refused(run, poison):
    path = run / "last" / "optimizer.safetensors"
    tensors, metadata = load_tensors(path)
    name = next(k for k in sorted(tensors) if k.endswith("exp_avg_sq"))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan") if poison == "nan" else -1.0
    save_tensors(path, tensors, {"txl_kind": metadata["txl_kind"]})
    refused_keeping_last(run, "optimizer", "exp_avg_sq")


def test_non_finite_weights_in_last_are_refused(run):
    path = run / "last" / "model.safetensors"
    tensors, metadata = load_tensors(path)
    name = sorted(tensors)[0]
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_tensors(path, tensors, {"txl_kind": metadata["txl_kind"]})
    line = refused_keeping_last(run, "not finite")
    assert str(run / "best") in line  # the other checkpoint is named


# ---------------------------------------------------------------------------------------------
# Digests: files txl wrote must carry theirs


def test_a_retyped_tensor_without_a_digest_is_refused(run):
    """The review's second case: a well-formed optimizer.safetensors with no digest and a retyped tensor."""
    from safetensors.torch import load_file, save_file

    path = run / "last" / "optimizer.safetensors"
    tensors = load_file(str(path))
    name = next(k for k in sorted(tensors) if k.endswith("exp_avg"))
    tensors[name] = tensors[name].to(torch.float64)
    save_file(tensors, str(path), metadata={"format": "pt", "txl_kind": "optimizer"})
    refused_keeping_last(run, "optimizer.safetensors", "txl_sha256")


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "trainer.safetensors"])
def test_a_removed_digest_key_in_last_is_refused(run, name):
    path = run / "last" / name
    header, data = read_st(path)
    del header["__metadata__"]["txl_sha256"]
    header["__metadata__"].pop("txl_kind")  # nothing left that says txl wrote it: under last/ it did
    write_st(path, header, data)
    refused_keeping_last(run, name, "txl_sha256")


def test_one_flipped_bit_in_the_digest_key_does_not_turn_verification_off(run):
    path = run / "last" / "model.safetensors"
    raw = bytearray(path.read_bytes())
    at = raw.index(b"txl_sha256") + 4
    raw[at] ^= 0x01  # "txl_sha256" -> "txl_rha256": same length, header still valid JSON
    path.write_bytes(bytes(raw))
    flip_data_bit(path)  # and a second flip in the weights
    refused_keeping_last(run, "model.safetensors", "txl_sha256", "'txl_rha256'")


def test_best_without_its_digest_is_refused_by_eval(run):
    path = run / "best" / "model.safetensors"
    header, data = read_st(path)
    del header["__metadata__"]["txl_sha256"]
    write_st(path, header, data)
    flip_data_bit(path)
    code, err = call("eval", str(run), "--device", "cpu", "--max-tokens", "64")
    line = one_error_line(err)
    assert code == 2 and "txl_sha256" in line and "best" in line, line
    assert f"use {run / 'last'} (the run's other checkpoint)" in line  # which one exists


def test_a_strangers_plain_weights_without_digest_still_load(tmp_path, tiny):
    """Policy: only files txl wrote must carry a digest (every txl since the first checkpoint commit wrote
    one); weights someone saved with safetensors themselves, in a plain directory, load as before."""
    from safetensors.torch import save_file

    from txl.models.transformer_xl.model import TransformerXL

    model = TransformerXL(tiny())
    model.save_pretrained(tmp_path / "ckpt")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "ckpt" / "model.safetensors"))
    loaded = TransformerXL.from_pretrained(tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))


# ---------------------------------------------------------------------------------------------
# trainer_state.json: the progress is covered by a digest


@pytest.mark.parametrize("edit", ["iterator", "tokens_seen", "step"])
def test_an_edited_progress_in_trainer_state_is_refused(run, edit):
    path = run / "last" / "trainer_state.json"
    state = json.loads(path.read_text())
    if edit == "iterator":
        state["iterator"]["position"] += 1  # skip ahead: still inside the stream, so the iterator accepts it
    else:
        state[edit] += 1
    path.write_text(json.dumps(state))
    refused_keeping_last(run, "trainer_state.json", "edited", steps=5)


def test_a_run_saved_before_the_progress_digest_resumes_with_a_note(run):
    """Policy for older runs: trainer.safetensors without the progress digest (txl before issue 50) resumes
    as it always did, saying so; removing the digest from a newer file needs its txl_sha256 recomputed."""
    path = run / "last" / "trainer.safetensors"
    tensors, metadata = load_tensors(path)
    del tensors["trainer_state.sha256"]
    save_tensors(path, tensors, {"txl_kind": metadata["txl_kind"]})
    code, err = resume(run)
    assert code == 0, err
    assert "without a digest of its trainer_state.json" in err
    assert "trainer_state.sha256" in load_tensors(path)[0]  # the new checkpoint has one again


def test_an_unedited_state_still_resumes(run):
    code, err = resume(run)
    assert code == 0, err
    assert helpers.saved_step(run) == 3


# ---------------------------------------------------------------------------------------------
# Non-finite state is never written


def _trainer(run_dir: Path, **train):
    """The run resumed in this process (max_steps 6), with `train` settings changed."""
    from txl.train import Trainer
    from txl.train.state import resume_config

    config = resume_config(run_dir, max_steps=6)
    for key, value in train.items():
        setattr(config.train, key, value)
    return Trainer(config, run_dir, resume=True, quiet=True)


def test_weights_that_become_non_finite_stop_the_run_before_any_checkpoint(run, monkeypatch):
    """The loss of the step is finite (the weights broke in its update): the check before saving stops it."""
    trainer = _trainer(run)
    before = files(run / "last")
    real_step = trainer.optimizer_step

    def poisoned(lr, finite):
        real_step(lr, finite)
        if trainer.step == 3:  # the update of the 4th step breaks the weights
            with torch.no_grad():
                next(trainer.model.parameters()).view(-1)[0] = float("inf")

    monkeypatch.setattr(trainer, "optimizer_step", poisoned)
    with pytest.raises(TrainingError) as info:
        trainer.fit()
    trainer.close()
    message = str(info.value)
    assert "\n" not in message and "not finite" in message and "step 4" in message and "step 3" in message, message
    assert helpers.saved_step(run) == 3  # the step-3 checkpoint of this session, not the broken step 4
    weights, _ = load_tensors(run / "last" / "model.safetensors")
    assert all(bool(torch.isfinite(w).all()) for w in weights.values())
    assert files(run / "last") != before  # (step 3 was saved; nothing after it)


def test_the_reviews_betas_case_never_reaches_last_even_if_the_check_were_skipped(run, monkeypatch):
    """Belt and braces: with the resume check bypassed, the finite check before saving still keeps `last/`."""
    import txl.train.state

    path = run / "last" / "optimizer.json"
    path.write_text(path.read_text().replace("0.999", "9.999"))
    monkeypatch.setattr(txl.train.state, "check_optimizer_hyperparameters", lambda *a, **k: None)
    before = files(run / "last")
    code, err = resume(run)
    line = one_error_line(err)
    assert code == 2 and "not finite" in line, line
    assert files(run / "last") == before


def test_a_non_finite_loss_is_recorded_as_null_not_zero(run, monkeypatch):
    trainer = _trainer(run, log_interval=1, max_nonfinite=3)
    real_forward = trainer.forward

    def poisoned(*args, **kwargs):
        out = real_forward(*args, **kwargs)
        out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(trainer, "forward", poisoned)
    with pytest.raises(TrainingError):
        trainer.fit()
    trainer.close()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    bad = [r for r in records if r["split"] == "train" and r["step"] > 2]
    assert [r["step"] for r in bad] == [3, 4]
    for record in bad:
        assert record["loss"] is None and record[trainer.metric] is None and record["nonfinite_steps"] == 1, record
    assert "NaN" not in (run / "metrics.jsonl").read_text()


# ---------------------------------------------------------------------------------------------
# A run's records: regular files only, bounded


@pytest.mark.parametrize("name", ["last/optimizer.json", "last/trainer_state.json", "run.json", "metrics.jsonl",
                                  "last/config.json"])
def test_a_fifo_among_a_runs_files_ends_resume_in_one_line(run, name):
    path = run / name
    path.unlink()
    os.mkfifo(path)
    with hang_guard():
        code, err = resume(run)
    line = one_error_line(err)
    assert code == 2 and "FIFO" in line and path.name in line, line


@pytest.mark.parametrize("name", ["run.json", "last/trainer_state.json", "best/trainer_state.json"])
def test_a_fifo_among_a_runs_records_ends_eval_in_one_line(run, name):
    path = run / name
    path.unlink()
    os.mkfifo(path)
    with hang_guard():
        code, err = call("eval", str(run), "--device", "cpu", "--max-tokens", "64")
    line = one_error_line(err)
    assert code == 2 and "FIFO" in line and path.name in line, line


@pytest.mark.slow
def test_a_sparse_1_gb_config_json_is_refused_by_its_size_unread(run, tmp_path):
    path = run / "last" / "config.json"
    with open(path, "r+b") as f:
        f.truncate(2**30)
    script = ("import sys\nfrom txl.models.registry import load_model\nfrom txl.errors import CheckpointError\n"
              "try:\n    load_model(sys.argv[1])\nexcept CheckpointError as err:\n    print(err)\n"
              # VmHWM, not ru_maxrss: the latter keeps the forking pytest worker's high-water mark at exec
              "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')))\n")
    proc = subprocess.run([sys.executable, "-c", script, str(run / "last")], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})
    message, peak_kb = proc.stdout.strip().splitlines()
    assert "config.json" in message and "1 GiB" in message and "more than" in message, proc.stdout + proc.stderr
    assert int(peak_kb) < 600 * 1024  # torch alone is ~300 MB; reading the file would add 1 GB


# ---------------------------------------------------------------------------------------------
# run.json / trainer_state.json values, checked where read


@pytest.mark.parametrize("key, value, words", [
    ("eval_tgt_len", "abc", ("eval_tgt_len", "'abc'")),
    ("eval_tgt_len", math.inf, ("eval_tgt_len", "inf")),
    ("tgt_len", [1, 2], ("tgt_len", "[1, 2]")),
    ("tgt_len", -5, ("tgt_len", "-5")),
    ("eval_mem_len", 1e11, ("eval_mem_len",)),
    ("eval_mem_len", 10**11, ("eval_mem_len", "<=")),
])
def test_a_damaged_setting_in_the_runs_records_ends_eval_in_one_line(run, key, value, words):
    for path, section in ((run / "last" / "trainer_state.json", "run"), (run / "run.json", "config")):
        data = json.loads(path.read_text())
        data[section]["train"][key] = value
        path.write_text(json.dumps(data))
    code, err = call("eval", str(run), "--device", "cpu", "--max-tokens", "64")
    line = one_error_line(err)
    assert code == 2, err
    for word in (*words, "trainer_state.json"):
        assert word in line, line


def test_the_runs_largest_eval_mem_len_is_bounded_by_the_text(run):
    """eval_mem_len at its maximum (2**24, a valid run setting): memory never holds more than the text it read,
    so the evaluator works with that (65 tokens here), not with 16M-key segments one row at a time."""
    from txl.eval.api import evaluate_checkpoint

    for path, section in ((run / "last" / "trainer_state.json", "run"), (run / "run.json", "config")):
        data = json.loads(path.read_text())
        data[section]["train"]["eval_mem_len"] = 2**24
        path.write_text(json.dumps(data))
    result, _ = evaluate_checkpoint(run, max_tokens=64, device="cpu")
    assert result.mem_len == 65 and math.isfinite(result.loss)
