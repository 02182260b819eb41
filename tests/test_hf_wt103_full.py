"""The full transfo-xl-wt103 shape (18 layers, d_model 1024, adaptive input/softmax with cutoffs
20000/40000/200000 and div_val 4, vocabulary 267,735: the paper's "257M" model, 285,205,322 parameters
when each tensor is counted once), random weights, against
transformers 4.35.2 over 2 segments with the published memory (mem_len 1600, clamp_len 1000,
same_length). The tiny configs of test_hf_parity.py cannot show that the large-vocabulary clusters,
the projections of div_val 4 and clamping at 1000 are mapped right.

Slow (about a minute of CPU and 5 GB of memory: three copies of the weights exist at once), so marked
`slow`; it runs in CI.
"""

from __future__ import annotations

import pytest
import torch

from txl.cli.main import main as txl_main
from txl.models.transformer_xl.model import TransformerXL
from txl.nn.memory import Memory

transformers = pytest.importorskip("transformers", reason="parity needs transformers==4.35.2 (dev extra)")
pytestmark = [pytest.mark.hf, pytest.mark.slow]


def test_full_wt103_shape_matches_hf_over_two_segments_with_memory(tmp_path):
    config = transformers.TransfoXLConfig(dropout=0.0, dropatt=0.0)  # the defaults are transfo-xl-wt103's
    assert (config.vocab_size, config.n_layer, config.d_model, config.cutoffs, config.div_val) == (
        267735, 18, 1024, [20000, 40000, 200000], 4)
    assert (config.mem_len, config.clamp_len, config.same_length, config.untie_r) == (1600, 1000, True, True)
    torch.manual_seed(0)
    hf = transformers.TransfoXLLMHeadModel(config).eval()
    with torch.no_grad():  # init leaves biases and LayerNorm shifts at constants: perturb the small tensors
        for p in hf.parameters():
            if p.numel() < 1_000_000:
                p.add_(torch.randn_like(p) * 0.05)
    n_params = sum(p.numel() for p in hf.parameters())
    assert n_params == 285_205_322  # each tensor once (tied ones once); the paper quotes this model as 257M
    hf.save_pretrained(tmp_path / "hf")
    assert txl_main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "txl")]) == 0
    ours = TransformerXL.from_pretrained(tmp_path / "txl").eval()
    assert sum(p.numel() for p in ours.parameters()) == n_params

    torch.manual_seed(1)
    seg, batch = 128, 1
    tokens = torch.randint(0, config.vocab_size, (batch, 2 * seg))
    tokens[0, :8] = torch.tensor([0, 5, 19999, 20000, 39999, 40000, 199999, 267734])  # every cluster's edges
    # HF starts from mem_len zero vectors where we start empty: give both the same random memory.
    start = [torch.randn(batch, config.mem_len, config.d_model) for _ in range(config.n_layer)]
    hf_mems = [m.transpose(0, 1).contiguous() for m in start]
    memory = Memory(tuple(start))
    worst = 0.0
    with torch.no_grad():
        for s in range(2):
            x = tokens[:, s * seg : (s + 1) * seg]
            ref = hf(input_ids=x, mems=hf_mems)
            out = ours(x, memory=memory)
            diff = (out.logits - ref.prediction_scores).abs().max().item()
            worst = max(worst, diff)
            assert diff <= 1e-5, f"segment {s}: max |log-prob difference| {diff:.2e}"
            for a, b in zip(out.memory.hidden, ref.mems):
                torch.testing.assert_close(a, b.transpose(0, 1), atol=1e-5, rtol=0)
            hf_mems, memory = ref.mems, out.memory
    print(f"wt103 full shape: {n_params:,} parameters, max |log-prob difference| over 2 segments {worst:.2e}")
