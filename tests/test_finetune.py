"""Fine-tune and resume on real text (issue 45, build item 3). Each test here failed before its fix.

- `--init-from` reads the new text with the checkpoint's vocabulary: text whose characters are a strict
  subset of the checkpoint's fine-tunes (it was refused: "the checkpoint has symbols the data lacks"), then
  evaluates, generates and resumes; symbols the vocabulary lacks read as <unk> with one note when it has
  one, else one error line naming them with their counts; the prepared cache keys on the vocabulary used,
  so a later plain run on the same text gets the text's own vocabulary;
- corpus fingerprints hash content, not names: a renamed or moved corpus resumes bit-exact (it was refused
  as "different content"), changed text is still refused in one line, and fingerprints saved in the old
  path-hashing form still match their unchanged corpus;
- word-level prompts name the words they read as <unk> (they were replaced silently).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import helpers
from helpers import TINY, call, one_error_line
from txl.data import Vocab, open_corpus
from txl.data.corpus import fingerprint_matches
from txl.errors import DataError
from txl.generate.text import encode_prompt, prompt_notice

corpus, cache_dir = helpers.corpus, helpers.cache_dir  # fixtures
pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = ["memory", "segment", "attention", "relative", "position", "token", "layer", "the", "of", "and"]


def write_lines(path: Path, words: list[str], lines: int = 300, seed: int = 1) -> Path:
    import random

    rng = random.Random(seed)
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 10))) for _ in range(lines)))
    return path


def train(tmp: Path, corpus: Path, out: str, tokenizer: str, *more: str, steps: int = 2) -> Path:
    config = helpers.write_config(tmp, corpus, steps=steps, varlen="false")
    config.write_text(config.read_text().replace("tokenizer=bytes", f"tokenizer={tokenizer}"))
    code, err = call("train", "--config", str(config), "--out", str(tmp / out), "--quiet", *TINY, *more)
    assert code == 0, err
    return tmp / out


@pytest.fixture(scope="module")
def chars_run(tmp_path_factory, corpus) -> Path:
    """A tiny run on the shared corpus, read as characters."""
    return train(tmp_path_factory.mktemp("chars"), corpus, "run", "chars")


def vocab_of(directory: Path) -> Vocab:
    return Vocab.load(directory / "vocab.json")


# ---------------------------------------------------------------------------------------------
# --init-from reads new text with the checkpoint's vocabulary


def test_fine_tuning_on_text_with_a_subset_of_the_characters_evaluates_generates_and_resumes(chars_run, tmp_path):
    subset = write_lines(tmp_path / "subset.txt", ["the", "of", "and", "token"])  # 11 of the 20 characters
    assert set(subset.read_text()) < set(vocab_of(chars_run / "last").symbols)
    out = tmp_path / "ft"
    code, err = call("train", "--init-from", str(chars_run), "--data", f"text:{subset}?tokenizer=chars",
                     "--out", str(out), "--max-steps", "2", "--quiet")
    assert code == 0, err
    assert vocab_of(out / "last") == vocab_of(chars_run / "last")  # ids mean what the weights learned
    assert "read as" not in err  # nothing unknown, nothing to say
    code, err = call("eval", str(out), "--device", "cpu", "--quiet")
    assert code == 0, err
    code, err = call("generate", str(out), "--prompt", "the", "--max-new-tokens", "8", "--seed", "1")
    assert code == 0, err
    code, err = call("train", "--resume", str(out), "--max-steps", "3", "--quiet")
    assert code == 0, err
    assert json.loads((out / "last" / "trainer_state.json").read_text())["step"] == 3


def test_a_character_the_checkpoint_lacks_is_one_line_naming_it_with_its_count(chars_run, tmp_path):
    text = write_lines(tmp_path / "new.txt", ["the", "zebra!"], lines=50)
    count = text.read_text().count("z")
    code, err = call("train", "--init-from", str(chars_run), "--data", f"text:{text}?tokenizer=chars",
                     "--out", str(tmp_path / "ft"), "--max-steps", "2", "--quiet")
    line = one_error_line(err)
    assert code == 2
    assert f"'z' ×{count}" in line and "'!'" in line and "'b'" in line and "no <unk>" in line, line
    assert "--init-from" in line and "replace or remove them" in line, line
    assert not (tmp_path / "ft").exists()  # a failed start leaves nothing behind


def test_text_read_with_another_tokenizer_than_the_checkpoints_says_which(chars_run, tmp_path):
    text = write_lines(tmp_path / "new.txt", ["the", "of"], lines=50)
    code, err = call("train", "--init-from", str(chars_run), "--data", f"text:{text}",
                     "--out", str(tmp_path / "ft"), "--max-steps", "2", "--quiet")
    line = one_error_line(err)
    assert code == 2 and "bytes vocabulary" in line and "same tokenizer" in line, line
    assert f"--data text:{text}?tokenizer=chars" in line, line


def test_unknown_words_read_as_unk_with_one_note_counting_them(tmp_path, corpus):
    run = train(tmp_path, corpus, "run", "words")
    text = write_lines(tmp_path / "new.txt", ["the", "of", "zebra", "The"], lines=200)
    count = text.read_text().split().count("zebra")
    capitalised = text.read_text().split().count("The")
    code, err = call("train", "--init-from", str(run), "--data", f"text:{text}?tokenizer=words",
                     "--out", str(tmp_path / "ft"), "--max-steps", "2", "--quiet")
    assert code == 0, err
    notes = [line for line in err.splitlines() if "read as <unk>" in line]
    assert len(notes) == 1 and f"'zebra' ×{count}" in notes[0] and f"{count + capitalised} occurrence" in notes[0], err
    assert f"{capitalised} of them are known in lower case" in notes[0], notes[0]
    assert vocab_of(tmp_path / "ft" / "last") == vocab_of(run / "last")
    code, err = call("eval", str(tmp_path / "ft"), "--device", "cpu", "--quiet")
    assert code == 0, err


def test_a_bytes_checkpoint_fine_tunes_on_any_text(tmp_path, corpus):
    run = train(tmp_path, corpus, "run", "bytes")
    text = write_lines(tmp_path / "new.txt", ["été", "ø", "the"], lines=100)
    code, err = call("train", "--init-from", str(run), "--data", f"text:{text}", "--out", str(tmp_path / "ft"),
                     "--max-steps", "2", "--quiet")
    assert code == 0 and "<unk>" not in err, err


def test_a_bpe_checkpoint_reads_new_text_with_its_own_merges(tmp_path, corpus):
    pytest.importorskip("tokenizers")
    run = train(tmp_path, corpus, "run", "bpe", "--data", f"text:{corpus}?tokenizer=bpe&vocab_size=300")
    text = write_lines(tmp_path / "new.txt", ["the", "of", "zebra", "attention"], lines=200)
    code, err = call("train", "--init-from", str(run), "--data", f"text:{text}?tokenizer=bpe&vocab_size=300",
                     "--out", str(tmp_path / "ft"), "--max-steps", "2", "--quiet")
    assert code == 0, err
    assert vocab_of(tmp_path / "ft" / "last") == vocab_of(run / "last")


def test_the_prepared_cache_keys_on_the_vocabulary_used(chars_run, tmp_path):
    subset = write_lines(tmp_path / "subset.txt", ["the", "of", "and"])
    spec = f"text:{subset}?tokenizer=chars"
    given = vocab_of(chars_run / "last")
    read_with_checkpoint = open_corpus(spec, vocab=given)
    own = open_corpus(spec)  # a later plain run on the same text
    assert read_with_checkpoint.vocab == given and own.vocab != given
    assert set(own.vocab.symbols) == set(subset.read_text())
    assert read_with_checkpoint.path != own.path
    assert open_corpus(spec, vocab=given).path == read_with_checkpoint.path  # and each is reused
    text = own.vocab.decode(own.split("train")[:50])
    assert given.decode(read_with_checkpoint.split("train")[:50]) == text


# ---------------------------------------------------------------------------------------------
# fingerprints hash content, not names


def train_records(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in ("step", "loss", "lr", "tokens") if k in r} for r in rows if r["split"] == "train"]


def test_a_renamed_and_moved_corpus_resumes_bit_exact(tmp_path):
    text = helpers.make_corpus(tmp_path / "corpus.txt", lines=400)
    run = train(tmp_path, text, "run", "chars")
    same = tmp_path / "same"
    shutil.copytree(run, same)
    code, err = call("train", "--resume", str(same), "--max-steps", "4", "--quiet")
    assert code == 0, err
    moved = tmp_path / "elsewhere" / "renamed.txt"
    moved.parent.mkdir()
    text.rename(moved)
    code, err = call("train", "--resume", str(run), "--data", f"text:{moved}?tokenizer=chars", "--max-steps", "4",
                     "--quiet")
    assert code == 0, err
    assert train_records(run) == train_records(same)  # the same losses, to the bit
    assert [r["step"] for r in train_records(run)] == [1, 2, 3, 4]


def test_a_corpus_with_changed_text_is_still_refused_in_one_line(tmp_path):
    text = helpers.make_corpus(tmp_path / "corpus.txt", lines=400)
    run = train(tmp_path, text, "run", "chars")
    body = text.read_text()
    text.write_text(body.replace("the", "eht", 1))  # the same characters and size, other text
    code, err = call("train", "--resume", str(run), "--max-steps", "4", "--quiet")
    line = one_error_line(err)
    assert code == 2 and "other text" in line and "different content" in line, line


LEGACY = Path(__file__).parent / "data" / "legacy_run"


def test_a_fingerprint_saved_in_the_old_path_hashing_form_still_matches_its_corpus(tmp_path):
    state = json.loads((LEGACY / "run" / "last" / "trainer_state.json").read_text())
    shutil.copy(LEGACY / "corpus.txt", tmp_path / "corpus.txt")
    corpus = open_corpus(f"text:{tmp_path / 'corpus.txt'}?tokenizer=chars")
    assert corpus.fingerprint != state["corpus_fingerprint"]  # today's form hashes no name
    assert fingerprint_matches(corpus, state["corpus_fingerprint"])
    (tmp_path / "corpus.txt").rename(tmp_path / "renamed.txt")
    renamed = open_corpus(f"text:{tmp_path / 'renamed.txt'}?tokenizer=chars")
    assert renamed.fingerprint == corpus.fingerprint
    # the old form hashed the name, so a renamed corpus cannot prove it holds the same text under it
    assert not fingerprint_matches(renamed, state["corpus_fingerprint"])


# ---------------------------------------------------------------------------------------------
# word-level prompts name what they read as <unk>

PTB_LIKE = Vocab("words", ["<unk>", "<eos>", "the", "company", "said", "that", "bob", "'s", "N"], eos="<eos>",
                 unk="<unk>")


def test_a_prompt_with_unknown_words_names_them_with_the_lower_case_spelling():
    prompt = "The Company said that Bob's"
    assert encode_prompt(PTB_LIKE, prompt) == [0, 0, 4, 5, 0]  # as before: the ids do not change
    notice = prompt_notice(PTB_LIKE, prompt)
    assert notice is not None and "3 words" in notice and "<unk>" in notice
    assert "'the' for 'The'" in notice and "'company' for 'Company'" in notice and "\"bob 's\" for \"Bob's\"" in notice
    assert prompt_notice(PTB_LIKE, "the company said") is None
    assert prompt_notice(Vocab("bytes"), "Anything at all") is None


def test_a_prompt_with_unknown_words_and_no_unk_is_one_error_naming_all_of_them():
    vocab = Vocab("words", ["<eos>", "the", "company"], eos="<eos>")
    with pytest.raises(DataError) as err:
        encode_prompt(vocab, "The zebra company")
    assert "'The', 'zebra'" in str(err.value) and "no <unk>" in str(err.value) and "'the' for 'The'" in str(err.value)


def test_txl_generate_warns_once_per_prompt_on_stderr(tmp_path, corpus):
    run = train(tmp_path, corpus, "run", "words")
    code, err = call("generate", str(run), "--prompt", "The memory Zebra", "--max-new-tokens", "3", "--seed", "1")
    assert code == 0, err
    warnings = [line for line in err.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and "'The', 'Zebra'" in warnings[0] and "'the' for 'The'" in warnings[0], err
    assert warnings[0].startswith("txl generate: warning: 2 words of the prompt are not in the vocabulary")


# ---------------------------------------------------------------------------------------------
# --init-from takes a checkpoint of the run's own family

SMALL = {"vocab_size": 40, "n_layer": 1, "d_model": 16, "n_head": 2, "d_head": 8, "d_inner": 32}


@pytest.mark.parametrize(("model", "what"), [
    ({"arch": "encoder-decoder", "n_encoder_layer": 1}, "a sequence-to-sequence model (model.arch='encoder-decoder')"),
    ({"arch": "rnn-seq2seq", "d_hidden": 16}, "a sequence-to-sequence model (model.arch='rnn-seq2seq')"),
    ({"arch": "style-transformer", "n_encoder_layer": 1, "n_discriminator_layer": 1, "max_length": 7},
     "a Style Transformer (model.arch='style-transformer')"),
    ({"arch": "decoder", "causal": False, "mem_len": 0, "pos_encoding": "rope"},
     "a bidirectional masked LM (model.arch='decoder')"),
], ids=["encoder-decoder", "rnn-seq2seq", "style-transformer", "masked-lm"])
def test_a_checkpoint_of_another_family_is_refused_before_its_vocabulary_is_read(tmp_path, corpus, model, what):
    """The encoder-decoder's pair vocabulary was read as a language model's ("not a txl vocabulary"), the masked
    LM's mask id was a shape mismatch blamed on its config.json."""
    from txl.models.registry import build_model, config_from_dict

    rnn = model["arch"] == "rnn-seq2seq"  # (no heads, no feed-forward)
    config = config_from_dict({k: v for k, v in {**SMALL, **model}.items()
                               if not rnn or k not in ("n_head", "d_head", "d_inner")})
    build_model(config).save_pretrained(tmp_path / "other")
    (tmp_path / "other" / "vocab.json").write_text("{}")  # never read: the family is told first
    config_file = helpers.write_config(tmp_path, corpus, steps=1, varlen="false")
    code, err = call("train", "--config", str(config_file), "--init-from", str(tmp_path / "other"), "--out",
                     str(tmp_path / "run"), "--quiet")  # (the model section is the checkpoint's)
    line = one_error_line(err)
    assert code == 2 and f"the checkpoint is {what} but this run trains a causal language model" in line, line
    assert not (tmp_path / "run").exists()
