"""Every data test gets its own cache directory, also exported as $TXL_CACHE_DIR for CLI calls."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    """Every test gets its own cache (also via $TXL_CACHE_DIR, so CLI calls use it)."""
    path = tmp_path / "cache"
    monkeypatch.setenv("TXL_CACHE_DIR", str(path))
    return path
