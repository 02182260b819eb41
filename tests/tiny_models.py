"""Small models for the core tests (test_model, test_memory, test_positional): a plain module imported
by name (pytest puts tests/ on sys.path)."""

from __future__ import annotations

import torch

from txl import TransformerXLConfig
from txl.models.transformer_xl.model import TransformerXL


def tiny(**overrides) -> TransformerXLConfig:
    base = dict(vocab_size=61, n_layer=2, d_model=32, n_head=4, d_head=8, d_inner=48, mem_len=16,
                dropout=0.0, dropatt=0.0)
    return TransformerXLConfig(**{**base, **overrides})


def build(seed=0, **overrides) -> TransformerXL:
    torch.manual_seed(seed)
    model = TransformerXL(tiny(**overrides)).eval()
    with torch.no_grad():  # make biases/LayerNorm shifts non-trivial so every path matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def two_segments_vs_one_pass(model, seg=8, batch=2):
    torch.manual_seed(3)
    x = torch.randint(0, model.config.vocab_size, (batch, 2 * seg))
    with torch.no_grad():
        full = model(x, mem_len=2 * seg).logits
        first = model(x[:, :seg], mem_len=2 * seg)
        second = model(x[:, seg:], memory=first.memory, mem_len=2 * seg)
    return (second.logits - full[:, seg:]).abs().max().item()
