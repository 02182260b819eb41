"""Transformer-XL evaluation (`evaluate`): the split is cut into `batch_size` contiguous streams read
`tgt_len` tokens at a time; each stream carries its own memory from segment to segment, so a token attends
`mem_len` positions back per layer without re-running them (Dai et al. 2019, §3.2). With `warm_memory`
each stream starts `mem_len` tokens early and those warm-up tokens are fed but not scored, so every
scored token has full context; without it, scoring starts at each stream's first token like the
reference. Every target of the split is scored exactly once either way.

With `documents` (document offsets: each start, then the token count) the split is a collection of
documents scored independently, the standard for document-level LM evaluation (issue 47): every row reads
one document at a time from its first token (a document of n tokens gives its n - 1 targets), the end of a
document pads the rest of its segment, and the row's memory is reset before its next document, so no
document sees another (`ShuffledSentenceIterator(boundaries=True)`, `Memory.reset`).

Also the pieces every evaluator that reads a split with memory shares (runtime settings, their checks,
`forward_segment`) and the memory sweep (`sweep_memory`: bpc/ppl against attention length)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from txl.errors import UsageError
from txl.eval.precision import autocast
from txl.eval.result import EvalResult, attention_length


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
    documents: np.ndarray | None = None,
) -> EvalResult:
    """Score `tokens` (a 1-D array of ids; targets are tokens[1:]) segment by segment with memory.

    mem_len: memory per layer (None = the model's `mem_len`). clamp_len / same_length: override the
    model's runtime settings for this call (None = keep). rows: evaluate only these streams of the
    batch (distributed evaluation: each rank takes its rows; sum `loss * tokens` over ranks).
    per_token: a float array of len(tokens) - 1 (after `max_tokens`) that receives each target's NLL
    at its corpus position (target k -> per_token[k - 1]). documents: document offsets (each start, then
    len(tokens)): score each document on its own (see the module docstring; `warm_memory` does not apply,
    a document starts with an empty memory; the first token of each document is not a target).
    """
    from txl.data import EvalIterator
    from txl.data.iterators import ShuffledSentenceIterator

    device = torch.device(device)
    inner = getattr(model, "module", model)
    mem_len = inner.mem_len if mem_len is None else mem_len
    if batch_size < 1:
        raise UsageError(f"batch_size must be >= 1, got {batch_size}")
    check_segment_settings(inner, mem_len=mem_len, tgt_len=tgt_len, max_tokens=max_tokens, same_length=same_length)
    if max_tokens:
        tokens = tokens[: max_tokens + 1]
    _check_per_token(per_token, max(len(tokens) - 1, 0))
    if documents is not None:  # (cut to the tokens read: max_tokens, or a caller's own cut)
        documents = np.asarray(documents, dtype=np.int64)
        documents = np.append(documents[documents < len(tokens)], len(tokens))
        documents_iterator = ShuffledSentenceIterator(tokens, documents, batch_size, tgt_len, shuffle=False,
                                                      drop_last=False, boundaries=True)
        iterator, steps = documents_iterator.epoch(), documents_iterator.steps_per_epoch  # one pass
    else:
        iterator = EvalIterator(tokens, batch_size=batch_size, tgt_len=tgt_len, warm_len=mem_len if warm_memory else 0)
        steps = len(iterator)
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    memory = None
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc="eval", unit="seg", leave=False, dynamic_ncols=True,
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
                attention_mask = None
                if batch.reset is not None:  # documents: a row whose document ended starts the next afresh
                    reset = batch.reset if rows is None else batch.reset[rows]
                    attention_mask = batch.attention_mask if rows is None else batch.attention_mask[rows]
                    attention_mask = attention_mask.to(device)
                    if memory is not None and bool(reset.any()):
                        memory = memory.reset(reset.to(device))
                with autocast(device, precision):
                    nll, memory = forward_segment(model, inputs, labels, memory, mem_len=mem_len, settings=settings,
                                                  attention_mask=attention_mask)
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


# Evaluation holds one memory and a bounded working set: streams are run in row groups whose memories
# are views of one set of buffers, and each group's memory is donated (`Memory.donate`), so the fast
# backend overwrites its rows in place. At mem_len 3800 on the base shape that keeps peak RSS under
# half of the eager reference's.
EVAL_GROUP_ELEMENTS = 1 << 23  # (rows × keys × d_model) per group: 32 MiB of fp32 per layer input


@torch.no_grad()
def forward_segment(model, inputs, labels, memory, *, mem_len: int, settings: RuntimeSettings | None = None,
                    attention_mask=None):
    """One no-grad segment for every stream: (nll (b, t), next memory). The memory passed in is given
    up (it may be overwritten in place). attention_mask: (b, t) padding of the segment (documents), or None."""

    inner = getattr(model, "module", model)
    extra = {} if settings is None else {"clamp_len": settings.clamp_len, "same_length": settings.same_length}
    if attention_mask is not None:
        extra["attention_mask"] = attention_mask
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
        group_extra = extra if attention_mask is None else {**extra, "attention_mask": attention_mask[group]}
        out = model(inputs[group], memory=part, labels=labels[group], mem_len=mem_len, return_logits=False,
                    **group_extra)
        nlls.append(out.nll)
        parts.append(out.memory)
        in_place &= part is not None and out.memory is part
    if in_place:
        return torch.cat(nlls), memory
    return torch.cat(nlls), None if parts[0] is None else type(parts[0]).cat(parts)  # (a recurrent LM's kind too)



def sweep_memory(model, tokens: np.ndarray, *, mem_lens: Sequence[int], metric: str, **kwargs) -> list[EvalResult]:
    """`evaluate` once per memory length (same tokens, tgt_len and settings)."""
    results = []
    for mem_len in mem_lens:
        results.append(evaluate(model, tokens, metric=metric, mem_len=int(mem_len), **kwargs))
    return results
