"""A run directory written by the commit before issue 44 (b278d1b) resumes with today's code and goes on
exactly as the old code's uninterrupted run did (issue 44, "a run started before the change resumes after it").

The fixture (tests/data/legacy_run/, made by its make.sh) is a tiny decoder with a kernel option in the old
flat config shape (attention = "sliding", sliding_window = 6), dropout, an EMA of the weights, varlen and
roll, stopped at step 4 of 8 with its `last/` checkpoint; expected_metrics.jsonl holds the records of the
same run left to reach step 8 with the old code. The resume reads every file of the old formats (run.json's
flat model section, config.json, trainer_state.json, the optimiser, RNG and EMA tensors), so equality here is
bitwise: every train loss, learning rate and token count, and the validations of live and averaged weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import helpers
from helpers import finish, txl

pytestmark = pytest.mark.slow
cache_dir = helpers.cache_dir  # fixture: the subprocess's prepared-corpus cache

FIXTURE = Path(__file__).parent / "data" / "legacy_run"
SAME = ("split", "step", "loss", "lr", "tokens")  # what a resumed run must reproduce (not the timings)


def records(path: Path) -> list[dict]:
    return [{k: r[k] for k in SAME if k in r} for r in map(json.loads, path.read_text().splitlines())]


def test_a_run_written_before_issue_44_resumes_bitwise(tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "legacy")
    work = tmp_path / "legacy"
    # run.json records the corpus relative to the fixture directory, as a user would have typed it there
    code, log = finish(txl("train", "--resume", "run", "--max-steps", "8", "--quiet", cwd=work,
                           env={"OMP_NUM_THREADS": "1"}))
    assert code == 0, log
    resumed, expected = records(work / "run" / "metrics.jsonl"), records(work / "expected_metrics.jsonl")
    assert [r["step"] for r in resumed if r["split"] == "train"] == list(range(1, 9))
    assert resumed == expected, [(a, b) for a, b in zip(resumed, expected) if a != b][:3]
    state = json.loads((work / "run" / "last" / "trainer_state.json").read_text())
    assert state["step"] == 8
