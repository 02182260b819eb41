"""The benchmarks `txl bench NAME` runs, by name, and how to load one. Imports nothing heavy: a
benchmark's module is imported when it runs (see txl/bench/__init__.py for what a module provides)."""

from __future__ import annotations

import importlib
import importlib.util

# NAME -> module providing TITLE, run(options) and table(result) (see txl/bench/__init__.py).
BENCHES: dict[str, str] = {
    "train": "txl.bench.train",
    "eval": "txl.bench.evaluation",
    "generate": "txl.bench.generation",
    "mfu": "txl.bench.mfu",
    "kernel": "txl.bench.kernel",
    "curve": "txl.bench.curve",
    "eval-speedup": "txl.bench.eval_speedup",
    "attention-scaling": "txl.bench.attention_scaling",
}
# The studies that train many models (arena, claims, recipes) are scripts in experiments/, not benchmarks.


def available(name: str) -> bool:
    return importlib.util.find_spec(BENCHES[name]) is not None


def load(name: str):
    from txl.errors import UsageError

    if not available(name):
        raise UsageError(f"benchmark {name!r} is not part of this install yet (module {BENCHES[name]} missing)")
    return importlib.import_module(BENCHES[name])


def has_own_cli(module) -> bool:
    """A benchmark module that declares its own flags (`configure(parser)`, `run(args) -> int`)
    instead of the shared ones (`TITLE`, `run(options) -> dict`, `table(result)`)."""
    return hasattr(module, "configure") and not (hasattr(module, "TITLE") and hasattr(module, "table"))
