"""Training: one readable loop that runs the same on a laptop CPU and on many GPUs.

What a step does (the reference's train.py, batch-first and without its global state):
  for each micro-batch (rows of the global batch, each with its own memory):
      loss = model(inputs, memory, labels).loss / grad_accum ; backward      (DDP: no_sync but last)
      memory = out.memory                                                    (detached: SG(m))
  skip the update if the loss is not finite; unscale (fp16), clip, optimiser step, lr for the step.

Distribution is DistributedDataParallel under torchrun (gloo on CPU, nccl on GPU): rank r reads rows
[r·B/W, (r+1)·B/W) of the same global batch, so W processes see exactly what one process with the
whole batch sees. Only rank 0 writes. Checkpoints hold everything an exact resume needs: weights,
optimiser, scaler, RNG states, data position and every rank's memory (see `save_checkpoint`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from txl.checkpoint import (
    atomic_directory,
    load_tensors,
    read_json,
    recover_directory,
    save_tensors,
    write_json,
    write_model_files,
)
from txl.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    OutputError,
    TrainingError,
    UsageError,
    describe_os_error,
)
from txl.evaluate import EvalResult, autocast, evaluate, metric_value
from txl.memory import Memory
from txl.model import TransformerXL
from txl.optim import build_optimizer, lr_at, optimizer_state_join, optimizer_state_split, set_lr
from txl.run_config import RunConfig, build_run_config, merge, preset_names

LAST, BEST = "last", "best"
OPTIMIZER_STATE_KEYS = {"step", "exp_avg", "exp_avg_sq"}  # per parameter, for adam, adamw and lamb alike
STATE_FILE = "trainer_state.json"


# ---------------------------------------------------------------------------------------------
# Distributed context


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def rows(self, batch_size: int) -> slice:
        per = batch_size // self.world
        return slice(self.rank * per, (self.rank + 1) * per)

    def all_sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    if not value.strip().isdigit():
        raise UsageError(f"environment variable {name}={value!r} must be a non-negative integer (torchrun sets it); "
                         f"unset it to train in one process")
    return int(value)


def init_distributed(device: str) -> Dist:
    world = max(_env_int("WORLD_SIZE", 1), 1)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but no CUDA device is available; use --device cpu")
    dev = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return Dist(rank=rank, world=world, local_rank=local_rank, device=dev)


# ---------------------------------------------------------------------------------------------
# The trainer


class Trainer:
    def __init__(self, run: RunConfig, out_dir: str | Path, *, device: str = "auto", resume: bool = False,
                 quiet: bool = False):
        from txl.data import StreamIterator, open_corpus

        self.run = run
        self.cfg = run.train
        self.out = Path(out_dir)
        self.quiet = quiet
        self.dist = init_distributed(device)
        if self.cfg.batch_size % (self.dist.world * self.cfg.grad_accum):
            raise ConfigError(
                f"train.batch_size={self.cfg.batch_size} must be divisible by world size × grad_accum "
                f"= {self.dist.world} × {self.cfg.grad_accum}"
            )
        if self.dist.main:
            for name in (LAST, BEST):  # a crash mid-checkpoint leaves the previous one set aside
                recover_directory(self.out / name)
            if not resume:
                self._prepare_out_dir()
        self.corpus = open_corpus(self.cfg.data)
        self.model_config = run.model_config(vocab_size=len(self.corpus.vocab))
        torch.manual_seed(self.cfg.seed)
        self.model = TransformerXL(self.model_config).to(self.dist.device)
        torch.manual_seed(self.cfg.seed + self.dist.rank)  # distinct dropout streams per rank
        self.ddp = self.model
        if self.dist.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.ddp = DistributedDataParallel(
                self.model,
                device_ids=[self.dist.local_rank] if self.dist.device.type == "cuda" else None,
                find_unused_parameters=self.model_config.adaptive,  # tail clusters may see no token
            )
        self.forward = torch.compile(self.ddp) if self.cfg.compile else self.ddp
        self.optimizer = build_optimizer(self.cfg.optimizer, self.model.parameters(), lr=self.cfg.lr,
                                         weight_decay=self.cfg.weight_decay)
        self.scaler = torch.amp.GradScaler(self.dist.device.type, enabled=self.cfg.precision == "fp16")
        self.train_iter = StreamIterator(self.corpus.split("train"), batch_size=self.cfg.batch_size,
                                         tgt_len=self.cfg.tgt_len, varlen=self.cfg.varlen, roll=self.cfg.roll,
                                         seed=self.cfg.seed)
        self.memories: list[Memory | None] = [None] * self.cfg.grad_accum
        self.step = 0
        self.tokens_seen = 0
        self.elapsed = 0.0  # training seconds over all sessions of this run
        self.best_valid = math.inf
        self.nonfinite_streak = 0
        self.stop_requested = False
        self._checked_splits: set[str] = set()
        self.metric = self.corpus.metric
        if resume:
            self.load_checkpoint(self.out / LAST)

    # -- set-up ----------------------------------------------------------------------------------
    def _prepare_out_dir(self) -> None:
        if (self.out / LAST).exists():
            raise UsageError(
                f"{self.out} already holds a run; continue it with --resume {self.out} or pick a new --out"
            )
        if self.out.exists() and not self.out.is_dir():
            raise OutputError(f"output directory {self.out} exists and is not a directory; pick a new --out")
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            probe = self.out / ".write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as err:
            raise OutputError(f"cannot write to output directory {self.out}: {describe_os_error(err)}") from None

    def write_run_file(self) -> None:
        data = {"config": self.run.to_dict(), "model": self.model_config.to_dict(), "world_size": self.dist.world,
                "data": self.cfg.data, "metric": self.metric, "parameters": self.model.num_parameters(),
                "torch": torch.__version__}
        write_json(self.out / "run.json", data)

    # -- one optimisation step ---------------------------------------------------------------------
    def train_step(self, batch) -> tuple[float, int]:
        """Forward/backward over this rank's micro-batches. Returns (summed NLL over this rank's tokens,
        token count); the NLL is NaN when any micro-batch loss was not finite. One host sync per step."""
        rows = self.dist.rows(self.cfg.batch_size)
        inputs = batch.inputs[rows].to(self.dist.device, non_blocking=True)
        targets = batch.targets[rows].to(self.dist.device, non_blocking=True)
        micro = inputs.shape[0] // self.cfg.grad_accum
        nll_sum = torch.zeros((), dtype=torch.float64, device=self.dist.device)
        for j in range(self.cfg.grad_accum):
            x, y = inputs[j * micro : (j + 1) * micro], targets[j * micro : (j + 1) * micro]
            last = j == self.cfg.grad_accum - 1
            sync = contextlib.nullcontext() if last or self.dist.world == 1 else self.ddp.no_sync()
            with sync:
                with autocast(self.dist.device, self.cfg.precision):
                    out = self.forward(x, memory=self.memories[j], labels=y)
                loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss  # compressive memory
                self.scaler.scale(loss / self.cfg.grad_accum).backward()
            self.memories[j] = out.memory
            # the loss, not the per-token NLL, decides finiteness (a caller may poison either)
            nll_sum += out.nll.detach().double().sum() + out.loss.detach().double() * 0
        return float(nll_sum), inputs.shape[0] * inputs.shape[1]

    def optimizer_step(self, lr: float, finite: bool) -> None:
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            self.memories = [None] * self.cfg.grad_accum  # do not carry NaNs into the next segment
            return
        set_lr(self.optimizer, lr)
        self.scaler.unscale_(self.optimizer)
        if self.cfg.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    # -- the loop ----------------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg = self.cfg
        if self.dist.main:
            self.write_run_file()
        log = MetricsLog(self.out, enabled=self.dist.main, truncate_after=self.step)
        bar = Progress(total=cfg.max_steps, initial=self.step, enabled=self.dist.main and not self.quiet,
                       metric=self.metric)
        previous_handlers = self._install_signal_handlers()
        window_nll, window_tokens, window_start = 0.0, 0, time.perf_counter()
        session_start = time.perf_counter()
        elapsed_before = self.elapsed
        reason = "max_steps"
        batches = iter(self.train_iter)  # endless; continues from a resumed position
        try:
            self.model.train()
            while self.step < cfg.max_steps:
                batch = next(batches)
                # inputs[:, 1:] == targets[:, :-1]: the targets and the first column cover every id
                self.check_token_ids(max(int(batch.targets.max()), int(batch.inputs[:, 0].max())), "train")
                if batch.step == 0:
                    self.memories = [None] * cfg.grad_accum  # memory does not cross epochs
                lr = lr_at(self.step, schedule=cfg.schedule, lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                           max_steps=cfg.max_steps, eta_min=cfg.eta_min)
                nll_sum, count = self.train_step(batch)
                local_bad = 0.0 if math.isfinite(nll_sum) else 1.0
                total_nll, total_count, bad, stop = self.dist.all_sum(
                    [0.0 if local_bad else nll_sum, count, local_bad, float(self.stop_requested)]
                )
                finite = bad == 0
                self.optimizer_step(lr, finite)
                self.step += 1
                self.tokens_seen += int(total_count)
                self.elapsed = elapsed_before + time.perf_counter() - session_start
                if finite:
                    self.nonfinite_streak = 0
                    window_nll += total_nll
                    window_tokens += int(total_count)
                else:
                    self.nonfinite_streak += 1
                    bar.write(f"warning: non-finite loss at step {self.step}; update skipped "
                              f"({self.nonfinite_streak} in a row)")
                    if self.nonfinite_streak >= cfg.max_nonfinite:
                        raise TrainingError(
                            f"loss was not finite for {self.nonfinite_streak} steps in a row (last at step "
                            f"{self.step}); the last good checkpoint is {self.out / LAST}; lower train.lr, "
                            "raise train.warmup_steps or use precision fp32/bf16"
                        )
                if self.step % cfg.log_interval == 0 or self.step == cfg.max_steps:
                    now = time.perf_counter()
                    loss = window_nll / max(window_tokens, 1)
                    speed = window_tokens / max(now - window_start, 1e-9)
                    log.write({"split": "train", "step": self.step, "loss": loss, self.metric:
                               metric_value(loss, self.metric), "lr": lr, "tokens_per_second": speed,
                               "tokens": self.tokens_seen, "elapsed": self.elapsed})
                    bar.show(step=self.step, loss=loss, lr=lr, speed=speed)
                    window_nll, window_tokens, window_start = 0.0, 0, now
                bar.advance(self.step)
                time_up = cfg.max_minutes > 0 and self.elapsed >= cfg.max_minutes * 60
                stopping = stop > 0 or time_up or self.step == cfg.max_steps
                if self.step % cfg.eval_interval == 0 or time_up or self.step == cfg.max_steps:
                    self.validate(log, bar)  # (not on a signal: save and leave quickly)
                due = (cfg.save_interval and self.step % cfg.save_interval == 0) or (
                    not cfg.save_interval and self.step % cfg.eval_interval == 0
                )
                if (stopping or due) and self.nonfinite_streak == 0:  # keep the last *good* checkpoint
                    self.save_checkpoint(self.out / LAST)
                if stop > 0:
                    reason = "signal"
                    break
                if time_up:
                    reason = "max_minutes"
                    break
        finally:
            bar.close()
            log.close()
            self._restore_signal_handlers(previous_handlers)
        return {"steps": self.step, "stopped_by": reason, "tokens": self.tokens_seen, "elapsed": self.elapsed,
                "tokens_per_second": self.tokens_seen / max(self.elapsed, 1e-9), "best_valid": self.best_valid}

    def validate(self, log: MetricsLog, bar: Progress) -> EvalResult:
        result = self.evaluate_split("valid", max_tokens=self.cfg.eval_max_tokens)
        log.write({"split": "valid", "step": self.step, "loss": result.loss, self.metric: result.value,
                   "tokens": result.tokens, "tokens_per_second": result.tokens_per_second,
                   "elapsed": self.elapsed})
        bar.write(f"step {self.step}: valid {self.metric} {result.value:.4f} (loss {result.loss:.4f}, "
                  f"{result.tokens:,} tokens)")
        if result.loss < self.best_valid:
            self.best_valid = result.loss
            if self.dist.main:
                self.save_best(result)
        self.model.train()
        return result

    def check_token_ids(self, largest: int, split: str) -> None:
        """Prepared arrays are unsigned, so only an id >= vocab_size can be wrong (a damaged cache):
        without this it is an IndexError deep inside the embedding. Costs one max over the batch's
        B×T ids on the CPU per step, before they move to the device (about 0.02 ms for 22×512, 0.1 ms
        for 128×384: far below 0.1% of a step); the model forward itself is left alone."""
        if largest >= self.model_config.vocab_size:
            raise DataError(f"token id {largest} in the {split} split of {self.cfg.data!r} is outside the "
                            f"vocabulary ({self.model_config.vocab_size} ids): the prepared cache is damaged; "
                            f"run `txl data prepare {self.cfg.data} --force`")

    def evaluate_split(self, split: str, *, max_tokens: int = 0, progress: bool = False) -> EvalResult:
        cfg = self.cfg
        tokens = self.corpus.split(split)
        if split not in self._checked_splits and len(tokens):  # once per split: one pass over <= 5% of the corpus
            self.check_token_ids(int(tokens[: max_tokens + 1 if max_tokens else None].max()), split)
            self._checked_splits.add(split)
        bsz = cfg.eval_batch_size
        rows = None
        if self.dist.world > 1:
            bsz = max(bsz // self.dist.world, 1) * self.dist.world
            rows = self.dist.rows(bsz)
        result = evaluate(
            self.model, self.corpus.split(split), metric=self.metric, batch_size=bsz,
            tgt_len=cfg.eval_tgt_len or cfg.tgt_len, mem_len=cfg.eval_mem_len, warm_memory=cfg.eval_warm_memory,
            max_tokens=max_tokens, device=self.dist.device, precision=cfg.precision, rows=rows,
            progress=progress and self.dist.main and not self.quiet,
        )
        if self.dist.world > 1:
            total, count = self.dist.all_sum([result.loss * result.tokens, result.tokens])
            result.loss, result.tokens = total / max(count, 1), int(count)
        result.split = split
        return result

    # -- checkpoints -------------------------------------------------------------------------------
    def _state(self) -> dict:
        return {"step": self.step, "tokens_seen": self.tokens_seen, "elapsed": self.elapsed,
                "best_valid": self.best_valid if math.isfinite(self.best_valid) else None,
                "nonfinite_streak": self.nonfinite_streak, "world_size": self.dist.world,
                "grad_accum": self.cfg.grad_accum, "data": self.cfg.data,
                "vocab_fingerprint": self.corpus.vocab.fingerprint, "iterator": self.train_iter.state_dict(),
                "scaler": self.scaler.state_dict(), "metric": self.metric, "run": self.run.to_dict()}

    def _gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if self.dist.world == 1:
            return [tensor]
        parts = [torch.empty_like(tensor) for _ in range(self.dist.world)]
        dist.all_gather(parts, tensor.contiguous())
        return parts

    def save_checkpoint(self, path: Path) -> None:
        """Everything for an exact resume, written atomically by rank 0 (others contribute their
        memory and RNG state through all_gather)."""
        extra: dict[str, torch.Tensor] = {}
        for j, memory in enumerate(self.memories):
            if memory is None:
                continue
            for layer, hidden in enumerate(memory.hidden):
                for rank, part in enumerate(self._gather(hidden)):
                    extra[f"memory.rank{rank}.chunk{j}.layer{layer}"] = part
        for rank, part in enumerate(self._gather(torch.get_rng_state())):
            extra[f"rng.cpu.rank{rank}"] = part
        if self.dist.device.type == "cuda":
            for rank, part in enumerate(self._gather(torch.cuda.get_rng_state(self.dist.device).to(self.dist.device))):
                extra[f"rng.cuda.rank{rank}"] = part.cpu()
        if not self.dist.main:
            return
        opt_tensors, opt_plain = optimizer_state_split(self.optimizer)
        with atomic_directory(path) as tmp:
            write_model_files(self.model, tmp)
            self.corpus.vocab.save(tmp / "vocab.json")
            save_tensors(tmp / "optimizer.safetensors", opt_tensors, {"txl_kind": "optimizer"})
            save_tensors(tmp / "trainer.safetensors", extra, {"txl_kind": "trainer"})
            write_json(tmp / "optimizer.json", opt_plain)
            write_json(tmp / STATE_FILE, self._state())

    def save_best(self, result: EvalResult) -> None:
        with atomic_directory(self.out / BEST) as tmp:
            write_model_files(self.model, tmp)
            self.corpus.vocab.save(tmp / "vocab.json")
            write_json(tmp / STATE_FILE, {"step": self.step, "valid": result.to_dict(), "metric": self.metric,
                                          "data": self.cfg.data})

    def load_checkpoint(self, path: Path) -> None:
        """Restore everything `save_checkpoint` wrote. The files may be damaged or come from another
        run: every value is checked before it is used, and any mismatch is one `CheckpointError`."""
        from txl.checkpoint import WEIGHTS_NAME, check_state_dict, load_config

        if not (path / STATE_FILE).is_file():
            raise CheckpointError(f"{path.parent} is not a txl training run (no {LAST}/{STATE_FILE}); "
                                  "pass the --out directory of an earlier `txl train`")
        state = check_trainer_state(read_json(path / STATE_FILE, "trainer state"), path / STATE_FILE)
        if state["vocab_fingerprint"] != self.corpus.vocab.fingerprint:
            raise CheckpointError(f"{path} was trained on a different vocabulary than {self.cfg.data!r} has now "
                                  "(the corpus files changed); restore them or start a new run")
        saved_config = load_config(path)
        if saved_config.to_dict() != self.model_config.to_dict():
            raise CheckpointError(f"{path}/config.json does not match this run's model config; resume with the "
                                  "same configuration (only max_steps/max_minutes may change)")
        weights, _ = load_tensors(path / WEIGHTS_NAME, "checkpoint weights")
        check_state_dict(self.model.state_dict(), weights, path)
        self.model.load_state_dict(weights)
        self._load_optimizer(path)
        damaged = f"{path / STATE_FILE} is damaged"
        try:
            self.scaler.load_state_dict(state["scaler"])
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            raise CheckpointError(f"{damaged}: its gradient-scaler state is unusable ({err})") from None
        try:
            self.train_iter.load_state_dict(state["iterator"])
        except DataError as err:
            raise CheckpointError(f"{damaged} or was saved for other data: {err}") from None
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.elapsed = float(state["elapsed"])
        self.best_valid = math.inf if state["best_valid"] is None else float(state["best_valid"])
        self.nonfinite_streak = state["nonfinite_streak"]
        extra, _ = load_tensors(path / "trainer.safetensors", "trainer state")
        same_layout = state["world_size"] == self.dist.world and state["grad_accum"] == self.cfg.grad_accum
        if same_layout:
            self._load_memory_and_rng(extra, path)
        elif self.dist.main:
            print(f"note: {path} was written with world size {state['world_size']} × grad_accum "
                  f"{state['grad_accum']}; memory and RNG restart (the resume is not bit-exact)",
                  file=sys.stderr)

    def _load_optimizer(self, path: Path) -> None:
        opt_tensors, _ = load_tensors(path / "optimizer.safetensors", "optimizer state")
        opt_plain = read_json(path / "optimizer.json", "optimizer state")
        unusable = f"{path}: the optimizer state does not fit this model (the checkpoint is damaged or from another run)"
        if not (isinstance(opt_plain, dict) and isinstance(opt_plain.get("param_groups"), list)
                and isinstance(opt_plain.get("state", {}), dict)):
            raise CheckpointError(f"{path}/optimizer.json is damaged: expected an object with param_groups and "
                                  "state; restore the file or start a new run")
        fresh_groups = self.optimizer.state_dict()["param_groups"]
        try:
            joined = optimizer_state_join(opt_tensors, opt_plain)
            _check_param_groups(fresh_groups, joined["param_groups"])
            self.optimizer.load_state_dict(joined)
        except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as err:
            raise CheckpointError(f"{unusable}: {type(err).__name__}: {err}") from None
        # torch compares neither state keys nor shapes with the parameters; a mismatch would only fail
        # at the first step, deep inside the optimiser
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                state = self.optimizer.state.get(param, {})  # empty: the parameter never had a gradient
                if state and set(state) != OPTIMIZER_STATE_KEYS:
                    raise CheckpointError(f"{unusable}: a parameter's state holds {sorted(state)}, expected "
                                          f"{sorted(OPTIMIZER_STATE_KEYS)}")
                for key, value in state.items():
                    ok = isinstance(value, torch.Tensor) and value.dtype.is_floating_point and (
                        value.numel() == 1 if key == "step" else tuple(value.shape) == tuple(param.shape))
                    if not ok:
                        got = f"a {value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(
                            value, torch.Tensor) else repr(value)
                        raise CheckpointError(f"{unusable}: {key!r} of a parameter of shape {tuple(param.shape)} "
                                              f"is {got}")

    def _load_memory_and_rng(self, extra: dict[str, torch.Tensor], path: Path) -> None:
        rank = self.dist.rank
        rows = self.cfg.batch_size // self.dist.world // self.cfg.grad_accum
        width, mem_len = self.model_config.d_model, self.model_config.mem_len
        for j in range(self.cfg.grad_accum):
            names = [f"memory.rank{rank}.chunk{j}.layer{i}" for i in range(self.model_config.n_layer)]
            layers = [extra[n] for n in names if n in extra]
            if layers and (len(layers) != len(names) or any(
                    t.dim() != 3 or t.shape[0] != rows or t.shape[1] > mem_len or t.shape[2] != width
                    or not t.dtype.is_floating_point for t in layers)):
                raise CheckpointError(f"{path}/trainer.safetensors: the saved memory does not fit this model "
                                      f"(expected {self.model_config.n_layer} float tensors of shape ({rows}, <= {mem_len}, "
                                      f"{width})); the checkpoint is damaged or from another run")
            self.memories[j] = Memory(tuple(t.to(self.dist.device) for t in layers)) if layers else None
        try:
            torch.set_rng_state(extra[f"rng.cpu.rank{rank}"])
            if self.dist.device.type == "cuda" and f"rng.cuda.rank{rank}" in extra:
                torch.cuda.set_rng_state(extra[f"rng.cuda.rank{rank}"], self.dist.device)
        except (KeyError, TypeError, RuntimeError) as err:
            raise CheckpointError(f"{path}/trainer.safetensors: the saved random-number state is missing or "
                                  f"unusable ({type(err).__name__}: {err}); the checkpoint is damaged") from None

    # -- signals -----------------------------------------------------------------------------------
    def _install_signal_handlers(self):
        def request_stop(signum, frame):
            if self.stop_requested:  # a second signal: stop now
                raise KeyboardInterrupt
            self.stop_requested = True

        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not in the main thread
                previous[sig] = signal.signal(sig, request_stop)
        return previous

    @staticmethod
    def _restore_signal_handlers(previous) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# Types of the trainer_state.json fields `load_checkpoint` reads (JSON gives us untyped values).
_STATE_FIELDS: dict[str, tuple[type, ...]] = {
    "step": (int,), "tokens_seen": (int,), "elapsed": (int, float), "best_valid": (int, float, type(None)),
    "nonfinite_streak": (int,), "world_size": (int,), "grad_accum": (int,), "vocab_fingerprint": (str,),
    "iterator": (dict,), "scaler": (dict,), "run": (dict,),
}


def check_trainer_state(state, where: Path) -> dict:
    """trainer_state.json must be an object holding every field `load_checkpoint` reads, typed."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{where} is damaged: it holds a JSON {type(state).__name__}, not an object")
    for key, types in _STATE_FIELDS.items():
        value = state.get(key)
        if key not in state or not isinstance(value, types) or isinstance(value, bool):
            raise CheckpointError(f"{where} is damaged: {key!r} is missing or has the wrong type (expected "
                                  f"{' or '.join(t.__name__ for t in types)}); restore the file or start a new run")
        if isinstance(value, int | float) and (value < 0 or not math.isfinite(value)):
            raise CheckpointError(f"{where} is damaged: {key!r} is {value!r}; restore the file or start a new run")
    return state


