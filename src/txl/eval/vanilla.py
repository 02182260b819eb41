"""The vanilla evaluation baseline (Al-Rfou et al. 2018, the paper's Fig. 1b): for every scored token a
fresh forward over the previous `attn_len` tokens with no memory, keeping only the last prediction.
`stride` S scores the last S positions of each window instead (cheaper, less context for all but the
last). This is what Transformer-XL's evaluation speed-up is measured against (`txl bench eval-speedup`),
and `context_nll` is the l(c, t) of RECL (`txl.eval.recl`)."""

from __future__ import annotations

import math
import sys
import time

import numpy as np
import torch

from txl.errors import DataError, UsageError
from txl.eval.precision import autocast
from txl.eval.result import EvalResult
from txl.eval.segments import _check_per_token, runtime_settings


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
