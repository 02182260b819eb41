"""User journeys, end to end, the way a new user runs them: from a working directory that is not the
project root, on every corpus kind (bytes, chars, words, BPE, PTB characters, PTB words), with each
preset that fits, with `--data` pointing elsewhere: train, eval, eval of a new file with the run's
vocabulary, generate, resume, fine-tune with `--init-from`, plot. Every step must exit 0, and every
run must leave result.json (issue 16).

Models are shrunk with --set so each command takes a second; the presets still decide the corpus
name, the sample prompt, the final splits and the schedule, which is what these journeys exercise.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from txl.cli import main

SMALL = ["--set", "model.n_layer=1", "--set", "model.d_model=32", "--set", "model.n_head=2", "--set", "model.d_head=16",
         "--set", "model.d_inner=64", "--set", "model.mem_len=16", "--set", "tgt_len=16", "--set", "eval_tgt_len=16",
         "--set", "batch_size=4", "--set", "eval_batch_size=2", "--set", "eval_max_tokens=300", "--set", "max_steps=3",
         "--set", "eval_interval=3", "--set", "log_interval=1", "--set", "max_minutes=0", "--set", "sample_tokens=12",
         "--set", "warmup_steps=0", "--quiet"]

WORDS = ["memory", "segment", "attention", "relative", "position", "token", "layer", "the", "of", "and", "model"]


def _lines(count: int, seed: int, rare: int = 0) -> list[str]:
    """Lines of words; `rare` adds that many distinct rare words (a vocabulary above adaptive cutoffs)."""
    rng = random.Random(seed)
    words = WORDS + [f"w{i}" for i in range(rare)]
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))) for _ in range(count)]
    if rare:
        lines += [" ".join(words[len(WORDS) + i : len(WORDS) + i + 10]) for i in range(0, rare, 10)]
        rng.shuffle(lines)
    return lines


def _ptb_char(line: str) -> str:
    return " ".join("_" if c == " " else c for c in line)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> Path:
    """Corpora of every kind, in a directory of their own (not the working directory of the runs)."""
    root = tmp_path_factory.mktemp("corpora")
    (root / "plain.txt").write_text("\n".join(_lines(700, 0)) + "\n")
    ptb = root / "ptb"
    ptb.mkdir()
    for split, count, seed in (("train", 600, 1), ("valid", 80, 2), ("test", 80, 3)):
        lines = _lines(count, seed, rare=2100 if split == "train" else 0)  # ptb-word-small's cutoff is 2000
        (ptb / f"ptb.{split}.txt").write_text("".join(f" {line} \n" for line in lines))
        (ptb / f"ptb.char.{split}.txt").write_text("".join(_ptb_char(line) + "\n" for line in lines[:400]))
    (root / "new.txt").write_text("the memory of the model\nattention and position\n")
    (root / "new-ptb-char.txt").write_text(_ptb_char("the memory of the model") + "\n")
    return root


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """A fresh working directory away from the project and the corpora, with its own cache."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("TXL_CACHE_DIR", str(tmp_path / "cache"))
    return work