def _check_param_groups(fresh: list[dict], saved) -> None:
    """The saved optimiser hyperparameters must have the types of a freshly built optimiser's:
    torch copies them unchecked and only fails (or silently misbehaves) at the next step."""
    if not isinstance(saved, list) or len(saved) != len(fresh):
        raise ValueError(f"{len(fresh)} parameter group(s) expected")
    for want, got in zip(fresh, saved):
        if not isinstance(got, dict):
            raise TypeError("a parameter group is not an object")
        for key, value in want.items():
            if key == "params":
                continue
            if key not in got or not _same_kind(value, got[key]):
                raise TypeError(f"hyperparameter {key!r} is {got.get(key)!r}, expected a value like {value!r}")


def _same_kind(want, got) -> bool:
    if want is None or isinstance(want, bool):
        return got is None or isinstance(got, bool) if want is None else isinstance(got, bool)
    if isinstance(want, int | float):
        return isinstance(got, int | float) and not isinstance(got, bool) and math.isfinite(got)
    if isinstance(want, tuple | list):
        return isinstance(got, tuple | list) and len(got) == len(want) and all(map(_same_kind, want, got))
    return type(got) is type(want)


# ---------------------------------------------------------------------------------------------
# Records: metrics.jsonl (+ TensorBoard when installed), and a tqdm bar


