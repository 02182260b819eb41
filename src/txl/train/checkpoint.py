"""The `last` and `best` checkpoints of a run, written and read by a `Checkpointer` over components that
save and restore their own state (torchtitan's pattern): the model, the optimiser, the gradient scaler,
the data position, the run's progress, the weight average, and the memory and RNG states.

`last` holds everything an exact resume needs; `best` holds the weights with the best validation loss.
The files are those of every earlier txl (model.safetensors + config.json, vocab.json, optimizer.safetensors
+ optimizer.json, trainer.safetensors, trainer_state.json), so a run resumes bit-exactly across versions
(tests/test_legacy_run.py). Saving is atomic (`txl.models.pretrained.atomic_directory`); restoring checks
every value before it is used, in a fixed order, so a damaged checkpoint or one from another run is one
`CheckpointError`, never a crash at the next step.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from txl.data.corpus import fingerprint_matches  # today's content form, or the path-hashing one of old runs
from txl.errors import CheckpointError, DataError, parse_json
from txl.models.pretrained import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    atomic_directory,
    check_state_dict,
    first_non_finite,
    load_tensors,
    read_json,
    save_tensors,
    use_another_checkpoint,
    write_json,
    write_model_files,
)
from txl.models.registry import load_config
from txl.models.rnn.config import RNN_ARCHS
from txl.nn.memory import Memory
from txl.train.distributed import (
    full_model_state,
    full_optimizer_state,
    local_tensor,
    set_full_model_state,
    set_full_optimizer_state,
)
from txl.train.optim import optimizer_state_split
from txl.train.rundir import BEST, LAST
from txl.train.state import (
    PROGRESS_TENSOR,
    STATE_FILE,
    check_progress_digest,
    check_trainer_state,
    digest_tensor,
    load_optimizer,
)


@dataclass
class Progress:
    """Where the run is: what `last` resumes from besides the tensors."""

    step: int = 0
    tokens_seen: int = 0
    elapsed: float = 0.0  # training seconds over all sessions of this run
    best_valid: float = math.inf
    nonfinite_streak: int = 0
    saved_step: int | None = None  # the step `last` holds (None: no checkpoint yet)


def restart_hint(path: Path) -> str:
    """The fix when `last` cannot be resumed: start a new run from the run's other checkpoint if there is one."""
    advice = use_another_checkpoint(path)
    if advice.startswith("use "):
        other = advice.removeprefix("use ").partition(" (")[0]
        return f"start a new run from the run's other weights (--init-from {other} --out NEW), or restore {path}"
    return f"restore {path} or start a new run"


class Component:
    """One part of a run's state: its fields of trainer_state.json, its tensors in trainer.safetensors,
    its own files, and how it is checked and restored from them."""

    def state(self) -> dict:
        return {}

    def tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def write(self, directory: Path) -> None:
        pass

    def load(self, state: dict, extra: dict[str, torch.Tensor], path: Path) -> None:
        pass


class ModelState(Component):
    """The weights. A sharded model's (train.parallelism = "fsdp") are gathered whole first (`gather`, a
    collective every rank calls) and written as one process's; a restore gives each rank its shard."""

    def __init__(self, model, config, *, sharded: bool = False):
        self.model, self.config, self.sharded = model, config, sharded

    def gather(self) -> dict[str, torch.Tensor] | None:
        """The whole weights on rank 0 when sharded (a collective), else None (the model holds them)."""
        return full_model_state(self.model) if self.sharded else None

    def write(self, directory: Path, weights: dict[str, torch.Tensor] | None = None) -> None:
        if weights is None:
            write_model_files(self.model, directory)
        else:  # what write_model_files writes, from the gathered weights
            write_json(directory / CONFIG_NAME, self.config.to_dict())
            save_tensors(directory / WEIGHTS_NAME, weights, {"txl_kind": "model"})

    def check_config(self, path: Path) -> None:
        if load_config(path, follow_links=False).to_dict() != self.config.to_dict():
            raise CheckpointError(f"{path}/config.json does not match this run's model config; resume with the "
                                  "same configuration (only max_steps/max_minutes may change)")

    def load(self, state, extra, path) -> None:
        weights, _ = load_tensors(path / WEIGHTS_NAME, "checkpoint weights", require_digest=True, follow_links=False)
        check_state_dict(self.model.state_dict(), weights, path)
        bad = first_non_finite(weights)
        if bad is not None:
            raise CheckpointError(f"{path / WEIGHTS_NAME} holds weights that are not finite (NaN/Inf in {bad}): the "
                                  f"run had diverged when it was saved; {restart_hint(path)}")
        if self.sharded:
            current = self.model.state_dict()
            set_full_model_state(self.model, {k: v.to(local_tensor(current[k]).device) for k, v in weights.items()})
        else:
            self.model.load_state_dict(weights)