def txl(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def ok(capsys, *args) -> str:
    code, out, err = txl(capsys, *args)
    assert code == 0, f"txl {' '.join(map(str, args))} exited {code}: {err[-2000:]}"
    return out


# kind -> (data spec relative to the corpora directory, new-text file, presets that fit)
KINDS = {
    "bytes": ("text:{root}/plain.txt", "new.txt", ["tiny"]),
    "chars": ("text:{root}/plain.txt?tokenizer=chars", "new.txt", ["tiny", "ptb-char-small"]),
    "words": ("text:{root}/plain.txt?tokenizer=words", "new.txt", ["tiny"]),
    "bpe": ("text:{root}/plain.txt?tokenizer=bpe&vocab_size=300", "new.txt", ["tiny"]),
    "ptb-char": ("ptb-char:{root}/ptb", "new-ptb-char.txt", ["tiny", "ptb-char-small", "arena-ptb-char"]),
    "ptb-word": ("ptb-word:{root}/ptb", "new.txt", ["tiny", "ptb-word-small"]),
}
JOURNEYS = [(kind, preset) for kind, (_, _, presets) in KINDS.items() for preset in presets]


@pytest.mark.parametrize(("kind", "preset"), JOURNEYS, ids=[f"{k}-{p}" for k, p in JOURNEYS])
def test_journey(kind, preset, corpora, workdir, capsys, tmp_path, monkeypatch):
    spec_template, new_file, _ = KINDS[kind]
    # --data relative to the working directory, the way a user types it; the run must store it absolute
    relative = Path("..") / Path(shutil.copytree(corpora, tmp_path / "data")).relative_to(tmp_path)
    spec = spec_template.format(root=relative)
    ok(capsys, "train", "--preset", preset, "--data", spec, "--out", "run", *SMALL)
    result = json.loads((workdir / "run" / "result.json").read_text())
    assert result["steps"] == 3 and result["sample"] and result["sample_ids"]
    assert result["sample"].encode("utf-8")  # valid UTF-8, whatever bytes the model produced
    assert json.loads((workdir / "run" / "run.json").read_text())["data_as_typed"] == spec

    elsewhere = tmp_path / "elsewhere"  # every later command from another directory
    elsewhere.mkdir()
    run = workdir / "run"
    monkeypatch.chdir(elsewhere)
    out = ok(capsys, "eval", run, "--json", "--max-tokens", 200, "--batch-size", 2)
    assert json.loads(out)["tokens"] > 0
    out = ok(capsys, "eval", run, "--text", corpora / new_file, "--json")
    scored = json.loads(out)
    assert scored["split"] == "all" and scored["tokens"] > 0
    ok(capsys, "generate", run, "--prompt", "", "--max-new-tokens", 8, "--seed", 0)
    ok(capsys, "generate", run, "--max-new-tokens", 8, "--seed", 0, "--num-samples", 2, "--json")
    ok(capsys, "train", "--resume", run, "--max-steps", 5)
    assert json.loads((run / "result.json").read_text())["steps"] == 5
    ok(capsys, "train", "--init-from", run, "--preset", preset, "--data", spec_template.format(root=corpora),
       "--out", "tuned", *SMALL)
    tuned = json.loads((elsewhere / "tuned" / "run.json").read_text())
    assert tuned["init_from"] and (elsewhere / "tuned" / "result.json").is_file()
    ok(capsys, "plot", run, elsewhere / "tuned", "--out", "curves.png")
    assert (elsewhere / "curves.png").stat().st_size > 0


def test_tiny_on_ptb_char_exits_zero_with_result_and_sample(corpora, workdir, capsys):
    """Before: exit 2 after training, "word 'def' is not in the vocabulary" (tiny's prompt was Python)."""
    ok(capsys, "train", "--preset", "tiny", "--data", f"ptb-char:{corpora / 'ptb'}", "--max-steps", 20, "--out", "run",
       "--set", "eval_max_tokens=300", "--set", "sample_tokens=20", "--set", "max_minutes=0", "--quiet")
    result = json.loads((workdir / "run" / "result.json").read_text())
    assert result["steps"] == 20 and result["sample"] and (workdir / "run" / "sample.txt").is_file()
    assert result["best_valid_loss_nats"] > 0 and result["best_valid_bpc"] > 0


def test_a_preset_corpus_that_is_not_downloaded_names_the_fix_and_leaves_nothing(corpora, workdir, capsys, tmp_path):
    """Before: presets named ../shared/data/ptb, so they failed outside the project root and left an empty run."""
    code, _, err = txl(capsys, "train", "--preset", "ptb-char-small", "--out", "run", *SMALL)
    assert code == 2 and "txl data download ptb" in err and "--data ptb-char:DIR" in err
    assert not (workdir / "run").exists()
    shutil.copytree(corpora / "ptb", tmp_path / "cache" / "downloads" / "ptb")  # where `txl data download` puts it
    ok(capsys, "train", "--preset", "ptb-char-small", "--out", "run", *SMALL)
    assert (workdir / "run" / "result.json").is_file()


def test_presets_name_corpora_not_paths():
    from txl.run_config import load_preset, preset_names

    for name in preset_names():
        data = load_preset(name)["train"].get("data", "")
        assert ".." not in data and "/" not in data, f"preset {name} names a path: {data}"
        assert "sample_prompt" not in load_preset(name)["train"], f"preset {name} carries a corpus-specific prompt"
