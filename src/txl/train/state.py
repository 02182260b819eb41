"""The state of a training run on disk: its directory, `run.json`, and the `last` / `best` checkpoints.

`last` holds everything an exact resume needs (weights, optimiser, scaler, RNG states, data position and
every rank's memory); `best` holds the weights with the best validation loss. Saving is atomic
(`txl.models.pretrained.atomic_directory`); restoring checks every value before it is used, so a damaged
checkpoint or one from another run is one `CheckpointError`, never a crash at the next step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from txl.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    OutputError,
    UsageError,
    describe_os_error,
    parse_json,
)
from txl.io import CONFIG_LIMIT, STATE_LIMIT
from txl.io.rundir import LOCK_NAME, RunLock, check_utf8_path, refuse_link, remove_stale_temporaries
from txl.models.pretrained import (
    WEIGHTS_NAME,
    atomic_directory,
    check_state_dict,
    first_non_finite,
    load_tensors,
    read_json,
    recover_directory,
    save_tensors,
    use_another_checkpoint,
    write_json,
    write_model_files,
)
from txl.models.registry import load_config
from txl.models.rnn.config import RNN_ARCHS
from txl.nn.memory import Memory
from txl.train.config import RunConfig, merge
from txl.train.optim import Lamb, optimizer_state_join, optimizer_state_split

if TYPE_CHECKING:
    from txl.eval.result import EvalResult
    from txl.train.loop import Trainer

LAST, BEST = "last", "best"
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


def check_out_dir(out: Path) -> None:
    """A new run's --out, before anything is created: refuse one that holds a run or is not a
    directory, and one whose nearest existing parent cannot be written."""
    if (out / LAST).exists():
        raise UsageError(f"{out} already holds a run; continue it with --resume {out} or pick a new --out")
    if out.exists() and not out.is_dir():
        raise OutputError(f"output directory {out} exists and is not a directory; pick a new --out")
    parent = out.absolute()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"cannot write to output directory {out}: {parent} is a file, not a directory; "
                          "pick a new --out")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write to output directory {out}: {parent} is not writable (permission denied); "
                          "pick a new --out")


def create_out_dir(out: Path) -> None:
    """Create a new run's --out (the last step before training) and prove it is writable."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):  # O_EXCL: never an existing entry
            pass
    except OSError as err:
        raise OutputError(f"cannot write to output directory {out}: {describe_os_error(err)}") from None


# What a run directory holds that txl wrote (its temporaries start with "." and one of these names).
RUN_ENTRIES = (LAST, BEST, "run.json", "metrics.jsonl", "result.json", "sample.txt", "tensorboard", "curves.png",
               "arena.json", LOCK_NAME)  # arena.json: `txl bench arena` records the command before training


_OVERWRITTEN = ("run.json", "metrics.jsonl", "result.json", "sample.txt", "curves.png")  # what a new run replaces


def _is_txl_entry(name: str) -> bool:
    return name in RUN_ENTRIES or any(name.startswith(f".{known}.") for known in RUN_ENTRIES)


def check_run_entries(out: Path) -> None:
    """A run directory from a stranger may hold links aimed outside it; every entry txl writes, moves
    or deletes is refused by name when it is one (the directory itself may be a link the user made)."""
    if not out.is_dir():
        return
    for name in RUN_ENTRIES:
        refuse_link(out / name, "in a run directory")
    for entry in out.iterdir():
        if entry.name.startswith(".") and _is_txl_entry(entry.name):
            refuse_link(entry, "in a run directory")


def check_foreign_files(out: Path, *, force: bool) -> None:
    """Refuse a new run's --out that holds files txl did not write (unless `force`): training would
    overwrite a user's own metrics.jsonl, run.json, result.json or sample.txt."""
    if not out.is_dir():
        return
    names = sorted(e.name for e in out.iterdir() if e.name != LOCK_NAME)
    foreign = [n for n in names if not _is_txl_entry(n)]
    # txl's names without a run.json (e.g. a metrics.jsonl alone) are not proof that txl wrote them
    unproven = [] if "run.json" in names else [n for n in names if n in _OVERWRITTEN]
    if (foreign or unproven) and not force:
        example = (foreign or unproven)[0]
        raise OutputError(f"{out} exists and holds files txl did not write ({example!r}); training would overwrite "
                          "its metrics.jsonl, run.json, result.json and sample.txt: pick an empty or new --out, or "
                          "pass --force")


