"""The messages a newcomer meets in the first hour (issue 45, item 4): a file given where a corpus spec
goes, a corpus that moved, a run evaluated before its first checkpoint, a UTF-16 text file and a download
without a network. Each ends in one line that names the cause and the command that works."""

from __future__ import annotations

import errno
import json
import urllib.error
from unittest import mock

from test_robustness import TINY, Ctx, Outcome, api, call_cli, case, cli, env, train_args  # noqa: F401

TEXT = "\n".join(f"line {i} of the notes, with a few words to learn" for i in range(300)) + "\n"


@case("newcomer-data-file-not-a-spec", "a text file given as the data spec", "txl train --data notes.txt",
      "text:", "notes.txt")
def _(ctx):
    notes = ctx.write("notes.txt", TEXT)
    return cli(*train_args(ctx, "--data", str(notes)))


@case("newcomer-data-folder-not-a-spec", "a folder of text given as the data spec", "txl train --data DIR",
      "text:", "train.txt")
def _(ctx):
    ctx.write("texts/train.txt", TEXT)
    return cli(*train_args(ctx, "--data", str(ctx.dir / "texts")))


@case("newcomer-data-name-typo", "a misspelt corpus name", "txl train --data ptb-wrod:DIR", "did you mean",
      "ptb-word")
def _(ctx):
    return cli(*train_args(ctx, "--data", f"ptb-wrod:{ctx.dir}"))


def _chars_run(ctx: Ctx):
    """A two-step run with a character vocabulary, trained on DIR/corpus.txt."""
    corpus = ctx.write("corpus.txt", TEXT)
    code, err = call_cli("train", "--data", f"text:{corpus}?tokenizer=chars", "--out", str(ctx.dir / "run"),
                         "--quiet", *TINY, "--set", "max_steps=2", "--set", "final_splits=[]",
                         "--set", "sample_tokens=0")
    assert code == 0, err
    return ctx.dir / "run"


def _run_on_moved_corpus(ctx: Ctx):
    """A run trained on text:DIR/corpus.txt, then the corpus renamed to moved.txt."""
    run = _chars_run(ctx)
    (ctx.dir / "corpus.txt").rename(ctx.dir / "moved.txt")
    return run


@case("newcomer-eval-corpus-moved", "`txl eval` of a run whose corpus was moved", "txl eval RUN",
      "corpus.txt", "--data text:NEWPLACE?tokenizer=chars")
def _(ctx):
    return cli("eval", str(_run_on_moved_corpus(ctx)), "--device", "cpu")


@case("newcomer-resume-corpus-moved", "`--resume` of a run whose corpus was moved", "txl train --resume RUN",
      "corpus.txt", "--data text:NEWPLACE?tokenizer=chars")
def _(ctx):
    return cli("train", "--resume", str(_run_on_moved_corpus(ctx)), "--max-steps", "3", "--quiet")


@case("newcomer-eval-before-first-checkpoint", "`txl eval` of a run that has not saved a checkpoint yet",
      "txl eval RUN", "no checkpoint yet", "step 400", "train.save_interval")
def _(ctx):
    record = json.loads((ctx.run_copy() / "run.json").read_text())
    run = ctx.dir / "starting"  # what `txl train` has written before its first save
    run.mkdir()
    record["config"]["train"].update(save_interval=400, eval_interval=1000, max_steps=5000)
    (run / "run.json").write_text(json.dumps(record))
    return cli("eval", str(run), "--device", "cpu")


@case("newcomer-utf16-bom", "a UTF-16 text file (with its byte-order mark)", "txl train --data text:FILE",
      "UTF-16", "iconv -f UTF-16 -t UTF-8")
def _(ctx):
    path = ctx.write("notes.txt", TEXT.encode("utf-16"))
    return cli(*train_args(ctx, "--data", f"text:{path}?tokenizer=chars"))


@case("newcomer-utf16-no-bom", "a UTF-16LE text file without a byte-order mark (it trained on NUL bytes)",
      "txl train --data text:FILE?tokenizer=chars", "UTF-16LE", "iconv -f UTF-16LE -t UTF-8")
def _(ctx):
    path = ctx.write("notes.txt", TEXT.encode("utf-16-le"))
    return cli(*train_args(ctx, "--data", f"text:{path}?tokenizer=chars"))


@case("newcomer-utf32-bom", "a UTF-32 text file", "txl train --data text:FILE?tokenizer=words", "UTF-32",
      "iconv -f UTF-32 -t UTF-8")
def _(ctx):
    path = ctx.write("notes.txt", TEXT.encode("utf-32"))
    return cli(*train_args(ctx, "--data", f"text:{path}?tokenizer=words"))


@case("newcomer-eval-text-utf16", "`txl eval --text` of a UTF-16 file with a character vocabulary",
      "txl eval RUN --text FILE", "UTF-16", "iconv -f UTF-16 -t UTF-8")
def _(ctx):
    run = _chars_run(ctx)
    path = ctx.write("notes.txt", TEXT.encode("utf-16"))
    return cli("eval", str(run), "--text", str(path), "--device", "cpu")


@case("newcomer-init-from-before-first-checkpoint", "`txl train --init-from` a run that has not saved yet",
      "txl train --init-from RUN", "no checkpoint yet", "step 400")
def _(ctx):
    record = json.loads((ctx.run_copy() / "run.json").read_text())
    run = ctx.dir / "starting"
    run.mkdir()
    record["config"]["train"].update(save_interval=400, eval_interval=1000, max_steps=5000)
    (run / "run.json").write_text(json.dumps(record))
    return cli(*train_args(ctx, "--init-from", str(run)))


@case("newcomer-generate-prompt-file-utf16", "`txl generate --prompt-file` in UTF-16 (it said: not UTF-8, byte 0)",
      "txl generate RUN --prompt-file FILE", "UTF-16", "iconv -f UTF-16 -t UTF-8")
def _(ctx):
    run = _chars_run(ctx)
    path = ctx.write("prompts.txt", TEXT.encode("utf-16"))
    return cli("generate", str(run), "--prompt-file", str(path), "--device", "cpu")


def _no_network(request, timeout=None):
    """What urlopen raises on a machine without a network (the same line on every machine)."""
    raise urllib.error.URLError(OSError(errno.ENETUNREACH, "Network is unreachable"))


@case("newcomer-download-offline", "`txl data download` without a network (it only said: run it again)",
      "txl data download ptb", "simple-examples.tgz", "--data ptb-word:DIR", "ptb-char:DIR")
def _(ctx):
    with mock.patch("urllib.request.urlopen", _no_network):
        return cli("data", "download", "ptb", "--dest", str(ctx.dir / "ptb"), "--retries", "0")

@case("newcomer-eval-threads-negative", "a negative thread count for `txl eval` (it had no --threads)",
      "txl eval CKPT --threads -1", "--threads", ">= 0")
def _(ctx):
    return cli("eval", str(ctx.dir / "ckpt"), "--threads", "-1")


@case("newcomer-eval-text-name-too-long", "`txl eval --text` with a name too long for the system (a traceback)",
      "txl eval CKPT --text AAAA...", "--text", "too long")
def _(ctx):
    return cli("eval", str(ctx.checkpoint_copy()), "--text", "a" * 300)
