"""`txl export RUN OUT`: the forward pass with memory of a trained model as `torch.export` programs
(start.pt2, step.pt2; with --onnx also start.onnx, step.onnx), vocab.json and export.json in OUT.

Each program is loaded back from the bytes written and run against the eager model (start + 2 segments,
its own memory fed back) before anything is renamed into place; the largest difference is printed and
recorded. How the programs are called: txl.models.export and docs/guide/evaluation.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from txl.cli.arguments import MAX_LENGTH, add_checkpoint, add_threads, integer
from txl.errors import OutputError, UsageError


def configure(parser: argparse.ArgumentParser) -> None:
    add_checkpoint(parser)
    parser.add_argument("out", metavar="OUT", help="the directory to write (new, or an earlier export: replaced whole)")
    parser.add_argument("--segment-len", type=integer(1, MAX_LENGTH), metavar="T",
                        help="tokens per step (default: the run's tgt_len; a bare checkpoint without one: its mem_len)")
    parser.add_argument("--onnx", action="store_true",
                        help="also write ONNX models (needs the optional extra: pip install \"txl[onnx]\"; checked "
                             "with onnxruntime when it is installed)")
    add_threads(parser)


def _segment_len(args: argparse.Namespace, ckpt) -> int:
    if args.segment_len is not None:
        return args.segment_len
    tgt_len = ckpt.train_setting("tgt_len")
    if tgt_len:
        return tgt_len
    if ckpt.model.mem_len:
        return ckpt.model.mem_len
    raise UsageError(f"{ckpt.path} records no segment length and has mem_len 0; pass --segment-len T")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.onnx:
        from txl.models.export import onnx_available

        if not onnx_available():
            raise UsageError("--onnx needs onnx and onnxscript: pip install \"txl[onnx]\" (or leave out --onnx)")
    from txl.models.export import check_output

    check_output(out)  # before minutes of tracing
    from txl.models.checkpoint import load_checkpoint
    from txl.models.export import (
        CHECK_TOLERANCE,
        START,
        STEP,
        check_export,
        describe,
        export_model,
        exportable,
        load_program_bytes,
        onnx_bytes,
        onnx_callable,
        program_bytes,
        vocab_bytes,
        write_export,
    )

    ckpt = load_checkpoint(args.checkpoint)
    model = ckpt.model.eval()
    exportable(model)
    segment_len = _segment_len(args, ckpt)
    exported = export_model(model, segment_len=segment_len)
    files = {f"{name}.pt2": program_bytes(program) for name, program in exported.programs.items()}
    loaded = {name: load_program_bytes(files[f"{name}.pt2"], out / f"{name}.pt2").module()
              for name in exported.programs}  # what a user will load: the bytes written
    diff = check_export(model, loaded[STEP], loaded.get(START), segment_len=segment_len, mem_len=exported.mem_len)
    exported.max_abs_diff = diff
    scale = max(1.0, _logit_scale(model, segment_len))
    if not diff <= CHECK_TOLERANCE * scale:
        raise OutputError(f"the exported program differs from the eager model by {diff:.3g} (more than "
                          f"{CHECK_TOLERANCE:g} x {scale:.3g}); nothing was written; please report this with the model")
    onnx_diffs: dict[str, float | None] = {}
    if args.onnx:
        for name, data in onnx_bytes(model, exported).items():
            files[f"{name}.onnx"] = data
        sessions = {name: onnx_callable(files[f"{name}.onnx"], exported.signatures[name]) for name in exported.programs}
        if all(s is not None for s in sessions.values()):
            onnx_diff = check_export(model, sessions[STEP], sessions.get(START), segment_len=segment_len,
                                     mem_len=exported.mem_len)
            if not onnx_diff <= CHECK_TOLERANCE * scale:
                raise OutputError(f"the ONNX model differs from the eager model by {onnx_diff:.3g} under onnxruntime; "
                                  "nothing was written; please report this with the model")
            onnx_diffs = dict.fromkeys(exported.programs, onnx_diff)
        else:
            onnx_diffs = dict.fromkeys(exported.programs)
    vocab = vocab_bytes(ckpt.path)
    if vocab is not None:
        files["vocab.json"] = vocab
    meta = describe(exported, model, source=str(ckpt.path), files=list(files), onnx=onnx_diffs)
    write_export(out, files, meta)
    written = ", ".join(sorted([*files, "export.json"]))
    print(f"txl export: wrote {out}/ ({written})")
    print(f"txl export: loaded back and run against the eager model (start + 2 segments of {segment_len} tokens, "
          f"memory {exported.mem_len}): max |difference| {diff:.3g}")
    if args.onnx:
        if onnx_diffs and next(iter(onnx_diffs.values())) is not None:
            print(f"txl export: ONNX under onnxruntime: max |difference| {next(iter(onnx_diffs.values())):.3g}")
        else:
            print("txl export: ONNX written but not run (onnxruntime is not installed)")
    return 0


def _logit_scale(model, segment_len: int) -> float:
    """The largest |logit| of a few example segments: the scale the check's tolerance is relative to."""
    from txl.models.export import eager_logits, example_ids

    ids = example_ids(model, 1, model.mem_len + segment_len, 4)
    return max(t.abs().max().item() for t in eager_logits(model, ids, segment_len=segment_len, mem_len=model.mem_len))

