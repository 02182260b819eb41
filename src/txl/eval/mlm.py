"""Masked-LM evaluation of a bidirectional encoder (`causal=False`): masked-token loss and accuracy."""

from __future__ import annotations

import time

import numpy as np
import torch

from txl.errors import UsageError
from txl.eval.precision import autocast
from txl.eval.result import EvalResult


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
