"""Evaluation: token-weighted loss over a whole split as bpc or perplexity, two ways.

**Transformer-XL** (`evaluate`): the split is cut into `batch_size` contiguous streams read `tgt_len`
tokens at a time; each stream carries its own memory from segment to segment, so a token attends
`mem_len` positions back per layer without re-running them (Dai et al. 2019, §3.2). With `warm_memory`
each stream starts `mem_len` tokens early and those warm-up tokens are fed but not scored, so every
scored token has full context; without it, scoring starts at each stream's first token like the
reference. Every target of the split is scored exactly once either way.

**Vanilla** (`evaluate_vanilla`, Al-Rfou et al. 2018, the paper's Fig. 1b baseline): for every scored
token a fresh forward over the previous `attn_len` tokens with no memory, keeping only the last
prediction. `stride` S scores the last S positions of each window instead (cheaper, less context for
all but the last). This is what Transformer-XL's evaluation speed-up is measured against
(`txl bench eval-speedup`).

`evaluate_checkpoint` is the Python face of `txl eval`: it opens a checkpoint (or a run directory),
checks that the corpus vocabulary is the checkpoint's, and runs either evaluator.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from txl.errors import CheckpointError, DataError, OutputError, UsageError, describe_os_error
from txl.io import read_bytes
from txl.io.rundir import save_array, save_figure, write_text
from txl.models.checkpoint import LoadedCheckpoint, load_checkpoint

TEXT_LIMIT = 2**31  # `txl eval --text FILE` holds the whole file and its token ids in memory


@dataclass
class EvalResult:
    loss: float  # mean NLL in nats per scored token
    tokens: int  # tokens scored
    seconds: float
    metric: str  # "bpc" or "ppl"
    mem_len: int
    tgt_len: int
    batch_size: int
    warm_memory: bool
    clamp_len: int | None = None  # None: not recorded (the model's own setting)
    same_length: bool | None = None
    mode: str = "xl"  # "xl": segments with memory; "vanilla": one fresh window per scored token
    attn_len: int | None = None  # keys the last query of a segment attends to (see `attention_length`)
    stride: int | None = None  # vanilla: positions scored per window
    split: str | None = None
    accuracy: float | None = None  # mlm: share of masked tokens whose argmax prediction is the original
    mask_prob: float | None = None  # mlm: positions picked per window
    dynamic_lr: float | None = None  # dynamic evaluation (txl.eval.dynamic): SGD step size η ...
    dynamic_decay: float | None = None  # ... and decay λ toward the trained weights

    @property
    def value(self) -> float:
        return metric_value(self.loss, self.metric)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    def to_dict(self) -> dict:
        out = asdict(self)
        out[self.metric] = self.value
        out["tokens_per_second"] = self.tokens_per_second
        return out


def metric_value(loss: float, metric: str) -> float:
    """bpc = nats / ln 2 (bits per byte or character token); ppl = exp(nats)."""
    if metric == "bpc":
        return loss / math.log(2)
    return math.exp(min(loss, 700.0))


def attention_length(*, mem_len: int, tgt_len: int, same_length: bool) -> int:
    """Keys the *last* query of a segment attends to at each layer: mem_len + tgt_len (the first query
    sees mem_len + 1), or exactly mem_len with same_length. The x-axis of `--sweep-mem`."""
    return mem_len if same_length else mem_len + tgt_len


def bf16_instructions(device: torch.device) -> bool:
    """Whether `device` has bfloat16 matrix instructions at all (CUDA compute capability 8 or later;
    an x86 CPU with AVX512-BF16 or AMX). Necessary for a bf16 speed-up, not sufficient on CPUs."""
    if device.type == "cuda":  # compute capability 8 (Ampere) and later; older GPUs only emulate bf16
        return torch.cuda.is_available() and torch.cuda.get_device_properties(device).major >= 8
    if device.type == "cpu":
        cpu = getattr(torch, "cpu", None)
        checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(getattr(cpu, name, lambda: False)() for name in checks)
    return False


BF16_MIN_SPEEDUP = 1.25  # a CPU must run the probe this much faster in bf16 for `auto` to choose it


def matmul_seconds(dtypes: Sequence[torch.dtype], *, size: int = 512, repeats: int = 7) -> list[float]:
    """The fastest of `repeats` single-threaded CPU products of two size x size matrices, per dtype,
    interleaved so a busy machine slows every dtype alike (one warm-up product each first)."""
    pairs = [(torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)) for dtype in dtypes]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # per-core speed: with several threads a busy core stalls the whole product
    try:
        for a, b in pairs:
            torch.mm(a, b)
        best = [float("inf")] * len(pairs)
        for _ in range(repeats):
            for i, (a, b) in enumerate(pairs):
                start = time.perf_counter()
                torch.mm(a, b)
                best[i] = min(best[i], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return best


_CPU_BF16_VERDICT: list[bool] = []  # the probe's answer, once per process


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 autocast is a speed-up on `device`. On CUDA: the instructions exist (compute
    capability >= 8). On a CPU the instructions are not enough: AVX512-BF16 without AMX can run bf16
    products slower than fp32 (an Emerald Rapids VM with AMX hidden: about 0.5x), so the first call
    also times a 512 x 512 product in both precisions on one thread (a few milliseconds, once per
    process) and says yes only when bf16 is at least BF16_MIN_SPEEDUP times faster."""
    if not bf16_instructions(device):
        return False
    if device.type != "cpu":
        return True
    if not _CPU_BF16_VERDICT:
        fp32, bf16 = matmul_seconds((torch.float32, torch.bfloat16))
        _CPU_BF16_VERDICT.append(fp32 >= BF16_MIN_SPEEDUP * bf16)
    return _CPU_BF16_VERDICT[0]


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto` = bf16 autocast where it is a speed-up on the device (fast_bf16), else fp32; others as given."""
    if precision != "auto":
        return precision
    return "bf16" if fast_bf16(device) else "fp32"


def autocast(device: torch.device, precision: str):
    precision = resolve_precision(precision, device)
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return torch.autocast(device_type=device.type, dtype=dtype)


@dataclass(frozen=True)
class RuntimeSettings:
    """The settings every forward call of one evaluation passes to the model."""

    clamp_len: int
    same_length: bool


@contextlib.contextmanager
def runtime_settings(model, *, clamp_len: int | None = None, same_length: bool | None = None) -> Iterator[Any]:
    """The `clamp_len` / `same_length` of a block of forward calls: the given values, else the model's
    (they change no parameter, so a model trained with one setting can be evaluated with another).
    The model is never changed: the calls pass them as keyword arguments."""
    inner = getattr(model, "module", model)
    if clamp_len is not None and clamp_len < 0:
        raise UsageError(f"clamp_len must be >= 0 (0 = no clamp), got {clamp_len}")
    yield RuntimeSettings(clamp_len=inner.clamp_len if clamp_len is None else clamp_len,
                          same_length=inner.same_length if same_length is None else same_length)


def check_segment_settings(model, *, mem_len: int, tgt_len: int, max_tokens: int, same_length: bool | None) -> None:
    """The settings of reading a split segment by segment with memory (static or dynamic evaluation)."""
    if mem_len < 0:
        raise UsageError(f"mem_len must be >= 0, got {mem_len}")
    if tgt_len < 1:
        raise UsageError(f"tgt_len must be >= 1, got {tgt_len}")
    if max_tokens < 0:
        raise UsageError(f"max_tokens must be >= 0 (0 = the whole split), got {max_tokens}")
    if (model.same_length if same_length is None else same_length) and mem_len < 1:
        raise UsageError("same_length needs mem_len >= 1 (each query sees exactly mem_len keys); "
                         "raise mem_len or turn same_length off")


def _check_per_token(per_token: np.ndarray | None, n_targets: int) -> None:
    if per_token is not None and per_token.shape != (n_targets,):
        raise UsageError(f"per_token must have shape ({n_targets},) (one entry per target), got {per_token.shape}")


@torch.no_grad()
def evaluate(
    model,
    tokens: np.ndarray,
    *,
    metric: str,
    batch_size: int = 10,
    tgt_len: int = 128,
    mem_len: int | None = None,
    warm_memory: bool = True,
    max_tokens: int = 0,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
    rows: slice | None = None,
    per_token: np.ndarray | None = None,
    progress: bool = False,
    clamp_len: int | None = None,
    same_length: bool | None = None,
) -> EvalResult:
    """Score `tokens` (a 1-D array of ids; targets are tokens[1:]) segment by segment with memory.

    mem_len: memory per layer (None = the model's `mem_len`). clamp_len / same_length: override the
    model's runtime settings for this call (None = keep). rows: evaluate only these streams of the
    batch (distributed evaluation: each rank takes its rows; sum `loss * tokens` over ranks).
    per_token: a float array of len(tokens) - 1 (after `max_tokens`) that receives each target's NLL
    at its corpus position (target k -> per_token[k - 1]).
    """
    from txl.data import EvalIterator

    device = torch.device(device)
    inner = getattr(model, "module", model)
    mem_len = inner.mem_len if mem_len is None else mem_len
    if batch_size < 1:
        raise UsageError(f"batch_size must be >= 1, got {batch_size}")
    check_segment_settings(inner, mem_len=mem_len, tgt_len=tgt_len, max_tokens=max_tokens, same_length=same_length)
    if max_tokens:
        tokens = tokens[: max_tokens + 1]
    _check_per_token(per_token, max(len(tokens) - 1, 0))
    iterator = EvalIterator(tokens, batch_size=batch_size, tgt_len=tgt_len, warm_len=mem_len if warm_memory else 0)
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    memory = None
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(iterator), desc="eval", unit="seg", leave=False, dynamic_ncols=True,
                   disable=not sys.stderr.isatty())  # a log file gets no \r-redrawn bar
    with runtime_settings(model, clamp_len=clamp_len, same_length=same_length) as settings:
        used_clamp, used_same = settings.clamp_len, settings.same_length
        start = time.perf_counter()
        try:
            for batch in iterator:
                inputs, targets, mask = batch.inputs, batch.targets, batch.score_mask
                positions = batch.positions
                if rows is not None:
                    inputs, targets, mask, positions = inputs[rows], targets[rows], mask[rows], positions[rows]
                inputs, targets, mask = inputs.to(device), targets.to(device), mask.to(device)
                labels = targets.masked_fill(~mask, -100)
                with autocast(device, precision):
                    nll, memory = forward_segment(model, inputs, labels, memory, mem_len=mem_len, settings=settings)
                nll = nll.float()
                total += nll.sum().double().cpu()
                count += int(mask.sum())
                if per_token is not None:
                    keep = positions >= 0
                    # positions are split indices of the targets (1 … N-1); target k is per_token[k - 1]
                    per_token[positions[keep].numpy() - 1] = nll[keep.to(nll.device)].cpu().numpy()
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            model.train(was_training)
        seconds = time.perf_counter() - start
    loss = (total / max(count, 1)).item()
    return EvalResult(loss=loss, tokens=count, seconds=seconds, metric=metric, mem_len=mem_len,
                      tgt_len=tgt_len, batch_size=batch_size, warm_memory=warm_memory, clamp_len=used_clamp,
                      same_length=used_same, mode="xl",
                      attn_len=attention_length(mem_len=mem_len, tgt_len=tgt_len, same_length=used_same))


@torch.no_grad()
def evaluate_mlm(
    model,
    tokens: np.ndarray,
    *,
    metric: str,
    batch_size: int = 10,
    tgt_len: int = 128,
    mask_prob: float = 0.15,
    seed: int = 0,
    max_tokens: int = 0,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
    shard: tuple[int, int] = (0, 1),
    progress: bool = False,
) -> EvalResult:
    """Masked-LM evaluation of a bidirectional encoder (`causal=False`): `tokens` cut into windows of
    `tgt_len`, each masked by BERT's recipe (`txl.data.masking.mask_tokens`, `mask_prob`, the mask token
    being the model's last id) with a generator seeded `seed` and drawn window by window, so every
    run, batch size and rank count scores the same positions. loss = mean NLL of the masked tokens
    (so bpc/ppl are of masked tokens), accuracy = share predicted exactly. shard = (rank, world): this
    rank scores windows rank, rank + world, … (sum loss·tokens and accuracy·tokens over ranks)."""
    from txl.data.masking import mask_tokens

    inner = getattr(model, "module", model)
    if inner.config.causal:
        raise UsageError("masked-LM evaluation needs a bidirectional model (causal=false); this one is a causal LM")
    if tgt_len < 1 or batch_size < 1:
        raise UsageError(f"tgt_len and batch_size must be >= 1, got {tgt_len} and {batch_size}")
    if max_tokens < 0:
        raise UsageError(f"max_tokens must be >= 0 (0 = the whole split), got {max_tokens}")
    if max_tokens:
        tokens = tokens[:max_tokens]
    if len(tokens) < 1:
        raise UsageError("masked-LM evaluation needs at least one token")
    device = torch.device(device)
    vocab_size = inner.config.vocab_size
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    windows = [ids[start:start + tgt_len] for start in range(0, len(ids), tgt_len)]
    generator = torch.Generator().manual_seed(seed)
    masked = [mask_tokens(w[None], mask_id=vocab_size - 1, vocab_size=vocab_size, rate=mask_prob, generator=generator)
              for w in windows]  # every window, so a shard's draws do not depend on the others
    rank, world = shard
    mine = masked[rank::world]
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    count = correct = 0
    start = time.perf_counter()
    try:
        for i in range(0, len(mine), batch_size):
            group = mine[i:i + batch_size]
            by_length: dict[int, list] = {}
            for inputs, labels in group:  # the last window may be shorter: batch it alone
                by_length.setdefault(inputs.shape[1], []).append((inputs, labels))
            for pairs in by_length.values():
                inputs = torch.cat([p[0] for p in pairs]).to(device)
                labels = torch.cat([p[1] for p in pairs]).to(device)
                with autocast(device, precision):
                    out = model(inputs, labels=labels, return_logits=True)
                scored = labels != -100
                total += out.nll.float().sum().double().cpu()
                count += int(scored.sum())
                correct += int((out.logits.argmax(-1) == labels)[scored].sum())
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - start
    return EvalResult(loss=(total / max(count, 1)).item(), tokens=count, seconds=seconds, metric=metric, mem_len=0,
                      tgt_len=tgt_len, batch_size=batch_size, warm_memory=False, mode="mlm",
                      accuracy=correct / max(count, 1), mask_prob=mask_prob)


# Evaluation holds one memory and a bounded working set: streams are run in row groups whose memories
# are views of one set of buffers, and each group's memory is donated (`Memory.donate`), so the fast
# backend overwrites its rows in place. At mem_len 3800 on the base shape that keeps peak RSS under
# half of the eager reference's.
EVAL_GROUP_ELEMENTS = 1 << 23  # (rows × keys × d_model) per group: 32 MiB of fp32 per layer input


@torch.no_grad()
def forward_segment(model, inputs, labels, memory, *, mem_len: int, settings: RuntimeSettings | None = None):
    """One no-grad segment for every stream: (nll (b, t), next memory). The memory passed in is given
    up (it may be overwritten in place)."""

    inner = getattr(model, "module", model)
    extra = {} if settings is None else {"clamp_len": settings.clamp_len, "same_length": settings.same_length}
    batch = inputs.shape[0]
    keys = mem_len + inputs.shape[1]
    rows = max(1, EVAL_GROUP_ELEMENTS // (keys * inner.config.d_model))
    if rows >= batch:
        out = model(inputs, memory=None if memory is None else memory.donate(), labels=labels, mem_len=mem_len,
                    return_logits=False, **extra)
        return out.nll, out.memory
    nlls, parts, in_place = [], [], True
    for start in range(0, batch, rows):
        group = slice(start, start + rows)
        part = None if memory is None else memory.select(group).donate()  # views: in-place writes reach `memory`
        out = model(inputs[group], memory=part, labels=labels[group], mem_len=mem_len, return_logits=False, **extra)
        nlls.append(out.nll)
        parts.append(out.memory)
        in_place &= part is not None and out.memory is part
    if in_place:
        return torch.cat(nlls), memory
    return torch.cat(nlls), None if parts[0] is None else type(parts[0]).cat(parts)  # (a recurrent LM's kind too)


# ---------------------------------------------------------------------------------------------
# The vanilla baseline (Al-Rfou et al. 2018): one fresh window per scored token, no memory


def default_window_batch(attn_len: int) -> int:
    """Windows per forward for the vanilla evaluator: about 4096 tokens per batch (fewer windows at
    long lengths keep the (windows × heads × L × L) score tensors bounded)."""
    return max(1, 4096 // max(attn_len, 1))


def _window_nll(model, tokens: np.ndarray, starts: np.ndarray, *, length: int, scored: np.ndarray,
                device: torch.device, precision: str, clamp_len: int | None = None) -> torch.Tensor:
    """NLL of the last `scored[b]` targets of the windows tokens[starts[b] : starts[b] + length] (inputs)
    -> (B, length) float32, 0 where not scored. One forward, no memory (mem_len = 0)."""
    index = starts[:, None] + np.arange(length + 1)[None, :]  # (B, length + 1): inputs + next token
    window = torch.from_numpy(np.asarray(tokens[index.reshape(-1)], dtype=np.int64).reshape(index.shape))
    inputs, targets = window[:, :-1].to(device), window[:, 1:].to(device)
    columns = torch.arange(length, device=device)[None, :]
    keep = columns >= (length - torch.as_tensor(scored, device=device))[:, None]  # the last scored[b] columns
    labels = targets.masked_fill(~keep, -100)
    with autocast(device, precision):
        out = model(inputs, labels=labels, mem_len=0, clamp_len=clamp_len, same_length=False, return_logits=False)
    return out.nll.float().masked_fill(~keep, 0.0)


@torch.no_grad()
def context_nll(
    model,
    tokens: np.ndarray,
    targets: np.ndarray,
    *,
    context_len: int,
    batch_size: int = 0,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
    clamp_len: int | None = None,
) -> np.ndarray:
    """NLL of tokens[k] for each k in `targets` given exactly its previous `context_len` tokens
    (fewer when k < context_len): one fresh window per target, no memory. This is l(c, t) of the
    RECL definition (Dai et al. 2019, appendix C) and the vanilla model's per-token evaluation."""
    device = torch.device(device)
    tokens = np.asarray(tokens) if not isinstance(tokens, np.ndarray) else tokens
    targets = np.asarray(targets, dtype=np.int64)
    if context_len < 1:
        raise UsageError(f"the context length must be >= 1, got {context_len}")
    if targets.size and (targets.min() < 1 or targets.max() >= len(tokens)):
        raise UsageError(f"targets must lie in [1, {len(tokens) - 1}] (token 0 has no context)")
    batch_size = batch_size or default_window_batch(context_len)
    out = np.zeros(len(targets), dtype=np.float32)
    was_training = model.training
    model.eval()
    try:
        with runtime_settings(model, clamp_len=clamp_len, same_length=False) as settings:
            full = np.flatnonzero(targets >= context_len)
            for chunk in np.array_split(full, max(1, math.ceil(len(full) / batch_size))):
                if not len(chunk):
                    continue
                starts = targets[chunk] - context_len
                nll = _window_nll(model, tokens, starts, length=context_len, scored=np.ones(len(chunk), np.int64),
                                  device=device, precision=precision, clamp_len=settings.clamp_len)
                out[chunk] = nll[:, -1].cpu().numpy()
            for i in np.flatnonzero(targets < context_len):  # the whole history is shorter than the context
                k = int(targets[i])
                nll = _window_nll(model, tokens, np.array([0]), length=k, scored=np.array([1]), device=device,
                                  precision=precision, clamp_len=settings.clamp_len)
                out[i] = float(nll[0, -1])
    finally:
        model.train(was_training)
    return out


@torch.no_grad()
def evaluate_vanilla(
    model,
    tokens: np.ndarray,
    *,
    metric: str,
    attn_len: int,
    stride: int = 1,
    batch_size: int = 0,
    max_tokens: int = 0,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
    clamp_len: int | None = None,
    per_token: np.ndarray | None = None,
    progress: bool = False,
) -> EvalResult:
    """The vanilla Transformer evaluation of Al-Rfou et al. 2018 (Dai et al. 2019, Fig. 1b).

    Target k (tokens 1..N-1) is predicted by a fresh forward over tokens[k - attn_len : k] with no
    memory, keeping the last prediction. The first window, tokens[0 : attn_len], scores all of its
    targets at once: each of them already sees its whole history, exactly what a window of its own
    would give. After that, windows end every `stride` tokens and score their last `stride`
    positions (stride 1 = the paper's figure: every token has exactly attn_len tokens of context;
    larger strides give the earlier positions of a window less). `batch_size` windows run in one
    forward (0 = about 4096 tokens' worth); per-token semantics do not depend on it.
    """
    device = torch.device(device)
    if attn_len < 1:
        raise UsageError(f"attn_len must be >= 1, got {attn_len}")
    if not 1 <= stride <= attn_len:
        raise UsageError(f"stride must be in [1, attn_len={attn_len}], got {stride}")
    if batch_size < 0 or max_tokens < 0:
        raise UsageError("batch_size and max_tokens must be >= 0 (0 = automatic / the whole split)")
    if max_tokens:
        tokens = tokens[: max_tokens + 1]
    n = len(tokens)
    if n < 2:
        raise DataError(f"a split of {n} token(s) has nothing to score; it needs at least 2 tokens")
    _check_per_token(per_token, n - 1)
    batch_size = batch_size or default_window_batch(attn_len)
    first = min(attn_len, n - 1)  # the first window's length: it scores targets 1 … first
    ends = np.arange(first + stride, n - 1 + stride, stride, dtype=np.int64)  # last target of each later window
    ends[-1:] = np.minimum(ends[-1:], n - 1)
    scored = np.diff(np.concatenate([[first], ends])) if len(ends) else np.zeros(0, np.int64)
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n - 1, desc="vanilla eval", unit="tok", leave=False, dynamic_ncols=True,
                   disable=not sys.stderr.isatty())
    with runtime_settings(model, clamp_len=clamp_len, same_length=False) as settings:
        used_clamp = settings.clamp_len
        start = time.perf_counter()
        try:
            nll = _window_nll(model, tokens, np.array([0]), length=first, scored=np.array([first]), device=device,
                              precision=precision, clamp_len=settings.clamp_len)[0]
            total += float(nll.double().sum())
            count += first
            if per_token is not None:
                per_token[:first] = nll.cpu().numpy()
            if bar is not None:
                bar.update(first)
            for chunk in np.array_split(np.arange(len(ends)), max(1, math.ceil(len(ends) / batch_size))):
                if not len(chunk):
                    continue
                e, s = ends[chunk], scored[chunk]
                nll = _window_nll(model, tokens, e - attn_len, length=attn_len, scored=s, device=device,
                                  precision=precision, clamp_len=settings.clamp_len)
                total += float(nll.double().sum())
                count += int(s.sum())
                if per_token is not None:
                    values = nll.cpu().numpy()
                    for row, (end, k) in enumerate(zip(e.tolist(), s.tolist())):
                        per_token[end - k : end] = values[row, attn_len - k :]  # targets end-k+1 … end
                if bar is not None:
                    bar.update(int(s.sum()))
        finally:
            if bar is not None:
                bar.close()
            model.train(was_training)
        seconds = time.perf_counter() - start
    return EvalResult(loss=total / max(count, 1), tokens=count, seconds=seconds, metric=metric, mem_len=0,
                      tgt_len=attn_len, batch_size=batch_size, warm_memory=False, clamp_len=used_clamp,
                      same_length=False, mode="vanilla", attn_len=attn_len, stride=stride)


# ---------------------------------------------------------------------------------------------
# Memory sweep: bpc/ppl against attention length


def sweep_memory(model, tokens: np.ndarray, *, mem_lens: Sequence[int], metric: str, **kwargs) -> list[EvalResult]:
    """`evaluate` once per memory length (same tokens, tgt_len and settings)."""
    results = []
    for mem_len in mem_lens:
        results.append(evaluate(model, tokens, metric=metric, mem_len=int(mem_len), **kwargs))
    return results


def sweep_markdown(results: Sequence[EvalResult], *, title: str = "") -> str:
    metric = results[0].metric if results else "bpc"
    lines = [f"{title}\n" if title else ""]
    lines.append(f"| mem_len | tgt_len | attention length | {metric} | loss (nats) | tokens | seconds |")
    lines.append("|---:|---:|---:|---:|---:|---:|---:|")
    best = min(results, key=lambda r: r.loss) if results else None
    for r in results:
        value = f"**{r.value:.4f}**" if r is best else f"{r.value:.4f}"
        lines.append(f"| {r.mem_len} | {r.tgt_len} | {r.attn_len} | {value} | {r.loss:.4f} | {r.tokens:,} | "
                     f"{r.seconds:.1f} |")
    return "\n".join(lines).lstrip("\n") + "\n"


def plot_sweep(results: Sequence[EvalResult], path: str | Path, *, title: str = "",
               train_attn_len: int | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    metric = results[0].metric
    # Without memory the first tokens of every segment have almost no context, so mem_len 0 sits far
    # above the rest; a second panel then shows mem_len > 0 on its own scale, where the differences
    # past the training attention length live.
    with_memory = [r for r in results if r.mem_len > 0]
    panels = [results, with_memory] if len(with_memory) >= 2 and len(with_memory) < len(results) else [results]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4), squeeze=False)
    for ax, shown in zip(axes[0], panels):
        ax.plot([r.attn_len for r in shown], [r.value for r in shown], "o-")
        if train_attn_len:
            ax.axvline(train_attn_len, color="grey", linestyle="--", linewidth=1, label="training attention length")
            ax.legend()
        ax.set_xlabel("attention length at evaluation (mem_len + tgt_len)")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    axes[0][0].set_title(title or f"{metric} against evaluation attention length")
    if len(panels) == 2:
        axes[0][1].set_title("mem_len > 0, own scale")
    fig.tight_layout()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_figure(fig, path, dpi=120)
    except OSError as err:
        raise OutputError(f"cannot write {path}: {describe_os_error(err)}") from None
    finally:
        plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# Checkpoints + corpora


def encode_text(vocab, text: str | bytes, *, what: str = "the text") -> np.ndarray:
    """Token ids of `text` with a checkpoint's vocabulary (not one rebuilt from the text), for any kind:
    bytes and byte-level BPE read everything; chars and words map an unknown symbol to `<unk>` when the
    vocabulary has one, else one `DataError` naming the first unknown symbol and where it is."""
    if vocab.kind == "words" and vocab.unk is None:
        body = text.decode("utf-8", "replace") if isinstance(text, bytes | bytearray) else text
        for number, line in enumerate(body.split("\n"), 1):
            for column, word in enumerate(line.split(), 1):
                if word not in vocab.stoi:
                    hint = ""
                    special = {vocab.eos, vocab.bos}
                    if all(len(s) == 1 for s in vocab.symbols if s not in special):
                        hint = ("; this vocabulary's words are single characters (PTB-char style): write the text as "
                                "space-separated characters with _ between words, e.g. 't h e _ c a t'")
                    raise DataError(f"{what}: word {word!r} (line {number}, word {column}) is not in the checkpoint's "
                                    f"vocabulary and it has no <unk> symbol{hint}")
    if vocab.kind == "chars" and vocab.unk is not None:
        body = text.decode("utf-8") if isinstance(text, bytes | bytearray) else text
        known = set(vocab.symbols)
        text = "".join(c if c in known else vocab.unk for c in body)
    try:
        return vocab.encode(text)
    except DataError as err:
        fix = "; the checkpoint's vocabulary has no <unk>: replace or remove it" if vocab.kind == "chars" else ""
        raise DataError(f"{what}: {err}{fix}") from None


def read_text_tokens(vocab, path: str | Path) -> np.ndarray:
    """A whole text file as token ids of the checkpoint's vocabulary (`txl eval --text FILE`)."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise DataError(f"{path} is a directory; --text takes one text file")
    # a path the user typed (links followed); a FIFO or device is refused, the size bounded
    data = read_bytes(path, what="text file", limit=TEXT_LIMIT, follow_links=True)
    tokens = encode_text(vocab, data, what=str(path))
    if len(tokens) < 2:
        raise DataError(f"{path} holds {len(tokens)} token(s) with the checkpoint's vocabulary; at least 2 are needed "
                        "to score one prediction")
    return tokens


def _text_file_of(spec_text: str | None) -> str | None:
    """The FILE of a `text:FILE[?...]` spec (scored with the checkpoint's vocabulary), else None."""
    if not spec_text:
        return None
    from txl.data import parse_spec

    spec = parse_spec(spec_text)
    if spec.name == "text" and spec.path and Path(spec.path).is_file():
        return spec.path
    return None


def open_eval_corpus(ckpt: LoadedCheckpoint, data: str | None, split: str, text: str | Path | None = None):
    """The corpus to score and its split tokens; its vocabulary must be the checkpoint's. A text file
    (`text`, or `data` = text:FILE with split "all") is read whole with the checkpoint's vocabulary
    instead: returns (None, tokens)."""
    from txl.data import open_corpus

    if text is None and split == "all":
        text = _text_file_of(data)
        if text is None:
            raise UsageError("--split all scores a whole text file with the checkpoint's vocabulary: give --text FILE "
                             "or --data text:FILE")
    if text is not None:
        if ckpt.vocab is None:
            raise CheckpointError(f"{ckpt.path} has no vocab.json; it is needed to turn text into token ids")
        return None, read_text_tokens(ckpt.vocab, text)
    spec = data or ckpt.data_spec
    if not spec:
        raise UsageError(f"{ckpt.path} does not record its training data; pass --data SPEC")
    if ckpt.vocab is not None and ckpt.vocab.text_rules is not None:
        return _fixed_vocab_corpus(ckpt, spec, split)
    corpus = open_corpus(spec)
    if ckpt.vocab is not None:
        try:
            corpus.vocab.check_same(ckpt.vocab, what=f"the checkpoint {ckpt.path}")
        except DataError as err:
            if _text_file_of(spec) is None:
                raise
            raise DataError(f"{err}; to score this file with the checkpoint's own vocabulary use --text FILE "
                            "(or --split all)") from None
    else:
        corpus.vocab.check_matches(ckpt.model.config.vocab_size)
        print(f"note: {ckpt.path} has no vocab.json; only the vocabulary size was checked against {spec}",
              file=sys.stderr)
    tokens = corpus.split(split)
    # Prepared arrays are unsigned, so only an id >= vocab_size can be wrong (a damaged cache): one pass
    # over the split here instead of an IndexError deep inside the embedding (as the trainer does).
    largest = int(tokens.max()) if len(tokens) else 0
    if largest >= ckpt.model.config.vocab_size:
        raise DataError(f"token id {largest} in the {split} split of {spec!r} is outside the vocabulary "
                        f"({ckpt.model.config.vocab_size} ids): the prepared cache is damaged; run "
                        f"`txl data prepare {spec} --force`")
    return corpus, tokens


@dataclass
class FixedVocabCorpus:
    """A split read with the checkpoint's own vocabulary (what `open_eval_corpus` returns for it)."""

    metric: str
    vocab: Any
    fingerprint: str


def _fixed_vocab_corpus(ckpt: LoadedCheckpoint, spec: str, split: str):
    """A published model's vocabulary (imported, with text rules) is fixed: the corpus is read with it
    instead of with a vocabulary built from its train split (which would number words differently)."""
    import hashlib

    from txl.data import parse_spec
    from txl.data.readers import encode_split

    tokens, metric = encode_split(parse_spec(spec), split, ckpt.vocab)
    digest = hashlib.sha256(ckpt.vocab.fingerprint.encode() + tokens.tobytes()).hexdigest()
    return FixedVocabCorpus(metric=metric, vocab=ckpt.vocab, fingerprint=digest), tokens


def evaluate_checkpoint(
    checkpoint: str | Path | LoadedCheckpoint,
    *,
    data: str | None = None,
    split: str = "valid",
    tgt_len: int | None = None,
    mem_len: int | None = None,
    clamp_len: int | None = None,
    same_length: bool | None = None,
    batch_size: int = 10,
    warm_memory: bool = True,
    precision: str = "fp32",
    max_tokens: int = 0,
    vanilla: bool = False,
    attn_len: int | None = None,
    stride: int = 1,
    device: torch.device | str = "cpu",
    per_token: bool = False,
    progress: bool = False,
    text: str | Path | None = None,
    mask_prob: float | None = None,
    seed: int = 0,
    dynamic_lr: float | None = None,
    dynamic_decay: float = 0.0,
) -> tuple[EvalResult, np.ndarray | None]:
    """What `txl eval` computes: (result, per-token NLL in corpus order or None).

    data: a data spec (default: the one the run trained on). tgt_len: default the run's evaluation
    segment length (eval_tgt_len, else tgt_len), else 128. mem_len / clamp_len / same_length: default
    the checkpoint's config. vanilla: the Al-Rfou evaluator with `attn_len` (default mem_len + tgt_len)
    and `stride`; `batch_size` then counts windows per forward. A bidirectional (masked-LM) model is
    scored by `evaluate_mlm` (mask_prob: default the run's, seed: which positions are masked).
    dynamic_lr: dynamic evaluation (`txl.eval.dynamic`) with this step size and `dynamic_decay`, one
    stream (batch_size and warm_memory do not apply).
    """
    ckpt = checkpoint if isinstance(checkpoint, LoadedCheckpoint) else load_checkpoint(checkpoint, device=device)
    model = ckpt.model
    if precision not in ("fp32", "bf16", "fp16", "auto"):
        raise UsageError(f"precision must be fp32, bf16, fp16 or auto, got {precision!r}")
    for name, value in (("mem_len", mem_len), ("clamp_len", clamp_len), ("max_tokens", max_tokens)):
        if value is not None and value < 0:
            raise UsageError(f"{name} must be >= 0, got {value}")
    if tgt_len is not None and tgt_len < 1:
        raise UsageError(f"tgt_len must be >= 1, got {tgt_len}")
    corpus, tokens = open_eval_corpus(ckpt, data, split, text)
    metric = corpus.metric if corpus is not None else checkpoint_metric(ckpt)
    if corpus is None:
        split = "all"
    tgt_len = tgt_len or ckpt.train_setting("eval_tgt_len") or ckpt.train_setting("tgt_len") or 128
    if max_tokens:
        tokens = tokens[: max_tokens + 1]
    if mem_len is None:
        mem_len = ckpt.train_setting("eval_mem_len")  # what the run validated with (None: the model's)
        if mem_len is not None:  # (checked: an int <= 2**24) memory never holds more than the text it read
            mem_len = min(mem_len, max(len(tokens), 1))
    nll = np.zeros(max(len(tokens) - 1, 0), dtype=np.float32) if per_token else None
    if not model.config.causal:  # a masked-LM encoder: masked-token loss and accuracy
        if vanilla or per_token or dynamic_lr is not None:
            raise UsageError(f"{ckpt.path} is a bidirectional (masked-LM) model: --vanilla, --per-token and "
                             "dynamic evaluation apply to causal LMs")
        result = evaluate_mlm(model, tokens, metric=metric, batch_size=batch_size, tgt_len=tgt_len,
                              mask_prob=mask_prob if mask_prob is not None else ckpt.train_setting("mask_prob") or 0.15,
                              seed=seed, device=device, precision=precision, progress=progress)
        result.split = split
        return result, None
    if dynamic_lr is not None:
        from txl.eval.dynamic import evaluate_dynamic

        if vanilla:
            raise UsageError("dynamic evaluation reads the text with memory; it does not combine with --vanilla")
        result = evaluate_dynamic(model, tokens, metric=metric, lr=dynamic_lr, decay=dynamic_decay, tgt_len=tgt_len,
                                  mem_len=mem_len, device=device, precision=precision, per_token=nll,
                                  progress=progress, clamp_len=clamp_len, same_length=same_length)
    elif vanilla:
        mem = model.mem_len if mem_len is None else mem_len
        result = evaluate_vanilla(model, tokens, metric=metric, attn_len=attn_len or mem + tgt_len,
                                  stride=stride, batch_size=batch_size, device=device, precision=precision,
                                  clamp_len=clamp_len, per_token=nll, progress=progress)
    else:
        result = evaluate(model, tokens, metric=metric, batch_size=batch_size, tgt_len=tgt_len,
                          mem_len=mem_len, warm_memory=warm_memory, device=device, precision=precision,
                          per_token=nll, progress=progress, clamp_len=clamp_len, same_length=same_length)
    result.split = split
    return result, nll


def checkpoint_metric(ckpt: LoadedCheckpoint) -> str:
    """bpc or ppl: what the run reported, else by vocabulary kind (bytes and characters: bpc)."""
    metric = ckpt.state.get("metric") or ckpt.run.get("metric")
    if metric in ("bpc", "ppl"):
        return metric
    return "bpc" if ckpt.vocab is not None and ckpt.vocab.kind in ("bytes", "chars") else "ppl"


def save_per_token(values: np.ndarray, path: str | Path) -> Path:
    """Per-token NLL (nats, corpus order) as .npy (numpy, no pickle) or .txt (one value per line)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".npy":
            save_array(path, np.asarray(values, dtype=np.float32))
        elif path.suffix == ".txt":
            write_text(path, "".join(f"{v:.8g}\n" for v in np.asarray(values, dtype=np.float64).tolist()))
        else:
            raise UsageError(f"--per-token {path}: use a .npy or .txt file name")
    except OSError as err:
        raise OutputError(f"cannot write {path}: {describe_os_error(err)}") from None
    return path


def load_per_token(path: str | Path) -> np.ndarray:
    path = Path(path)
    if path.suffix == ".npy":
        return np.load(path, allow_pickle=False)
    return np.loadtxt(path, dtype=np.float64, ndmin=1)


def result_table(result: EvalResult) -> str:
    """The readable summary `txl eval` prints."""
    r = result
    rows = [("split", r.split or "-"), (r.metric, f"{r.value:.4f}"), ("loss (nats/token)", f"{r.loss:.4f}"),
            ("tokens scored", f"{r.tokens:,}"), ("seconds", f"{r.seconds:.2f}"),
            ("tokens/s", f"{r.tokens_per_second:,.0f}")]
    if r.mode == "mlm":
        rows += [("evaluator", "masked LM (BERT 80/10/10): loss, bpc/ppl and accuracy of the masked tokens"),
                 ("masked-token accuracy", f"{r.accuracy:.4f}"), ("mask_prob", str(r.mask_prob)),
                 ("tgt_len (window)", str(r.tgt_len)), ("windows per forward", str(r.batch_size))]
    elif r.mode == "dynamic":
        rows += [("evaluator", "dynamic evaluation (Krause et al. 2018): one stream with memory, an SGD step on "
                               "each segment after scoring it"),
                 ("learning rate η", f"{r.dynamic_lr:g}"), ("decay λ", f"{r.dynamic_decay:g}"),
                 ("mem_len", str(r.mem_len)), ("tgt_len", str(r.tgt_len)), ("attention length", str(r.attn_len))]
    elif r.mode == "vanilla":
        rows += [("evaluator", "vanilla (Al-Rfou et al. 2018): a fresh window per token, no memory"),
                 ("attention length", str(r.attn_len)), ("stride", str(r.stride)),
                 ("windows per forward", str(r.batch_size)), ("clamp_len", str(r.clamp_len))]
    else:
        rows += [("evaluator", "Transformer-XL: segments with memory"), ("mem_len", str(r.mem_len)),
                 ("tgt_len", str(r.tgt_len)), ("attention length", str(r.attn_len)),
                 ("clamp_len", f"{r.clamp_len} (0 = no clamp)" if r.clamp_len is not None else "-"),
                 ("same_length", str(r.same_length)), ("batch size (streams)", str(r.batch_size)),
                 ("warm memory", str(r.warm_memory))]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


__all__ = [
    "EvalResult",
    "attention_length",
    "autocast",
    "context_nll",
    "evaluate",
    "evaluate_checkpoint",
    "evaluate_mlm",
    "evaluate_vanilla",
    "metric_value",
    "plot_sweep",
    "result_table",
    "save_per_token",
    "sweep_markdown",
    "sweep_memory",
]
