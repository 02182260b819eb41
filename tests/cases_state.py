"""Bad inputs of a run's own state (issue 50, build items 2 and 6): a damaged or edited `last/`, files txl
wrote that lost their digest, FIFOs and oversized files among a run's records, and damaged values in
run.json / trainer_state.json. Registered into tests/test_robustness.py's table (ids prefixed `state-`);
tests/test_resume_hostile.py checks more of each (the previous `last/` stays byte-identical)."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch

from helpers import hang_guard
from test_robustness import Ctx, Outcome, case, cli

HOSTILE = "tests/test_resume_hostile.py::"


def _run(ctx: Ctx) -> Path:
    run = ctx.run_copy()
    (run / ".txl-lock").unlink(missing_ok=True)
    return run


def _resume(run: Path, steps: int = 3) -> Outcome:
    return cli("train", "--resume", str(run), "--max-steps", str(steps), "--quiet")


def _eval(run: Path) -> Outcome:
    return cli("eval", str(run), "--device", "cpu", "--max-tokens", "64")




def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _setting(run: Path, key: str, value) -> None:
    """A [train] value written into both of the run's records (trainer_state.json is read first)."""
    for path, section in ((run / "last" / "trainer_state.json", "run"), (run / "run.json", "config")):
        data = json.loads(path.read_text())
        data[section]["train"][key] = value
        path.write_text(json.dumps(data))


# ---------------------------------------------------------------------------------------------
# A damaged state never replaces a good checkpoint


@case("state-betas-edited", "`last/optimizer.json` with Adam's beta2 edited from 0.999 to 9.999",
      "txl train --resume RUN", "optimizer.json", "betas", "9.999", "restore",
      test=HOSTILE + "test_edited_adam_betas_are_refused_and_last_stays_byte_identical")
def _(ctx):
    run = _run(ctx)
    path = run / "last" / "optimizer.json"
    path.write_text(path.read_text().replace("0.999", "9.999"))
    return _resume(run)


@case("state-optimizer-retyped", "`last/optimizer.safetensors` with a moment retyped to float16 (valid digest)",
      "txl train --resume RUN", "optimizer state does not fit", "float16",
      test=HOSTILE + "test_a_retyped_optimizer_tensor_with_a_valid_digest_is_refused")
def _(ctx):
    from txl.models.pretrained import load_tensors, save_tensors

    run = _run(ctx)
    path = run / "last" / "optimizer.safetensors"
    tensors, _ = load_tensors(path)
    name = next(k for k in sorted(tensors) if k.endswith("exp_avg_sq"))
    tensors[name] = tensors[name].to(torch.float16)
    save_tensors(path, tensors, {"txl_kind": "optimizer"})
    return _resume(run)


@case("state-optimizer-nan", "`last/optimizer.safetensors` whose second moments hold NaN (valid digest)",
      "txl train --resume RUN", "exp_avg_sq", "NaN",
      test=HOSTILE + "test_non_finite_or_negative_optimizer_moments_are_refused")
def _(ctx):
    from txl.models.pretrained import load_tensors, save_tensors

    run = _run(ctx)
    path = run / "last" / "optimizer.safetensors"
    tensors, _ = load_tensors(path)
    name = next(k for k in sorted(tensors) if k.endswith("exp_avg_sq"))
    tensors[name] = torch.full_like(tensors[name], math.nan)
    save_tensors(path, tensors, {"txl_kind": "optimizer"})
    return _resume(run)


@case("state-weights-nan", "`last/model.safetensors` holding NaN weights (saved by an older txl)",
      "txl train --resume RUN", "not finite", "--init-from", "best",
      test=HOSTILE + "test_non_finite_weights_in_last_are_refused")
def _(ctx):
    from txl.models.pretrained import load_tensors, save_tensors

    run = _run(ctx)
    path = run / "last" / "model.safetensors"
    tensors, _ = load_tensors(path)
    name = sorted(tensors)[0]
    tensors[name] = torch.full_like(tensors[name], math.nan)
    save_tensors(path, tensors, {"txl_kind": "model"})
    return _resume(run)


@case("state-no-digest", "`last/optimizer.safetensors` rewritten without txl's digest (a retyped tensor)",
      "txl train --resume RUN", "optimizer.safetensors", "txl_sha256", "restore",
      test=HOSTILE + "test_a_retyped_tensor_without_a_digest_is_refused")
def _(ctx):
    from safetensors.torch import load_file, save_file

    run = _run(ctx)
    path = run / "last" / "optimizer.safetensors"
    tensors = load_file(str(path))
    name = next(k for k in sorted(tensors) if k.endswith("exp_avg"))
    tensors[name] = tensors[name].to(torch.float64)
    save_file(tensors, str(path))
    return _resume(run)


@case("state-digest-key-flipped", "one bit flipped in the `txl_sha256` key of `last/model.safetensors`, "
      "another in its data", "txl train --resume RUN", "model.safetensors", "txl_sha256",
      test=HOSTILE + "test_one_flipped_bit_in_the_digest_key_does_not_turn_verification_off")
