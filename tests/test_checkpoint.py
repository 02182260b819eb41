"""Safe checkpoint save/load (`txl.checkpoint`): safetensors + JSON, validated against the config."""

from __future__ import annotations

import json

import pytest
import torch

from txl import CheckpointError, TransformerXLConfig
from txl.checkpoint import CONFIG_NAME, WEIGHTS_NAME
from txl.model import TransformerXL

SMALL = dict(vocab_size=50, n_layer=2, d_model=16, n_head=2, d_head=8, d_inner=32, mem_len=8)


def _saved(tmp_path, **overrides):
    torch.manual_seed(0)
    model = TransformerXL(TransformerXLConfig(**{**SMALL, **overrides})).eval()
    model.save_pretrained(tmp_path / "ckpt")
    return model, tmp_path / "ckpt"


@pytest.mark.parametrize("overrides", [{}, {"cutoffs": (10, 30), "div_val": 2}, {"pos_encoding": "alibi"},
                                       {"pos_encoding": "shaw", "shaw_values": True}])
def test_save_load_round_trip_gives_identical_outputs(tmp_path, overrides):
    model, path = _saved(tmp_path, **overrides)
    assert sorted(p.name for p in path.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]
    loaded = TransformerXL.from_pretrained(path)
    x = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        assert torch.equal(model(x).logits, loaded(x).logits)


def test_weights_that_disagree_with_config_fail_with_one_clear_message(tmp_path):
    _, path = _saved(tmp_path)
    data = json.loads((path / CONFIG_NAME).read_text())
    data["d_inner"] = 64
    (path / CONFIG_NAME).write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as info:
        TransformerXL.from_pretrained(path)
    message = str(info.value)
    assert "\n" not in message and "fc1" in message and "(32, 16)" in message and "(64, 16)" in message


def test_missing_tensor_and_extra_layer(tmp_path):
    _, path = _saved(tmp_path)
    data = json.loads((path / CONFIG_NAME).read_text())
    data["n_layer"] = 3
    (path / CONFIG_NAME).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="missing"):
        TransformerXL.from_pretrained(path)


def test_corrupt_and_truncated_weights_are_detected(tmp_path):
    _, path = _saved(tmp_path)
    raw = bytearray((path / WEIGHTS_NAME).read_bytes())
    raw[-5] ^= 0x10  # flip one bit in the last tensor's data
    (path / WEIGHTS_NAME).write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="SHA-256"):
        TransformerXL.from_pretrained(path)
    (path / WEIGHTS_NAME).write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        TransformerXL.from_pretrained(path)


def test_missing_directory_and_bad_config_json(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        TransformerXL.from_pretrained(tmp_path / "nope")
    _, path = _saved(tmp_path)
    (path / CONFIG_NAME).write_text('{"n_layer": 2, "colour": "blue"}')
    with pytest.raises(CheckpointError, match="colour"):
        TransformerXL.from_pretrained(path)


def test_save_replaces_atomically(tmp_path):
    model, path = _saved(tmp_path)
    model.save_pretrained(path)  # overwrite in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary leftovers