def open_run_dir(out: Path, *, resume: bool, force: bool = False) -> RunLock:
    """Check and lock a run directory before anything in it is read, moved or written.

    The lock comes first (a second writer fails at once naming the holder); a new run's directory is
    created for it and `RunLock.abandon` removes it again (and the lock file) if the start fails, so a
    failed start leaves nothing behind. Then links among the entries txl touches are refused, crash
    leftovers are recovered, and a new run's --out is checked (`check_out_dir`; no files txl did not
    write unless `force`). Resume: the run must exist.
    """
    check_utf8_path(out, "--resume" if resume else "--out")
    if resume:
        if not out.is_dir():
            raise CheckpointError(f"{out} is not a txl training run (no such directory); pass the --out directory "
                                  "of an earlier `txl train`")
    elif not out.exists():
        check_out_dir(out)  # the parent: a file, or not writable
    elif not out.is_dir():
        raise OutputError(f"output directory {out} exists and is not a directory; pick a new --out")
    created = False
    if not out.exists():
        try:
            out.mkdir(parents=True)
            created = True
        except FileExistsError:  # another txl made it this instant: the lock below decides who writes
            if not out.is_dir():
                raise OutputError(f"output directory {out} exists and is not a directory; pick a new --out") from None
        except OSError as err:
            raise OutputError(f"cannot write to output directory {out}: {describe_os_error(err)}") from None
    lock = RunLock.acquire(out, created_dir=created)
    try:
        check_run_entries(out)
        remove_stale_temporaries(out, RUN_ENTRIES)  # what a killed session left half-written
        for name in (LAST, BEST):  # a crash mid-checkpoint leaves the previous one set aside
            recover_directory(out / name)
        if not resume:  # checked under the lock: no other txl can be writing it now
            check_out_dir(out)
            check_foreign_files(out, force=force)
    except BaseException:
        lock.abandon()
        raise
    return lock


def resolve_data(spec_text: str) -> str:
    """The data spec with an absolute path (stored in the run, so eval/generate/resume work from any
    directory). A spec without a path (a preset names corpora, not paths) means the default download
    location; when the corpus is not there, one line says how to get it or point at it."""
    from txl.data import parse_spec

    spec = parse_spec(spec_text)
    body = spec.text.partition("?")[0] if "?" in spec.text else spec.text
    implicit = ":" not in body
    if spec.path is not None and spec.name != "builtin":
        spec = dataclasses.replace(spec, path=os.path.abspath(spec.path))  # normalised: no "work/../data"
    if implicit and spec.info.download and spec.path is not None and not Path(spec.path).exists():
        raise DataError(f"corpus {spec.name} not found in its download location {spec.path}; fetch it with "
                        f"`txl data download {spec.info.download}` or point at your copy with --data "
                        f"{spec.name}:DIR")
    return spec.canonical()


def load_initial_weights(model, source: str | Path, vocab) -> Path:
    """Fine-tuning (`--init-from`): copy trained weights into a new run's model. The vocabulary must be
    the same one (ids mean the same symbols); the error says how the two differ."""
    from txl.models.checkpoint import load_checkpoint

    ckpt = load_checkpoint(source)
    if ckpt.vocab is not None and ckpt.vocab.fingerprint != vocab.fingerprint:
        raise DataError(f"--init-from {source}: {vocab_difference(ckpt.vocab, vocab)}; fine-tune on data with the "
                        "checkpoint's vocabulary (same tokenizer and symbols)")
    if ckpt.vocab is None and ckpt.model.config.vocab_size != vocab.size:
        raise DataError(f"--init-from {source}: the checkpoint has {ckpt.model.config.vocab_size} ids but the data has "
                        f"{vocab.size}")
    weights = ckpt.model.state_dict()
    check_state_dict(model.state_dict(), weights, ckpt.path)
    model.load_state_dict(weights)
    return ckpt.path


