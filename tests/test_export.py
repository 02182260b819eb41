"""The default TransformerXL (backend "auto", attention_impl "auto": the fast paths) is an ordinary module:
`torch.export.export` of a forward pass with memory, and `torch.compile(fullgraph=True)` of a training
step, work on it as built (issue 44, item 3).

The memory and the output are pytrees (`txl.nn.memory.register_pytree`), so the exported program takes
the memory of the segment before and returns the next one, as the model does. Inside a traced graph the
fast backend takes its traceable forms (`torch.compiler.is_compiling()`): the attention kernel's
composed path, torch's dropout, no projection cache or memoised tables.

`txl export RUN OUT` (issue 46, item 5) writes such programs over plain tensors (txl.models.export): they are
loaded back from disk and equal the eager model over segments with memory; an archive holding a pickle is
refused before torch reads it; bad commands are one line and write nothing.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers import call, finish, one_error_line, txl
from serve_helpers import train_run
from txl import Memory, TransformerXLConfig
from txl.errors import CheckpointError
from txl.models.checkpoint import load_checkpoint
from txl.models.export import (
    check_archive,
    eager_logits,
    export_model,
    load_export,
    load_program,
    onnx_available,
    program_bytes,
    run_programs,
)
from txl.models.registry import config_from_dict
from txl.models.rnn.model import RecurrentLM
from txl.models.transformer_xl.model import TransformerXL

TINY = dict(vocab_size=61, n_layer=2, d_model=32, n_head=4, d_head=8, d_inner=48, mem_len=8)


def default_model(**overrides) -> TransformerXL:
    config = TransformerXLConfig(**{**TINY, **overrides})
    assert config.backend == "auto" and config.attention_impl == "auto"  # the defaults: the fast paths
    torch.manual_seed(0)
    return TransformerXL(config)


def test_export_of_a_forward_pass_with_memory_gives_eager_outputs():
    model = default_model().eval()
    tokens = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(1))
    first, second, third = tokens[:, :8], tokens[:, 8:16], tokens[:, 16:]
    with torch.no_grad():
        memory = model(first).memory  # segment 1, eager
        eager = model(second, memory=memory)
        eager_next = model(third, memory=eager.memory)
    program = torch.export.export(model, (second,), {"memory": memory})  # segment 2 passes segment 1's memory
    exported = program.module()
    with torch.no_grad():
        out = exported(second, memory=memory)
        out_next = exported(third, memory=out.memory)  # the program's own memory feeds it back
        after = model(second, memory=memory)  # tracing left nothing behind in the eager model
    assert isinstance(out.memory, Memory) and out.memory.length == 8
    torch.testing.assert_close(out.logits, eager.logits, atol=1e-6, rtol=0)
    for exported_layer, eager_layer in zip(out.memory.hidden, eager.memory.hidden, strict=True):
        torch.testing.assert_close(exported_layer, eager_layer, atol=1e-6, rtol=0)
    torch.testing.assert_close(out_next.logits, eager_next.logits, atol=1e-6, rtol=0)
    assert torch.equal(after.logits, eager.logits)


@pytest.mark.parametrize("overrides", [
    {"cmem_len": 4, "cmem_ratio": 2},  # compressive memory: [compressed ; memory ; segment]
    {"universal": True},
    {"arch": "lstm", "n_head": None, "d_head": None},  # recurrent memory: the LSTM states
    {"arch": "sha-rnn", "n_head": None, "d_head": None, "d_inner": 64},  # and SHA-RNN's attention memory
])
def test_every_memory_kind_goes_through_export(overrides):
    config = {**TINY, **overrides}
    config = config_from_dict({k: v for k, v in config.items() if v is not None})  # the arch's own config
    torch.manual_seed(0)
    model = (RecurrentLM if config.arch in ("lstm", "sha-rnn") else TransformerXL)(config).eval()
    tokens = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        memory = model(tokens[:, 8:16], memory=model(tokens[:, :8]).memory).memory  # compressed states too
        eager = model(tokens[:, 16:], memory=memory)
    out = torch.export.export(model, (tokens[:, 16:],), {"memory": memory}).module()(tokens[:, 16:], memory=memory)
    assert type(out.memory) is type(eager.memory)
    torch.testing.assert_close(out.logits, eager.logits, atol=1e-6, rtol=0)
    for exported_tensor, eager_tensor in zip(out.memory.tensors(), eager.memory.tensors(), strict=True):
        torch.testing.assert_close(exported_tensor, eager_tensor, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_compile_fullgraph_of_a_training_step_with_memory():
    model = default_model()  # dropout 0.1 as the default config: the fast backend's dropout modules trace too
    reference = default_model()
    tokens = torch.randint(0, 61, (2, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        memory = model.eval()(tokens[:, :8]).memory
    model.train(), reference.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    compiled = torch.compile(model, fullgraph=True)  # fullgraph: any graph break is an error
    out = compiled(tokens[:, 8:16], memory=memory, labels=tokens[:, 9:17])
    out.loss.backward()
    optimizer.step()

    eager = reference(tokens[:, 8:16], memory=memory, labels=tokens[:, 9:17])
    eager.loss.backward()
    # dropout draws other random numbers inside the graph: the same loss up to them
    assert math.isfinite(out.loss.item()) and abs(out.loss.item() - eager.loss.item()) < 0.05 * eager.loss.item()
    assert isinstance(out.memory, Memory) and out.memory.length == 8
    assert not any(h.requires_grad for h in out.memory.hidden)  # detached: the stop-gradient
    grads = {name for name, p in reference.named_parameters() if p.grad is not None}
    assert grads == {name for name, p in model.named_parameters() if p.grad is not None}
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert all(not torch.equal(before[name], p) for name, p in model.named_parameters() if name in grads)


# ---------------------------------------------------------------------------------------------
# `txl export RUN OUT` (issue 46, item 5): programs on disk, loaded back, = the eager model

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return train_run(tmp_path_factory.mktemp("export"), steps=4)  # byte vocab, tgt_len 16, mem_len 16


def round_trip(model, directory, *, segments=2, batch=2):
    """(program logits, eager logits) of the start segment and `segments` steps, the programs' own memory fed back."""
    step, start, meta = load_export(directory)
    t, m = meta["segment_len"], meta["mem_len"]
    ids = torch.randint(0, model.config.vocab_size, (batch, m + segments * t), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        got = run_programs(step, start, ids, segment_len=t, mem_len=m)
    return got, eager_logits(model.eval(), ids, segment_len=t, mem_len=m)


def test_txl_export_of_a_trained_run_round_trips(run_dir, tmp_path):
    out = tmp_path / "exported"
    code, err = call("export", str(run_dir), str(out), "--threads", "1")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["export.json", "start.pt2", "step.pt2", "vocab.json"]
    assert (out / "vocab.json").read_bytes() == (run_dir / "best" / "vocab.json").read_bytes()
    meta = json.loads((out / "export.json").read_text())
    assert meta["segment_len"] == 16 and meta["mem_len"] == 16 and meta["scores"] == "logits"
    assert meta["check"]["max_abs_diff"] < 1e-5
    assert [i["name"] for i in meta["programs"]["step"]["inputs"]] == ["input_ids", "memory.0", "memory.1"]
    assert not list(tmp_path.glob(".exported.*"))  # no temporary left beside it
    model = load_checkpoint(run_dir).model  # the eager model as txl loads it: backend and kernel "auto"
    for batch in (1, 3):  # the batch is dynamic (traced at 2)
        got, want = round_trip(model, out, batch=batch)
        assert len(got) == 3  # start + 2 segments with memory
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def test_export_prints_the_check_and_replaces_an_earlier_export(run_dir, tmp_path, capsys):
    from txl.cli.main import main

    out = tmp_path / "exported"
    assert main(["export", str(run_dir), str(out), "--segment-len", "8", "--threads", "1"]) == 0
    assert main(["export", str(run_dir), str(out), "--threads", "1"]) == 0  # an earlier export: replaced whole
    printed = capsys.readouterr().out
    assert "max |difference|" in printed and "start + 2 segments of 16 tokens" in printed
    assert json.loads((out / "export.json").read_text())["segment_len"] == 16


@pytest.mark.parametrize("overrides", [
    {},
    {"cutoffs": [20, 40], "div_val": 2, "d_embed": 32},  # adaptive softmax: the program returns log-probs
    {"universal": True},
    {"mem_len": 0},  # no memory: one program, input_ids only
    {"same_length": True, "clamp_len": 6, "n_layer": 3},
    {"n_kv_head": 2, "qk_norm": True, "residual": "gru-gate", "pre_lnorm": True, "ffn": "swiglu", "norm": "rmsnorm",
     "memory_source": "same-layer"},  # the block options and ERNIE-Doc's recurrence (issue 47)
])
def test_exported_programs_equal_the_eager_model(overrides, tmp_path):
    model = default_model(**overrides).eval()
    exported = export_model(model, segment_len=5)
    assert set(exported.programs) == ({"step"} if model.mem_len == 0 else {"start", "step"})
    for name, program in exported.programs.items():
        (tmp_path / f"{name}.pt2").write_bytes(program_bytes(program))
    (tmp_path / "export.json").write_text(json.dumps({"segment_len": 5, "mem_len": model.mem_len}))
    got, want = round_trip(model, tmp_path, batch=3)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def test_an_archive_with_a_pickle_is_refused_before_torch_reads_it(tmp_path):
    class Plus(torch.nn.Module):
        def forward(self, x):
            return x + 1

    program = torch.export.export(Plus(), (torch.randn(3),))
    torch.export.save(program, tmp_path / "plain.pt2")  # torch pickles the example inputs (torch.save)
    with pytest.raises(CheckpointError, match=r"pickled entry \(data/sample_inputs/model.pt\)"):
        load_program(tmp_path / "plain.pt2")
    program.example_inputs = None  # what txl export writes: JSON and raw tensor bytes only
    check_archive(program_bytes(program), "test")
    (tmp_path / "junk.pt2").write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match="not a torch.export archive"):
        load_program(tmp_path / "junk.pt2")