def _(ctx):
    run = _run(ctx)
    path = run / "last" / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[raw.index(b"txl_sha256") + 4] ^= 0x01
    raw[-3] ^= 0x10
    path.write_bytes(bytes(raw))
    return _resume(run)


@case("state-best-no-digest", "`best/model.safetensors` without its digest key and with a flipped bit",
      "txl eval RUN", "best", "txl_sha256", test=HOSTILE + "test_best_without_its_digest_is_refused_by_eval")
def _(ctx):
    run = _run(ctx)
    path = run / "best" / "model.safetensors"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    del header["__metadata__"]["txl_sha256"]
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    data = bytearray(raw[8 + n :])
    data[-3] ^= 0x10
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(data))
    return _eval(run)


@case("state-position-edited", "`last/trainer_state.json` with the data position moved on by hand",
      "txl train --resume RUN", "trainer_state.json", "edited", "exact continuation",
      test=HOSTILE + "test_an_edited_progress_in_trainer_state_is_refused")
def _(ctx):
    run = _run(ctx)
    path = run / "last" / "trainer_state.json"
    state = json.loads(path.read_text())
    state["iterator"]["position"] += 1
    path.write_text(json.dumps(state))
    return _resume(run)


# ---------------------------------------------------------------------------------------------
# A run's records: regular files only, bounded


@case("state-fifo-optimizer", "a FIFO as `last/optimizer.json`", "txl train --resume RUN", "optimizer.json",
      "FIFO", "regular file", test=HOSTILE + "test_a_fifo_among_a_runs_files_ends_resume_in_one_line")
def _(ctx):
    run = _run(ctx)
    _fifo(run / "last" / "optimizer.json")
    with hang_guard():
        return _resume(run)


@case("state-fifo-run-json", "a FIFO as a run's `run.json`", "txl train --resume RUN", "run.json", "FIFO",
      test=HOSTILE + "test_a_fifo_among_a_runs_files_ends_resume_in_one_line")
def _(ctx):
    run = _run(ctx)
    _fifo(run / "run.json")
    with hang_guard():
        return _resume(run)


@case("state-fifo-eval", "a FIFO as `last/trainer_state.json`", "txl eval RUN", "trainer_state.json", "FIFO",
      test=HOSTILE + "test_a_fifo_among_a_runs_records_ends_eval_in_one_line")
def _(ctx):
    run = _run(ctx)
    _fifo(run / "last" / "trainer_state.json")
    with hang_guard():
        return _eval(run)


@case("state-config-sparse", "a 1 GiB sparse `config.json` in a checkpoint", "txl eval CKPT", "config.json",
      "1 GiB", "more than", test=HOSTILE + "test_a_sparse_1_gb_config_json_is_refused_by_its_size_unread")
def _(ctx):
    ckpt = ctx.checkpoint_copy()
    os.truncate(ckpt / "config.json", 2**30)
    return cli("eval", str(ckpt), "--device", "cpu", "--max-tokens", "64")


# ---------------------------------------------------------------------------------------------
# Values in run.json / trainer_state.json, checked where read


@case("state-eval-tgt-len-text", 'a run whose records hold `eval_tgt_len: "abc"`', "txl eval RUN",
      "trainer_state.json", "eval_tgt_len", "'abc'", "command line")
def _(ctx):
    run = _run(ctx)
    _setting(run, "eval_tgt_len", "abc")
    return _eval(run)


@case("state-eval-tgt-len-inf", "a run whose records hold `eval_tgt_len: Infinity`", "txl eval RUN",
      "trainer_state.json", "eval_tgt_len", "inf")
def _(ctx):
    run = _run(ctx)
    _setting(run, "eval_tgt_len", math.inf)
    return _eval(run)


@case("state-tgt-len-list", "a run whose records hold `tgt_len: [1, 2]`", "txl eval RUN", "tgt_len", "[1, 2]")
def _(ctx):
    run = _run(ctx)
    _setting(run, "tgt_len", [1, 2])
    return _eval(run)


@case("state-tgt-len-negative", "a run whose records hold `tgt_len: -5`", "txl eval RUN", "tgt_len", ">= 1", "-5")
def _(ctx):
    run = _run(ctx)
    _setting(run, "tgt_len", -5)
    return _eval(run)


@case("state-eval-mem-len-huge", "a run whose records hold `eval_mem_len: 1e11`", "txl eval RUN", "eval_mem_len",
      "int")
def _(ctx):
    run = _run(ctx)
    _setting(run, "eval_mem_len", 1e11)
    return _eval(run)


@case("state-data-not-text", "a run whose records hold `data: [1]`", "txl eval RUN", "data spec", "--data")
def _(ctx):
    run = _run(ctx)
    for path in (run / "last" / "trainer_state.json", run / "best" / "trainer_state.json", run / "run.json"):
        data = json.loads(path.read_text())
        data["data"] = [1]
        path.write_text(json.dumps(data))
    return _eval(run)
