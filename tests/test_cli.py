"""The command line: help texts and one-line errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from txl.cli import COMMANDS, main


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for name in COMMANDS:
        assert name in text


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as info:
        main([name, "--help"])
    assert info.value.code == 0
    assert "usage: txl " + name in capsys.readouterr().out


def test_console_script_and_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "txl", "--help"], capture_output=True, text=True, check=True)
    assert "import-hf" in out.stdout


def test_user_error_is_one_line_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "txl", "import-hf", str(tmp_path / "missing"), str(tmp_path / "out")],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "not found" in proc.stderr
    assert not (tmp_path / "out").exists()