def test_export_errors_are_one_line_and_write_nothing(run_dir, tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    cases = [
        ((str(tmp_path / "full"), str(tmp_path / "o1")), "CheckpointError", "config.json"),  # not a run
        ((str(run_dir), str(tmp_path / "afile")), "exists and is not a directory", None),
        ((str(run_dir), str(tmp_path / "full")), "is not an earlier export", None),
        ((str(run_dir), str(tmp_path / "afile" / "out")), "cannot write the export", None),
    ]
    for argv, *must in cases:
        code, err = call("export", *argv, "--threads", "1")
        line = one_error_line(err)
        assert code != 0 and all(m in line for m in must if m and m != "CheckpointError"), line
    assert (tmp_path / "full" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "afile").read_text() == "x"
    # a failure while writing leaves neither OUT nor a temporary beside it
    import txl.models.export as export

    def broken(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "write_bytes", broken)
    code, err = call("export", str(run_dir), str(tmp_path / "o2"), "--threads", "1")
    assert code == 2 and "No space left on device" in one_error_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "full"]


@pytest.mark.parametrize(("overrides", "why"), [
    ({"cmem_len": 4, "cmem_ratio": 2}, "compressive-memory"),
    ({"causal": False, "mem_len": 0, "pos_encoding": "rope"}, "bidirectional"),
    ({"arch": "encoder-decoder"}, "encoder-decoder"),
    ({"arch": "lstm"}, "lstm model cannot be exported"),
    ({"num_labels": 2}, "a document classifier cannot be exported"),  # (it was exported as a language model)
])
def test_models_without_a_fixed_shape_step_are_refused(overrides, why, tmp_path):
    if "arch" in overrides or "num_labels" in overrides:  # another architecture or head: built by the registry
        from txl.models.registry import build_model

        fields = dict(vocab_size=23, n_layer=2, d_model=32, d_inner=48, mem_len=8, **overrides)
        if overrides.get("arch") == "encoder-decoder":
            fields.update(n_head=4, d_head=8, pos_encoding="sinusoidal")
            del fields["mem_len"]
        build_model(config_from_dict(fields)).save_pretrained(tmp_path / "ckpt")
    else:
        default_model(**overrides).save_pretrained(tmp_path / "ckpt")
    code, err = call("export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--threads", "1")
    assert code == 2 and why in one_error_line(err)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # 10 s: torch.onnx's exporter, twice, and two onnxruntime sessions