class MetricsLog:
    def __init__(self, out: Path, *, enabled: bool, truncate_after: int):
        self.enabled = enabled
        self.path = out / "metrics.jsonl"
        self.file = None
        self.tb = None
        if not enabled:
            return
        try:
            if self.path.exists():  # a resumed run: drop records the crashed session wrote after the checkpoint
                text = self.path.read_bytes().decode("utf-8", "replace")  # a damaged line is dropped below
                keep = [line for line in text.splitlines() if line.strip() and _record_step(line) <= truncate_after]
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text("".join(line + "\n" for line in keep))
                os.replace(tmp, self.path)
            self.file = open(self.path, "a")  # noqa: SIM115 (closed in close())
        except OSError as err:
            raise OutputError(f"cannot write {self.path}: {describe_os_error(err)}") from None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tensorboard"))
        except Exception:  # tensorboard is an optional dependency
            self.tb = None

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as err:
            raise OutputError(f"cannot write {self.path}: {describe_os_error(err)}") from None
        if self.tb is not None:
            for key, value in record.items():
                if key not in ("split", "step") and isinstance(value, (int, float)):
                    self.tb.add_scalar(f"{record['split']}/{key}", value, record["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def _record_step(line: str) -> int:
    """The step of a metrics.jsonl record; a damaged record sorts after every step (and is dropped)."""
    try:
        record = json.loads(line)
        return int(record.get("step", 0)) if isinstance(record, dict) else 1 << 62
    except (ValueError, TypeError, OverflowError, RecursionError):
        return 1 << 62


class Progress:
    """A tqdm bar (loss, bpc/ppl, tokens/s, lr, ETA) on a terminal; plain log lines otherwise."""

    def __init__(self, *, total: int, initial: int, enabled: bool, metric: str):
        self.enabled, self.metric = enabled, metric
        self.bar = None
        self.tty = sys.stderr.isatty()
        if enabled and self.tty:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)

    def advance(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def show(self, *, step: int, loss: float, lr: float, speed: float) -> None:
        if not self.enabled:
            return
        value = metric_value(loss, self.metric)
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.3f} {self.metric} {value:.3f} {speed:,.0f} tok/s lr {lr:.2e}")
        else:
            print(f"step {step}: loss {loss:.4f} {self.metric} {value:.4f} {speed:,.0f} tok/s lr {lr:.3e}",
                  file=sys.stderr, flush=True)

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------------------
# After training: final scores and a sample


def finish(trainer: Trainer, summary: dict) -> dict:
    """Evaluate the final splits with the best weights, print a table and a sample; write result.json."""
    cfg = trainer.cfg
    results = {}
    if trainer.dist.world > 1:
        dist.barrier()  # rank 0 has finished writing `best`
    if (trainer.out / BEST).is_dir():
        best = TransformerXL.from_pretrained(trainer.out / BEST, map_location=trainer.dist.device)
        trainer.model.load_state_dict(best.state_dict())
    for split in cfg.final_splits:
        if split not in trainer.corpus.splits:
            continue
        result = trainer.evaluate_split(split, max_tokens=cfg.eval_max_tokens, progress=True)
        results[split] = result.to_dict()
    summary = {**summary, "final": results, "metric": trainer.metric,
               "parameters": trainer.model.num_parameters()}
    sample = None
    if trainer.dist.main and cfg.sample_tokens:
        sample = write_sample(trainer)
        summary["sample"] = sample
    if trainer.dist.main:
        write_json(trainer.out / "result.json", summary)
        print_summary(trainer, summary)
    return summary


def write_sample(trainer: Trainer) -> str:
    from txl.generate import stream_tokens

    vocab = trainer.corpus.vocab
    prompt = list(vocab.encode(trainer.cfg.sample_prompt)) if trainer.cfg.sample_prompt else []
    if not prompt:
        prompt = [int(t) for t in trainer.corpus.split("valid")[:64]]
    generator = torch.Generator().manual_seed(trainer.cfg.seed)
    tokens = list(stream_tokens(trainer.model, prompt, max_new_tokens=trainer.cfg.sample_tokens,
                                temperature=0.8, top_k=40, generator=generator))
    text = vocab.decode(prompt + tokens)
    try:
        (trainer.out / "sample.txt").write_text(text, encoding="utf-8", errors="surrogateescape")
    except OSError as err:
        raise OutputError(f"cannot write {trainer.out / 'sample.txt'}: {describe_os_error(err)}") from None
    return text


def print_summary(trainer: Trainer, summary: dict) -> None:
    metric = summary["metric"]
    cap = trainer.cfg.eval_max_tokens
    print(f"\nrun: {trainer.out}  ({summary['parameters']:,} parameters, {summary['steps']} steps, "
          f"{summary['tokens']:,} tokens, {summary['tokens_per_second']:,.0f} tokens/s, stopped by "
          f"{summary['stopped_by']})")
    print(f"\n| split | {metric} | loss (nats) | tokens scored |\n|---|---|---|---|")
    for split, r in summary["final"].items():
        print(f"| {split} | {r[metric]:.4f} | {r['loss']:.4f} | {r['tokens']:,} |")
    if cap:
        print(f"(scored on the first {cap:,} tokens of each split; train.eval_max_tokens=0 scores them whole)")
    if summary.get("sample") is not None:
        print("\nsample:\n" + summary["sample"] + "\n")


# ---------------------------------------------------------------------------------------------
# Command line


def configure_cli(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", help=f"one of: {', '.join(preset_names())} (default: tiny)")
    parser.add_argument("--config", help="a TOML file with [model] and [train] sections")
    parser.add_argument("--data", help="data spec, e.g. ptb-char:../shared/data/ptb (see `txl data list`)")
    parser.add_argument("--out", help="run directory (default: runs/PRESET-TIMESTAMP)")
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--max-minutes", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue a run exactly where its last checkpoint left it")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key: model.d_model=256, lr=1e-3, precision=bf16 ...")
    parser.add_argument("--nproc", type=int, default=0,
                        help="launch N processes on this machine (torchrun --nproc-per-node N)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def resume_config(run_dir: Path, *, max_steps: int | None = None, max_minutes: float | None = None) -> RunConfig:
    """The configuration saved in RUN/last (after crash recovery), with a new step or time budget."""
    recover_directory(run_dir / LAST)
    where = run_dir / LAST / STATE_FILE
    if not where.is_file():
        raise CheckpointError(f"{run_dir} is not a txl training run (no {LAST}/{STATE_FILE}); pass the --out "
                              "directory of an earlier `txl train`")
    saved = check_trainer_state(read_json(where, "training state"), where)
    try:
        run = RunConfig.from_dict(saved["run"], str(where))
    except ConfigError as err:
        raise CheckpointError(f"{where} is damaged: {err}") from None
    budget = {"max_steps": max_steps, "max_minutes": max_minutes}
    merge(run, {"train": {k: v for k, v in budget.items() if v is not None}}, "command-line flags")
    return run


def run_cli(args: argparse.Namespace) -> int:
    if args.nproc < 0:
        raise UsageError(f"--nproc must be >= 0 (0 = this process only), got {args.nproc}")
    if args.nproc and _env_int("WORLD_SIZE", 1) == 1:
        return launch(args.nproc)
    flags = {"data": args.data, "max_steps": args.max_steps, "max_minutes": args.max_minutes, "seed": args.seed}
    if args.resume:
        if args.preset or args.config or args.set or args.data or args.seed is not None:
            raise UsageError("--resume continues the saved configuration; only --max-steps and --max-minutes "
                             "may change")
        out = Path(args.resume)
        run = resume_config(out, max_steps=args.max_steps, max_minutes=args.max_minutes)
    else:
        preset = args.preset or (None if args.config else "tiny")
        run = build_run_config(preset=preset, config_file=args.config, sets=args.set, flags=flags)
        out = Path(args.out) if args.out else Path("runs") / f"{preset or Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    trainer = Trainer(run, out, device=args.device, resume=bool(args.resume), quiet=args.quiet)
    if trainer.dist.main:
        print(f"txl train: {trainer.model.num_parameters():,} parameters, data {run.train.data} "
              f"({len(trainer.corpus.vocab):,} tokens in the vocabulary, metric {trainer.metric}), "
              f"out {out}, world size {trainer.dist.world}", file=sys.stderr)
    summary = trainer.fit()
    if summary["stopped_by"] != "signal":
        finish(trainer, summary)
    elif trainer.dist.main:
        print(f"txl train: stopped by signal at step {summary['steps']}; resume with --resume {out}", file=sys.stderr)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def launch(nproc: int) -> int:
    """`txl train --nproc N ...` = `torchrun --nproc-per-node N -m txl train ...` (same arguments)."""
    import subprocess

    argv = [a for a in sys.argv[1:]]
    cleaned, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        cleaned.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "txl", *cleaned]
    return subprocess.call(cmd)
