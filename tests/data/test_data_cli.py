"""`txl data ...`: bad inputs end in one line and exit 2; good ones print tables or JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from txl_data_fixtures import make_ptb

from txl.cli.main import main
from txl.data import Vocab


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["data", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    """The error is one line, the last one; before it at most `prepare` progress lines."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err
    errors = [line for line in lines if "error" in line]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    assert errors[0].startswith("txl data: error: ")
    return errors[0]


def test_bad_inputs_each_end_in_one_line_and_exit_2(tmp_path, capsys):
    root = make_ptb(tmp_path / "ptb")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    (tmp_path / "empty.txt").write_bytes(b"")
    bad = tmp_path / "bad"
    make_ptb(bad)
    (bad / "ptb.train.txt").write_bytes(b"fine words\nbad \xfe byte\n")
    vocab_file = tmp_path / "other_vocab.json"
    Vocab("bytes").save(vocab_file)
    cases = [
        (["stats", f"ptb-word:{tmp_path / 'missing'}"], "path not found"),
        (["stats", f"text:{tmp_path / 'empty.txt'}"], "empty corpus"),
        (["stats", f"ptb-word:{empty_dir}"], "lacks ptb.train.txt, ptb.valid.txt, ptb.test.txt"),
        (["prepare", f"ptb-word:{bad}"], "ptb.train.txt: invalid UTF-8 at byte offset 15"),
        (["stats", f"ptb-word:{root}", "--vocab-size", "10000"], "checkpoint has 10000 ids"),
        (["stats", f"ptb-word:{root}", "--vocab", str(vocab_file)], "vocabulary mismatch"),
        (["stats", "wt3:foo"], "unknown corpus 'wt3'"),
        (["prepare", "text:x?tokenizer=nope"], "not one of bytes, chars, words, bpe"),
        (["download", "imagenet", "--dest", str(tmp_path / "d")], "no download for 'imagenet'"),
    ]
    for argv, expected in cases:
        code, _out, err = run_cli(capsys, *argv)
        assert code == 2, argv
        assert expected in one_error_line(err), (argv, err)
    assert not any((tmp_path / "cache" / "corpora").glob(".*tmp*"))  # nothing half-written


def test_stats_json_table_and_list(tmp_path, capsys):
    root = make_ptb(tmp_path / "ptb")
    code, out, err = run_cli(capsys, "prepare", f"ptb-word:{root}")
    assert code == 0 and "prepared in" in err and "train" in out
    code, out, err = run_cli(capsys, "stats", f"ptb-word:{root}", "--json")
    stats = json.loads(out)
    assert code == 0 and err == ""
    assert set(stats["tokens"]) == {"train", "valid", "test"} and stats["metric"] == "ppl"
    code, out, _ = run_cli(capsys, "stats", f"ptb-word:{root}", "--vocab-size", str(stats["vocab_size"]))
    assert code == 0 and f"{stats['tokens']['train']:,} tokens" in out
    code, out, _ = run_cli(capsys, "list")
    assert code == 0 and "ptb-word" in out and "builtin" in out
    code, out, _ = run_cli(capsys, "list", "--json")
    assert "lm1b" in json.loads(out)


@pytest.mark.slow
def test_subprocess_exit_code_and_fast_import(tmp_path):
    env = {**os.environ, "TXL_CACHE_DIR": str(tmp_path / "c")}
    proc = subprocess.run(
        [sys.executable, "-m", "txl", "data", "stats", f"ptb-char:{tmp_path / 'nope'}"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and "path not found" in proc.stderr
    check = "import sys, txl.cli.data, txl.data; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False"
