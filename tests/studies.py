"""The experiment scripts (experiments/ at the repository root: not installed, not importable as txl),
loaded for their tests the way `python experiments/NAME.py` sees them: with their own directory first
on sys.path, so their shared module (experiments/campaign.py) imports as `campaign`."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def load(name: str) -> ModuleType:
    """experiments/NAME.py as a module (arena, claims, recipes, campaign)."""
    if str(EXPERIMENTS) not in sys.path:
        sys.path.insert(0, str(EXPERIMENTS))
    return importlib.import_module(name)


def script(name: str, *args, **kwargs) -> subprocess.Popen:
    """`python experiments/NAME.py ARGS` with its output captured (the way a user runs it)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **kwargs.pop("env", {})}
    return subprocess.Popen([sys.executable, str(EXPERIMENTS / f"{name}.py"), *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
