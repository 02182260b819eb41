"""The published PTB numbers on the real files in the shared data directory (skipped when absent)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from txl_data_fixtures import SHARED

from txl.cli.main import main
from txl.data.cache import sha256_file
from txl.data.fetch import SOURCES

PTB = SHARED / "ptb"
pytestmark = pytest.mark.skipif(not (PTB / "ptb.train.txt").is_file(), reason="shared PTB data not available")


def stats(capsys, spec: str) -> dict:
    assert main(["data", "stats", spec, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_ptb_word_published_counts(capsys):
    s = stats(capsys, f"ptb-word:{PTB}")
    assert s["tokens"] == {"train": 929_589, "valid": 73_760, "test": 82_430}
    assert s["vocab_size"] == 10_000 and s["metric"] == "ppl"


def test_ptb_char_counts(capsys):
    s = stats(capsys, f"ptb-char:{PTB}")
    # 49 symbols (a-z, digits, punctuation, '_', the letters of <unk>) + <eos>; one <eos> per line,
    # the train file's final unterminated line (" ") included, as the reference's `for line in f` reads it.
    assert s["tokens"] == {"train": 5_017_483, "valid": 393_043, "test": 442_424}
    assert s["vocab_size"] == 50 and s["metric"] == "bpc"


@pytest.mark.slow
def test_preparing_ptb_char_peak_rss_under_500_mb(tmp_path):
    code = (
        "import sys; from txl.data import open_corpus; "
        f"c = open_corpus('ptb-char:{PTB}', cache_dir=sys.argv[1]); "
        # VmHWM, not ru_maxrss: the kernel carries the forking pytest worker's high-water mark over at exec,
        # and a worker that has run other tests is past 500 MB on its own
        "print(next(line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM:')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "c")],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    peak_mb = int(out.stdout.strip()) / 1024  # kB
    assert peak_mb < 500, f"peak RSS {peak_mb:.0f} MB"


def test_ptb_download_pins_match_the_local_files():
    for member in SOURCES["ptb"].members:
        path = PTB / member.dest
        assert path.stat().st_size == member.size
        assert sha256_file(path) == member.sha256
