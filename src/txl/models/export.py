"""A trained model's forward pass with memory as a `torch.export` program (and ONNX): `txl export RUN OUT`.

What is exported is one segment step over plain tensors, callable without txl installed:

    step(input_ids (b, T) int64, memory.0, ..., memory.{L-1} (b, M, d_model))
        -> (logits (b, T, V), next_memory.0, ..., next_memory.{L-1} (b, M, d_model))

with T the segment length and M the model's mem_len (logits are log-probabilities for an adaptive
softmax, as the model returns them). The batch is dynamic; T and M are fixed: the relative shift and the
memory update (`min(M, m + T)` kept positions) branch on the lengths, so `torch.export` cannot keep
them symbolic (its guards pin them). A memory starts empty, so the first segment is a second program,

    start(input_ids (b, M)) -> (logits (b, M, V), memory.0, ..., memory.{L-1} (b, M, d_model))

whose M tokens fill the memory exactly; every later segment is a `step`. The pair gives what the eager
model gives for the same segments (`check_export`). At mem_len 0 there is only `step`, without memory.

The program is traced from a copy of the model on the reference backend with the eager attention: the
same weights and arithmetic (the parity tests pin the backends together), without the fast backend's
size-dependent choices, which would pin the batch (`txl.fast.linear.applies` guards on rows x width).

No pickle (the house rule): `torch.export.save` writes a zip of JSON (the graph) and raw tensor bytes,
except for the example inputs, which it pickles with `torch.save` (and `torch.export.load` reads with
`weights_only=False` when `weights_only=True` fails), and tensor subclasses or script objects among
the weights and constants, which it pickles too. The example inputs are dropped before saving, and
`check_archive` refuses any archive with a pickled entry before `torch.export.load` sees it.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from txl.errors import CheckpointError, OutputError
from txl.io import VOCAB_LIMIT, fsync_dir, read_bytes, refuse_link, write_bytes, write_json
from txl.nn.memory import Memory

FORMAT = "txl-export-1"
EXPORT_JSON = "export.json"
START, STEP = "start", "step"  # the programs: start.pt2 fills the memory, step.pt2 runs every later segment
MAX_BATCH = 4096  # the dynamic batch's upper bound (torch.export needs one)
PROGRAM_LIMIT = 1 << 40  # bytes of a .pt2 txl reads back (the weights are inside)
CHECK_TOLERANCE = 1e-4  # |program - eager| over the largest |logit|: fp32 sums in another order, no more
ONNX_OPSET = 18


def exportable(model: nn.Module) -> None:
    """Refuse, in one CheckpointError, a model whose forward pass with memory has no fixed-shape form."""
    from txl.models.transformer_xl.model import TransformerXL

    config = model.config
    if config.arch == "encoder-decoder":
        raise CheckpointError("an encoder-decoder model cannot be exported: its decoder cache grows with every "
                              "token (txl export takes decoder-only Transformer-XL models)")
    if not isinstance(model, TransformerXL):
        why = "the recurrent ones have no export path" if config.arch in ("lstm", "sha-rnn") else "language models only"
        raise CheckpointError(f"a {config.arch} model cannot be exported yet (txl export takes Transformer-XL "
                              f"models; {why})")
    if getattr(config, "num_labels", 0):
        raise CheckpointError("a document classifier cannot be exported: txl export writes a language model's "
                              "segment step, and a classifier's training never scores its LM head")
    if not config.causal:
        raise CheckpointError("a bidirectional encoder (causal=false) has no memory to export; txl export takes "
                              "causal language models")
    if getattr(config, "cmem_len", 0):
        raise CheckpointError("a compressive-memory model cannot be exported: its compressed memory grows "
                              "segment by segment, and a program needs fixed shapes (cmem_len > 0)")


class SegmentStep(nn.Module):
    """The model's forward pass over plain tensors: (input_ids, *memory) -> (logits, *next_memory)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, *memory: Tensor) -> tuple[Tensor, ...]:
        out = self.model(input_ids, memory=Memory(hidden=memory) if memory else None)
        return (out.logits, *(() if out.memory is None else out.memory.hidden))


def reference_copy(model: nn.Module) -> nn.Module:
    """The same weights on the reference backend with the eager attention, in eval mode (what is traced)."""
    from txl.models.registry import build_model

    copy = build_model(model.config.replace(backend="reference", attention_impl="eager"))
    copy.load_state_dict(model.state_dict())
    return copy.eval()


