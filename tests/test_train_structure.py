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
