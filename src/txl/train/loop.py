"""Training: one readable loop that runs the same on a laptop CPU and on many GPUs.

What a step does (the reference's train.py, batch-first and without its global state):
  for each micro-batch (rows of the global batch, each with its own memory):
      loss = model(inputs, memory, labels).loss / grad_accum ; backward      (DDP: no_sync but last)
      memory = out.memory                                                    (detached: SG(m))
  skip the update if the loss is not finite; unscale (fp16), clip, optimiser step, lr for the step.

The run's directory and checkpoints live in `txl.train.state`, its records in `txl.train.progress`,
the end of a run in `txl.train.finish` and the command line in `txl.cli.train`.
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

from txl.data.masking import mask_tokens
from txl.errors import ConfigError, DataError, TrainingError
from txl.eval.mlm import evaluate_mlm
from txl.eval.precision import autocast, resolve_precision
from txl.eval.result import EvalResult, metric_value
from txl.eval.segments import evaluate
from txl.models.registry import build_model
from txl.models.rnn.config import RNN_ARCHS
from txl.nn.memory import Memory
from txl.train.averaging import WeightAverage
from txl.train.config import RunConfig
from txl.train.distributed import init_distributed
from txl.train.finish import sample_prompt_ids
from txl.train.optim import build_optimizer, dropout_at, lr_at, set_lr
from txl.train.progress import MetricsLog, Progress
from txl.train.state import (
    LAST,
    create_out_dir,
    load_initial_weights,
    non_finite_state,
    open_run_dir,
    previous_run_record,
    resolve_data,
    restore_checkpoint,
    save_best,
    save_checkpoint,
    write_run_file,
)


def shared_precision(chosen: str, dist) -> str:
    """What `auto` became on this rank -> what every rank uses: on a CPU it comes from a timed probe
    (`txl.eval.precision.fast_bf16`) that may differ between processes, so bf16 only if every rank chose it."""
    if dist.world == 1:
        return chosen
    votes = dist.all_sum([float(chosen == "bf16")])[0]
    return "bf16" if votes == dist.world else "fp32"


class Trainer:
    def __init__(self, run: RunConfig, out_dir: str | Path, *, device: str = "auto", resume: bool = False,
                 quiet: bool = False, init_from: str | Path | None = None, force: bool = False):
        """Everything a run needs at its end is checked here, before the first step: the data (and a
        preset's corpus being where it is expected), the sample prompt, the validation split and the
        output directory, which is locked first (one writer per run, txl.train.state.open_run_dir) and
        removed again when the start fails, so a failed start leaves nothing behind."""
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
        lock = open_run_dir(self.out, resume=resume, force=force) if self.dist.main else None
        try:
            self._build(run, resume=resume, init_from=init_from)
        except BaseException:
            if lock is not None:
                lock.abandon()  # our hold only; a failed new run leaves its directory as it was
            raise
        if lock is not None:  # one writer per run: held until close() (or this object or its process dies)
            self._unlock = weakref.finalize(self, lock.release)  # runs once, whichever comes first

    def _build(self, run: RunConfig, *, resume: bool, init_from) -> None:
        from txl.data import StreamIterator, open_corpus, parse_spec
        from txl.data.spec import SEQ2SEQ_CORPORA

        self.data_as_typed = self.cfg.data
        self.cfg.data = resolve_data(self.cfg.data)  # absolute: the run works from any directory
        # a pair corpus trains an encoder-decoder (txl.models.seq2seq) through this same loop
        self.seq2seq = parse_spec(self.cfg.data).name in SEQ2SEQ_CORPORA
        if self.seq2seq:
            from txl.data.seq2seq import open_pair_corpus

            self.corpus = open_pair_corpus(self.cfg.data)
        else:
            self.corpus = open_corpus(self.cfg.data)
        self.metric = self.corpus.metric
        self.validates = "valid" in self.corpus.splits
        if not self.validates and self.dist.main and not resume:
            print(f"note: {self.cfg.data} has no valid split: validation is off, so there is no `best` checkpoint "
                  "and no final score (add a valid.txt to the corpus directory to get them)", file=sys.stderr)
        self.sample_prompt = [] if self.seq2seq else sample_prompt_ids(self.corpus, self.cfg)
        self.model_config = run.model_config(vocab_size=len(self.corpus.vocab))
        if self.seq2seq:
            self.model_config = seq2seq_model_config(self.model_config, self.corpus)
        elif self.model_config.arch == "encoder-decoder":
            raise ConfigError(f"model.arch={self.model_config.arch!r} trains on a pair corpus (pairs:, reverse, "
                              f"pydoc-summaries), not {self.cfg.data!r}; pick one with --data")
        if self.cfg.optimizer == "muon" and self.model_config.arch != "decoder":
            raise ConfigError(f"train.optimizer='muon' is for the Transformer-XL decoder (model.arch='decoder'), "
                              f"not model.arch={self.model_config.arch!r}; use adam or adamw")
        if self.cfg.dropout_start is not None and self.model_config.arch in RNN_ARCHS:
            raise ConfigError(f"train.dropout_start schedules the Transformer's dropout layers; model.arch="
                              f"{self.model_config.arch!r} applies its dropouts as functions: unset train.dropout_start")
        torch.manual_seed(self.cfg.seed)
        self.model = build_model(self.model_config).to(self.dist.device)
        self.init_from = None
        if init_from is not None and not resume:
            self.init_from = str(load_initial_weights(self.model, init_from, self.corpus.vocab))
        elif resume:  # keep the record of where a fine-tuned run started (a path; anything else is no record)
            init_from = previous_run_record(self.out).get("init_from")
            self.init_from = init_from if isinstance(init_from, str) else None
        torch.manual_seed(self.cfg.seed + self.dist.rank)  # distinct dropout streams per rank
        self.ddp = self.model
        if self.dist.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.ddp = DistributedDataParallel(
                self.model,
                device_ids=[self.dist.local_rank] if self.dist.device.type == "cuda" else None,
                # tail clusters may see no token; shared-QK kernels (lsh, routing) never use the query projection
                find_unused_parameters=self.model_config.adaptive or any(
                    getattr(m, "unused_query_projection", False) for m in self.model.modules()),
            )
        self.forward = torch.compile(self.ddp) if self.cfg.compile else self.ddp
        self.optimizer = build_optimizer(self.cfg.optimizer, self.model, lr=self.cfg.lr,
                                         weight_decay=self.cfg.weight_decay, betas=self.cfg.adam_betas,
                                         eps=self.cfg.adam_eps)
        self.precision = resolve_precision(self.cfg.precision, self.dist.device)  # `auto` decided once
        if self.cfg.precision == "auto":
            self.precision = shared_precision(self.precision, self.dist)
        self.scaler = torch.amp.GradScaler(self.dist.device.type, enabled=self.precision == "fp16")
        self.average = WeightAverage(self.model, self.cfg.ema) if self.cfg.ema > 0 else None
        # train.dropout_start: the layers at model.dropout (after the fast backend swapped its own in)
        self.scheduled_dropouts = [] if self.cfg.dropout_start is None else [
            m for m in self.model.modules() if isinstance(m, torch.nn.Dropout) and m.p == self.model_config.dropout]
        if self.seq2seq:  # batch_size pairs per step, bucketed by length
            from txl.data.seq2seq import PairBatches

            self.train_iter = PairBatches(self.corpus.pairs("train"), self.corpus.vocab,
                                          batch_size=self.cfg.batch_size, seed=self.cfg.seed)
        else:
            self.train_iter = StreamIterator(self.corpus.split("train"), batch_size=self.cfg.batch_size,
                                             tgt_len=self.cfg.tgt_len, varlen=self.cfg.varlen, roll=self.cfg.roll,
                                             seed=self.cfg.seed)
        self.memories: list[Memory | None] = [None] * self.cfg.grad_accum
        self.step = 0
        self.tokens_seen = 0
        self.elapsed = 0.0  # training seconds over all sessions of this run
        self.best_valid = math.inf
        self.nonfinite_streak = 0
        self.saved_step: int | None = None  # the step `last` holds (None: no checkpoint yet)
        self.ponder_depth = None  # universal: the last micro-batch's average depth (ACT)
        self.stop_requested = False
        self._checked_splits: set[str] = set()
        if resume:
            restore_checkpoint(self, self.out / LAST)
        elif self.dist.main:
            create_out_dir(self.out)  # (created with its lock; this proves it is writable)

    def close(self) -> None:
        """Release the run directory's lock (also released when the trainer or the process goes)."""
        if self._unlock is not None:
            self._unlock()

    # -- one optimisation step ---------------------------------------------------------------------
    def train_step(self, batch) -> tuple[float, int]:
        """Forward/backward over this rank's micro-batches. Returns (summed NLL over this rank's scored
        tokens, their count); the NLL is NaN when any micro-batch loss was not finite. One host sync per
        step. Masked LM (`objective = "mlm"`): the segment's tokens are masked by BERT's recipe and only
        the picked positions are scored (labels = the original tokens there, no shift)."""
        if self.seq2seq:
            return self.seq2seq_step(batch)
        rows = self.dist.rows(self.cfg.batch_size)
        inputs = batch.inputs[rows]
        targets = batch.targets[rows]
        scored = None
        if self.cfg.objective == "mlm":  # the global RNG: saved in checkpoints, so a resume is exact
            vocab = self.model_config.vocab_size
            inputs, targets = mask_tokens(inputs, mask_id=vocab - 1, vocab_size=vocab, rate=self.cfg.mask_prob)
            scored = int((targets != -100).sum())
        inputs = inputs.to(self.dist.device, non_blocking=True)
        targets = targets.to(self.dist.device, non_blocking=True)
        micro = inputs.shape[0] // self.cfg.grad_accum
        nll_sum = torch.zeros((), dtype=torch.float64, device=self.dist.device)
        for j in range(self.cfg.grad_accum):
            x, y = inputs[j * micro : (j + 1) * micro], targets[j * micro : (j + 1) * micro]
            last = j == self.cfg.grad_accum - 1
            sync = contextlib.nullcontext() if last or self.dist.world == 1 else self.ddp.no_sync()
            with sync:
                with autocast(self.dist.device, self.precision):
                    out = self.forward(x, memory=self.memories[j], labels=y)
                loss = out.loss if out.aux_loss is None else out.loss + out.aux_loss  # compressive memory
                self.scaler.scale(loss / self.cfg.grad_accum).backward()
            self.memories[j] = out.memory
            self.ponder_depth = None if out.ponder_depth is None else out.ponder_depth.detach()  # universal
            # the loss, not the per-token NLL, decides finiteness (a caller may poison either)
            nll_sum += out.nll.detach().double().sum() + out.loss.detach().double() * 0
        return float(nll_sum), inputs.shape[0] * inputs.shape[1] if scored is None else scored

    def seq2seq_step(self, batch) -> tuple[float, int]:
        """`train_step` for a pair batch: teacher forcing (the decoder reads the target shifted right),
        label smoothing in the loss that is minimised, the unsmoothed NLL in the records."""
        rows = self.dist.rows(batch.source.shape[0]) if batch.source.shape[0] >= self.dist.world else slice(None)
        device = self.dist.device
        tensors = [t[rows].to(device, non_blocking=True) for t in
                   (batch.source, batch.attention_mask, batch.decoder_input, batch.labels)]
        micro = max(tensors[0].shape[0] // self.cfg.grad_accum, 1)
        count = int((tensors[3] != -100).sum())
        nll_sum = torch.zeros((), dtype=torch.float64, device=device)
        chunks = list(zip(*(t.split(micro) for t in tensors)))
        for j, (src, mask, dec, labels) in enumerate(chunks):
            last = j == len(chunks) - 1
            sync = contextlib.nullcontext() if last or self.dist.world == 1 else self.ddp.no_sync()
            with sync:
                with autocast(device, self.precision):
                    out = self.forward(src, mask, dec, labels, label_smoothing=self.cfg.label_smoothing)
                # mean over the step's scored tokens, whatever their split into micro-batches
                scale = int((labels != -100).sum()) / max(count, 1)
                self.scaler.scale(out.loss * scale).backward()
            nll_sum += out.nll.detach().double().sum() + out.loss.detach().double() * 0
        return float(nll_sum), count

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
            write_run_file(self)
        log = MetricsLog(self.out, enabled=self.dist.main, truncate_after=self.step)
        bar = Progress(total=cfg.max_steps, initial=self.step, enabled=self.dist.main and not self.quiet,
                       metric=self.metric)
        previous_handlers = self._install_signal_handlers()
        # scored = tokens the loss averages over (mlm: the masked ones); tokens = all tokens processed
        window_nll, window_scored, window_tokens, window_start = 0.0, 0, 0, time.perf_counter()
        window_skipped = 0  # steps of the window whose loss was not finite (their update skipped)
        session_start = time.perf_counter()
        elapsed_before = self.elapsed
        reason = "max_steps"
        batches = iter(self.train_iter)  # endless; continues from a resumed position
        try:
            self.model.train()
            while self.step < cfg.max_steps:
                batch = next(batches)
                # inputs[:, 1:] == targets[:, :-1]: the targets and the first column cover every id
                if not self.seq2seq:  # (pair ids are encoded in memory by this run's own vocabulary)
                    self.check_token_ids(max(int(batch.targets.max()), int(batch.inputs[:, 0].max())), "train")
                if batch.step == 0:
                    self.memories = [None] * cfg.grad_accum  # memory does not cross epochs
                spent = (self.elapsed / (60 * cfg.max_minutes)
                         if cfg.schedule_clock == "minutes" and cfg.max_minutes > 0 else 0.0)
                lr = lr_at(self.step, schedule=cfg.schedule, lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                           max_steps=cfg.max_steps, eta_min=cfg.eta_min, time_fraction=spent)
                dropout = None
                if self.scheduled_dropouts:
                    dropout = dropout_at(self.step, start=cfg.dropout_start, end=self.model_config.dropout,
                                         ramp=cfg.dropout_ramp, max_steps=cfg.max_steps, time_fraction=spent)
                    for module in self.scheduled_dropouts:
                        module.p = dropout
                nll_sum, count = self.train_step(batch)
                local_bad = 0.0 if math.isfinite(nll_sum) else 1.0
                # the ranks agree on the clock (their mean), so the time-following schedule and the
                # max_minutes stop are the same decision everywhere
                total_nll, total_count, bad, stop, elapsed_sum = self.dist.all_sum(
                    [0.0 if local_bad else nll_sum, count, local_bad, float(self.stop_requested),
                     elapsed_before + time.perf_counter() - session_start]
                )
                finite = bad == 0
                self.optimizer_step(lr, finite)
                if finite and self.average is not None:
                    self.average.update()
                self.step += 1
                # over all ranks (a pair batch: its scored target tokens)
                processed = int(total_count) if self.seq2seq else cfg.batch_size * batch.inputs.shape[1]
                self.tokens_seen += processed
                self.elapsed = elapsed_sum / self.dist.world
                if finite:
                    self.nonfinite_streak = 0
                    window_nll += total_nll
                    window_scored += int(total_count)
                    window_tokens += processed
                else:
                    self.nonfinite_streak += 1
                    window_skipped += 1
                    bar.write(f"warning: non-finite loss at step {self.step}; update skipped "
                              f"({self.nonfinite_streak} in a row)")
                    if self.nonfinite_streak >= cfg.max_nonfinite:
                        kept = (f"the last good checkpoint is {self.out / LAST} (step {self.saved_step})"
                                if self.saved_step is not None else "no checkpoint was written")
                        raise TrainingError(
                            f"loss was not finite for {self.nonfinite_streak} steps in a row (last at step "
                            f"{self.step}); {kept}; lower train.lr, raise train.warmup_steps or use precision "
                            "fp32/bf16"
                        )
                if self.step % cfg.log_interval == 0 or self.step == cfg.max_steps:
                    now = time.perf_counter()
                    # the mean over the window's finite steps; none finite: no loss (JSON null), never 0.0
                    loss = window_nll / window_scored if window_scored else math.nan
                    speed = window_tokens / max(now - window_start, 1e-9)
                    record = {"split": "train", "step": self.step, "loss": finite_or_none(loss),
                              self.metric: finite_or_none(metric_value(loss, self.metric)), "lr": lr,
                              "tokens_per_second": speed, "tokens": self.tokens_seen, "elapsed": self.elapsed}
                    if window_skipped:
                        record["nonfinite_steps"] = window_skipped
                    if dropout is not None:
                        record["dropout"] = dropout
                    if self.ponder_depth is not None:  # universal: average depth used (steps + remainder)
                        record["ponder_depth"] = float(self.ponder_depth)
                    log.write(record)
                    bar.show(step=self.step, loss=loss, lr=lr, speed=speed)
                    window_nll, window_scored, window_tokens, window_start = 0.0, 0, 0, now
                    window_skipped = 0
                bar.advance(self.step)
                time_up = cfg.max_minutes > 0 and self.elapsed >= cfg.max_minutes * 60
                stopping = stop > 0 or time_up or self.step == cfg.max_steps
                validating = self.validates and (self.step % cfg.eval_interval == 0 or time_up
                                                 or self.step == cfg.max_steps)
                due = (cfg.save_interval and self.step % cfg.save_interval == 0) or (
                    not cfg.save_interval and self.step % cfg.eval_interval == 0
                )
                saving = (stopping or due) and self.nonfinite_streak == 0  # keep the last *good* checkpoint
                if validating or saving:
                    self.check_finite_state()
                if validating:
                    self.validate(log, bar, last=time_up or self.step == cfg.max_steps)  # (not on a signal)
                if saving:
                    save_checkpoint(self, self.out / LAST)
                    self.saved_step = self.step
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

    def check_finite_state(self) -> None:
        """Before a validation or a checkpoint: the weights, the optimiser's state and the weight average must be
        finite. A step whose loss was finite can still break them in its update (a learning rate far too large,
        a damaged hyperparameter); saving them would replace the last good `last` with NaNs. The ranks agree
        (their states are the same; the sum makes them stop together)."""
        bad = non_finite_state(self)
        broken = bad is not None if self.dist.world == 1 else self.dist.all_sum([float(bad is not None)])[0] > 0
        if not broken:
            return
        kept = (f"{self.out / LAST} keeps step {self.saved_step}" if self.saved_step is not None
                else "no checkpoint was written")
        raise TrainingError(
            f"at step {self.step} the model's state is not finite (NaN/Inf in {bad or 'another rank'}); nothing "
            f"was saved: {kept}; lower train.lr, raise train.warmup_steps or train.clip, or "
            "use precision fp32/bf16"
        )

    def validate(self, log: MetricsLog, bar: Progress, *, last: bool = False) -> None:
        """Score the live weights on valid (and the weight average, `train.ema`, as split "valid_ema");
        whichever beats the best so far becomes `best`. With train.eval_live false only the average is
        scored, except at the run's `last` validation."""
        if self.average is None or self.cfg.eval_live or last:
            self._validate_weights(log, bar, averaged=False)
        if self.average is not None:
            with self.average.applied():
                self._validate_weights(log, bar, averaged=True)
        self.model.train()

    def _validate_weights(self, log: MetricsLog, bar: Progress, *, averaged: bool) -> None:
        result = self.evaluate_split("valid", max_tokens=self.cfg.eval_max_tokens)
        record = {"split": "valid_ema" if averaged else "valid", "step": self.step,
                  "loss": finite_or_none(result.loss), self.metric: finite_or_none(result.value), "tokens": result.tokens, "tokens_per_second": result.tokens_per_second, "elapsed": self.elapsed}
        accuracy = ""
        if result.accuracy is not None:  # masked LM
            record["accuracy"] = result.accuracy
            accuracy = f", masked-token accuracy {result.accuracy:.4f}"
        log.write(record)
        which = " (weight average)" if averaged else ""
        bar.write(f"step {self.step}: valid {self.metric}{which} {result.value:.4f} (loss {result.loss:.4f}, "
                  f"{result.tokens:,} tokens{accuracy})")
        if result.loss < self.best_valid:
            self.best_valid = result.loss
            if self.dist.main:
                save_best(self, result, weights="average" if averaged else "live")

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
        if self.seq2seq:  # teacher-forced NLL and token accuracy (decoding scores come at the end)
            from txl.eval.seq2seq import teacher_forced

            return teacher_forced(self.model, self.corpus, split, batch_size=cfg.eval_batch_size,
                                  device=self.dist.device, precision=self.precision)
        tokens = self.corpus.split(split)
        if split not in self._checked_splits and len(tokens):  # once per split: one pass over <= 5% of the corpus
            self.check_token_ids(int(tokens[: max_tokens + 1 if max_tokens else None].max()), split)
            self._checked_splits.add(split)
        bsz = cfg.eval_batch_size
        if cfg.objective == "mlm":
            result = evaluate_mlm(self.model, tokens, metric=self.metric, batch_size=bsz,
                                  tgt_len=cfg.eval_tgt_len or cfg.tgt_len, mask_prob=cfg.mask_prob, seed=cfg.seed,
                                  max_tokens=max_tokens, device=self.dist.device, precision=self.precision,
                                  shard=(self.dist.rank, self.dist.world))
            if self.dist.world > 1:
                total, count, hits = self.dist.all_sum([result.loss * result.tokens, result.tokens,
                                                        result.accuracy * result.tokens])
                result.loss, result.tokens, result.accuracy = total / max(count, 1), int(count), hits / max(count, 1)
            result.split = split
            return result
        rows = None
        if self.dist.world > 1:
            bsz = max(bsz // self.dist.world, 1) * self.dist.world
            rows = self.dist.rows(bsz)
        result = evaluate(
            self.model, self.corpus.split(split), metric=self.metric, batch_size=bsz,
            tgt_len=cfg.eval_tgt_len or cfg.tgt_len, mem_len=cfg.eval_mem_len, warm_memory=cfg.eval_warm_memory,
            max_tokens=max_tokens, device=self.dist.device, precision=self.precision, rows=rows,
            progress=progress and self.dist.main and not self.quiet,
        )
        if self.dist.world > 1:
            total, count = self.dist.all_sum([result.loss * result.tokens, result.tokens])
            result.loss, result.tokens = total / max(count, 1), int(count)
        result.split = split
        return result

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


def finite_or_none(value: float) -> float | None:
    """A number for metrics.jsonl: JSON has no NaN or Infinity, and a non-finite loss is not 0.0, so it is null."""
    return value if math.isfinite(value) else None


def seq2seq_model_config(config, corpus):
    """The model config of a pair corpus: an encoder-decoder whose vocabularies are the corpus's."""
    if config.arch != "encoder-decoder":
        raise ConfigError(f"{corpus.name} is a sequence-to-sequence corpus: it trains model.arch='encoder-decoder' "
                          "(e.g. --preset seq2seq-reverse), not a decoder-only LM")
    vocab = corpus.vocab
    return config.replace(source_vocab_size=0 if vocab.shared else vocab.source.size,
                          share_embeddings=config.share_embeddings and vocab.shared)