def _names(prefix: str, n_layer: int) -> list[str]:
    return [f"{prefix}.{i}" for i in range(n_layer)]


@dataclass
class Exported:
    """The programs of one model, their call signatures and the check against the eager model."""

    programs: dict[str, torch.export.ExportedProgram]  # START (when mem_len > 0) and STEP
    signatures: dict[str, dict[str, Any]]  # name -> {"inputs": [...], "outputs": [...]} (names, shapes, dtypes)
    segment_len: int
    mem_len: int
    max_abs_diff: float | None = None


def _signature(model: nn.Module, *, q_len: int, memory: bool, layers: int) -> dict[str, Any]:
    """Names, shapes and dtypes of a program's inputs and outputs (`layers`: memory tensors it returns)."""
    c = model.config
    mem = [{"name": n, "shape": ["batch", model.mem_len, c.d_model], "dtype": "float32"}
           for n in _names("memory", layers)]
    nxt = [{"name": n, "shape": ["batch", model.mem_len, c.d_model], "dtype": "float32"}
           for n in _names("next_memory", layers)]
    return {"inputs": [{"name": "input_ids", "shape": ["batch", q_len], "dtype": "int64"}, *(mem if memory else [])],
            "outputs": [{"name": "logits", "shape": ["batch", q_len, c.vocab_size], "dtype": "float32"}, *nxt]}


def _batch_dynamic(dim: Any, memory: tuple[Tensor, ...]) -> tuple:
    """dynamic_shapes of (input_ids, *memory): the batch (dim 0) of each; `*memory` is one nested entry."""
    return ({0: dim}, tuple({0: dim} for _ in memory)) if memory else ({0: dim},)


