"""The `txl` command line: one entry point, one subcommand per job.

Each subcommand is one module of `txl.cli` (named in COMMANDS) with two functions: `configure(parser)`
declares its arguments and `run(args) -> int` carries it out. A module is imported only when its
subcommand runs, so `txl --help` stays fast. User errors (`TxlError`) print one line and exit non-zero;
`--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import traceback
from collections.abc import Callable, Sequence

# name -> (help, the module under txl.cli that declares it). Every command module has the same two
# functions: `configure(parser)` declares its arguments, `run(args) -> int` carries it out.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train a model (no flags: the demo, preset tiny on the built-in corpus, into runs/)", "train"),
    "data": ("corpora: list, download, prepare (tokenize once into memory-mapped arrays), stats", "data"),
    "eval": ("score a checkpoint on a split (bpc/ppl) with long memory, the vanilla baseline, or a memory sweep",
             "eval"),
    "generate": ("continue a prompt with a checkpoint, reusing memory; streams text to stdout", "generate"),
    "recl": ("relative effective context length of a group of checkpoints (Dai et al. 2019, appendix C)", "recl"),
    "plot": ("PNG training curves (loss, bpc/ppl, lr, tokens/s) from one or more run directories", "plot"),
    "bench": ("benchmarks: train, eval, generate, mfu, kernel, curve, eval-speedup, attention-scaling, all", "bench"),
    "serve": ("a local playground page: streamed generation, attention over memory, loss vs memory length", "serve"),
    "export": ("write a trained model's forward pass with memory as torch.export programs (and ONNX), checked "
               "against the eager model", "export"),
    "import-hf": ("convert a Hugging Face TransfoXL checkpoint (a directory, or a hub repo id such as "
                  "transfo-xl/transfo-xl-wt103) with its vocab.pkl, read without unpickling", "import_hf"),
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("txl")
    except PackageNotFoundError:  # run from a source tree
        from txl import __version__

        return __version__


def _load(command: str, function: str) -> Callable:
    """`configure` or `run` of a command's module, imported only now (`txl --help` stays fast)."""
    return getattr(importlib.import_module(f"txl.cli.{COMMANDS[command][1]}"), function)


