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

from txl.cli.main import main

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
@pytest.mark.slow
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
    ok(capsys, "train", "--resume", "tuned", "--max-steps", 4)
    tuned = json.loads((elsewhere / "tuned" / "run.json").read_text())
    assert tuned["init_from"] and (elsewhere / "tuned" / "result.json").is_file()
    ok(capsys, "plot", run, elsewhere / "tuned", "--out", "curves.png")
    assert (elsewhere / "curves.png").stat().st_size > 0


@pytest.mark.slow
def test_tiny_on_ptb_char_exits_zero_with_result_and_sample(corpora, workdir, capsys):
    """Before: exit 2 after training, "word 'def' is not in the vocabulary" (tiny's prompt was Python)."""
    ok(capsys, "train", "--preset", "tiny", "--data", f"ptb-char:{corpora / 'ptb'}", "--max-steps", 20, "--out", "run",
       "--set", "eval_max_tokens=300", "--set", "sample_tokens=20", "--set", "max_minutes=0", "--quiet")
    result = json.loads((workdir / "run" / "result.json").read_text())
    assert result["steps"] == 20 and result["sample"] and (workdir / "run" / "sample.txt").is_file()
    assert result["best_valid_loss_nats"] > 0 and result["best_valid_bpc"] > 0


@pytest.mark.parametrize("preset", ["tiny", "ptb-word-small"])
def test_presets_on_a_corpus_their_old_prompts_could_not_encode(preset, workdir, capsys):
    """Before: tiny's prompt "def " and ptb-word-small's "the company said" failed after training on a DNA
    file of characters (no result.json)."""
    rng = random.Random(0)
    (workdir / "dna.txt").write_text("".join("".join(rng.choice("ACGT") for _ in range(60)) + "\n" for _ in range(300)))
    model = ["--set", "model.cutoffs=[]"] if preset == "ptb-word-small" else []  # 4 symbols: no adaptive softmax
    ok(capsys, "train", "--preset", preset, "--data", "text:dna.txt?tokenizer=chars", "--out", "run", *SMALL, *model)
    result = json.loads((workdir / "run" / "result.json").read_text())
    assert set(result["sample"]) <= set("ACGT\n")


def test_a_preset_corpus_that_is_not_downloaded_names_the_fix_and_leaves_nothing(corpora, workdir, capsys, tmp_path):
    """Before: presets named ../shared/data/ptb, so they failed outside the project root and left an empty run."""
    code, _, err = txl(capsys, "train", "--preset", "ptb-char-small", "--out", "run", *SMALL)
    assert code == 2 and "txl data download ptb" in err and "--data ptb-char:DIR" in err
    assert not (workdir / "run").exists()
    shutil.copytree(corpora / "ptb", tmp_path / "cache" / "downloads" / "ptb")  # where `txl data download` puts it
    ok(capsys, "train", "--preset", "ptb-char-small", "--out", "run", *SMALL)
    assert (workdir / "run" / "result.json").is_file()


def test_presets_name_corpora_not_paths():
    from txl.train.config import load_preset, preset_names

    for name in preset_names():
        data = load_preset(name)["train"].get("data", "")
        assert ".." not in data and "/" not in data, f"preset {name} names a path: {data}"
        assert "sample_prompt" not in load_preset(name)["train"], f"preset {name} carries a corpus-specific prompt"


# ---------------------------------------------------------------------------------------------
# The defects of issue 16, one test each (each failed before the fix)


def test_a_sample_prompt_the_corpus_cannot_encode_stops_before_training(corpora, workdir, capsys):
    """Before: the run trained, then failed at the sample (or the word silently became <unk>)."""
    for spec, prompt, word in ((f"text:{corpora / 'plain.txt'}?tokenizer=words", "the zebra", "'zebra'"),
                               (f"text:{corpora / 'plain.txt'}?tokenizer=chars", "déf", "'é'")):
        code, _, err = txl(capsys, "train", "--data", spec, "--out", "run", *SMALL, "--set", f"sample_prompt={prompt}")
        assert code == 2 and "sample_prompt" in err and word in err and len(err.strip().splitlines()) == 1, err
        assert not (workdir / "run").exists()


def test_a_text_folder_with_only_train_trains_without_validation(corpora, workdir, capsys, tmp_path):
    """Before: "text has no split 'valid'" after training, and no checkpoint."""
    folder = tmp_path / "own"
    folder.mkdir()
    shutil.copy(corpora / "plain.txt", folder / "train.txt")
    code, out, err = txl(capsys, "train", "--data", f"text:{folder}", "--out", "run", *SMALL)
    assert code == 0, err
    assert "no valid split" in err and "validation is off" in err
    result = json.loads((workdir / "run" / "result.json").read_text())
    assert result["final"] == {} and result["best_valid_loss_nats"] is None and result["sample"]
    assert (workdir / "run" / "last" / "model.safetensors").is_file()
    ok(capsys, "eval", "run", "--text", corpora / "new.txt")


