"""No pickle on any path (the hole that got Hugging Face's TransfoXL deprecated, CVE-2023-6730).

Two kinds of test: a scan of the source of every txl module (src/ and the installed package) for the
calls that can run code while loading data, and behavioural tests that hand txl files built to run
code when unpickled and check that they are refused and never executed.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from txl.errors import CheckpointError, DataError

SRC = Path(__file__).resolve().parents[1] / "src" / "txl"

# Modules whose loaders execute code from the data they read.
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "shelve", "marshal", "joblib",
                  "jsonpickle", "pickletools"}


def _dotted(node: ast.AST) -> str:
    """`torch.serialization.load` for an attribute chain, `eval` for a name, "" otherwise."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _keyword_is(call: ast.Call, name: str, value: object) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is value for k in call.keywords)


def unsafe_calls(source: str, filename: str = "<source>") -> list[str]:
    """Every construct in `source` that can unpickle or run code from data, as 'file:line: why'."""
    found = []

    def flag(node: ast.AST, why: str) -> None:
        found.append(f"{filename}:{node.lineno}: {why}")

    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in BANNED_MODULES:
                    flag(node, f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            module = (node.module or "").split(".")[0]
            names = {a.name for a in node.names}
            if module in BANNED_MODULES:
                flag(node, f"from {node.module} import ...")
            if module == "torch" and names & {"load", "save"}:
                flag(node, "from torch import load/save (hides the weights_only check)")
            if module in ("numpy", "yaml") and "load" in names:
                flag(node, f"from {module} import load (hides the allow_pickle / Loader check)")
        elif isinstance(node, ast.keyword) and node.arg == "weights_only":
            if not (isinstance(node.value, ast.Constant) and node.value.value is True):
                flag(node.value, "weights_only is not the constant True")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            last = name.rsplit(".", 1)[-1]
            if name in ("eval", "exec", "compile", "builtins.eval", "builtins.exec"):
                flag(node, f"{name}() runs code")
            elif name in ("torch.load", "torch.serialization.load") and not _keyword_is(node, "weights_only", True):
                flag(node, f"{name} without weights_only=True")
            elif name in ("torch.save", "torch.serialization.save"):
                flag(node, f"{name} pickles (use safetensors + JSON)")
            elif name in ("torch.jit.load", "torch.package.PackageImporter"):
                flag(node, f"{name} loads code")
            elif name in ("np.load", "numpy.load") or last == "read_array":
                if not _keyword_is(node, "allow_pickle", False):
                    flag(node, f"{name} without allow_pickle=False")
            elif name in ("yaml.load", "yaml.unsafe_load", "yaml.full_load"):
                flag(node, f"{name} can build arbitrary objects (use yaml.safe_load)")
            elif last in ("read_pickle", "to_pickle"):
                flag(node, f"{name} pickles")
            elif name.split(".")[0] in BANNED_MODULES:
                flag(node, f"{name}() (module imported under another name?)")
            elif (last in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
                  and str(node.args[0].value).split(".")[0] in BANNED_MODULES):
                flag(node, f"{name}({node.args[0].value!r})")
    return found


def package_files() -> list[Path]:
    """txl's Python files in src/ and where the interpreter imports txl from (the installed package)."""
    roots = {SRC.resolve()}
    spec = importlib.util.find_spec("txl")
    for location in spec.submodule_search_locations or []:
        roots.add(Path(location).resolve())
    files = sorted({p.resolve() for root in roots if root.is_dir() for p in root.rglob("*.py")})
    assert len(files) > 20, roots  # the package is really there
    return files


def test_no_module_can_unpickle_or_run_code_from_data():
    problems = [p for path in package_files() for p in unsafe_calls(path.read_text(), str(path))]
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle", "import cloudpickle as cp", "from dill import loads", "import marshal",
        "from pickle import load", "import shelve", "torch.load(path)", "torch.load(path, weights_only=False)",
        "torch.load(path, weights_only=flag)", "torch.serialization.load(f)", "torch.save(model, path)",
        "torch.save(model.state_dict(), path)", "from torch import load", "np.load(path)",
        "np.load(path, allow_pickle=True)", "numpy.load(path, mmap_mode='r')", "np.lib.format.read_array(f)",
        "eval(text)", "exec(code)", "builtins.eval(s)", "yaml.load(text)", "pd.read_pickle(path)",
        "importlib.import_module('pickle')", "f(weights_only=False)", "marshal.loads(data)",
    ],
)
def test_the_scanner_catches(snippet):
    assert unsafe_calls(snippet), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "torch.load(path, map_location='cpu', weights_only=True)",
        "np.load(path, mmap_mode='r', allow_pickle=False)", "json.loads(text)", "model.eval()",
        "safetensors.torch.load_file(path)", "text = 'pickle is never used'", "yaml.safe_load(text)",
    ],
)
def test_the_scanner_allows(snippet):
    assert unsafe_calls(snippet) == [], snippet


# ---------------------------------------------------------------------------------------------
# Behaviour: files built to run code when unpickled are refused, and the code never runs