class OptimizerState(Component):
    """The optimiser's state; a sharded model's (`model` given) is gathered whole on rank 0 for the files and
    set back as shards on every rank, so the files are those of one process."""

    def __init__(self, optimizer, *, model=None):
        self.optimizer, self.model = optimizer, model

    def gather(self) -> dict | None:
        """The whole state in `optimizer.state_dict()`'s form on rank 0 when sharded (a collective), else None."""
        return None if self.model is None else full_optimizer_state(self.model, self.optimizer)

    def write(self, directory: Path, whole: dict | None = None) -> None:
        tensors, plain = optimizer_state_split(self.optimizer if whole is None else _Gathered(whole))
        save_tensors(directory / "optimizer.safetensors", tensors, {"txl_kind": "optimizer"})
        write_json(directory / "optimizer.json", plain)

    def load(self, state, extra, path) -> None:
        apply = None if self.model is None else (
            lambda joined: set_full_optimizer_state(self.model, self.optimizer, joined))
        load_optimizer(self.optimizer, path, saved_step=state["step"], apply=apply)


class _Gathered:
    """A gathered optimiser state where `optimizer_state_split` reads an optimiser's."""

    def __init__(self, state: dict):
        self._state = state

    def state_dict(self) -> dict:
        return self._state


class ScalerState(Component):
    def __init__(self, scaler):
        self.scaler = scaler

    def state(self) -> dict:
        return {"scaler": self.scaler.state_dict()}

    def load(self, state, extra, path) -> None:
        try:
            self.scaler.load_state_dict(state["scaler"])
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            raise CheckpointError(f"{path / STATE_FILE} is damaged: its gradient-scaler state is unusable "
                                  f"({err})") from None


class DataState(Component):
    """The corpus (its vocabulary and text, by fingerprint) and the training stream's position."""

    def __init__(self, corpus, batches, spec: str):
        self.corpus, self.batches, self.spec = corpus, batches, spec

    def state(self) -> dict:
        return {"data": self.spec, "vocab_fingerprint": self.corpus.vocab.fingerprint,
                "corpus_fingerprint": self.corpus.fingerprint, "iterator": self.batches.state_dict()}

    def write(self, directory: Path) -> None:
        self.corpus.vocab.save(directory / "vocab.json")

    def check_corpus(self, state: dict, path: Path) -> None:
        if state["vocab_fingerprint"] != self.corpus.vocab.fingerprint:
            raise CheckpointError(f"{path} was trained on a different vocabulary than {self.spec!r} has now "
                                  "(the corpus files changed); restore them or start a new run")
        saved_corpus = state.get("corpus_fingerprint")  # absent in runs saved before it was recorded
        if isinstance(saved_corpus, str) and not fingerprint_matches(self.corpus, saved_corpus):
            raise CheckpointError(f"{path} was trained on other text than {self.spec!r} holds now (same vocabulary, "
                                  "different content); resume with the corpus the run trained on, or start a new "
                                  "run with --init-from")

    def load(self, state, extra, path) -> None:
        try:
            self.batches.load_state_dict(state["iterator"])
        except DataError as err:
            raise CheckpointError(f"{path / STATE_FILE} is damaged or was saved for other data: {err}") from None


class ProgressState(Component):
    """The counters, the layout the memories were saved for, and the run's configuration."""

    def __init__(self, progress: Progress, *, run, metric: str, world: int):
        self.progress, self.run, self.metric, self.world = progress, run, metric, world

    def state(self) -> dict:
        p = self.progress
        return {"step": p.step, "tokens_seen": p.tokens_seen, "elapsed": p.elapsed,
                "best_valid": p.best_valid if math.isfinite(p.best_valid) else None,
                "nonfinite_streak": p.nonfinite_streak, "world_size": self.world,
                "grad_accum": self.run.train.grad_accum, "metric": self.metric, "run": self.run.to_dict()}

    def load(self, state, extra, path) -> None:
        p = self.progress
        p.step, p.tokens_seen, p.saved_step = state["step"], state["tokens_seen"], state["step"]
        p.elapsed = float(state["elapsed"])
        p.best_valid = math.inf if state["best_valid"] is None else float(state["best_valid"])
        p.nonfinite_streak = state["nonfinite_streak"]


class FiniteTensors(Component):
    """trainer.safetensors' memories and weight average must be finite (checked before either is used)."""

    def load(self, state, extra, path) -> None:
        bad = first_non_finite({k: v for k, v in extra.items() if not k.startswith("rng.")})
        if bad is not None:
            raise CheckpointError(f"{path}/trainer.safetensors holds {bad} with NaN/Inf values; the checkpoint is "
                                  f"damaged: {restart_hint(path)}")


