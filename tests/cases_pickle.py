"""Bad inputs of a Hugging Face folder given to `txl import-hf` (issue 50, build item 3): vocab.pkl files
that cost work rather than bytes, deep or damaged JSON next to them, tokens added beyond vocab.pkl that
do not fit it, and a config.json that declares more than its weights hold. Registered into
tests/test_robustness.py's table (ids prefixed `pickle-`); tests/test_pickle_bounds.py,
tests/test_hf_vocab.py and tests/test_hf_import_bounds.py check more of each (memory, nothing built)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from test_robustness import HF_CONFIG, Ctx, _hf_dir, case, cli

TESTS = Path(__file__).resolve().parent
BOUNDS = "tests/test_pickle_bounds.py::"
VOCAB = "tests/test_hf_vocab.py::"


def _import(ctx: Ctx, src: Path):
    outcome = cli("import-hf", str(src), str(ctx.dir / "out"))
    assert not (ctx.dir / "out").exists()
    return outcome


def _with_vocab(ctx: Ctx, data: bytes) -> Path:
    src = _hf_dir(ctx.dir / "hf", complete=True)
    (src / "vocab.pkl").write_bytes(data)
    return src


def _added_folder(ctx: Ctx, added_tokens: str | None = None) -> Path:
    """The folder saved by transformers 4.35.2 with `<formula>` added as id 67 (tests/data/hf_added_tokens),
    its tokenizer_config.json without added_tokens_decoder (as transformers < 4.34 wrote it), so that
    added_tokens.json is what names the added tokens."""
    src = ctx.dir / "hf"
    shutil.copytree(TESTS / "data" / "hf_added_tokens", src)
    config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    del config["added_tokens_decoder"]
    (src / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if added_tokens is not None:
        (src / "added_tokens.json").write_text(added_tokens, encoding="utf-8")
    return src


@case("pickle-shared-tuple-keys", "vocab.pkl of 6 KB: nested shared tuples as dictionary keys (hashing them took "
      "hours)", "txl import-hf SRC OUT", "pickle bomb", "nothing in it was run",
      test=BOUNDS + "test_the_review_files_end_in_one_short_line_under_300_mb")
def _(ctx):
    from test_pickle_bounds import shared_tuple_key_bomb

    return _import(ctx, _with_vocab(ctx, shared_tuple_key_bomb()))


@case("pickle-large-key", "vocab.pkl with a dictionary key of 1,023 items (keys are hashed only when small)",
      "txl import-hf SRC OUT", "key or set member of more than 1,000 items",
      test=BOUNDS + "test_a_large_key_is_refused_before_it_is_hashed")
def _(ctx):
    from test_pickle_bounds import _laughs_key

    return _import(ctx, _with_vocab(ctx, _laughs_key(8)))


@case("pickle-empty-sets", "vocab.pkl of 10 MB of EMPTY_SET opcodes (3.1 GB before)", "txl import-hf SRC OUT",
      "more than 200,000 containers", test=BOUNDS + "test_the_review_files_end_in_one_short_line_under_300_mb")
def _(ctx):
    from test_pickle_bounds import empty_set_bomb

    return _import(ctx, _with_vocab(ctx, empty_set_bomb()))


@case("pickle-long-error-line", "vocab.pkl of 231 bytes whose setting expands to millions of items (a 100 MB "
      "error line before)", "txl import-hf SRC OUT", "'lower_case' is [[[...], [...]]", "not a TransfoXL vocabulary",
      test=BOUNDS + "test_the_review_files_end_in_one_short_line_under_300_mb")
def _(ctx):
    from test_pickle_bounds import long_error_line_bomb

    outcome = _import(ctx, _with_vocab(ctx, long_error_line_bomb(levels=20)))
    assert len(outcome.text) < 400 + len(str(ctx.dir)), len(outcome.text)
    return outcome


@case("pickle-long-global-name", "vocab.pkl naming a global of 200,000 characters", "txl import-hf SRC OUT",
      "could run code", "nothing in it was run", test=BOUNDS + "test_quoted_names_are_truncated")
def _(ctx):
    module = "m" * 200_000
    data = b"\x80\x04\x8d" + len(module).to_bytes(8, "little") + module.encode() + b"\x8c\x01f\x93N."
    outcome = _import(ctx, _with_vocab(ctx, data))
    assert len(outcome.text) < 400 + len(str(ctx.dir)), len(outcome.text)
    return outcome


@case("pickle-vocab-fifo", "vocab.pkl that is a FIFO (a read would wait for ever)", "txl import-hf SRC OUT",
      "vocab.pkl", "not a regular file", test=VOCAB + "test_a_fifo_in_the_folder_is_refused_not_waited_on")
def _(ctx):
    src = _hf_dir(ctx.dir / "hf", complete=True)
    os.mkfifo(src / "vocab.pkl")
    return _import(ctx, src)


@case("pickle-deep-tokenizer-config", "tokenizer_config.json nested 100,000 deep (a RecursionError traceback "
      "before)", "txl import-hf SRC OUT", "tokenizer_config.json", "nests too deeply",
      test=VOCAB + "test_a_100k_deep_json_file_in_the_folder_is_one_line")
def _(ctx):
    src = _added_folder(ctx)
    (src / "tokenizer_config.json").write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    return _import(ctx, src)


@case("pickle-added-token-taken-id", "added_tokens.json giving an added token the id of a vocab.pkl symbol",
      "txl import-hf SRC OUT", "gives '<formula>' id 2, which vocab.pkl gives to 'the'", "remove the entry",
      test=VOCAB + "test_a_damaged_added_tokens_json_is_one_line")
def _(ctx):
    return _import(ctx, _added_folder(ctx, '{"<formula>": 2}'))


@case("pickle-added-token-gap", "added_tokens.json with a gap after vocab.pkl's ids", "txl import-hf SRC OUT",
      "id 70", "next free id is 67", test=VOCAB + "test_a_damaged_added_tokens_json_is_one_line")
def _(ctx):
    return _import(ctx, _added_folder(ctx, '{"<formula>": 70}'))


@case("pickle-added-token-extra", "added_tokens.json with one more token than config.json's vocab_size counts",
      "txl import-hf SRC OUT", "69 symbols (with the tokens of added_tokens.json)", "vocab_size=68",
      test=VOCAB + "test_a_damaged_added_tokens_json_is_one_line")
def _(ctx):
    return _import(ctx, _added_folder(ctx, '{"<formula>": 67, "<extra>": 68}'))


@case("pickle-hf-vocab-size-bomb", "HF config.json with vocab_size 2**21 next to 14 KB of weights (2.3 GB were "
      "allocated before the comparison)", "txl import-hf SRC OUT", "emb_layers.0.weight", "vocab_size=2097152",
      "disagree", test="tests/test_hf_import_bounds.py::test_a_vocab_size_its_weights_lack_is_refused_under_300_mb")
def _(ctx):
    return _import(ctx, _hf_dir(ctx.dir / "hf", complete=True, vocab_size=2**21))


@case("pickle-hf-int-weights", "HF weights holding an integer tensor where config.json implies a float one",
      "txl import-hf SRC OUT", "'head.bias'", "expected a float dtype",
      test="tests/test_hf_import_bounds.py::test_config_and_weights_are_compared_before_anything_is_built")
def _(ctx):
    from safetensors.torch import load_file, save_file

    src = _hf_dir(ctx.dir / "hf", complete=True)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["crit.out_layers.0.bias"] = torch.zeros(HF_CONFIG["vocab_size"], dtype=torch.int64)
    save_file(tensors, str(src / "model.safetensors"))
    return _import(ctx, src)