def test_set_flags_are_applied_together_in_any_order():
    """Before: `--set attention=performer --set pos_encoding=rope` failed; the reverse order worked."""
    from txl.train.config import build_run_config

    for sets in (["attention=performer", "pos_encoding=rope"], ["pos_encoding=rope", "attention=performer"]):
        run = build_run_config(preset="tiny", sets=sets)
        assert run.model["attention"] == "performer" and run.model["pos_encoding"] == "rope"


def test_resume_refuses_out_and_accepts_the_corpus_moved(corpora, workdir, capsys, tmp_path):
    """Before: --resume silently ignored --out, and refused --data, so a moved corpus ended the run."""
    data = tmp_path / "data"
    shutil.copytree(corpora / "ptb", data)
    ok(capsys, "train", "--preset", "tiny", "--data", f"ptb-char:{data}", "--out", "run", *SMALL)
    code, _, err = txl(capsys, "train", "--resume", "run", "--out", "other", "--max-steps", 5)
    assert code == 2 and "drop --out" in err and "--init-from" in err and not (workdir / "other").exists()
    data.rename(tmp_path / "moved")
    code, _, err = txl(capsys, "train", "--resume", "run", "--max-steps", 5)
    assert code == 2 and "not found" in err
    ok(capsys, "train", "--resume", "run", "--max-steps", 5, "--data", f"ptb-char:{tmp_path / 'moved'}")
    assert json.loads((workdir / "run" / "result.json").read_text())["steps"] == 5
    code, _, err = txl(capsys, "train", "--resume", "run", "--max-steps", 7, "--data",
                       f"text:{corpora / 'plain.txt'}")  # another corpus: the fingerprints differ
    assert code == 2 and "different vocabulary" in err
    edited = tmp_path / "edited"
    shutil.copytree(tmp_path / "moved", edited)
    train = edited / "ptb.char.train.txt"
    lines = train.read_text().splitlines(keepends=True)
    train.write_text("".join(lines[:-100] + lines[:-101:-1]))  # the same counts of the same symbols, other text
    code, _, err = txl(capsys, "train", "--resume", "run", "--max-steps", 7, "--data", f"ptb-char:{edited}")
    assert code == 2 and "other text" in err


def test_a_longer_schedule_on_resume_is_stated(corpora, workdir, capsys):
    ok(capsys, "train", "--data", f"text:{corpora / 'plain.txt'}", "--out", "run", *SMALL)
    code, _, err = txl(capsys, "train", "--resume", "run", "--max-steps", 6)
    assert code == 0 and "max_steps 3 -> 6" in err and "cosine schedule now ends at step 6" in err
    code, _, err = txl(capsys, "train", "--resume", "run", "--max-steps", 4)
    assert code == 2 and "not beyond the run's step 6" in err


def test_fine_tuning_needs_the_same_vocabulary_and_says_how_it_differs(corpora, workdir, capsys):
    ok(capsys, "train", "--data", f"text:{corpora / 'plain.txt'}?tokenizer=chars", "--out", "run", *SMALL)
    (workdir / "other.txt").write_text("zzz qqq\n" * 200)
    code, _, err = txl(capsys, "train", "--init-from", "run", "--data", "text:other.txt?tokenizer=chars",
                       "--out", "tuned", *SMALL)
    assert code == 2 and "--init-from run" in err and "chars vocabulary has" in err and "lacks" in err
    assert not (workdir / "tuned").exists()
    ok(capsys, "train", "--init-from", "run", "--data", f"text:{corpora / 'plain.txt'}?tokenizer=chars",
       "--out", "tuned", *SMALL, "--set", "lr=1e-4")
    from txl import TransformerXL

    assert TransformerXL.from_pretrained(workdir / "tuned").config.d_model == 32  # the checkpoint's shape


def test_eval_of_new_text_uses_the_runs_vocabulary_and_names_unknown_symbols(corpora, workdir, capsys):
    """Before: the vocabulary was rebuilt from the new file, so chars/words/BPE runs refused it."""
    ok(capsys, "train", "--data", f"text:{corpora / 'plain.txt'}?tokenizer=chars", "--out", "chars", *SMALL)
    (workdir / "odd.txt").write_text("the model\nthe mødel\n")
    code, _, err = txl(capsys, "eval", "chars", "--text", "odd.txt")
    assert code == 2 and "'ø'" in err and "position 15" in err
    ok(capsys, "eval", "chars", "--data", f"text:{corpora / 'new.txt'}?tokenizer=chars", "--split", "all")
    code, _, err = txl(capsys, "eval", "chars", "--split", "all")
    assert code == 2 and "--text FILE" in err
    ok(capsys, "train", "--data", f"text:{corpora / 'plain.txt'}?tokenizer=words", "--out", "words", *SMALL)
    out = ok(capsys, "eval", "words", "--text", "odd.txt", "--json")  # "mødel" is <unk>: the vocabulary has one
    assert json.loads(out)["tokens"] == 5