def example_ids(model: nn.Module, batch: int, length: int, seed: int) -> Tensor:
    return torch.randint(0, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def export_model(model: nn.Module, *, segment_len: int) -> Exported:
    """`torch.export` programs of `model`'s forward pass with memory (see the module docstring)."""
    exportable(model)
    if segment_len < 1:
        raise CheckpointError(f"the segment length must be >= 1, got {segment_len}")
    traced = SegmentStep(reference_copy(model)).eval()
    mem_len, batch = model.mem_len, 2  # an example batch of 2: torch.export specializes sizes 0 and 1
    dim = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    programs, signatures = {}, {}
    memory: tuple[Tensor, ...] = ()
    with torch.no_grad():
        if mem_len:
            first = (example_ids(model, batch, mem_len, 0),)
            programs[START] = torch.export.export(traced, first, dynamic_shapes=({0: dim},))
            memory = traced(*first)[1:]  # one (b, mem_len, d_model) tensor per layer
            signatures[START] = _signature(model, q_len=mem_len, memory=False, layers=len(memory))
        step = (example_ids(model, batch, segment_len, 1), *memory)
        programs[STEP] = torch.export.export(traced, step, dynamic_shapes=_batch_dynamic(dim, memory))
        signatures[STEP] = _signature(model, q_len=segment_len, memory=bool(mem_len), layers=len(memory))
    for program in programs.values():
        program.example_inputs = None  # torch.export.save would pickle them (module docstring)
    return Exported(programs, signatures, segment_len=segment_len, mem_len=mem_len)


def run_programs(step: Any, start: Any | None, ids: Tensor, *, segment_len: int, mem_len: int) -> list[Tensor]:
    """Logits of `ids` (b, mem_len + k * segment_len) through callables with the programs' signatures:
    `start` on the first mem_len tokens, then `step` per segment with the memory it returns."""
    logits, memory, pos = [], (), 0
    if mem_len:
        logits_0, *memory = start(ids[:, :mem_len])
        logits.append(logits_0)
        pos = mem_len
    while pos < ids.shape[1]:
        logits_i, *memory = step(ids[:, pos:pos + segment_len], *memory)
        logits.append(logits_i)
        pos += segment_len
    return logits


def eager_logits(model: nn.Module, ids: Tensor, *, segment_len: int, mem_len: int) -> list[Tensor]:
    """The eager model over the same segments as `run_programs`, its memory carried as txl carries it."""
    out, memory, pos = [], None, 0
    bounds = ([mem_len] if mem_len else []) + list(range(mem_len + segment_len, ids.shape[1] + segment_len,
                                                         segment_len))
    with torch.no_grad():
        for end in bounds:
            result = model(ids[:, pos:end], memory=memory)
            out.append(result.logits)
            memory, pos = result.memory, end
    return out


def check_export(model: nn.Module, step: Any, start: Any | None, *, segment_len: int, mem_len: int,
                 batch: int = 3, segments: int = 2) -> float:
    """The largest |program - eager| of the logits over the start segment and `segments` steps (the
    programs' own memory fed back), at a batch size other than the traced one."""
    ids = example_ids(model, batch, mem_len + segments * segment_len, 2)
    with torch.no_grad():
        got = run_programs(step, start, ids, segment_len=segment_len, mem_len=mem_len)
    want = eager_logits(model.eval(), ids, segment_len=segment_len, mem_len=mem_len)
    return max((g - w).abs().max().item() for g, w in zip(got, want, strict=True))


# ---------------------------------------------------------------------------------------------
# The archive: pickle-free .pt2


def program_bytes(program: torch.export.ExportedProgram) -> bytes:
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    data = buffer.getvalue()
    check_archive(data, "the program txl wrote")
    return data


def check_archive(data: bytes, where: str | Path) -> None:
    """Refuse a .pt2 archive with any pickled entry (tensor subclasses, script objects, example inputs,
    the legacy whole-state-dict files): `torch.export.load` unpickles those, some with weights_only=False."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        entries = {info.filename.split("/", 1)[-1]: info for info in archive.infolist()}
        for name, info in entries.items():
            legacy = name.endswith(".pt") and name.startswith(("data/weights/", "data/constants/"))
            if legacy or (name.startswith("data/sample_inputs/") and info.file_size) or "/custom_obj_" in name \
                    or "/opaque_obj_" in name:
                raise CheckpointError(f"{where} holds a pickled entry ({name}); txl never unpickles: export the "
                                      "model again with `txl export`")
            if name.endswith("_config.json") and name.startswith(("data/weights/", "data/constants/")):
                config = json.loads(archive.read(info))
                pickled = [k for k, v in config.get("config", {}).items() if v.get("use_pickle")]
                if pickled:
                    raise CheckpointError(f"{where} holds pickled tensors ({pickled[0]}); txl never unpickles: "
                                          "export the model again with `txl export`")
    except (zipfile.BadZipFile, ValueError, AttributeError, KeyError) as err:
        raise CheckpointError(f"{where} is not a torch.export archive ({err}); export the model again") from None


def load_program(path: str | Path) -> torch.export.ExportedProgram:
    """A .pt2 written by `txl export`, checked to be pickle-free before torch reads it."""
    data = read_bytes(path, what="exported program", limit=PROGRAM_LIMIT, error=CheckpointError, follow_links=True)
    return load_program_bytes(data, path)


def load_program_bytes(data: bytes, where: str | Path) -> torch.export.ExportedProgram:
    """`torch.export.load` of an archive's bytes once `check_archive` has passed them."""
    check_archive(data, where)
    return torch.export.load(io.BytesIO(data))


def load_export(directory: str | Path) -> tuple[Any, Any | None, dict[str, Any]]:
    """(step, start or None, export.json) of an export directory, as callable modules."""
    from txl.io import read_json

    directory = Path(directory)
    meta = read_json(directory / EXPORT_JSON, what="export record", error=CheckpointError)
    start = load_program(directory / f"{START}.pt2").module() if meta.get("mem_len") else None
    return load_program(directory / f"{STEP}.pt2").module(), start, meta


# ---------------------------------------------------------------------------------------------
# ONNX (optional: pip install "txl[onnx]")


def onnx_available() -> bool:
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError:
        return False
    return True


def onnx_bytes(model: nn.Module, exported: Exported) -> dict[str, bytes]:
    """name -> ONNX model of each program (torch.onnx.export, dynamo=True: the same torch.export trace)."""
    import logging
    import warnings

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # "torchvision is not installed" lines, per program
    traced = SegmentStep(reference_copy(model)).eval()
    dim = torch.export.Dim("batch", min=1, max=MAX_BATCH)
    out = {}
    for name, signature in exported.signatures.items():
        inputs = [spec["name"] for spec in signature["inputs"]]
        ids = example_ids(model, 2, signature["inputs"][0]["shape"][1], 3)
        memory = tuple(torch.zeros(2, model.mem_len, model.config.d_model) for _ in inputs[1:])
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(traced, (ids, *memory), dynamo=True, verbose=False, opset_version=ONNX_OPSET,
                                        input_names=inputs, output_names=[s["name"] for s in signature["outputs"]],
                                        dynamic_shapes=_batch_dynamic(dim, memory))
        out[name] = program.model_proto.SerializeToString()
    return out


def onnx_callable(data: bytes, signature: dict[str, Any]):
    """An onnxruntime session called like the programs (tensors in, tensors out); None without onnxruntime."""
    try:
        import onnxruntime
    except ImportError:
        return None
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    names = [spec["name"] for spec in signature["inputs"]]

    def call(*tensors: Tensor) -> list[Tensor]:
        feed = {n: t.contiguous().numpy() for n, t in zip(names, tensors, strict=True)}
        return [torch.from_numpy(a) for a in session.run(None, feed)]

    return call


# ---------------------------------------------------------------------------------------------
# The directory


def check_output(out: Path) -> None:
    """OUT may be new, or an earlier export (replaced whole); anything else is refused before any work."""
    refuse_link(out, "where it writes the export")
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out} exists and is not a directory; choose another place for the export")
    if out.is_dir() and any(out.iterdir()) and not (out / EXPORT_JSON).is_file():
        raise OutputError(f"{out} exists and is not an earlier export (no {EXPORT_JSON}); choose a new directory "
                          "(txl only replaces an export it wrote)")
    parent = out.absolute().parent
    while not parent.exists() and parent != parent.parent:  # the first existing folder: OUT's parents are made
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"cannot write the export {out}: {parent} is not a directory; choose another place")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write the export {out}: {parent} is not writable; choose another place")