def vocab_difference(old, new) -> str:
    """How two vocabularies differ, in words (kind, size, the first symbols only one of them has)."""
    if old.kind != new.kind:
        return f"the checkpoint has a {old.kind} vocabulary, the data a {new.kind} vocabulary"
    text = f"the checkpoint's {old.kind} vocabulary has {old.size} ids, the data's {new.size}"
    if old.symbols is not None and new.symbols is not None:
        missing = [s for s in new.symbols if s not in set(old.symbols)][:5]
        extra = [s for s in old.symbols if s not in set(new.symbols)][:5]
        if missing:
            text += f"; the data has symbols the checkpoint lacks ({', '.join(map(repr, missing))})"
        if extra:
            text += f"; the checkpoint has symbols the data lacks ({', '.join(map(repr, extra))})"
        if not missing and not extra:
            text += "; the same symbols in a different order"
    return text


def previous_run_record(out: Path) -> dict:
    """run.json of an existing run ({} when absent). An entry that is not a small regular JSON file (a FIFO
    would block for ever, holding the run's lock) is one CheckpointError naming it; a JSON value that is
    not an object counts as no record (it is a record, not state)."""
    if not os.path.lexists(out / "run.json"):
        return {}
    data = read_json(out / "run.json", "run record", follow_links=False)
    return data if isinstance(data, dict) else {}


def write_run_file(trainer: Trainer) -> None:
    data = {"config": trainer.run.to_dict(), "model": trainer.model_config.to_dict(), "world_size": trainer.dist.world,
            "data": trainer.cfg.data, "data_as_typed": trainer.data_as_typed, "metric": trainer.metric,
            "parameters": trainer.model.num_parameters(), "torch": torch.__version__,
            "init_from": trainer.init_from, "validation": trainer.validates,
            "precision": trainer.precision}  # what `auto` became
    write_json(trainer.out / "run.json", data)


def trainer_state(trainer: Trainer) -> dict:
    """trainer_state.json of `last`: the counters, data position and configuration of the run."""
    return {"step": trainer.step, "tokens_seen": trainer.tokens_seen, "elapsed": trainer.elapsed,
            "best_valid": trainer.best_valid if math.isfinite(trainer.best_valid) else None,
            "nonfinite_streak": trainer.nonfinite_streak, "world_size": trainer.dist.world,
            "grad_accum": trainer.cfg.grad_accum, "data": trainer.cfg.data,
            "vocab_fingerprint": trainer.corpus.vocab.fingerprint, "corpus_fingerprint": trainer.corpus.fingerprint,
            "iterator": trainer.train_iter.state_dict(),
            "scaler": trainer.scaler.state_dict(), "metric": trainer.metric, "run": trainer.run.to_dict(),
            "ema_updates": None if trainer.average is None else trainer.average.updates}


