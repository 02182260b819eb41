"""Bad inputs of fine-tuning and resuming on real text (issue 45, build item 3): each ends in one line naming
the cause and the fix. The behaviour behind them (fine-tuning onto a subset, <unk> notes, renamed corpora
resuming bit-exact): tests/test_finetune.py."""

from __future__ import annotations

from test_robustness import Ctx, Outcome, api, call_cli, case, cli, env, train_args  # noqa: F401


def _chars_run(ctx: Ctx):
    """A one-step run on the shared corpus read as characters (the shared run reads bytes)."""
    code, err = call_cli(*train_args(ctx, "--data", f"text:{ctx.corpus}?tokenizer=chars", "--max-steps", "1",
                                     "--out", str(ctx.dir / "chars")))
    assert code == 0, err
    return ctx.dir / "chars"


@case("finetune-new-character", "`--init-from` a chars run onto text with characters its vocabulary lacks",
      "txl train --init-from RUN --data text:NEW?tokenizer=chars", "--init-from", "'é' ×3", "'ø' ×1", "no <unk>",
      "replace or remove them", test="test_finetune.py")
def _(ctx):
    run = _chars_run(ctx)
    text = ctx.write("new.txt", "the memory\n" * 100 + "été é\nø\n")
    return cli(*train_args(ctx, "--init-from", str(run), "--data", f"text:{text}?tokenizer=chars"))


@case("finetune-other-tokenizer", "`--init-from` a chars run onto text read as bytes (the default)",
      "txl train --init-from RUN --data text:NEW", "chars vocabulary", "bytes vocabulary", "same tokenizer",
      "?tokenizer=chars", test="test_finetune.py")
def _(ctx):
    run = _chars_run(ctx)
    text = ctx.write("new.txt", "the memory\n" * 100)
    return cli(*train_args(ctx, "--init-from", str(run), "--data", f"text:{text}"))


@case("resume-renamed-corpus-edited", "`--resume` with `--data` at a renamed corpus whose text was also edited",
      "txl train --resume RUN --data text:RENAMED", "other text", "different content", "--init-from",
      test="test_finetune.py")
def _(ctx):
    corpus = ctx.write("corpus.txt", ctx.corpus.read_text())
    code, err = call_cli(*train_args(ctx, "--data", f"text:{corpus}?tokenizer=bytes", "--max-steps", "1",
                                     "--out", str(ctx.dir / "run")))
    assert code == 0, err
    renamed = ctx.write("renamed.txt", corpus.read_text().replace("the", "eht", 1))
    corpus.unlink()
    return cli("train", "--resume", str(ctx.dir / "run"), "--data", f"text:{renamed}?tokenizer=bytes",
               "--max-steps", "2", "--quiet")


@case("prompt-unknown-words-no-unk", "a prompt with words a vocabulary without <unk> lacks",
      "txl.generate.text.encode_prompt", "'The', 'zebra'", "no <unk>", "'the' for 'The'", test="test_finetune.py")
def _(ctx):
    from txl.data import Vocab
    from txl.errors import DataError
    from txl.generate.text import encode_prompt

    vocab = Vocab("words", ["<eos>", "the", "company"], eos="<eos>")
    return api(lambda: encode_prompt(vocab, "The zebra company"), DataError)
