"""`txl train --nproc N`: the local launcher (txl.train.distributed.launch_local) starts N ranks as
`torchrun --standalone` does, but a mistake stays one line (torchrun's agent reported a failed rank with a
Python traceback of its own) and the other ranks' output is shown only when they failed differently."""

from __future__ import annotations

import subprocess
import sys
import tempfile

import pytest

from txl.train.distributed import _wait_for_ranks


class Done:
    """A finished rank: what subprocess.Popen looks like once the process has exited."""

    def __init__(self, code: int):
        self.returncode = code

    def poll(self):
        return self.returncode


def log_of(text: str):
    f = tempfile.TemporaryFile()  # noqa: SIM115 (read by the launcher, closed when collected)
    f.write(text.encode())
    return f


def test_a_rank_failing_like_rank_0_is_not_repeated(capsys):
    code = _wait_for_ranks([Done(2), Done(2)], [None, log_of("txl train: error: the same line\n")])
    assert code == 2 and capsys.readouterr().err == ""


def test_a_rank_failing_alone_is_shown_with_its_rank(capsys):
    code = _wait_for_ranks([Done(0), Done(134)], [None, log_of("before\nterminate called\n")])
    assert code == 134
    assert capsys.readouterr().err.splitlines() == ["rank 1: before", "rank 1: terminate called"]


def test_a_rank_killed_by_a_signal_is_reported_as_128_plus_it(capsys):
    assert _wait_for_ranks([Done(0), Done(-9)], [None, log_of("")]) == 137


@pytest.mark.slow
def test_a_data_mistake_under_nproc_2_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "txl", "train", "--nproc", "2", "--data", f"text:{tmp_path}/nope.txt",
                           "--out", str(tmp_path / "run"), "--quiet"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("txl train: error: ") and "nope.txt" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "run").exists()