def progress_digest(state: dict) -> str:
    """SHA-256 of trainer_state.json's progress (PROGRESS_KEYS) as JSON text, keys sorted."""
    progress = {key: state.get(key) for key in PROGRESS_KEYS}
    text = json.dumps(progress, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _digest_tensor(hexdigest: str) -> torch.Tensor:
    return torch.tensor(list(bytes.fromhex(hexdigest)), dtype=torch.uint8)


def non_finite_state(trainer: Trainer) -> str | None:
    """What a checkpoint would hold that is NaN or Inf (the weights, the optimiser's state, the weight
    average), named; None when all of it is finite. One host sync; checked before every checkpoint."""
    named = list(trainer.model.state_dict().items())
    for index, state in enumerate(trainer.optimizer.state.values()):
        named += [(f"optimizer state {index} {key}", value) for key, value in state.items()]
    if trainer.average is not None:
        named += list(trainer.average.tensors().items())
    return first_non_finite(named)


def save_checkpoint(trainer: Trainer, path: Path) -> None:
    """Everything for an exact resume, written atomically by rank 0 (others contribute their
    memory and RNG state through all_gather). The caller has checked the state finite (`non_finite_state`)."""
    extra: dict[str, torch.Tensor] = {}
    for j, memory in enumerate(trainer.memories):
        if memory is None:
            continue
        for layer, hidden in enumerate(memory.hidden):
            for rank, part in enumerate(trainer.dist.gather(hidden)):
                extra[f"memory.rank{rank}.chunk{j}.layer{layer}"] = part
        for k, state in enumerate(getattr(memory, "states", ())):  # a recurrent LM's LSTM states (txl.models.rnn.model)
            for rank, part in enumerate(trainer.dist.gather(state)):
                extra[f"memory.rank{rank}.chunk{j}.state{k}"] = part
    for rank, part in enumerate(trainer.dist.gather(torch.get_rng_state())):
        extra[f"rng.cpu.rank{rank}"] = part
    if trainer.dist.device.type == "cuda":
        for rank, part in enumerate(trainer.dist.gather(torch.cuda.get_rng_state(trainer.dist.device).to(trainer.dist.device))):
            extra[f"rng.cuda.rank{rank}"] = part.cpu()
    if not trainer.dist.main:
        return
    if trainer.average is not None:  # the same on every rank (every rank applies the same update)
        extra.update(trainer.average.tensors())
    opt_tensors, opt_plain = optimizer_state_split(trainer.optimizer)
    state = parse_json(json.dumps(trainer_state(trainer)))  # as it will read back (tuples become lists)
    extra[PROGRESS_TENSOR] = _digest_tensor(progress_digest(state))
    with atomic_directory(path) as tmp:
        write_model_files(trainer.model, tmp)
        trainer.corpus.vocab.save(tmp / "vocab.json")
        save_tensors(tmp / "optimizer.safetensors", opt_tensors, {"txl_kind": "optimizer"})
        save_tensors(tmp / "trainer.safetensors", extra, {"txl_kind": "trainer"})
        write_json(tmp / "optimizer.json", opt_plain)
        write_json(tmp / STATE_FILE, state)


def save_best(trainer: Trainer, result: EvalResult, *, weights: str = "live") -> None:
    """`best`: the model's current weights (weights = "average" while the weight average is applied)."""
    with atomic_directory(trainer.out / BEST) as tmp:
        write_model_files(trainer.model, tmp)
        trainer.corpus.vocab.save(tmp / "vocab.json")
        write_json(tmp / STATE_FILE, {"step": trainer.step, "valid": result.to_dict(), "metric": trainer.metric,
                                      "data": trainer.cfg.data, "weights": weights})


def restore_checkpoint(trainer: Trainer, path: Path) -> None:
    """Restore everything `save_checkpoint` wrote. The files may be damaged, edited or come from another
    run: every value is checked before it is used (types, the progress digest, the optimiser's
    hyperparameters against the run's configuration, dtypes, shapes, finiteness), and any mismatch is one
    `CheckpointError`, so a damaged state can never train on and replace this good-looking `last`."""
    where = path / STATE_FILE
    if not os.path.lexists(where):
        raise CheckpointError(f"{path.parent} is not a txl training run (no {LAST}/{STATE_FILE}); "
                              "pass the --out directory of an earlier `txl train`")
    state = check_trainer_state(read_json(where, "trainer state", follow_links=False), where)
    extra, _ = load_tensors(path / "trainer.safetensors", "trainer state", require_digest=True, follow_links=False)
    _check_progress_digest(state, extra, path, note=trainer.dist.main)
    if state["vocab_fingerprint"] != trainer.corpus.vocab.fingerprint:
        raise CheckpointError(f"{path} was trained on a different vocabulary than {trainer.cfg.data!r} has now "
                              "(the corpus files changed); restore them or start a new run")
    saved_corpus = state.get("corpus_fingerprint")  # absent in runs saved before it was recorded
    if isinstance(saved_corpus, str) and saved_corpus != trainer.corpus.fingerprint:
        raise CheckpointError(f"{path} was trained on other text than {trainer.cfg.data!r} holds now (same vocabulary, "
                              "different content); resume with the corpus the run trained on, or start a new run "
                              "with --init-from")
    saved_config = load_config(path, follow_links=False)
    if saved_config.to_dict() != trainer.model_config.to_dict():
        raise CheckpointError(f"{path}/config.json does not match this run's model config; resume with the "
                              "same configuration (only max_steps/max_minutes may change)")
    weights, _ = load_tensors(path / WEIGHTS_NAME, "checkpoint weights", require_digest=True, follow_links=False)
    check_state_dict(trainer.model.state_dict(), weights, path)
    bad = first_non_finite(weights)
    if bad is not None:
        raise CheckpointError(f"{path / WEIGHTS_NAME} holds weights that are not finite (NaN/Inf in {bad}): the run "
                              f"had diverged when it was saved; {_restart_hint(path)}")
    trainer.model.load_state_dict(weights)
    _load_optimizer(trainer, path, saved_step=state["step"])
    damaged = f"{where} is damaged"
    try:
        trainer.scaler.load_state_dict(state["scaler"])
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{damaged}: its gradient-scaler state is unusable ({err})") from None
    try:
        trainer.train_iter.load_state_dict(state["iterator"])
    except DataError as err:
        raise CheckpointError(f"{damaged} or was saved for other data: {err}") from None
    trainer.step, trainer.tokens_seen = state["step"], state["tokens_seen"]
    trainer.saved_step = state["step"]
    trainer.elapsed = float(state["elapsed"])
    trainer.best_valid = math.inf if state["best_valid"] is None else float(state["best_valid"])
    trainer.nonfinite_streak = state["nonfinite_streak"]
    bad = first_non_finite({k: v for k, v in extra.items() if not k.startswith("rng.")})
    if bad is not None:
        raise CheckpointError(f"{path}/trainer.safetensors holds {bad} with NaN/Inf values; the checkpoint is "
                              f"damaged: {_restart_hint(path)}")
    if trainer.average is not None:
        trainer.average.load(extra, state.get("ema_updates"), f"{path}/trainer.safetensors")
    same_layout = state["world_size"] == trainer.dist.world and state["grad_accum"] == trainer.cfg.grad_accum
    if same_layout:
        _load_memory_and_rng(trainer, extra, path)
    elif trainer.dist.main:
        print(f"note: {path} was written with world size {state['world_size']} × grad_accum "
              f"{state['grad_accum']}; memory and RNG restart (the resume is not bit-exact)",
              file=sys.stderr)


def _restart_hint(path: Path) -> str:
    """The fix when `last` cannot be resumed: start a new run from the run's other checkpoint if there is one."""
    advice = use_another_checkpoint(path)
    if advice.startswith("use "):
        other = advice.removeprefix("use ").partition(" (")[0]
        return f"start a new run from the run's other weights (--init-from {other} --out NEW), or restore {path}"
    return f"restore {path} or start a new run"


def _check_progress_digest(state: dict, extra: dict[str, torch.Tensor], path: Path, *, note: bool = True) -> None:
    """trainer_state.json's progress against the digest trainer.safetensors holds (runs saved before it was
    recorded have none: resumed as they always were, with a note)."""
    stored = extra.pop(PROGRESS_TENSOR, None)
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


def _load_optimizer(trainer: Trainer, path: Path, *, saved_step: int) -> None:
    opt_tensors, _ = load_tensors(path / "optimizer.safetensors", "optimizer state", require_digest=True,
                                  follow_links=False)
    where = path / "optimizer.json"
    opt_plain = read_json(where, "optimizer state", limit=STATE_LIMIT, follow_links=False)
    if not (isinstance(opt_plain, dict) and isinstance(opt_plain.get("param_groups"), list)
            and isinstance(opt_plain.get("state", {}), dict)):
        raise CheckpointError(f"{where} is damaged: expected an object with param_groups and "
                              "state; restore the file or start a new run")
    fresh_groups = trainer.optimizer.state_dict()["param_groups"]
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
    _check_optimizer_tensors(trainer, opt_tensors, opt_plain.get("state", {}), path, saved_step)
    try:
        joined = optimizer_state_join(opt_tensors, {**opt_plain, "param_groups": groups})
        trainer.optimizer.load_state_dict(joined)
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as err:
        raise CheckpointError(f"{unusable}: {type(err).__name__}: {err}") from None


def _check_optimizer_tensors(trainer: Trainer, tensors: dict[str, torch.Tensor], plain: dict, path: Path,
                             saved_step: int) -> None:
    """Every saved optimiser tensor against the parameter it belongs to, before torch sees it (torch casts
    them to the parameter's dtype and compares neither keys nor shapes; a mismatch would only fail, or
    silently train on garbage, at the next step): the keys of its group's algorithm, the dtype and shape a
    fresh optimiser would create, finite values, second moments >= 0, step counts whole and <= the run's."""
    unusable = (f"{path}/optimizer.safetensors: the optimizer state does not fit this model (the checkpoint is "
                "damaged or from another run)")
    lamb = isinstance(trainer.optimizer, Lamb)
    params: dict[int, tuple[torch.nn.Parameter, set[str]]] = {}
    fresh = trainer.optimizer.state_dict()["param_groups"]
    for group, described in zip(trainer.optimizer.param_groups, fresh):
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


def _load_recurrent_memory(trainer: Trainer, extra: dict[str, torch.Tensor], path: Path, rows: int) -> None:
    """The carried state of a recurrent LM (txl.models.rnn.model.RecurrentMemory): per layer h and c (rows, hidden
    size), and per attention layer its memory (rows, <= mem_len, d_model); checked against the model."""
    from txl.models.rnn.model import RecurrentMemory

    model, rank = trainer.model, trainer.dist.rank
    sizes = [layer.hidden_size if hasattr(layer, "hidden_size") else layer.rnn.hidden_size for layer in model.layers]
    state_shapes = [(rows, size) for size in sizes for _ in (0, 1)]
    width, mem_len = trainer.model_config.d_model, trainer.model_config.mem_len
    for j in range(trainer.cfg.grad_accum):
        states = [extra.get(f"memory.rank{rank}.chunk{j}.state{k}") for k in range(len(state_shapes))]
        hidden = [extra.get(f"memory.rank{rank}.chunk{j}.layer{i}") for i in range(len(model.attention_layers))]
        if all(t is None for t in states + hidden):
            trainer.memories[j] = None
            continue
        fits = all(t is not None and t.dtype.is_floating_point for t in states + hidden) and all(
            tuple(t.shape) == shape for t, shape in zip(states, state_shapes)) and all(
            t.dim() == 3 and t.shape[0] == rows and t.shape[1] <= mem_len and t.shape[2] == width for t in hidden)
        if not fits:
            raise CheckpointError(f"{path}/trainer.safetensors: the saved recurrent state does not fit this model "
                                  f"(expected LSTM states of shapes {state_shapes} and {len(hidden)} attention "
                                  f"memories of shape ({rows}, <= {mem_len}, {width})); the checkpoint is damaged "
                                  "or from another run")
        device = trainer.dist.device
        trainer.memories[j] = RecurrentMemory(tuple(t.to(device) for t in hidden),
                                              states=tuple(t.to(device) for t in states))


def _load_memory_and_rng(trainer: Trainer, extra: dict[str, torch.Tensor], path: Path) -> None:
    rank = trainer.dist.rank
    rows = trainer.cfg.batch_size // trainer.dist.world // trainer.cfg.grad_accum
    width, mem_len = trainer.model_config.d_model, trainer.model_config.mem_len
    if trainer.model_config.arch in RNN_ARCHS:
        _load_recurrent_memory(trainer, extra, path, rows)
    else:
        for j in range(trainer.cfg.grad_accum):
            names = [f"memory.rank{rank}.chunk{j}.layer{i}" for i in range(trainer.model_config.n_layer)]
            layers = [extra[n] for n in names if n in extra]
            if layers and (len(layers) != len(names) or any(
                    t.dim() != 3 or t.shape[0] != rows or t.shape[1] > mem_len or t.shape[2] != width
                    or not t.dtype.is_floating_point for t in layers)):
                raise CheckpointError(f"{path}/trainer.safetensors: the saved memory does not fit this model "
                                      f"(expected {trainer.model_config.n_layer} float tensors of shape ({rows}, <= {mem_len}, "
                                      f"{width})); the checkpoint is damaged or from another run")
            trainer.memories[j] = Memory(tuple(t.to(trainer.dist.device) for t in layers)) if layers else None
    try:
        torch.set_rng_state(extra[f"rng.cpu.rank{rank}"])
        if trainer.dist.device.type == "cuda" and f"rng.cuda.rank{rank}" in extra:
            torch.cuda.set_rng_state(extra[f"rng.cuda.rank{rank}"], trainer.dist.device)
    except (KeyError, TypeError, RuntimeError) as err:
        raise CheckpointError(f"{path}/trainer.safetensors: the saved random-number state is missing or "
                              f"unusable ({type(err).__name__}: {err}); the checkpoint is damaged") from None


# Types of the trainer_state.json fields `restore_checkpoint` reads (JSON gives us untyped values).
_STATE_FIELDS: dict[str, tuple[type, ...]] = {
    "step": (int,), "tokens_seen": (int,), "elapsed": (int, float), "best_valid": (int, float, type(None)),
    "nonfinite_streak": (int,), "world_size": (int,), "grad_accum": (int,), "vocab_fingerprint": (str,),
    "iterator": (dict,), "scaler": (dict,), "run": (dict,),
}


def check_trainer_state(state, where: Path) -> dict:
    """trainer_state.json must be an object holding every field `restore_checkpoint` reads, typed."""
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
