"""txl: Transformer-XL for modern PyTorch.

    from txl import TransformerXLConfig, TransformerXL

The model classes import torch, so they are loaded on first use: `txl --help` and the data tools
start without it.
"""

from typing import TYPE_CHECKING, Any

from txl.config import TransformerXLConfig
from txl.errors import CheckpointError, ConfigError, DataError, TxlError, UsageError

if TYPE_CHECKING:
    from txl.memory import Memory
    from txl.model import TransformerXL, TransformerXLOutput
    from txl.rnn import RecurrentLM
    from txl.seq2seq.model import EncoderDecoder

__version__ = "0.1.0"

_LAZY = {"TransformerXL": "txl.model", "TransformerXLOutput": "txl.model", "Memory": "txl.memory",
         "EncoderDecoder": "txl.seq2seq.model", "RecurrentLM": "txl.rnn"}

__all__ = [
    "TransformerXLConfig",
    "TransformerXL",
    "TransformerXLOutput",
    "EncoderDecoder",
    "RecurrentLM",
    "Memory",
    "TxlError",
    "ConfigError",
    "DataError",
    "CheckpointError",
    "UsageError",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'txl' has no attribute {name!r}")