@pytest.mark.skipif(not onnx_available(), reason="the onnx extra is not installed (pip install \"txl[onnx]\")")
def test_onnx_export_agrees_under_onnxruntime(run_dir, tmp_path):
    pytest.importorskip("onnxruntime")
    from txl.models.export import onnx_callable

    out = tmp_path / "exported"
    code, err = call("export", str(run_dir), str(out), "--onnx", "--threads", "1")
    assert code == 0, err
    meta = json.loads((out / "export.json").read_text())
    assert meta["onnx"]["step"]["max_abs_diff"] < 1e-5
    model = load_checkpoint(run_dir).model.eval()
    step = onnx_callable((out / "step.onnx").read_bytes(), meta["programs"]["step"])
    start = onnx_callable((out / "start.onnx").read_bytes(), meta["programs"]["start"])
    ids = torch.randint(0, 200, (1, 16 + 2 * 16), generator=torch.Generator().manual_seed(6))
    got = run_programs(step, start, ids, segment_len=16, mem_len=16)
    for g, w in zip(got, eager_logits(model, ids, segment_len=16, mem_len=16), strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def test_onnx_without_the_extra_is_one_line_before_any_work(run_dir, tmp_path, monkeypatch):
    import txl.models.export as export

    monkeypatch.setattr(export, "onnx_available", lambda: False)
    code, err = call("export", str(run_dir), str(tmp_path / "out"), "--onnx")
    assert code == 2 and 'pip install "txl[onnx]"' in one_error_line(err)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_txl_export_as_a_command(run_dir, tmp_path):
    """The journey a user types: `txl export RUN OUT` as a process, then the programs loaded from OUT."""
    code, output = finish(txl("export", str(run_dir), str(tmp_path / "exported")))
    assert code == 0, output
    assert "txl export: wrote" in output and "max |difference|" in output and "Traceback" not in output
    got, want = round_trip(load_checkpoint(run_dir).model, tmp_path / "exported")
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
