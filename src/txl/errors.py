"""Typed errors a user can cause.

Every error a user can trigger (bad config, missing file, corrupt checkpoint, wrong vocabulary, bad CLI
argument) is raised as a subclass of `TxlError` whose message is one line naming the cause and, where
there is one, the fix. The CLI prints that line and exits non-zero without a traceback (unless
`--debug`). Anything else escaping is a bug in txl.
"""

from __future__ import annotations


class TxlError(Exception):
    """Base class for user-facing errors: `str(err)` is one line that names the cause and the fix."""

    exit_code = 2


class ConfigError(TxlError, ValueError):
    """An impossible or unknown configuration value (also a `ValueError`)."""


class DataError(TxlError):
    """A corpus, data spec, vocabulary or prepared cache that cannot be used."""


class CheckpointError(TxlError):
    """A checkpoint directory that is missing, corrupt, or does not match its config."""


class UsageError(TxlError):
    """A command-line argument or API call that cannot be honoured."""


class TrainingError(TxlError):
    """Training cannot continue (e.g. too many non-finite losses in a row)."""
