"""Safe checkpoint save/load (`txl.models.pretrained`): safetensors + JSON, validated against the config."""

from __future__ import annotations

import json

import pytest
import torch

from txl import CheckpointError, TransformerXLConfig
from txl.models.pretrained import CONFIG_NAME, WEIGHTS_NAME
from txl.models.transformer_xl.model import TransformerXL

SMALL = dict(vocab_size=50, n_layer=2, d_model=16, n_head=2, d_head=8, d_inner=32, mem_len=8)


def _saved(tmp_path, **overrides):
    torch.manual_seed(0)
    model = TransformerXL(TransformerXLConfig(**{**SMALL, **overrides})).eval()
    model.save_pretrained(tmp_path / "ckpt")
    return model, tmp_path / "ckpt"


@pytest.mark.parametrize("overrides", [{}, {"cutoffs": (10, 30), "div_val": 2}, {"pos_encoding": "alibi"},
                                       {"pos_encoding": "shaw", "position_options": {"values": True}}])
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


def test_a_file_txl_wrote_needs_its_digest_even_in_a_plain_directory(tmp_path):
    """Its metadata says txl wrote it (`txl_kind`): a removed digest is an error, not a skip (issue 50)."""
    import struct

    _, path = _saved(tmp_path)
    raw = (path / WEIGHTS_NAME).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    del header["__metadata__"]["txl_sha256"]
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    (path / WEIGHTS_NAME).write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n :])
    with pytest.raises(CheckpointError, match="has no txl_sha256 digest") as info:
        TransformerXL.from_pretrained(path)
    assert "use another checkpoint" in str(info.value)  # a plain directory has no sibling to offer


def test_the_other_checkpoint_of_a_run_is_named_only_when_it_exists(tmp_path):
    from txl.models.pretrained import other_checkpoint, use_another_checkpoint

    model, _ = _saved(tmp_path)
    model.save_pretrained(tmp_path / "run" / "best")
    assert other_checkpoint(tmp_path / "run" / "best") is None
    model.save_pretrained(tmp_path / "run" / "last")
    assert other_checkpoint(tmp_path / "run" / "best") == tmp_path / "run" / "last"
    assert use_another_checkpoint(tmp_path / "run" / "last") == f"use {tmp_path / 'run' / 'best'} (the run's other checkpoint)"
    assert use_another_checkpoint(tmp_path / "ckpt") == "use another checkpoint"