class Payload:
    """Unpickling this calls open(marker, "w"): the marker file appearing means code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


HF_CONFIG = {"vocab_size": 40, "cutoffs": [], "d_model": 16, "d_embed": 16, "n_head": 2, "d_head": 8,
             "d_inner": 32, "div_val": 1, "n_layer": 1, "mem_len": 8, "clamp_len": 0, "same_length": False,
             "untie_r": True, "tie_word_embeddings": True}


def _hf_dir(tmp_path: Path, name: str) -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(HF_CONFIG))
    return directory


@pytest.mark.parametrize("container", ["torch-zip", "raw-pickle"])
def test_malicious_pytorch_model_bin_is_refused_by_import_hf(tmp_path, container, capsys):
    from txl.cli.main import main

    marker = tmp_path / "pwned"
    src = _hf_dir(tmp_path, "hf")
    payload = {"transformer.word_emb.emb_layers.0.weight": torch.zeros(40, 16), "evil": Payload(marker)}
    if container == "torch-zip":  # what torch.save writes: a zip holding data.pkl
        torch.save(payload, src / "pytorch_model.bin")
    else:  # a bare pickle stream, which torch.load also accepts
        (src / "pytorch_model.bin").write_bytes(pickle.dumps(payload, protocol=2))
    pickle.loads(pickle.dumps(Payload(tmp_path / "control")))  # the payload does work when unpickled
    assert (tmp_path / "control").exists()

    code = main(["import-hf", str(src), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "tensor-only checkpoint" in err and err.count("\n") == 1, err
    assert not marker.exists(), "unpickling ran the payload"
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_malicious_bin_through_the_installed_command(tmp_path):
    marker = tmp_path / "pwned"
    src = _hf_dir(tmp_path, "hf")
    torch.save({"w": Payload(marker)}, src / "pytorch_model.bin")
    proc = subprocess.run([sys.executable, "-m", "txl", "import-hf", str(src), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert not marker.exists()


def test_object_array_in_a_prepared_cache_is_refused(tmp_path, monkeypatch):
    from txl.data import open_corpus

    monkeypatch.setenv("TXL_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "c.txt").write_text("some text to prepare\n" * 200)
    corpus = open_corpus(f"text:{tmp_path / 'c.txt'}")
    marker = tmp_path / "pwned"
    n = corpus.num_tokens("train")
    evil = np.empty(n, dtype=object)
    evil[:] = [Payload(marker)] * n
    np.save(corpus.path / "train.npy", evil, allow_pickle=True)
    again = open_corpus(f"text:{tmp_path / 'c.txt'}")  # the cache still looks valid: same meta.json
    with pytest.raises(DataError, match="unreadable|not token ids"):
        again.split("train")
    assert not marker.exists()


def test_pickles_next_to_a_checkpoint_are_never_read(tmp_path):
    """vocab.pkl (the reference's and HF's vocabulary), training_args.bin, optimizer.pt: txl's loaders
    name the files they read (config.json, model.safetensors, vocab.json) and ignore every other one."""
    from txl import TransformerXLConfig
    from txl.models.transformer_xl.model import TransformerXL

    model = TransformerXL(TransformerXLConfig(vocab_size=40, n_layer=1, d_model=16, n_head=2, d_head=8,
                                              d_inner=32, mem_len=8))
    model.save_pretrained(tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    for name in ("vocab.pkl", "training_args.bin", "optimizer.pt", "pytorch_model.bin"):
        (tmp_path / "ckpt" / name).write_bytes(pickle.dumps(Payload(marker)))
    TransformerXL.from_pretrained(tmp_path / "ckpt")
    assert not marker.exists()


def test_hf_import_prefers_safetensors_over_a_pickle(tmp_path):
    """With both files present the pickle is not even opened (a damaged .bin would fail otherwise)."""
    from safetensors.torch import save_file

    from txl.models.hf_import import read_hf_weights

    src = _hf_dir(tmp_path, "hf")
    save_file({"w": torch.zeros(2)}, str(src / "model.safetensors"))
    (src / "pytorch_model.bin").write_bytes(b"not a pickle at all")
    assert set(read_hf_weights(src)) == {"w"}


def test_a_checkpoint_that_is_not_safetensors_is_refused(tmp_path):
    from txl.models.transformer_xl.model import TransformerXL

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"vocab_size": 40, "n_layer": 1, "d_model": 16,
                                                               "n_head": 2, "d_head": 8, "d_inner": 32}))
    torch.save({"w": Payload(tmp_path / "pwned")}, tmp_path / "ckpt" / "model.safetensors")  # a pickle in disguise
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        TransformerXL.from_pretrained(tmp_path / "ckpt")
    assert not (tmp_path / "pwned").exists()


def test_pytorch_model_bin_needs_a_torch_without_the_weights_only_bypass(tmp_path, monkeypatch):
    """torch < 2.6 let a crafted file run code even with weights_only=True (CVE-2025-32434)."""
    from txl.models.hf_import import read_hf_weights

    src = _hf_dir(tmp_path, "hf")
    torch.save({"w": torch.zeros(2)}, src / "pytorch_model.bin")
    assert set(read_hf_weights(src)) == {"w"}  # a plain tensor file loads on this torch
    monkeypatch.setattr(torch, "__version__", "2.5.1+cpu")
    with pytest.raises(CheckpointError, match="CVE-2025-32434"):
        read_hf_weights(src)
