"""Bad inputs of `txl export RUN OUT` (issue 46, item 5): not a run, an OUT that is a file or someone else's
folder or cannot be made, and models that have no fixed-shape step to export. Each is one line before any
tracing, and nothing is written. Registered into tests/test_robustness.py's table (ids prefixed `export-`);
tests/test_export.py checks more of each (no temporary left, an earlier export replaced whole)."""

from __future__ import annotations

import torch

from test_robustness import Ctx, case, cli

EXPORT = "tests/test_export.py::test_export_errors_are_one_line_and_write_nothing"


@case("export-not-a-run", "a folder that is no run or checkpoint", "txl export DIR OUT", "config.json", test=EXPORT)
def _(ctx: Ctx):
    (ctx.dir / "empty").mkdir(parents=True)
    return cli("export", str(ctx.dir / "empty"), str(ctx.dir / "out"))


@case("export-out-is-a-file", "OUT names an existing file", "txl export RUN notes.txt", "exists and is not a directory",
      "choose another place", test=EXPORT)
def _(ctx: Ctx):
    return cli("export", str(ctx.checkpoint_copy()), str(ctx.write("notes.txt", "mine")))


@case("export-out-foreign-folder", "OUT is a folder of the user's own files (it would have been replaced)",
      "txl export RUN ~/work", "is not an earlier export", "choose a new directory", test=EXPORT)
def _(ctx: Ctx):
    ctx.write("work/notes.txt", "mine")
    return cli("export", str(ctx.checkpoint_copy()), str(ctx.dir / "work"))


@case("export-out-under-a-file", "OUT inside a path that is a file (its folder cannot be made)",
      "txl export RUN notes.txt/out", "cannot write the export", "is not a directory", test=EXPORT)
def _(ctx: Ctx):
    return cli("export", str(ctx.checkpoint_copy()), str(ctx.write("notes.txt", "mine")) + "/out")


@case("export-encoder-decoder", "an encoder-decoder checkpoint (its decoder cache grows every token)",
      "txl export CKPT OUT", "encoder-decoder", "cannot be exported",
      test="tests/test_export.py::test_models_without_a_fixed_shape_step_are_refused")
def _(ctx: Ctx):
    from txl import EncoderDecoderConfig
    from txl.models.seq2seq import EncoderDecoder

    torch.manual_seed(0)
    config = EncoderDecoderConfig(vocab_size=23, n_layer=1, n_encoder_layer=1, d_model=16, n_head=2, d_head=8,
                                  d_inner=32, pos_encoding="sinusoidal")
    EncoderDecoder(config).save_pretrained(ctx.dir / "seq2seq")
    return cli("export", str(ctx.dir / "seq2seq"), str(ctx.dir / "out"))
