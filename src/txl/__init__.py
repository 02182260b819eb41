"""txl: Transformer-XL for modern PyTorch.

    from txl import TransformerXLConfig, TransformerXL

The model classes import torch, so they are loaded on first use: `txl --help` and the data tools
start without it.
"""

from typing import TYPE_CHECKING, Any

from txl.errors import CheckpointError, ConfigError, DataError, TxlError, UsageError
from txl.models.transformer_xl.config import TransformerXLConfig

if TYPE_CHECKING:
    from txl.models.rnn.model import RecurrentLM
    from txl.models.seq2seq.model import EncoderDecoder
    from txl.models.transformer_xl.model import TransformerXL, TransformerXLOutput
    from txl.nn.memory import Memory

__version__ = "0.1.0"

_LAZY = {"TransformerXL": "txl.models.transformer_xl.model", "TransformerXLOutput": "txl.models.transformer_xl.model", "Memory": "txl.nn.memory",
         "EncoderDecoder": "txl.models.seq2seq.model", "RecurrentLM": "txl.models.rnn.model"}

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
