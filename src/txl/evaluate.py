"""Evaluation with long memory: token-weighted loss over a whole split, as bpc or perplexity.

The split is cut into `batch_size` contiguous streams read `tgt_len` tokens at a time; each stream
carries its own memory from segment to segment, so a token can attend `mem_len` positions back per
layer without re-running them (Dai et al. 2019, §3.2: the evaluation speed-up). With `warm_memory`
each stream starts `mem_len` tokens early and those warm-up tokens are fed but not scored, so every
scored token has full context; without it, scoring starts at each stream's first token like the
reference. Every target of the split is scored exactly once either way.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from txl.errors import UsageError


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


def autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return torch.autocast(device_type=device.type, dtype=dtype)


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
) -> EvalResult:
    """Score `tokens` (a 1-D array of ids; targets are tokens[1:]).

    rows: evaluate only these streams of the batch (distributed evaluation: each rank takes its
    rows; sum `loss * tokens` over ranks). per_token: a float array of len(tokens) - 1 that receives
    each target's NLL at its corpus position.
    """
    from txl.data import EvalIterator

    device = torch.device(device)
    inner = getattr(model, "module", model)
    mem_len = inner.mem_len if mem_len is None else mem_len
    if mem_len < 0:
        raise UsageError(f"mem_len must be >= 0, got {mem_len}")
    if tgt_len < 1 or batch_size < 1:
        raise UsageError(f"tgt_len and batch_size must be >= 1, got {tgt_len} and {batch_size}")
    if max_tokens:
        tokens = tokens[: max_tokens + 1]
    iterator = EvalIterator(tokens, batch_size=batch_size, tgt_len=tgt_len, warm_len=mem_len if warm_memory else 0)
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    memory = None
    start = time.perf_counter()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(iterator), desc="eval", unit="seg", leave=False, dynamic_ncols=True)
    try:
        for batch in iterator:
            inputs, targets, mask = batch.inputs, batch.targets, batch.score_mask
            positions = batch.positions
            if rows is not None:
                inputs, targets, mask, positions = inputs[rows], targets[rows], mask[rows], positions[rows]
            inputs, targets, mask = inputs.to(device), targets.to(device), mask.to(device)
            labels = targets.masked_fill(~mask, -100)
            with autocast(device, precision):
                out = model(inputs, memory=memory, labels=labels, mem_len=mem_len, return_logits=False)
            memory = out.memory
            nll = out.nll.float()
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
                      tgt_len=tgt_len, batch_size=batch_size, warm_memory=warm_memory)
