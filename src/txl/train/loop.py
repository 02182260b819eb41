"""Training: one readable loop that runs the same on a laptop CPU and on many GPUs.

What a step does (the reference's train.py, batch-first and without its global state), for the language
modelling objective (`txl.train.objectives` holds it, masked LM and sequence-to-sequence beside it):
  for each micro-batch (rows of the global batch, each with its own memory):
      loss = model(inputs, memory, labels).loss / grad_accum ; backward      (DDP: no_sync but last)
      memory = out.memory                                                    (detached: SG(m))
  skip the update if the loss is not finite; unscale (fp16), clip, optimiser step, lr for the step.

The run's directory lives in `txl.train.rundir`, its checkpoints in `txl.train.checkpoint` (files and
checks: `txl.train.state`), its records in `txl.train.progress`, the end of a run in `txl.train.finish`
and the command line in `txl.cli.train`.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import time
import weakref
from pathlib import Path

import torch

from txl.errors import ConfigError, TrainingError
from txl.eval.precision import resolve_precision
from txl.eval.result import EvalResult, metric_value
from txl.models.registry import build_model, config_from_dict
from txl.models.rnn.config import RNN_ARCHS
from txl.train.averaging import WeightAverage
from txl.train.checkpoint import (
    AverageState,
    Checkpointer,
    DataState,
    MemoryState,
    ModelState,
    OptimizerState,
    Progress,
    ProgressState,
    ScalerState,
)
from txl.train.config import RunConfig
from txl.train.distributed import (
    GradientSync,
    full_model_state,
    init_distributed,
    shard_model,
    shared_precision,
)
from txl.train.finish import sample_prompt_ids
from txl.train.objectives import objective_class
from txl.train.optim import build_optimizer, dropout_at, lr_at, set_lr
from txl.train.progress import MetricsLog
from txl.train.progress import Progress as ProgressBar
from txl.train.rundir import (
    LAST,
    create_out_dir,
    load_initial_weights,
    open_run_dir,
    open_training_corpus,
    previous_run_record,
    resolve_data,
    write_run_file,
)


class Trainer:
    """A run: its objective (what a step and a score are), its model and optimiser, and a checkpointer over
    the components of its state. What other modules use of it: `fit`, `evaluate_split`, `close`, and the
    parts a run's end reads (`out`, `cfg`, `dist`, `model`, `corpus`, `metric`, `objective`, `average`,
    `validates`, `sample_prompt`)."""

    def __init__(self, run: RunConfig, out_dir: str | Path, *, device: str = "auto", resume: bool = False,
                 quiet: bool = False, init_from: str | Path | None = None, force: bool = False, lock=None):
        """Everything a run needs at its end is checked here, before the first step: the data (and a
        preset's corpus being where it is expected), the sample prompt, the validation split and the
        output directory. `lock`: the run directory's `RunLock` when the caller took it (`txl train` does,
        before it reads a resumed run's configuration), held by the caller; without one the trainer opens
        and locks the directory itself (`txl.train.rundir.open_run_dir`) and holds it until `close`. A
        failed start removes what it created, so it leaves nothing behind."""
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
        self._unlock = None
        own = open_run_dir(self.out, resume=resume, force=force) if self.dist.main and lock is None else None
        try:
            self._build(run, resume=resume, init_from=init_from)
        except BaseException:
            if own is not None:
                own.abandon()  # our hold only; a failed new run leaves its directory as it was
            raise
        if own is not None:  # one writer per run: held until close() (or this object or its process dies)
            self._unlock = weakref.finalize(self, own.release)  # runs once, whichever comes first

    def _build(self, run: RunConfig, *, resume: bool, init_from) -> None:
        cfg, dist = self.cfg, self.dist
        data_as_typed = cfg.data
        cfg.data = resolve_data(cfg.data)  # absolute: the run works from any directory
        objective = objective_class(cfg, cfg.data)  # a pair corpus trains an encoder-decoder (txl.models.seq2seq)
        # a fine-tuning run reads its text with the checkpoint's vocabulary (issue 45)
        self.corpus = open_training_corpus(objective, cfg.data, self.out, init_from=init_from, resume=resume,
                                           say=(lambda line: print(line, file=sys.stderr)) if dist.main else None)
        self.metric = self.corpus.metric
        self.validates = "valid" in self.corpus.splits
        if not self.validates and dist.main and not resume:
            print(f"note: {cfg.data} has no valid split: validation is off, so there is no `best` checkpoint "
                  "and no final score (add a valid.txt to the corpus directory to get them)", file=sys.stderr)
        self.sample_prompt = sample_prompt_ids(self.corpus, cfg) if objective.writes_sample else []
        self.model_config = objective.model_config(run.model_config(vocab_size=len(self.corpus.vocab)), self.corpus,
                                                   cfg.data)
        recorded = previous_run_record(self.out).get("model") if resume else None
        if isinstance(recorded, dict) and recorded.get("arch", "decoder") == self.model_config.arch:
            self.model_config = config_from_dict(recorded)  # complete: migrated with the behaviour it trained with
        arch = self.model_config.arch
        if cfg.optimizer == "muon" and arch != "decoder":
            raise ConfigError(f"train.optimizer='muon' is for the Transformer-XL decoder (model.arch='decoder'), "
                              f"not model.arch={arch!r}; use adam or adamw")
        if cfg.dropout_start is not None and arch in RNN_ARCHS:
            raise ConfigError(f"train.dropout_start schedules the Transformer's dropout layers; model.arch="
                              f"{arch!r} applies its dropouts as functions: unset train.dropout_start")
        torch.manual_seed(cfg.seed)
        self.model = build_model(self.model_config).to(dist.device)
        if cfg.activation_checkpointing == "blocks":
            if not hasattr(self.model, "checkpoint_blocks"):
                raise ConfigError(f"train.activation_checkpointing='blocks' is for the Transformer-XL decoder and "
                                  f"encoder (model.arch='decoder'), not model.arch={arch!r}; set it to 'none'")
            self.model.checkpoint_blocks = True  # each block recomputed in the backward (txl.nn.checkpointing)
        self.init_from = None
        if init_from is not None and not resume:
            self.init_from = str(load_initial_weights(self.model, init_from, self.corpus.vocab))
        elif resume:  # keep the record of where a fine-tuned run started (a path; anything else is no record)
            init_from = previous_run_record(self.out).get("init_from")
            self.init_from = init_from if isinstance(init_from, str) else None
        torch.manual_seed(cfg.seed + dist.rank)  # distinct dropout streams per rank
        ddp = sync = self.model
        self.sharded = check_parallelism(cfg, self.model_config, dist) and dist.world > 1
        if self.sharded:  # FSDP2: per block, then the root (txl.train.distributed.shard_model)
            ddp = shard_model(self.model)
            sync = GradientSync(self.model)
        elif dist.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            ddp = DistributedDataParallel(
                self.model,
                device_ids=[dist.local_rank] if dist.device.type == "cuda" else None,
                # tail clusters may see no token; shared-QK kernels (lsh, routing) never use the query projection
                find_unused_parameters=getattr(self.model_config, "adaptive", False) or any(
                    getattr(m, "unused_query_projection", False) for m in self.model.modules()),
            )
            sync = ddp
        self.forward = torch.compile(ddp) if cfg.compile else ddp
        self.optimizer = build_optimizer(cfg.optimizer, self.model, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                         betas=cfg.adam_betas, eps=cfg.adam_eps)
        precision = resolve_precision(cfg.precision, dist.device)  # `auto` decided once
        if cfg.precision == "auto":
            precision = shared_precision(precision, dist)
        self.scaler = torch.amp.GradScaler(dist.device.type, enabled=precision == "fp16")
        self.average = WeightAverage(self.model, cfg.ema) if cfg.ema > 0 else None
        # train.dropout_start: the layers at model.dropout (after the fast backend swapped its own in)
        self.scheduled_dropouts = [] if cfg.dropout_start is None else [
            m for m in self.model.modules() if isinstance(m, torch.nn.Dropout) and m.p == self.model_config.dropout]
        self.objective = objective(cfg, self.corpus, dist, vocab_size=self.model_config.vocab_size,
                                   precision=precision, scaler=self.scaler, ddp=sync)
        self.train_iter = self.objective.batches()
        self.progress = Progress()
        # this session's scores of valid on eval_max_tokens, so the run's end does not score the same weights
        # on the same tokens again (txl.train.finish): `best`'s (step, result) when this session saved it, and
        # the last validation's per weights ("live", "average")
        self.best_score: tuple[int, EvalResult] | None = None
        self.last_scores: dict[str, tuple[int, EvalResult]] = {}
        self.stop_requested = False
        self.checkpointer = Checkpointer(
            self.out, dist, model=ModelState(self.model, self.model_config, sharded=self.sharded),
            optimizer=OptimizerState(self.optimizer, model=self.model if self.sharded else None),
            scaler=ScalerState(self.scaler), data=DataState(self.corpus, self.train_iter, cfg.data),
            progress=ProgressState(self.progress, run=run, metric=self.metric, world=dist.world),
            average=AverageState(self.average),
            memory=MemoryState(self.objective, dist, model=self.model, config=self.model_config,
                               batch_size=cfg.batch_size, grad_accum=cfg.grad_accum))
        self.run_record = {
            "config": run.to_dict(), "model": self.model_config.to_dict(), "world_size": dist.world, "data": cfg.data,
            "data_as_typed": data_as_typed, "metric": self.metric, "parameters": self.model.num_parameters(),
            "torch": torch.__version__, "init_from": self.init_from, "validation": self.validates,
            "precision": precision}  # what `auto` became
        if resume:
            self.checkpointer.restore()
        elif dist.main:
            create_out_dir(self.out)  # (created with its lock; this proves it is writable)

    @property
    def step(self) -> int:
        return self.progress.step

    def close(self) -> None:
        """Release the run directory's lock if the trainer took it (also released when it or the process goes)."""
        if self._unlock is not None:
            self._unlock()

    # -- one optimisation step ---------------------------------------------------------------------
    def train_step(self, batch) -> tuple[float, int]:
        """Forward/backward over this rank's micro-batches (the objective's step through `self.forward`).
        Returns (summed NLL over this rank's scored tokens, their count); NaN when a loss was not finite."""
        return self.objective.step(self.forward, batch)

    def optimizer_step(self, lr: float, finite: bool) -> None:
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            self.objective.forget()  # do not carry NaNs into the next segment
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
        progress = self.progress
        if self.dist.main:
            write_run_file(self.out, self.run_record)
        log = MetricsLog(self.out, enabled=self.dist.main, truncate_after=progress.step)
        bar = ProgressBar(total=cfg.max_steps, initial=progress.step, enabled=self.dist.main and not self.quiet,
                          metric=self.metric)
        if self.dist.main and progress.step < cfg.warmup_steps and 2 * cfg.warmup_steps >= cfg.max_steps:
            self._warn(bar, f"warning: train.warmup_steps={cfg.warmup_steps} is {cfg.warmup_steps / cfg.max_steps:.0%} "
                            f"of max_steps={cfg.max_steps}: the learning rate reaches its peak only at step "
                            f"{min(cfg.warmup_steps, cfg.max_steps)} and has little of the run left to decay; lower "
                            f"warmup_steps (e.g. --set warmup_steps={max(cfg.max_steps // 10, 1)}) or raise --max-steps")
        previous_handlers = self._install_signal_handlers()
        # scored = tokens the loss averages over (mlm: the masked ones); tokens = all tokens processed
        window_nll, window_scored, window_tokens, window_start = 0.0, 0, 0, clock()
        window_skipped = 0  # steps of the window whose loss was not finite (their update skipped)
        session_start = clock()
        elapsed_before, step_before = progress.elapsed, progress.step
        # when the run will end by its minutes, checked once the step rate is known (the first log record or
        # step 50 of this session, whichever comes first)
        rate_known_at = progress.step + min(cfg.log_interval, 50)
        reason = "max_steps"
        batches = iter(self.train_iter)  # endless; continues from a resumed position
        try:
            self.model.train()
            while progress.step < cfg.max_steps:
                batch = next(batches)
                self.objective.check_batch(batch)  # its ids (a damaged cache); an epoch's start drops memory
                spent = (progress.elapsed / (60 * cfg.max_minutes)
                         if cfg.schedule_clock == "minutes" and cfg.max_minutes > 0 else 0.0)
                lr = lr_at(progress.step, schedule=cfg.schedule, lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                           max_steps=cfg.max_steps, eta_min=cfg.eta_min, time_fraction=spent)
                dropout = None
                if self.scheduled_dropouts:
                    dropout = dropout_at(progress.step, start=cfg.dropout_start, end=self.model_config.dropout,
                                         ramp=cfg.dropout_ramp, max_steps=cfg.max_steps, time_fraction=spent)
                    for module in self.scheduled_dropouts:
                        module.p = dropout
                nll_sum, count = self.train_step(batch)
                local_bad = 0.0 if math.isfinite(nll_sum) else 1.0
                # the ranks agree on the clock (their mean), so the time-following schedule and the
                # max_minutes stop are the same decision everywhere
                total_nll, total_count, bad, stop, elapsed_sum = self.dist.all_sum(
                    [0.0 if local_bad else nll_sum, count, local_bad, float(self.stop_requested),
                     elapsed_before + clock() - session_start]
                )
                finite = bad == 0
                self.optimizer_step(lr, finite)
                if finite and self.average is not None:
                    self.average.update()
                progress.step += 1
                processed = self.objective.tokens(batch, int(total_count))  # over all ranks
                progress.tokens_seen += processed
                progress.elapsed = elapsed_sum / self.dist.world
                if finite:
                    progress.nonfinite_streak = 0
                    window_nll += total_nll
                    window_scored += int(total_count)
                    window_tokens += processed
                else:
                    progress.nonfinite_streak += 1
                    window_skipped += 1
                    bar.write(f"warning: non-finite loss at step {progress.step}; update skipped "
                              f"({progress.nonfinite_streak} in a row)")
                    if progress.nonfinite_streak >= cfg.max_nonfinite:
                        kept = (f"the last good checkpoint is {self.out / LAST} (step {progress.saved_step})"
                                if progress.saved_step is not None else "no checkpoint was written")
                        raise TrainingError(
                            f"loss was not finite for {progress.nonfinite_streak} steps in a row (last at step "
                            f"{progress.step}); {kept}; lower train.lr, raise train.warmup_steps or use precision "
                            "fp32/bf16"
                        )
                if progress.step % cfg.log_interval == 0 or progress.step == cfg.max_steps:
                    now = clock()
                    # the mean over the window's finite steps; none finite: no loss (JSON null), never 0.0
                    loss = window_nll / window_scored if window_scored else math.nan
                    speed = window_tokens / max(now - window_start, 1e-9)
                    record = {"split": "train", "step": progress.step, "loss": finite_or_none(loss),
                              self.metric: finite_or_none(metric_value(loss, self.metric)), "lr": lr,
                              "tokens_per_second": speed, "tokens": progress.tokens_seen, "elapsed": progress.elapsed}
                    if window_skipped:
                        record["nonfinite_steps"] = window_skipped
                    if dropout is not None:
                        record["dropout"] = dropout
                    if self.objective.ponder_depth is not None:  # universal: average depth used (steps + remainder)
                        record["ponder_depth"] = float(self.objective.ponder_depth)
                    log.write(record)
                    bar.show(step=progress.step, loss=loss, lr=lr, speed=speed)
                    window_nll, window_scored, window_tokens, window_start = 0.0, 0, 0, now
                    window_skipped = 0
                bar.advance(progress.step, total=self.projected_steps(progress.elapsed - elapsed_before,
                                                                      progress.step - step_before))
                if progress.step == rate_known_at and self.dist.main:
                    self._check_warmup_fits(bar, progress.elapsed - elapsed_before, progress.step - step_before)
                time_up = cfg.max_minutes > 0 and progress.elapsed >= cfg.max_minutes * 60
                stopping = stop > 0 or time_up or progress.step == cfg.max_steps
                validating = self.validates and (progress.step % cfg.eval_interval == 0 or time_up
                                                 or progress.step == cfg.max_steps)
                due = (cfg.save_interval and progress.step % cfg.save_interval == 0) or (
                    not cfg.save_interval and progress.step % cfg.eval_interval == 0
                )
                saving = (stopping or due) and progress.nonfinite_streak == 0  # keep the last *good* checkpoint
                if validating or saving:
                    self.check_finite_state()
                if validating:
                    self.validate(log, bar, last=time_up or progress.step == cfg.max_steps)  # (not on a signal)
                if saving:
                    self.checkpointer.save()
                    progress.saved_step = progress.step
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
        if self.sharded:
            self._unshard()
        return {"steps": progress.step, "stopped_by": reason, "tokens": progress.tokens_seen, "elapsed": progress.elapsed,
                "tokens_per_second": progress.tokens_seen / max(progress.elapsed, 1e-9), "best_valid": progress.best_valid}

    def _unshard(self) -> None:
        """After the last step of a sharded run: every rank gets the whole model, unsharded, for the run's end
        (final scores, loading `best`, the sample on rank 0; txl.train.finish), as a DDP run has it."""
        weights = full_model_state(self.model, everywhere=True)
        model = build_model(self.model_config).to(self.dist.device)
        model.load_state_dict(weights)
        model.checkpoint_blocks = self.model.checkpoint_blocks
        self.model = model.train()

    def projected_steps(self, seconds: float, steps: int) -> int:
        """The step the run will likely end at: max_steps, or sooner where max_minutes binds first at this
        session's pace (`steps` took `seconds`, validations included, as the budget counts them)."""
        cfg = self.cfg
        if cfg.max_minutes <= 0 or steps <= 0 or seconds <= 0:
            return cfg.max_steps
        left = max(cfg.max_minutes * 60 - self.progress.elapsed, 0.0)
        return int(min(cfg.max_steps, self.progress.step + left * steps / seconds))

    def _check_warmup_fits(self, bar, seconds: float, steps: int) -> None:
        """A warning when the minutes budget will likely end the run inside its warm-up or soon after it."""
        cfg = self.cfg
        end = self.projected_steps(seconds, steps)
        if end >= cfg.max_steps or self.progress.step >= cfg.warmup_steps or 2 * cfg.warmup_steps < end:
            return
        inside = end < cfg.warmup_steps
        where = "inside its warm-up" if inside else "soon after its warm-up"
        effect = "never reaches its peak" if inside else "has little time to decay"
        self._warn(bar, f"warning: at {seconds / steps:.2g} s a step, max_minutes={cfg.max_minutes:g} will end the run "
                        f"near step {end}, {where} of {cfg.warmup_steps} steps (train.warmup_steps), so the learning "
                        f"rate {effect}; lower warmup_steps (e.g. --set warmup_steps={max(end // 10, 1)}) or raise "
                        "--max-minutes")

    def _warn(self, bar, text: str) -> None:
        """A warning line on stderr, above the progress bar when there is one (shown with --quiet too)."""
        if bar.enabled:
            bar.write(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def check_finite_state(self) -> None:
        """Before a validation or a checkpoint: the weights, the optimiser's state and the weight average must be
        finite. A step whose loss was finite can still break them in its update (a learning rate far too large,
        a damaged hyperparameter); saving them would replace the last good `last` with NaNs. The ranks agree
        (their states are the same; the sum makes them stop together)."""
        bad = self.checkpointer.non_finite()
        broken = bad is not None if self.dist.world == 1 else self.dist.all_sum([float(bad is not None)])[0] > 0
        if not broken:
            return
        kept = (f"{self.out / LAST} keeps step {self.progress.saved_step}" if self.progress.saved_step is not None
                else "no checkpoint was written")
        raise TrainingError(
            f"at step {self.progress.step} the model's state is not finite (NaN/Inf in {bad or 'another rank'}); nothing "
            f"was saved: {kept}; lower train.lr, raise train.warmup_steps or train.clip, or "
            "use precision fp32/bf16"
        )

    def validate(self, log: MetricsLog, bar: ProgressBar, *, last: bool = False) -> None:
        """Score the live weights on valid (and the weight average, `train.ema`, as split "valid_ema");
        whichever beats the best so far becomes `best`. With train.eval_live false only the average is
        scored, except at the run's `last` validation."""
        if self.average is None or self.cfg.eval_live or last:
            self._validate_weights(log, bar, averaged=False)
        if self.average is not None:
            with self.average.applied():
                self._validate_weights(log, bar, averaged=True)
        self.model.train()

    def _validate_weights(self, log: MetricsLog, bar: ProgressBar, *, averaged: bool) -> None:
        result = self.evaluate_split("valid", max_tokens=self.cfg.eval_max_tokens)
        record = {"split": "valid_ema" if averaged else "valid", "step": self.progress.step,
                  "loss": finite_or_none(result.loss), self.metric: finite_or_none(result.value),
                  "tokens": result.tokens, "tokens_per_second": result.tokens_per_second,
                  "elapsed": self.progress.elapsed}
        accuracy = ""
        if result.accuracy is not None:  # masked LM (of the masked tokens), classification (of the documents)
            record["accuracy"] = result.accuracy
            what = "accuracy" if self.objective.name == "classify" else "masked-token accuracy"
            accuracy = f", {what} {result.accuracy:.4f}"
        log.write(record)
        which = " (weight average)" if averaged else ""
        bar.write(f"step {self.progress.step}: valid {self.metric}{which} {result.value:.4f} (loss {result.loss:.4f}, "
                  f"{result.tokens:,} tokens{accuracy})")
        self.last_scores["average" if averaged else "live"] = (self.progress.step, result)
        if result.loss < self.progress.best_valid:
            self.progress.best_valid = result.loss
            self.best_score = (self.progress.step, result)
            if self.dist.main or self.sharded:  # sharded: every rank gathers the weights, rank 0 writes
                self.checkpointer.save_best(result, weights="average" if averaged else "live")

    def evaluate_split(self, split: str, *, max_tokens: int = 0, progress: bool = False) -> EvalResult:
        """The objective's score of `split` with the model's current weights (all ranks together)."""
        return self.objective.evaluate(self.model, split, max_tokens=max_tokens,
                                       progress=progress and self.dist.main and not self.quiet)

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


def check_parallelism(cfg, model_config, dist) -> bool:
    """Whether the run asks for sharded training (train.parallelism = "fsdp"), after the combinations it does
    not run are refused in one line (checked with any world size, so a config tried on one process does not
    fail on many). With one process there is nothing to shard: a note, and a plain run."""
    if cfg.parallelism != "fsdp":
        return False
    refuse = None
    if getattr(model_config, "arch", "decoder") != "decoder":
        refuse = f"the Transformer-XL decoder (model.arch='decoder'), not model.arch={model_config.arch!r}"
    elif cfg.objective != "lm":
        refuse = f"the language-modelling objective (train.objective='lm'), not {cfg.objective!r}"
    elif cfg.compile:
        refuse = "the uncompiled model: unset train.compile (torch.compile of a sharded model is not supported here)"
    elif cfg.ema > 0:
        refuse = "runs without a weight average: set train.ema=0 (the average would hold a whole copy per rank)"
    elif cfg.optimizer not in ("adam", "adamw"):
        refuse = f"train.optimizer adam or adamw, not {cfg.optimizer!r}"
    if refuse is not None:
        raise ConfigError(f"train.parallelism='fsdp' is for {refuse}; or use parallelism='ddp'")
    if dist.world == 1 and dist.main:
        print("note: train.parallelism='fsdp' with one process: nothing to shard, a plain run (start several "
              "processes, txl train --nproc N or torchrun, to shard)", file=sys.stderr)
    return True


def clock() -> float:
    """The trainer's clock in seconds (the minutes budget, the schedule that follows it, tokens/s); tests
    replace it with a fake one, so what a minutes budget does is pinned without waiting for it."""
    return time.perf_counter()


def finite_or_none(value: float) -> float | None:
    """A number for metrics.jsonl: JSON has no NaN or Infinity, and a non-finite loss is not 0.0, so it is null."""
    return value if math.isfinite(value) else None