def test_from_pretrained_accepts_a_run_folder(corpora, workdir, capsys):
    """Before: a CheckpointError, though every CLI command accepts a run folder."""
    from txl import TransformerXL

    ok(capsys, "train", "--data", f"text:{corpora / 'plain.txt'}", "--out", "run", *SMALL)
    model = TransformerXL.from_pretrained("run")
    best = TransformerXL.from_pretrained(workdir / "run" / "best")
    assert all((a == b).all() for a, b in zip(model.state_dict().values(), best.state_dict().values()))
    shutil.rmtree(workdir / "run" / "best")
    assert TransformerXL.from_pretrained("run").config.d_model == 32  # last, when there is no best


def test_the_end_of_a_run_says_where_everything_went_and_what_to_run_next(corpora, workdir, capsys):
    out = ok(capsys, "train", "--data", f"text:{corpora / 'plain.txt'}", "--out", "run", *SMALL)
    for text in ("result.json", "txl eval run", "txl generate run", "txl plot run", "txl train --resume run"):
        assert text in out
    result = json.loads((workdir / "run" / "result.json").read_text())
    assert {"best_valid_loss_nats", "best_valid_bpc", "data", "sample", "sample_ids"} <= set(result)
    assert "best_valid" not in result  # a bare name without its unit


def test_outputs_for_people_escape_control_bytes_and_keep_json_utf8():
    """Before: the end-of-run sample printed raw control bytes to the terminal and result.json held lone
    surrogates (`json.load(...)["sample"].encode()` failed)."""
    from txl.data import Vocab
    from txl.data.display import json_text, terminal_text

    text = Vocab("bytes").decode(list(b"ok\x1b[2J\x07\xff\xfe\n\tend"))
    assert terminal_text(text) == "ok\\x1b[2J\\x07\\xff\\xfe\n\tend"
    assert json_text(text) == "ok\x1b[2J\x07\\xff\\xfe\n\tend" and json.loads(json.dumps(json_text(text))).encode()


def test_plain_log_lines_without_carriage_returns(corpora, workdir, capsys):
    code, out, err = txl(capsys, "train", "--data", f"text:{corpora / 'plain.txt'}", "--out", "run",
                         *[a for a in SMALL if a != "--quiet"], "--set", "final_splits=[\"valid\",\"test\"]")
    assert code == 0 and "\r" not in err and "\r" not in out and "step 3" in err


def test_plot_one_point_series_one_colour_per_run_and_bpc_ppl_panels(corpora, workdir, capsys):
    """Before: a one-point series was invisible, a ppl run next to a bpc run was dropped without notice,
    and one run had different colours in different panels."""
    from txl.cli.plot import draw_runs

    ok(capsys, "train", "--data", f"text:{corpora / 'plain.txt'}", "--out", "bpc", *SMALL)
    ok(capsys, "train", "--data", f"text:{corpora / 'plain.txt'}?tokenizer=words", "--out", "ppl", *SMALL)
    notes: list[str] = []
    fig = draw_runs(["bpc", "ppl"], notes=notes)
    axes = {ax.get_ylabel(): ax for ax in fig.axes if ax.get_visible()}
    assert {"bpc", "ppl"} <= set(axes) and notes and "own panel" in notes[0]
    assert {line.get_label().split()[0] for line in axes["bpc"].lines} == {"bpc"}
    assert {line.get_label().split()[0] for line in axes["ppl"].lines} == {"ppl"}
    colours: dict[str, set] = {}
    for ax in fig.axes:
        for line in ax.lines:
            colours.setdefault(line.get_label().split()[0], set()).add(line.get_color())
            if len(line.get_xdata()) == 1:
                assert line.get_marker() not in (None, "None", "")  # a single point is visible
    assert all(len(c) == 1 for c in colours.values()) and colours["bpc"] != colours["ppl"]
    code, _, err = txl(capsys, "plot", "bpc", "ppl", "--out", "both.png")
    assert code == 0 and "note:" in err and (workdir / "both.png").is_file()


@pytest.mark.parametrize("attention", ["full", "sliding"])
def test_memory_tokens_train_evaluate_generate_and_resume(attention, corpora, workdir, capsys):
    """`--set model.memory_tokens=4`: the learned tokens train, are saved with the checkpoint and are
    used by eval, generate (token by token with the memory) and an exact resume."""
    data = f"text:{corpora / 'plain.txt'}?tokenizer=chars"
    ok(capsys, "train", "--preset", "tiny", "--data", data, "--out", "run", *SMALL, "--set", "model.memory_tokens=4",
       "--set", f"model.attention={attention}", "--set", "model.sliding_window=8")
    config = json.loads((workdir / "run" / "best" / "config.json").read_text())
    assert (config["memory_tokens"], config["attention"]) == (4, attention)
    assert json.loads(ok(capsys, "eval", "run", "--json", "--max-tokens", 200))["tokens"] > 0
    ok(capsys, "generate", "run", "--prompt", "the", "--max-new-tokens", 8, "--seed", 0)
    ok(capsys, "train", "--resume", "run", "--max-steps", 5)
    assert json.loads((workdir / "run" / "result.json").read_text())["steps"] == 5