def write_export(out: str | Path, files: dict[str, bytes], meta: dict[str, Any]) -> None:
    """The files and export.json into a temporary directory beside OUT, then renamed into place (an earlier
    export is replaced only once the new one is whole)."""
    out = Path(out)
    check_output(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as err:
        raise OutputError(f"cannot write the export {out}: {err.strerror or err}") from None
    try:
        for name, data in files.items():
            write_bytes(tmp / name, data)
        write_json(tmp / EXPORT_JSON, meta)
        os.chmod(tmp, 0o777 & ~_umask())
        fsync_dir(tmp)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / out.name)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError):
            raise OutputError(f"cannot write the export {out}: {err.strerror or err}") from None
        raise


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def vocab_bytes(directory: Path) -> bytes | None:
    path = directory / "vocab.json"
    if not path.is_file():
        return None
    return read_bytes(path, what="vocabulary", limit=VOCAB_LIMIT, error=CheckpointError)


def describe(exported: Exported, model: nn.Module, *, source: str, files: list[str],
             onnx: dict[str, float | None]) -> dict[str, Any]:
    """export.json: what the programs take and return, how to call them, and what is not exported."""
    return {
        "format": FORMAT,
        "torch": torch.__version__,
        "source": source,
        "config": model.config.to_dict(),
        "vocab": "vocab.json" if "vocab.json" in files else None,
        "segment_len": exported.segment_len,
        "mem_len": exported.mem_len,
        "batch": {"min": 1, "max": MAX_BATCH},
        "scores": "log_probs" if getattr(model.config, "adaptive", False) else "logits",
        "programs": {name: {"file": f"{name}.pt2", **sig} for name, sig in exported.signatures.items()},
        "onnx": {name: {"file": f"{name}.onnx", "max_abs_diff": diff} for name, diff in onnx.items()},
        "check": {"max_abs_diff": exported.max_abs_diff, "segments": "start + 2 steps, batch 3, against the eager model",
                  "tolerance": f"{CHECK_TOLERANCE} x max |logit|"},
        "call": ("program = torch.export.load('step.pt2').module(); logits, *memory = program(input_ids, *memory). "
                 "The first segment is start.pt2 on exactly mem_len tokens (no memory in); every later segment is "
                 "step.pt2 on exactly segment_len tokens with the memory the previous call returned."
                 if exported.mem_len else
                 "program = torch.export.load('step.pt2').module(); (logits,) = program(input_ids)"),
        "not_exported": ["the loss and labels", "sampling and generation (the decoding loop)", "dropout and training",
                         "attention_mask / padding", "other segment or memory lengths than the ones above",
                         "the tokenizer (vocab.json is copied beside the programs)"],
    }


__all__ = ["EXPORT_JSON", "Exported", "SegmentStep", "check_archive", "check_export", "check_output", "describe",
           "eager_logits", "exportable", "export_model", "load_export", "load_program", "load_program_bytes", "onnx_available",
           "onnx_bytes", "onnx_callable", "run_programs", "vocab_bytes", "write_export"]
