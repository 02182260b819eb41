"""txl: Transformer-XL for modern PyTorch."""

from txl.config import TransformerXLConfig
from txl.errors import CheckpointError, ConfigError, DataError, TxlError, UsageError

__version__ = "0.1.0"

__all__ = [
    "TransformerXLConfig",
    "TxlError",
    "ConfigError",
    "DataError",
    "CheckpointError",
    "UsageError",
]
