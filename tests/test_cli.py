"""The command line: help texts and one-line errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from txl.cli.main import COMMANDS, main


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


@pytest.mark.slow
def test_console_script_and_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "txl", "--help"], capture_output=True, text=True, check=True)
    assert "import-hf" in out.stdout


@pytest.mark.slow
def test_user_error_is_one_line_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "txl", "import-hf", str(tmp_path / "missing"), str(tmp_path / "out")],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "not found" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_bare_txl_prints_help_and_starts_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([]) == 0
    assert "usage: txl" in capsys.readouterr().out
    assert not (tmp_path / "runs").exists()  # it used to start a demo training in ./runs


def test_version(capsys):
    from txl import __version__

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"txl {__version__}"


def _actions(parser, path):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _actions(sub, [*path, name])
        elif action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction):
            yield " ".join(path), action


def test_every_flag_of_every_command_has_help():
    from txl.cli.main import build_parser

    actions = list(_actions(build_parser(), ["txl"]))
    assert len(actions) > 100
    missing = [(where, a.option_strings or a.dest) for where, a in actions if not a.help]
    assert not missing
    internal = [(where, a.help) for where, a in actions if "issue" in a.help or "shared/data" in a.help]
    assert not internal


def test_bench_help_lists_every_benchmark_in_whole_sentences_and_each_shows_only_its_flags(capsys):
    from txl.cli.bench import BENCHES

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in [*BENCHES, "all"]:
        assert f" {name} " in text
    assert "issue" not in text and "against the same" not in text  # no cut-off first docstring lines
    with pytest.raises(SystemExit):
        main(["bench", "generate", "--help"])
    generate = capsys.readouterr().out
    assert "--context" in generate and "--mem-lens" not in generate and "--against" not in generate
    with pytest.raises(SystemExit):
        main(["bench", "eval", "--help"])
    evaluation = capsys.readouterr().out
    assert "--mem-lens" in evaluation and "--context" not in evaluation
