"""Number types for command lines (txl's, the benchmarks' and the experiments'): every number is type- and range-checked where argparse reads it.

`txl` reads numbers from the command line in one place, so a zero, a negative value, `nan`, `inf`, a
huge value or a word ends in one line naming the flag, its range and what was given (`txl CMD: error:
argument --steps: must be an integer >= 1 and <= 10,000, got '0'`), not in a traceback far from the
flag (issue 50: 18 tracebacks from out-of-range numbers). The upper bounds are fixed numbers, not this
machine's, so the same mistake gives the same message everywhere; they sit far above any sensible value
and below what would exhaust memory, threads or time before the first result.

    parser.add_argument("--steps", type=integer(1, 10_000), default=5)
    parser.add_argument("--threshold", type=real(0, 1, low_open=True, high_open=True), default=0.01)
    parser.add_argument("--mem-lens", type=integer_list(1, 65_536, at_most=64), default=())
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

# Shared ceilings, so commands agree on them.
MAX_THREADS = 1024  # torch threads; 1e9 made libgomp abort the process trying to allocate 216 GB of stacks
MAX_LENGTH = 16_777_216  # tokens: the largest length a model txl builds takes (config.mem_len's bound)
MAX_COUNT = 10**12  # tokens, pairs, positions: more than any corpus txl reads
SHOWN = 40  # characters of a bad value quoted in a message (an argument can be megabytes long)


def shown(text: str) -> str:
    """The value as the message quotes it: repr, cut to SHOWN characters."""
    return repr(text) if len(text) <= SHOWN else repr(text[:SHOWN]) + f"... ({len(text):,} characters)"


def _given(text: str) -> str:
    """A number as given (it parsed, so it is short unless it has many digits)."""
    text = text.strip()
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}... ({len(text):,} characters)"


def _number(value: float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return f"{value:,}" if isinstance(value, int) and abs(value) >= 10_000 else f"{value:g}"


def _range(low, high, low_open: bool = False, high_open: bool = False) -> str:
    """'>= 1 and <= 10,000' for whole numbers; 'in (0, 1]' for a real interval; one side alone as '> 0'."""
    if low is not None and high is not None and (low_open or high_open or isinstance(low, float)):
        return f"in {'(' if low_open else '['}{_number(low)}, {_number(high)}{')' if high_open else ']'}"
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {_number(low)}")
    if high is not None:
        parts.append(f"{'<' if high_open else '<='} {_number(high)}")
    return " and ".join(parts)


def _mistake(text: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(text)


def integer(low: int | None = None, high: int | None = None, *, meaning: str = "") -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high] (either end None: unbounded). `meaning` is added
    to the message (e.g. "0 = txl's choice")."""
    bounds = _range(low, high)
    note = f" ({meaning})" if meaning else ""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise _mistake(f"must be an integer{' ' + bounds if bounds else ''}{note}, got {shown(text)}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise _mistake(f"must be {bounds}{note}, got {_given(text)}")
        return value

    parse.__name__ = "integer"
    return parse


def real(low: float | None = None, high: float | None = None, *, low_open: bool = False, high_open: bool = False,
         meaning: str = "") -> Callable[[str], float]:
    """An argparse type: a finite number in the range (an open end excludes its bound); nan and inf are
    refused, whatever the range."""
    low, high = (None if low is None else float(low)), (None if high is None else float(high))
    bounds = _range(low, high, low_open, high_open)
    note = f" ({meaning})" if meaning else ""

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise _mistake(f"must be a number{' ' + bounds if bounds else ''}{note}, got {shown(text)}") from None
        if (not math.isfinite(value)
                or (low is not None and (value <= low if low_open else value < low))
                or (high is not None and (value >= high if high_open else value > high))):
            raise _mistake(f"must be a finite number{' ' + bounds if bounds else ''}{note}, got {_given(text)}")
        return value

    parse.__name__ = "real"
    return parse


def integer_list(low: int | None = None, high: int | None = None, *, at_most: int = 64,
                 increasing: bool = False) -> Callable[[str], tuple[int, ...]]:
    """An argparse type: comma-separated integers, each in [low, high], one to `at_most` of them
    (strictly increasing when asked)."""
    each = _range(low, high)
    wanted = (f"1 to {at_most} comma-separated integers" + (f", each {each}" if each else "")
              + (", increasing" if increasing else ""))

    def parse(text: str) -> tuple[int, ...]:
        items = [item.strip() for item in text.split(",")]
        try:
            values = tuple(int(item) for item in items if item)
        except ValueError:
            raise _mistake(f"must be {wanted}, got {shown(text)}") from None
        if (not values or len(values) > at_most or any(not item for item in items)
                or any((low is not None and v < low) or (high is not None and v > high) for v in values)
                or (increasing and any(b <= a for a, b in zip(values, values[1:])))):
            raise _mistake(f"must be {wanted}, got {shown(text)}")
        return values

    parse.__name__ = "integer list"
    return parse


def threads(*, auto: bool = True) -> Callable[[str], int]:
    """Torch threads: 1 to MAX_THREADS, and 0 (txl's choice: `txl.cli.arguments.default_threads`) when `auto`."""
    return integer(0 if auto else 1, MAX_THREADS, meaning="0 = txl's choice" if auto else "")
