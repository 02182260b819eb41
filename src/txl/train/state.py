"""The files of a checkpoint's state and their checks: trainer_state.json (its fields, typed, and the digest
of its progress), the optimiser's saved state (against the run's configuration and parameters), and the
configuration a resumed run continues with. What saves and restores them: `txl.train.checkpoint`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

from txl.errors import CheckpointError, ConfigError
from txl.io import CONFIG_LIMIT, STATE_LIMIT
from txl.models.pretrained import load_tensors, read_json, recover_directory
from txl.train.config import RunConfig, merge
from txl.train.optim import Lamb, optimizer_state_join
from txl.train.rundir import BEST, LAST, check_run_entries

__all__ = ["BEST", "LAST", "STATE_FILE", "check_trainer_state", "load_optimizer", "resume_config"]

OPTIMIZER_STATE_KEYS = {"step", "exp_avg", "exp_avg_sq"}  # per parameter, for adam, adamw and lamb alike
MUON_STATE_KEYS = {"momentum_buffer"}  # per matrix of a group that runs Muon (txl.train.optim.MuonAdam)
STATE_FILE = "trainer_state.json"
# trainer_state.json's progress (what an exact resume continues from), covered by a SHA-256 that
# trainer.safetensors holds as a tensor, so the digest is itself covered by that file's required digest:
# an edited position is refused instead of resumed "exactly". Not covered: the fingerprints (compared
# with the data anyway), the run's configuration (resume_config checks it as a config) and `elapsed`
# (a clock reading; it only moves a minutes-based schedule, which is not bit-exact anyway).
PROGRESS_KEYS = ("step", "tokens_seen", "iterator", "nonfinite_streak", "best_valid", "ema_updates", "scaler",
                 "world_size", "grad_accum")
PROGRESS_TENSOR = "trainer_state.sha256"  # its name in trainer.safetensors (32 uint8)


def progress_digest(state: dict) -> str:
    """SHA-256 of trainer_state.json's progress (PROGRESS_KEYS) as JSON text, keys sorted."""
    progress = {key: state.get(key) for key in PROGRESS_KEYS}
    text = json.dumps(progress, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def digest_tensor(state: dict) -> torch.Tensor:
    """The progress digest of trainer_state.json as trainer.safetensors holds it (32 uint8)."""
    return torch.tensor(list(bytes.fromhex(progress_digest(state))), dtype=torch.uint8)


def check_progress_digest(state: dict, stored: torch.Tensor | None, path: Path, *, note: bool = True) -> None:
    """trainer_state.json's progress against the digest trainer.safetensors holds (runs saved before it was
    recorded have none: resumed as they always were, with a note)."""
    where = path / STATE_FILE
    if stored is None:
        if note:
            print(f"note: {path} was saved by an older txl without a digest of its {STATE_FILE}; its progress is "
                  "resumed unchecked", file=sys.stderr)
        return
    try:
        expected = bytes(stored.tolist()).hex() if stored.dtype == torch.uint8 and stored.shape == (32,) else None
        actual = progress_digest(state)
    except ValueError:  # NaN/Infinity in the progress (allow_nan=False)
        actual = None
    if expected is None or actual != expected:
        raise CheckpointError(f"{where} was edited or is damaged: its progress (step, token counts, data position) "
                              "does not match the digest stored in trainer.safetensors, so the resume would not be "
                              "the exact continuation it claims to be; restore the file or start a new run")


def check_optimizer_hyperparameters(fresh: list[dict], saved: list[dict], where: Path) -> None:
    """The saved parameter groups must hold the hyperparameters this run's configuration gives (a freshly
    built optimiser's), except the learning rate, which the schedule sets at every step (finite, >= 0).
    torch copies them unchecked: Adam's beta2 edited to 9.999 trains one step and makes every weight NaN."""
    if not isinstance(saved, list) or len(saved) != len(fresh):
        count = len(saved) if isinstance(saved, list) else "no list of"
        raise CheckpointError(f"{where} is damaged: {count} parameter groups, this run's optimiser has "
                              f"{len(fresh)}; restore the file or start a new run")
    for index, (want, got) in enumerate(zip(fresh, saved)):
        if not isinstance(got, dict):
            raise CheckpointError(f"{where} is damaged: parameter group {index} is not an object; restore the file "
                                  "or start a new run")
        for key, value in want.items():
            if key in _IMPLEMENTATION_FLAGS:
                continue
            found = got.get(key, "(missing)")
            if key == "lr":
                ok = isinstance(found, int | float) and not isinstance(found, bool) and 0 <= found < math.inf
            else:
                ok = _same_value(value, found)
            if not ok:
                shown = json.dumps(found) if key in got else "missing"
                wanted = "a finite number >= 0" if key == "lr" else json.dumps(list(value) if isinstance(
                    value, tuple) else value)
                raise CheckpointError(f"{where} does not match this run's configuration: parameter group {index} has "
                                      f"{key} {shown[:80]} where the run gives {wanted[:80]}; the file is damaged "
                                      "or was edited: restore it, or start a new run (--init-from keeps the weights)")


# How torch runs an optimiser, not what it computes: taken from this process's optimiser (a run saved
# where the fused kernel exists resumes where it does not).
_IMPLEMENTATION_FLAGS = ("foreach", "fused", "capturable", "differentiable")


def _same_value(want: Any, got: Any) -> bool:
    """Equal, and of the same kind (JSON turned tuples into lists; True is not 1)."""
    if isinstance(want, tuple | list):
        return isinstance(got, tuple | list) and len(got) == len(want) and all(map(_same_value, want, got))
    if isinstance(want, bool) or want is None or isinstance(got, bool):
        return got is want
    if isinstance(want, int | float):
        return isinstance(got, int | float) and got == want
    return type(got) is type(want) and got == want


def load_optimizer(optimizer, path: Path, *, saved_step: int, apply=None) -> None:
    """optimizer.safetensors + optimizer.json of `path` into `optimizer`, every value checked first.
    `apply(state)` loads the checked state (default `optimizer.load_state_dict`; a sharded model's
    optimiser takes it through `txl.train.distributed.set_full_optimizer_state`)."""
    opt_tensors, _ = load_tensors(path / "optimizer.safetensors", "optimizer state", require_digest=True,
                                  follow_links=False)
    where = path / "optimizer.json"
    opt_plain = read_json(where, "optimizer state", limit=STATE_LIMIT, follow_links=False)
    if not (isinstance(opt_plain, dict) and isinstance(opt_plain.get("param_groups"), list)
            and isinstance(opt_plain.get("state", {}), dict)):
        raise CheckpointError(f"{where} is damaged: expected an object with param_groups and "
                              "state; restore the file or start a new run")
    fresh_groups = optimizer.state_dict()["param_groups"]
    check_optimizer_hyperparameters(fresh_groups, opt_plain["param_groups"], where)
    unusable = f"{path}: the optimizer state does not fit this model (the checkpoint is damaged or from another run)"
    groups = []
    for want, got in zip(fresh_groups, opt_plain["param_groups"]):
        if not isinstance(got, dict):
            raise CheckpointError(f"{where} is damaged: a parameter group is not an object; restore the file")
        if got.get("params") != want["params"]:
            raise CheckpointError(f"{unusable}: its parameter groups list other parameters")
        # only what this optimiser has, its implementation flags its own
        groups.append({key: want[key] if key in _IMPLEMENTATION_FLAGS else got[key] for key in want
                       if key in got or key in _IMPLEMENTATION_FLAGS})
    _check_optimizer_tensors(optimizer, opt_tensors, opt_plain.get("state", {}), path, saved_step)
    try:
        joined = optimizer_state_join(opt_tensors, {**opt_plain, "param_groups": groups})
        (optimizer.load_state_dict if apply is None else apply)(joined)
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as err:
        raise CheckpointError(f"{unusable}: {type(err).__name__}: {err}") from None


def _check_optimizer_tensors(optimizer, tensors: dict[str, torch.Tensor], plain: dict, path: Path,
                             saved_step: int) -> None:
    """Every saved optimiser tensor against the parameter it belongs to, before torch sees it (torch casts
    them to the parameter's dtype and compares neither keys nor shapes; a mismatch would only fail, or
    silently train on garbage, at the next step): the keys of its group's algorithm, the dtype and shape a
    fresh optimiser would create, finite values, second moments >= 0, step counts whole and <= the run's."""
    unusable = (f"{path}/optimizer.safetensors: the optimizer state does not fit this model (the checkpoint is "
                "damaged or from another run)")
    lamb = isinstance(optimizer, Lamb)
    params: dict[int, tuple[torch.nn.Parameter, set[str]]] = {}
    fresh = optimizer.state_dict()["param_groups"]
    for group, described in zip(optimizer.param_groups, fresh):
        keys = MUON_STATE_KEYS if group.get("muon") else OPTIMIZER_STATE_KEYS
        for param, index in zip(group["params"], described["params"]):
            params[index] = (param, keys)
    for index, entry in plain.items():
        if not (isinstance(entry, dict) and not entry):  # txl's optimisers keep all their state in tensors
            raise CheckpointError(f"{path}/optimizer.json is damaged: the state of parameter {str(index)[:20]} holds "
                                  "plain values; restore the file or start a new run")
    found: dict[int, set[str]] = {}
    for name, value in tensors.items():
        prefix, index_text, key = (name.split(".", 2) + ["", ""])[:3]
        index = int(index_text) if prefix == "state" and index_text.isdigit() else -1
        if index not in params or key not in params[index][1]:
            raise CheckpointError(f"{unusable}: unexpected tensor {name[:80]!r}")
        param, _ = params[index]
        found.setdefault(index, set()).add(key)
        if key == "step":
            ok = value.dtype in (torch.float32, torch.float64) and value.numel() == 1
            count = float(value.reshape(-1)[0]) if ok else math.nan
            if not (ok and math.isfinite(count) and count == int(count) and 0 <= count <= saved_step):
                got = f"{value.dtype} of shape {tuple(value.shape)}" if not ok else repr(count)
                raise CheckpointError(f"{unusable}: the step count of parameter {index} is {got}, expected a "
                                      f"whole number from 0 to the run's step {saved_step}")
            continue
        dtype = torch.float32 if lamb else param.dtype
        if value.dtype != dtype or tuple(value.shape) != tuple(param.shape):
            raise CheckpointError(f"{unusable}: {key!r} of a parameter of shape {tuple(param.shape)} and dtype "
                                  f"{param.dtype} is a {value.dtype} tensor of shape {tuple(value.shape)}")
        if not bool(torch.isfinite(value).all()) or (key == "exp_avg_sq" and bool((value < 0).any())):
            what = "negative values" if bool(torch.isfinite(value).all()) else "NaN/Inf values"
            raise CheckpointError(f"{unusable}: {key!r} of parameter {index} holds {what}")
    for index, keys in found.items():
        expected = params[index][1]
        if keys != expected:
            raise CheckpointError(f"{unusable}: a parameter's state holds {sorted(keys)}, expected {sorted(expected)}")


# Types of the trainer_state.json fields `Checkpointer.restore` reads (JSON gives us untyped values).
_STATE_FIELDS: dict[str, tuple[type, ...]] = {
    "step": (int,), "tokens_seen": (int,), "elapsed": (int, float), "best_valid": (int, float, type(None)),
    "nonfinite_streak": (int,), "world_size": (int,), "grad_accum": (int,), "vocab_fingerprint": (str,),
    "iterator": (dict,), "scaler": (dict,), "run": (dict,),
}


def check_trainer_state(state, where: Path) -> dict:
    """trainer_state.json must be an object holding every field `Checkpointer.restore` reads, typed."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{where} is damaged: it holds a JSON {type(state).__name__}, not an object")
    for key, types in _STATE_FIELDS.items():
        value = state.get(key)
        if key not in state or not isinstance(value, types) or isinstance(value, bool):
            raise CheckpointError(f"{where} is damaged: {key!r} is missing or has the wrong type (expected "
                                  f"{' or '.join(t.__name__ for t in types)}); restore the file or start a new run")
        if isinstance(value, int | float) and (value < 0 or not math.isfinite(value) or value >= 2**63
                                               or (key in ("world_size", "grad_accum") and value < 1)):
            raise CheckpointError(f"{where} is damaged: {key!r} is {value!r}; restore the file or start a new run")
    return state


def _check_param_groups(fresh: list[dict], saved) -> None:
    """`check_optimizer_hyperparameters` raising ValueError (the name tests/test_optim.py imports)."""
    try:
        check_optimizer_hyperparameters(fresh, saved, Path("optimizer.json"))
    except CheckpointError as err:
        raise ValueError(str(err)) from None


def resume_config(run_dir: Path, *, max_steps: int | None = None, max_minutes: float | None = None) -> RunConfig:
    """The configuration saved in RUN/last (after crash recovery), with a new step or time budget.
    The caller holds the run's lock (`open_run_dir`): recovery must not race another writer."""
    check_run_entries(run_dir)
    recover_directory(run_dir / LAST)
    where = run_dir / LAST / STATE_FILE
    if not os.path.lexists(where):
        raise CheckpointError(f"{run_dir} is not a txl training run (no {LAST}/{STATE_FILE}); pass the --out "
                              "directory of an earlier `txl train`")
    # a regular file of at most CONFIG_LIMIT bytes (a FIFO here would block for ever, holding the lock)
    saved = check_trainer_state(read_json(where, "training state", limit=CONFIG_LIMIT, follow_links=False), where)
    try:
        run = RunConfig.from_dict(saved["run"], str(where))
    except ConfigError as err:
        raise CheckpointError(f"{where} is damaged: {err}") from None
    budget = {"max_steps": max_steps, "max_minutes": max_minutes}
    merge(run, {"train": {k: v for k, v in budget.items() if v is not None}}, "command-line flags")
    return run
