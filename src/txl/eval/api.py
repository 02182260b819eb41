"""`evaluate_checkpoint`, the Python face of `txl eval`: it opens a checkpoint (or a run directory),
checks that the corpus vocabulary is the checkpoint's, and runs the evaluator its settings ask for:
segments with memory (`txl.eval.segments`), the vanilla baseline (`txl.eval.vanilla`), masked-LM
(`txl.eval.mlm`) or dynamic evaluation (`txl.eval.dynamic`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from txl.errors import UsageError
from txl.eval.corpus import checkpoint_metric, open_eval_corpus
from txl.eval.mlm import evaluate_mlm
from txl.eval.result import EvalResult
from txl.eval.segments import evaluate
from txl.eval.vanilla import evaluate_vanilla
from txl.models.checkpoint import LoadedCheckpoint, load_checkpoint


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
    documents: bool | None = None,
) -> tuple[EvalResult, np.ndarray | None]:
    """What `txl eval` computes: (result, per-token NLL in corpus order or None).

    data: a data spec (default: the one the run trained on). tgt_len: default the run's evaluation
    segment length (eval_tgt_len, else tgt_len), else 128. mem_len / clamp_len / same_length: default
    the checkpoint's config. vanilla: the Al-Rfou evaluator with `attn_len` (default mem_len + tgt_len)
    and `stride`; `batch_size` then counts windows per forward. A bidirectional (masked-LM) model is
    scored by `evaluate_mlm` (mask_prob: default the run's, seed: which positions are masked).
    dynamic_lr: dynamic evaluation (`txl.eval.dynamic`) with this step size and `dynamic_decay`, one
    stream (batch_size and warm_memory do not apply). documents: score each document of the corpus on
    its own, from an empty memory (the standard for document-level evaluation; needs a corpus that records
    document starts: `docs:` collections, lm1b); default: what the run trained with (`document_boundaries`).
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
    offsets = _document_offsets(ckpt, corpus, split, documents)
    nll = np.zeros(max(len(tokens) - 1, 0), dtype=np.float32) if per_token else None
    if offsets is not None and (vanilla or dynamic_lr is not None or not model.config.causal):
        raise UsageError("scoring documents on their own (--documents) reads each document with the memory; it "
                         "does not combine with --vanilla, dynamic evaluation or a masked-LM model")
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
                          per_token=nll, progress=progress, clamp_len=clamp_len, same_length=same_length,
                          documents=offsets)
    result.split = split
    return result, nll


def _document_offsets(ckpt: LoadedCheckpoint, corpus, split: str, documents: bool | None) -> np.ndarray | None:
    """The document starts of `split` (then its token count) when documents are scored on their own, else None.
    Asked for (`documents=True`) on a corpus without document starts: one line; by default (the run's
    `document_boundaries`) such a corpus is read as one stream."""
    asked = documents is True
    if documents is None:
        documents = bool(ckpt.train_setting("document_boundaries"))
    if not documents:
        return None
    offsets = corpus.sentence_offsets(split) if corpus is not None and hasattr(corpus, "sentence_offsets") else None
    if offsets is None and asked:
        raise UsageError("this text records no document starts: scoring documents on their own needs a docs: "
                         "collection (a folder of files or JSONL) or lm1b")
    return None if offsets is None else np.asarray(offsets, dtype=np.int64)
