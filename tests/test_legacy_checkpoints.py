"""Checkpoints written by an older txl (commit 775862b, before the restructuring of issue 44) keep loading
and give the logits they gave then (tests/data/legacy: made by its make_fixtures.py with that commit)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from txl.models.registry import load_model

LEGACY = Path(__file__).resolve().parent / "data" / "legacy"
sys.path.insert(0, str(LEGACY))
from make_fixtures import MODELS, expected_logits  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_legacy_checkpoint_loads_and_gives_the_same_logits(name):
    folder = LEGACY / name
    model = load_model(folder).eval()
    expected = load_file(str(folder / "expected.safetensors"))
    got = expected_logits(model, model.config.arch)
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        # the fixtures were written on an AVX-512 machine; other SIMD widths sum in other orders (measured:
        # up to 2.8 fp32 ulps of the largest logit with ATen's AVX2 or default code paths); a wrongly loaded
        # weight moves logits by orders of magnitude more
        ulp = torch.finfo(torch.float32).eps * value.abs().max().item()
        torch.testing.assert_close(got[key], value, rtol=0, atol=8 * ulp, msg=f"{name}: {key}")


def test_every_architecture_and_kernels_with_options_are_covered():
    archs = {options.get("arch", "decoder") for options in MODELS.values()}
    assert archs == {"decoder", "encoder-decoder", "lstm", "sha-rnn"}
    kernels = {options.get("attention", "full") for options in MODELS.values()}
    assert len(kernels - {"full"}) >= 3
    assert any(o.get("cmem_len") for o in MODELS.values()) and any(o.get("universal") for o in MODELS.values())
