"""`txl import-hf` compares config.json with the weights (names, shapes, dtypes) before it builds anything
(issue 50): 96 KB of weights next to a config.json with vocab_size 2**21 cost 2.3 GB when the model was
built first and compared afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from txl.cli.main import main

D, HEADS, D_HEAD, INNER, VOCAB = 48, 2, 24, 96, 40
CONFIG = {"vocab_size": VOCAB, "cutoffs": [], "d_model": D, "d_embed": D, "n_head": HEADS, "d_head": D_HEAD,
          "d_inner": INNER, "div_val": 1, "n_layer": 1, "mem_len": 4, "clamp_len": 0, "same_length": False,
          "untie_r": True, "tie_word_embeddings": True}


def hf_tensors(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The tensors of a one-layer TransfoXLLMHeadModel of CONFIG (about 90 KB in float32)."""
    hd = HEADS * D_HEAD
    layer = "transformer.layers.0."
    shapes = {"transformer.word_emb.emb_layers.0.weight": (VOCAB, D), "crit.out_layers.0.bias": (VOCAB,),
              layer + "dec_attn.qkv_net.weight": (3 * hd, D), layer + "dec_attn.o_net.weight": (D, hd),
              layer + "dec_attn.r_net.weight": (hd, D), layer + "dec_attn.r_w_bias": (HEADS, D_HEAD),
              layer + "dec_attn.r_r_bias": (HEADS, D_HEAD), layer + "dec_attn.layer_norm.weight": (D,),
              layer + "dec_attn.layer_norm.bias": (D,), layer + "pos_ff.CoreNet.0.weight": (INNER, D),
              layer + "pos_ff.CoreNet.0.bias": (INNER,), layer + "pos_ff.CoreNet.3.weight": (D, INNER),
              layer + "pos_ff.CoreNet.3.bias": (D,), layer + "pos_ff.layer_norm.weight": (D,),
              layer + "pos_ff.layer_norm.bias": (D,)}
    return {name: torch.zeros(shape, dtype=dtype) for name, shape in shapes.items()}


def hf_dir(path: Path, *, weights: str = "model.safetensors", tensors: dict | None = None, **changes) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**CONFIG, **changes}))
    tensors = hf_tensors() if tensors is None else tensors
    if weights == "model.safetensors":
        save_file(tensors, str(path / weights))
    else:
        torch.save(tensors, path / weights)
    return path


def test_the_small_folder_itself_imports(tmp_path):
    assert main(["import-hf", str(hf_dir(tmp_path / "hf")), str(tmp_path / "out")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").stat().st_size < 100_000


# Started from a small launcher: Linux counts a child's RSS before exec (a fork of this large pytest
# process) into its peak, so the child must be forked from something small to measure txl alone.
LAUNCHER = r"""
import json, os, subprocess, sys
proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
err = proc.stderr.read().decode()
_, status, usage = os.wait4(proc.pid, 0)
print(json.dumps({"code": os.waitstatus_to_exitcode(status), "err": err, "rss_mb": usage.ru_maxrss / 1024}))
"""


def peak_run(args: list[str]) -> dict:
    """Exit code, stderr and peak RSS (MB) of one `python -m txl ...` at one thread, forked from LAUNCHER."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", LAUNCHER, sys.executable, "-m", "txl", *args], capture_output=True,
                         text=True, timeout=120, env=env, check=True).stdout  # the timeout is a hang guard only
    return json.loads(out)


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
@pytest.mark.slow
def test_a_vocab_size_its_weights_lack_is_refused_without_building_it(tmp_path, weights):
    """The refusal costs no more memory than importing the small folder itself (measured beside it, so the
    bound follows this machine's torch and allocator): the embedding config.json implies is 384 MiB."""
    small = peak_run(["import-hf", str(hf_dir(tmp_path / "small", weights=weights)), str(tmp_path / "small_out")])
    assert small["code"] == 0, small["err"]
    src = hf_dir(tmp_path / "hf", weights=weights, vocab_size=2**21)
    got = peak_run(["import-hf", str(src), str(tmp_path / "out")])
    lines = got["err"].strip().splitlines()
    assert got["code"] == 2 and len(lines) == 1 and "Traceback" not in got["err"], got["err"]
    assert ("'transformer.word_emb.emb_layers.0.weight' has shape (40, 48) but config.json (vocab_size=2097152, "
            "cutoffs []) implies (2097152, 48)") in lines[0], lines[0]
    assert got["rss_mb"] < small["rss_mb"] + 64, f"peak RSS {got['rss_mb']:.0f} MB, small import {small['rss_mb']:.0f} MB"
    assert not (tmp_path / "out").exists()


@pytest.fixture
def nothing_built(monkeypatch):
    """Fails the test if a TransformerXL is built anywhere but on the meta device (no memory)."""
    from txl.models.transformer_xl.model import TransformerXL

    devices: list[str] = []
    real = TransformerXL.__init__

    def init(self, *args, **kwargs):
        devices.append(torch.empty(()).device.type)
        real(self, *args, **kwargs)

    monkeypatch.setattr(TransformerXL, "__init__", init)
    yield devices
    assert set(devices) <= {"meta"}, devices


@pytest.mark.parametrize(
    ("changes", "tensors", "why"),
    [
        ({"vocab_size": 2**21}, None, "'transformer.word_emb.emb_layers.0.weight' has shape (40, 48) but"),
        ({"d_inner": 256}, None, "'blocks.0.ff.fc1.weight' has shape (96, 48) but config.json implies (256, 48)"),
        ({"n_layer": 2}, None, "has no tensor 'transformer.layers.1.dec_attn.qkv_net.weight'"),
        ({"n_layer": 1000, "d_model": 4096}, None, "describes a model of at least"),
        ({}, {**hf_tensors(), "crit.out_layers.0.bias": torch.zeros(VOCAB, dtype=torch.int64)},
         "'head.bias' has dtype torch.int64, expected a float dtype"),
        ({}, {**hf_tensors(), "transformer.layers.0.dec_attn.r_r_bias": torch.zeros(HEADS, 7)},
         "'pos.v' has shape (1, 2, 7) but config.json implies (1, 2, 24)"),
    ],
    ids=["vocab_size", "d_inner", "n_layer", "config-bomb", "int-bias", "r_r_bias"],
)
def test_config_and_weights_are_compared_before_anything_is_built(tmp_path, capsys, nothing_built, changes, tensors,
                                                                  why):
    src = hf_dir(tmp_path / "hf", tensors=tensors, **changes)
    assert main(["import-hf", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert why in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_a_matching_folder_builds_the_model_once(tmp_path, nothing_built):
    """The control: with matching weights the model is built (on the CPU) after the check, and only then."""
    assert main(["import-hf", str(hf_dir(tmp_path / "hf")), str(tmp_path / "out")]) == 0
    assert nothing_built.count("cpu") == 1
    nothing_built.clear()  # the fixture's own check is for the refusals