class AverageState(Component):
    """The weight average (`train.ema`): the same on every rank (every rank applies the same update)."""

    def __init__(self, average):
        self.average = average

    def state(self) -> dict:
        return {"ema_updates": None if self.average is None else self.average.updates}

    def tensors(self) -> dict[str, torch.Tensor]:
        return {} if self.average is None else self.average.tensors()

    def load(self, state, extra, path) -> None:
        if self.average is not None:
            self.average.load(extra, state.get("ema_updates"), f"{path}/trainer.safetensors")


class MemoryState(Component):
    """Every rank's memories (one per micro-batch, held by the objective) and RNG states: gathered to rank 0
    on save; restored only when the world size and grad_accum are those they were saved with."""

    def __init__(self, objective, dist, *, model, config, batch_size: int, grad_accum: int):
        self.objective, self.dist, self.model, self.config = objective, dist, model, config
        self.rows = batch_size // dist.world // grad_accum
        self.grad_accum = grad_accum

    def gather(self) -> dict[str, torch.Tensor]:
        """A collective: every rank calls it at every save."""
        dist, extra = self.dist, {}
        for j, memory in enumerate(self.objective.memories):
            if memory is None:
                continue
            for layer, hidden in enumerate(memory.hidden):
                for rank, part in enumerate(dist.gather(hidden)):
                    extra[f"memory.rank{rank}.chunk{j}.layer{layer}"] = part
            for k, state in enumerate(getattr(memory, "states", ())):  # a recurrent LM's LSTM states
                for rank, part in enumerate(dist.gather(state)):
                    extra[f"memory.rank{rank}.chunk{j}.state{k}"] = part
        for rank, part in enumerate(dist.gather(torch.get_rng_state())):
            extra[f"rng.cpu.rank{rank}"] = part
        if dist.device.type == "cuda":
            for rank, part in enumerate(dist.gather(torch.cuda.get_rng_state(dist.device).to(dist.device))):
                extra[f"rng.cuda.rank{rank}"] = part.cpu()
        return extra

    def load(self, state, extra, path) -> None:
        if state["world_size"] != self.dist.world or state["grad_accum"] != self.grad_accum:
            if self.dist.main:
                print(f"note: {path} was written with world size {state['world_size']} × grad_accum "
                      f"{state['grad_accum']}; memory and RNG restart (the resume is not bit-exact)", file=sys.stderr)
            return
        # the saved format differs: a recurrent LM also carries its LSTM states (txl.models.rnn.model)
        load = self._load_recurrent if self.config.arch in RNN_ARCHS else self._load_attention
        for j in range(self.grad_accum):
            self.objective.memories[j] = load(extra, path, j)
        rank = self.dist.rank
        try:
            torch.set_rng_state(extra[f"rng.cpu.rank{rank}"])
            if self.dist.device.type == "cuda" and f"rng.cuda.rank{rank}" in extra:
                torch.cuda.set_rng_state(extra[f"rng.cuda.rank{rank}"], self.dist.device)
        except (KeyError, TypeError, RuntimeError) as err:
            raise CheckpointError(f"{path}/trainer.safetensors: the saved random-number state is missing or "
                                  f"unusable ({type(err).__name__}: {err}); the checkpoint is damaged") from None

    def _load_attention(self, extra, path: Path, j: int) -> Memory | None:
        rank, rows, config = self.dist.rank, self.rows, self.config
        width, mem_len = config.d_model, config.mem_len
        names = [f"memory.rank{rank}.chunk{j}.layer{i}" for i in range(config.n_layer)]
        layers = [extra[n] for n in names if n in extra]
        if layers and (len(layers) != len(names) or any(
                t.dim() != 3 or t.shape[0] != rows or t.shape[1] > mem_len or t.shape[2] != width
                or not t.dtype.is_floating_point for t in layers)):
            raise CheckpointError(f"{path}/trainer.safetensors: the saved memory does not fit this model "
                                  f"(expected {config.n_layer} float tensors of shape ({rows}, <= {mem_len}, "
                                  f"{width})); the checkpoint is damaged or from another run")
        return Memory(tuple(t.to(self.dist.device) for t in layers)) if layers else None

    def _load_recurrent(self, extra, path: Path, j: int):
        """Per layer h and c (rows, hidden size), and per attention layer its memory (rows, <= mem_len,
        d_model) (txl.models.rnn.model.RecurrentMemory); checked against the model."""
        from txl.models.rnn.model import RecurrentMemory

        model, rank, rows = self.model, self.dist.rank, self.rows
        sizes = [layer.hidden_size if hasattr(layer, "hidden_size") else layer.rnn.hidden_size
                 for layer in model.layers]
        state_shapes = [(rows, size) for size in sizes for _ in (0, 1)]
        width, mem_len = self.config.d_model, self.config.mem_len
        states = [extra.get(f"memory.rank{rank}.chunk{j}.state{k}") for k in range(len(state_shapes))]
        hidden = [extra.get(f"memory.rank{rank}.chunk{j}.layer{i}") for i in range(len(model.attention_layers))]
        if all(t is None for t in states + hidden):
            return None
        fits = all(t is not None and t.dtype.is_floating_point for t in states + hidden) and all(
            tuple(t.shape) == shape for t, shape in zip(states, state_shapes)) and all(
            t.dim() == 3 and t.shape[0] == rows and t.shape[1] <= mem_len and t.shape[2] == width for t in hidden)
        if not fits:
            raise CheckpointError(f"{path}/trainer.safetensors: the saved recurrent state does not fit this model "
                                  f"(expected LSTM states of shapes {state_shapes} and {len(hidden)} attention "
                                  f"memories of shape ({rows}, <= {mem_len}, {width})); the checkpoint is damaged "
                                  "or from another run")
        device = self.dist.device
        return RecurrentMemory(tuple(t.to(device) for t in hidden), states=tuple(t.to(device) for t in states))


