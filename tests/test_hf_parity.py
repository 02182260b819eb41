"""Parity with Hugging Face TransfoXL (transformers==4.35.2, a port of the official code).

A randomly initialised TransfoXLLMHeadModel is saved, converted with `txl import-hf`, and both models
are run over 3 consecutive segments with memory. HF starts memory as mem_len zero vectors where we
start empty, so both start from the *same* memory (random, mem_len long) and then each carries its own.
"""

from __future__ import annotations

import pytest
import torch

from txl.cli.main import main as txl_main
from txl.models.transformer_xl.model import TransformerXL
from txl.nn.memory import Memory

transformers = pytest.importorskip("transformers", reason="parity needs transformers==4.35.2 (dev extra)")
pytestmark = pytest.mark.hf

BASE = dict(vocab_size=97, d_model=32, n_head=4, d_head=8, d_inner=64, n_layer=3, mem_len=12, tgt_len=8,
            clamp_len=-1, dropout=0.0, dropatt=0.0, cutoffs=[], div_val=1, d_embed=32, same_length=False)

CASES = {
    "full-softmax-tied-r": dict(untie_r=False),
    "full-softmax-untied-r": dict(untie_r=True),
    "adaptive-div2-untied": dict(cutoffs=[20, 50], div_val=2, untie_r=True),
    "adaptive-div2-tied-r": dict(cutoffs=[20, 50], div_val=2, untie_r=False),
    "adaptive-div1-d_embed": dict(cutoffs=[30], div_val=1, d_embed=24, untie_r=True),
    "full-d_embed-same_length-clamp": dict(d_embed=16, same_length=True, clamp_len=5, untie_r=False),
    "pre_lnorm": dict(pre_lnorm=True, untie_r=True, cutoffs=[40], div_val=2),
    "no-proj-sharing": dict(cutoffs=[20, 50], div_val=2, proj_share_all_but_first=False),
}


def _hf_model(overrides, seed=0):
    cfg = transformers.TransfoXLConfig(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = transformers.TransfoXLLMHeadModel(cfg).eval()
    # Random init leaves biases and LayerNorm shifts at 0; perturb everything so the map is tested.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


PARAMS = [(case, "safetensors") for case in sorted(CASES)] + [
    ("full-softmax-tied-r", "bin"),  # pytorch_model.bin, read with torch.load(weights_only=True)
    ("adaptive-div2-untied", "bin"),
]


@pytest.mark.parametrize(("case", "serialization"), PARAMS)
def test_logprobs_match_hf_over_three_segments(tmp_path, case, serialization):
    overrides = CASES[case]
    hf = _hf_model(overrides)
    src = tmp_path / "hf"
    hf.save_pretrained(src, safe_serialization=(serialization == "safetensors"))
    assert txl_main(["import-hf", str(src), str(tmp_path / "txl")]) == 0
    ours = TransformerXL.from_pretrained(tmp_path / "txl")

    torch.manual_seed(1)
    batch, seg, mem_len = 2, BASE["tgt_len"], BASE["mem_len"]
    tokens = torch.randint(0, BASE["vocab_size"], (batch, 3 * seg))
    start = [torch.randn(batch, mem_len, BASE["d_model"]) for _ in range(BASE["n_layer"])]
    hf_mems = [m.transpose(0, 1).contiguous() for m in start]  # HF is time-major
    memory = Memory(tuple(start))
    with torch.no_grad():
        for s in range(3):
            x = tokens[:, s * seg : (s + 1) * seg]
            ref = hf(input_ids=x, mems=hf_mems)
            out = ours(x, memory=memory)
            ours_logprobs = out.logits.log_softmax(-1)  # full softmax gives raw logits; adaptive gives log-probs
            torch.testing.assert_close(ours_logprobs, ref.prediction_scores, atol=1e-5, rtol=0)
            for a, b in zip(out.memory.hidden, ref.mems):
                torch.testing.assert_close(a, b.transpose(0, 1), atol=1e-5, rtol=0)
            hf_mems, memory = ref.mems, out.memory


def test_hf_losses_match_ours_in_input_order(tmp_path):
    """HF shifts labels inside and (for the adaptive softmax) returns losses grouped by cluster; ours
    take aligned targets and keep input order. The per-token values must agree once aligned."""
    hf = _hf_model(CASES["adaptive-div2-untied"])
    hf.save_pretrained(tmp_path / "hf")
    txl_main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "txl")])
    ours = TransformerXL.from_pretrained(tmp_path / "txl")
    torch.manual_seed(2)
    x = torch.randint(0, BASE["vocab_size"], (1, 9))
    with torch.no_grad():
        logprobs = hf(input_ids=x[:, :8]).prediction_scores  # (1, 8, V), zero memory
        expected = -logprobs[0].gather(1, x[0, 1:9, None]).squeeze(1)
        zero = Memory.zeros(BASE["n_layer"], 1, BASE["mem_len"], BASE["d_model"])
        out = ours(x[:, :8], memory=zero, labels=x[:, 1:9])
    torch.testing.assert_close(out.nll[0], expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.loss, expected.mean(), atol=1e-5, rtol=0)