class ArgumentMistake(Exception):
    """A command line argparse refuses; `main` prints it as one line (argparse would print the usage
    block above it and exit from inside the parser)."""

    def __init__(self, prog: str, message: str):
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `txl CMD: error: argument --flag: ...; see `txl CMD --help``.
    Its subcommands' parsers are of this class too (`add_subparsers` makes parsers of its parser's type)."""

    def error(self, message: str):
        raise ArgumentMistake(self.prog, message)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser; with `only`, just that subcommand's arguments are declared (faster, and a
    broken optional module cannot break unrelated subcommands)."""
    parser = Parser(
        prog="txl",
        description="Transformer-XL for modern PyTorch: train, evaluate, generate, measure.",
    )
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    parser.add_argument("--version", action="version", version=f"txl {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, _module) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        if only is None or only == name:
            _load(name, "configure")(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: 0 done, 2 a user error or a refused argument (one line on stderr), 1 an internal error (a bug: the
    traceback is kept), 130 interrupted, 141 stdout closed early (`txl data list | head -1`)."""
    from txl.allocator import keep_freed_memory
    from txl.errors import TxlError

    keep_freed_memory()  # large per-step tensors reuse the heap instead of fresh mmap pages (txl/allocator.py)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        build_parser(only="").print_help()  # bare `txl` explains itself; it starts nothing
        return 0
    first = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only=first if first in COMMANDS else None)
    try:
        args, extras = parser.parse_known_args(argv)
        if extras:
            raise _unknown_argument(parser, args, extras)
    except ArgumentMistake as err:
        print(f"{err.prog}: error: {_argument_line(str(err))}; see `{err.prog} --help`", file=sys.stderr)
        return 2
    if args.command is None:
        parser.print_help()
        return 0
    run = _load(args.command, "run")
    prefix = f"txl {args.command}"
    try:
        if getattr(args, "threads", None) is not None:  # every command that computes: --threads (0 = txl's choice)
            from txl.cli.arguments import apply_threads

            apply_threads(args.threads)
        return int(run(args) or 0)
    except TxlError as err:
        if args.debug:
            raise
        print(f"{prefix}: error: {_one_line(err)}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"{prefix}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Whoever read our output stopped reading; point stdout at /dev/null so the interpreter's
        # final flush does not raise again.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as err:
        if args.debug:
            raise
        if _report_out_of_memory(err, prefix, args.command):  # a resource limit, not a bug
            return 2
        traceback.print_exc()
        print(f"{prefix}: internal error: this {type(err).__name__} is a bug in txl, not in your input; please report "
              "it with the traceback above (see SECURITY.md)", file=sys.stderr)
        return 1


def _report_out_of_memory(err: BaseException, prefix: str, command: str) -> bool:
    """Print the out-of-memory line; True when `err` was one. This must not raise itself: the memory
    may still be exhausted (e.g. by a MemoryError's own traceback), so every step is guarded and the
    last resort is a fixed line written straight to the stderr descriptor."""
    from txl.errors import describe_out_of_memory, is_out_of_memory

    try:
        if not is_out_of_memory(err):
            return False
    except BaseException:  # noqa: BLE001 - classifying failed: treat as out of memory (MemoryError)
        if not isinstance(err, MemoryError):
            return False
    try:
        err.__traceback__ = None  # drop the frames (and the tensors they hold) before building the line
        fix = _MEMORY_FIX.get(command, _MEMORY_FIX[""])
        print(f"{prefix}: error: {describe_out_of_memory(err)}; {fix}", file=sys.stderr)
    except BaseException:  # noqa: BLE001
        with contextlib.suppress(BaseException):
            os.write(2, _OOM_LINE)
    return True


_OOM_LINE = b"txl: error: out of memory; use a smaller model, batch or segment length\n"

_MEMORY_FIX = {
    "train": "use a smaller model (n_layer, d_model, d_inner), a smaller batch_size or tgt_len, or grad_accum",
    "": "use a smaller model, batch or segment length, or a machine with more memory",
}


def _unknown_argument(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> ArgumentMistake:
    """The arguments no parser took, as one line for the deepest (sub)command chosen (`txl bench train`),
    with the closest option of that command to the first unknown one ("did you mean", as `--set` has)."""
    from txl.errors import did_you_mean

    chosen = parser
    while True:  # down the chosen subcommands: txl -> txl bench -> txl bench train
        actions = [a for a in chosen._actions if isinstance(a, argparse._SubParsersAction)]
        picked = next((a.choices.get(getattr(args, a.dest, None)) for a in actions if getattr(args, a.dest, None)),
                      None)
        if picked is None:
            break
        chosen = picked
    options = [o for a in chosen._actions for o in a.option_strings if o.startswith("--")]
    flag = next((e.partition("=")[0] for e in extras if e.startswith("-") and e != "-"), None)
    hint = did_you_mean(flag, options) if flag else ""
    given = " ".join(extras)
    given = given if len(given) <= 80 else f"{given[:80]}... ({len(given):,} characters)"
    return ArgumentMistake(chosen.prog, f"unrecognized arguments: {given}{hint}")


def _argument_line(message: str) -> str:
    """argparse's message as txl states it: "argument --steps: must be >= 1, got 0" reads "--steps must
    be >= 1, got 0" (the form of the checks made after parsing); a flag whose value starts with '-'
    (`--contexts -8,8`) is told how to pass it."""
    message = " ".join(message.split())
    flag, sep, rest = message.partition(": must be ")
    if sep and flag.startswith("argument ") and " " not in flag.removeprefix("argument "):
        message = f"{flag.removeprefix('argument ').split('/')[-1]} must be {rest}"
    if message.endswith("expected one argument"):
        message += " (a value that starts with '-' is written --flag=VALUE)"
    return message


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split("\n")).strip() or type(err).__name__


if __name__ == "__main__":
    raise SystemExit(main())