class Checkpointer:
    """Saves and restores a run's components; `last` and `best` under `out`."""

    def __init__(self, out: Path, dist, *, model: ModelState, optimizer: OptimizerState, scaler: ScalerState,
                 data: DataState, progress: ProgressState, average: AverageState, memory: MemoryState):
        self.out, self.dist = out, dist
        self.model, self.data, self.progress, self.average, self.memory = model, data, progress, average, memory
        # restored in this order: a damaged value is named before anything after it is used
        self.components: list[Component] = [model, optimizer, scaler, data, progress, FiniteTensors(), average,
                                            memory]

    def non_finite(self) -> str | None:
        """What a checkpoint would hold that is NaN or Inf (the weights, the optimiser's state, the weight
        average), named; None when all of it is finite. One host sync; checked before every checkpoint."""
        # a sharded model's tensors are DTensors: this rank checks its shards (the ranks' verdicts are summed)
        named = [(name, local_tensor(value)) for name, value in self.model.model.state_dict().items()]
        for index, state in enumerate(self.components[1].optimizer.state.values()):
            named += [(f"optimizer state {index} {key}", local_tensor(value)) for key, value in state.items()]
        named += list(self.average.tensors().items())
        return first_non_finite(named)

    def save(self) -> None:
        """Everything for an exact resume in `last`, written atomically by rank 0 (the others contribute
        their memory and RNG state through all_gather). The caller has checked the state finite."""
        extra = self.memory.gather()
        weights, whole_optimizer = self.model.gather(), self.components[1].gather()  # sharded: collectives
        if not self.dist.main:
            return
        state: dict = {}
        for component in self.components:
            state.update(component.state())
            extra.update(component.tensors())
        state = parse_json(json.dumps(state))  # as it will read back (tuples become lists)
        extra[PROGRESS_TENSOR] = digest_tensor(state)
        with atomic_directory(self.out / LAST) as tmp:
            self.model.write(tmp, weights)
            self.data.write(tmp)
            self.components[1].write(tmp, whole_optimizer)
            save_tensors(tmp / "trainer.safetensors", extra, {"txl_kind": "trainer"})
            write_json(tmp / STATE_FILE, state)

    def save_best(self, result, *, weights: str = "live") -> None:
        """`best`: the model's current weights (weights = "average" while the weight average is applied).
        Rank 0 writes; a sharded model's ranks all call it (they gather the weights together)."""
        gathered = self.model.gather()
        if not self.dist.main:
            return
        with atomic_directory(self.out / BEST) as tmp:
            self.model.write(tmp, gathered)
            self.data.write(tmp)
            write_json(tmp / STATE_FILE, {"step": self.progress.progress.step, "valid": result.to_dict(),
                                          "metric": self.progress.metric, "data": self.data.spec,
                                          "weights": weights})

    def restore(self) -> None:
        """Restore everything `save` wrote. The files may be damaged, edited or come from another run:
        every value is checked before it is used (types, the progress digest, the corpus, the model config,
        the optimiser's hyperparameters against the run's configuration, dtypes, shapes, finiteness), and any
        mismatch is one `CheckpointError`, so a damaged state can never train on and replace `last`."""
        path = self.out / LAST
        where = path / STATE_FILE
        if not os.path.lexists(where):
            raise CheckpointError(f"{path.parent} is not a txl training run (no {LAST}/{STATE_FILE}); "
                                  "pass the --out directory of an earlier `txl train`")
        state = check_trainer_state(read_json(where, "trainer state", follow_links=False), where)
        extra, _ = load_tensors(path / "trainer.safetensors", "trainer state", require_digest=True, follow_links=False)
        check_progress_digest(state, extra.pop(PROGRESS_TENSOR, None), path, note=self.dist.main)
        self.data.check_corpus(state, path)
        self.model.check_config(path)
        for component in self.components:
            component.load(state, extra, path)
