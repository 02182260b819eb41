"""Write the legacy checkpoints of tests/test_legacy_checkpoints.py with the txl of an older commit.

Each sub-folder is a tiny model saved by `save_pretrained` of commit 775862b (before the restructuring of
issue 44), with `expected.safetensors`: its logits on fixed inputs (two segments with memory for the
decoders). The test loads each folder with today's code and compares. Run from a checkout of the old commit:

    git worktree add /tmp/txl-old 775862b
    PYTHONPATH=/tmp/txl-old/src python tests/data/legacy/make_fixtures.py tests/data/legacy
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

SHAPE = dict(vocab_size=23, n_layer=2, d_model=16, n_head=2, d_head=8, d_inner=24, mem_len=6, dropout=0.0)
MODELS = {
    "decoder-xl": dict(cutoffs=(8, 16), div_val=2, untie_r=True, same_length=True, clamp_len=5),
    "decoder-sliding": dict(attention="sliding", sliding_window=3, global_tokens=1),
    "decoder-performer": dict(attention="performer", performer_features=8, performer_redraw_interval=0,
                              pos_encoding="rope"),
    "decoder-bigbird": dict(attention="bigbird", bigbird_block=2, bigbird_window=1, bigbird_global=1,
                            bigbird_random=1, pos_encoding="rope"),
    "decoder-compressive": dict(cmem_len=4, cmem_ratio=2),
    "decoder-universal": dict(universal=True, n_layer=3),
    "decoder-t5-memory-tokens": dict(pos_encoding="t5", t5_buckets=8, t5_max_distance=16, memory_tokens=2),
    "decoder-shaw-pre-ln": dict(pos_encoding="shaw", max_relative_distance=4, shaw_values=True, pre_lnorm=True),
    "encoder-decoder": dict(arch="encoder-decoder", mem_len=0, n_encoder_layer=1, pos_encoding="sinusoidal"),
    "lstm": dict(arch="lstm", n_head=8, d_head=64, d_inner=20),
    "sha-rnn": dict(arch="sha-rnn", n_head=8, d_head=64, d_inner=32, mem_len=6),
}


def inputs() -> torch.Tensor:
    return torch.arange(2 * 10).remainder(SHAPE["vocab_size"]).view(2, 10).flip(1).contiguous()


def expected_logits(model, arch: str) -> dict[str, torch.Tensor]:
    ids = inputs()
    with torch.no_grad():
        if arch == "encoder-decoder":
            out = model(ids, decoder_input_ids=ids[:, :7])
            return {"logits": out.logits}
        first = model(ids[:, :5])
        second = model(ids[:, 5:], memory=first.memory)
        return {"logits_0": first.logits, "logits_1": second.logits}


def main(root: Path) -> None:
    # the old commit's import paths (the test imports only MODELS and expected_logits from here)
    from txl.checkpoint import build_model

    from txl import TransformerXLConfig

    torch.manual_seed(0)
    for name, options in MODELS.items():
        config = TransformerXLConfig(**{**SHAPE, **options})
        model = build_model(config).eval()
        folder = root / name
        model.save_pretrained(folder)
        save_file({k: v.contiguous() for k, v in expected_logits(model, config.arch).items()},
                  str(folder / "expected.safetensors"))
        print(name, sum(p.numel() for p in model.parameters()))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
