"""The training package's structure (issue 44): one run-directory lock per `txl train`, the objective a
run trains for chosen once, and train/ importing only the packages below it."""

from __future__ import annotations

import ast
import contextlib
import io
import shutil
from pathlib import Path

import pytest

import helpers
from txl.io.rundir import LOCK_NAME, RunLock
from txl.train.objectives import (
    LanguageModelling,
    MaskedLanguageModelling,
    SequenceToSequence,
    objective_class,
)

cache_dir = helpers.cache_dir  # fixture
TRAIN = Path(__file__).parents[1] / "src" / "txl" / "train"
FIXTURE = Path(__file__).parent / "data" / "legacy_run"


def count_locks(monkeypatch) -> list[Path]:
    taken = []
    real = RunLock.acquire.__func__

    def acquire(cls, directory, **kwargs):
        taken.append(Path(directory))
        return real(cls, directory, **kwargs)

    monkeypatch.setattr(RunLock, "acquire", classmethod(acquire))
    return taken


def call_txl(*argv: str) -> int:
    from txl.cli.main import main

    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        return main(list(argv))


def test_txl_train_locks_its_run_directory_once(tmp_path, monkeypatch):
    shutil.copytree(FIXTURE, tmp_path / "work")
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    taken = count_locks(monkeypatch)
    assert call_txl("train", "--config", "config.toml", "--out", "new", "--max-steps", "1", "--quiet") == 0
    assert taken == [Path("new")]
    taken.clear()
    assert call_txl("train", "--resume", "run", "--max-steps", "5", "--quiet") == 0
    assert taken == [Path("run")]
    assert not (Path("run") / LOCK_NAME).exists() and not (Path("new") / LOCK_NAME).exists()  # released


def test_the_objective_follows_the_corpus_and_the_configured_objective():
    class Cfg:
        objective = "lm"

    assert objective_class(Cfg, "text:corpus.txt?tokenizer=chars") is LanguageModelling
    Cfg.objective = "mlm"
    assert objective_class(Cfg, "text:corpus.txt?tokenizer=chars") is MaskedLanguageModelling
    assert objective_class(Cfg, "reverse") is SequenceToSequence  # a pair corpus, whatever train.objective says


def imported_packages(path: Path) -> set[str]:
    """txl packages a module imports at any depth, function-level imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
            [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        found.update(n.split(".")[1] for n in names if n.startswith("txl.") and n.count(".") >= 1)
    return found


@pytest.mark.parametrize("module", sorted(p.name for p in TRAIN.glob("*.py")))
def test_train_imports_only_the_packages_below_it(module):
    allowed = {"train", "eval", "models", "generate", "fast", "nn", "data", "io", "errors", "allocator"}
    assert imported_packages(TRAIN / module) <= allowed, imported_packages(TRAIN / module) - allowed


@pytest.mark.parametrize("objective", [LanguageModelling, SequenceToSequence])
@pytest.mark.parametrize("splits", [("train", "valid", "test"), ("train", "valid"), ("train",)])
def test_the_printed_next_commands_name_only_splits_the_corpus_has(objective, splits):
    """`txl train`'s closing hint: `--split test` only when the corpus has a test split (it failed as printed)."""
    corpus = type("Corpus", (), {"splits": splits})()
    step = objective.__new__(objective)
    step.corpus = corpus
    lines = " ".join(command + " " + what for command, what in step.next_commands("runs/x"))
    assert ("--split test" in lines) == ("test" in splits)


@pytest.mark.parametrize(("eval_max", "final_max", "expected"), [(0, None, 0), (10, None, 2), (0, 4, 1), (10, 0, 0),
                                                                 (1, None, 1)])
def test_a_seq2seq_runs_final_decoding_follows_the_final_scores_cap(monkeypatch, eval_max, final_max, expected):
    """The decoded pairs are bounded like the final scores (final_max_tokens, else eval_max_tokens): a
    2-step run decoded its whole test split, for minutes."""
    import txl.eval.seq2seq as decoding

    seen = []

    class Result:
        def to_dict(self):
            return {}

    monkeypatch.setattr(decoding, "decode_split", lambda *a, max_pairs=0, **k: seen.append(max_pairs) or Result())
    step = SequenceToSequence.__new__(SequenceToSequence)
    step.cfg = type("Cfg", (), {"eval_max_tokens": eval_max, "final_max_tokens": final_max, "length_penalty": 0.6,
                                "eval_batch_size": 8, "beam_size": 1})()
    step.dist = type("Dist", (), {"device": "cpu"})()
    step.corpus = type("Corpus", (), {"pairs": lambda self, split: [([1], [1, 2, 3, 4])] * 5})()
    step.final_extras(None, "test")
    assert seen == [expected]
