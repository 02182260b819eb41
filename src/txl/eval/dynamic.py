"""Dynamic evaluation (Krause et al. 2018, "Dynamic Evaluation of Neural Sequence Models"; for
Transformer-XL, Krause et al. 2019, "Dynamic Evaluation of Transformer Language Models"): the model
keeps learning from the text it has just scored.

The split is read as one stream, segment by segment with memory, as `txl.eval.segments.evaluate` reads it
with one stream: each segment is scored with the current weights first, and only then used for one
gradient step on its own mean loss (the memory is detached, so the step sees this segment only). No
token is ever scored by weights that have seen it or anything after it. The step is Krause et al.'s
SGD with a decay toward the trained weights θ0:

    θ ← θ − η ∇L(segment) + λ (θ0 − θ)

η = `lr`, λ = `decay` (0: no pull back toward θ0); η = 0 is static evaluation. Their RMS-normalised variant (gradient statistics gathered on training data) is not
implemented. Dropout stays off, and the caller's weights are restored when the function returns.
Results are reported apart from static evaluation (`EvalResult.mode = "dynamic"`): the model adapts
to the test text while it reads it.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time

import numpy as np
import torch

from txl.errors import UsageError
from txl.eval.precision import autocast
from txl.eval.result import EvalResult, attention_length
from txl.eval.segments import _check_per_token, check_segment_settings, runtime_settings


def check_dynamic(lr: float, decay: float) -> None:
    if not (math.isfinite(lr) and lr >= 0):
        raise UsageError(f"the dynamic-evaluation learning rate must be a finite number >= 0, got {lr}")
    if not (math.isfinite(decay) and 0 <= decay <= 1):
        raise UsageError(f"the dynamic-evaluation decay must be in [0, 1], got {decay}")


def evaluate_dynamic(
    model,
    tokens: np.ndarray,
    *,
    metric: str,
    lr: float,
    decay: float = 0.0,
    tgt_len: int = 128,
    mem_len: int | None = None,
    max_tokens: int = 0,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
    per_token: np.ndarray | None = None,
    progress: bool = False,
    clamp_len: int | None = None,
    same_length: bool | None = None,
) -> EvalResult:
    """Score `tokens` (targets tokens[1:]) in one stream, one SGD step per segment after scoring it."""
    from txl.data import EvalIterator

    check_dynamic(lr, decay)
    device = torch.device(device)
    mem_len = model.mem_len if mem_len is None else mem_len
    check_segment_settings(model, mem_len=mem_len, tgt_len=tgt_len, max_tokens=max_tokens, same_length=same_length)
    if max_tokens:
        tokens = tokens[: max_tokens + 1]
    _check_per_token(per_token, max(len(tokens) - 1, 0))
    iterator = EvalIterator(tokens, batch_size=1, tgt_len=tgt_len, warm_len=0)
    params = [p for p in model.parameters() if p.requires_grad]
    trained = [p.detach().clone() for p in params]  # θ0, restored at the end
    was_training = model.training
    model.eval()  # no dropout: only the weights change
    total, count, memory = 0.0, 0, None
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(iterator), desc="dynamic eval", unit="seg", leave=False, dynamic_ncols=True,
                   disable=not sys.stderr.isatty())
    with runtime_settings(model, clamp_len=clamp_len, same_length=same_length) as settings:
        start = time.perf_counter()
        try:
            for batch in iterator:
                inputs, targets, mask = batch.inputs.to(device), batch.targets.to(device), batch.score_mask.to(device)
                labels = targets.masked_fill(~mask, -100)
                # cuDNN's LSTM has no backward in eval mode: the recurrent archs take the native kernel
                no_cudnn = torch.backends.cudnn.flags(enabled=False) if device.type == "cuda" else contextlib.nullcontext()
                with no_cudnn, torch.enable_grad(), autocast(device, precision):
                    out = model(inputs, memory=memory, labels=labels, mem_len=mem_len, return_logits=False,
                                clamp_len=settings.clamp_len, same_length=settings.same_length)
                nll = out.nll.float()
                scored = int(mask.sum())
                total += float(nll.detach()[mask].double().sum())  # scored before the step below
                count += scored
                if per_token is not None:
                    keep = batch.positions >= 0
                    per_token[batch.positions[keep].numpy() - 1] = nll.detach()[keep.to(nll.device)].cpu().numpy()
                memory = out.memory
                if scored and (lr > 0 or decay > 0):
                    grads = torch.autograd.grad(nll[mask].mean(), params, allow_unused=True)
                    with torch.no_grad():  # θ ← θ − η∇L + λ(θ0 − θ), both terms from the θ that scored
                        for p, g, p0 in zip(params, grads, trained, strict=True):
                            if decay > 0:
                                p.add_(p0 - p, alpha=decay)
                            if g is not None and lr > 0:
                                p.sub_(g.to(p.dtype), alpha=lr)
                if bar is not None:
                    bar.update(1)
        finally:
            with torch.no_grad():
                for p, p0 in zip(params, trained, strict=True):
                    p.copy_(p0)
            model.train(was_training)
            if bar is not None:
                bar.close()
        seconds = time.perf_counter() - start
    return EvalResult(loss=total / max(count, 1), tokens=count, seconds=seconds, metric=metric, mem_len=mem_len,
                      tgt_len=tgt_len, batch_size=1, warm_memory=False, clamp_len=settings.clamp_len,
                      same_length=settings.same_length, mode="dynamic",
                      attn_len=attention_length(mem_len=mem_len, tgt_len=tgt_len, same_length=settings.same_length),
                      dynamic_lr=lr, dynamic_decay=decay)
