"""txl: Transformer-XL for modern PyTorch.

    from txl import TransformerXLConfig, build_model

    config = TransformerXLConfig(n_layer=4, d_model=128, attention="sliding", attention_options={"window": 64})
    model = build_model(config)          # or TransformerXL(config)
    model = load_model("runs/x")          # any architecture, from its config.json

One config per architecture (`TransformerXLConfig` for the decoder and its bidirectional encoder,
`EncoderDecoderConfig`, `RecurrentConfig` for the LSTM and SHA-RNN, `RNNSeq2SeqConfig` for the RNN
encoder-decoder with attention), the models they build, the memory
interface (`MemoryState`, implemented by `Memory` and the recurrent and fast kinds) and the errors. The configs and errors load without torch; the model classes, `Memory`,
`build_model` and `load_model` import it on first use, so `txl --help` and `txl data` start without it.
"""

from typing import TYPE_CHECKING, Any

from txl.errors import CheckpointError, ConfigError, DataError, TxlError, UsageError
from txl.models.rnn.config import RecurrentConfig
from txl.models.rnn_seq2seq.config import RNNSeq2SeqConfig
from txl.models.seq2seq.config import EncoderDecoderConfig
from txl.models.transformer_xl.config import TransformerXLConfig

if TYPE_CHECKING:
    from txl.models.registry import build_model, load_model
    from txl.models.rnn.model import RecurrentLM
    from txl.models.rnn_seq2seq.model import RNNEncoderDecoder
    from txl.models.seq2seq.model import EncoderDecoder
    from txl.models.transformer_xl.model import TransformerXL, TransformerXLOutput
    from txl.nn.memory import Memory, MemoryState

__version__ = "0.1.0"

_LAZY = {
    "TransformerXL": "txl.models.transformer_xl.model",
    "TransformerXLOutput": "txl.models.transformer_xl.model",
    "EncoderDecoder": "txl.models.seq2seq.model",
    "RecurrentLM": "txl.models.rnn.model",
    "RNNEncoderDecoder": "txl.models.rnn_seq2seq.model",
    "Memory": "txl.nn.memory",
    "MemoryState": "txl.nn.memory",
    "build_model": "txl.models.registry",
    "load_model": "txl.models.registry",
}

__all__ = [
    "TransformerXLConfig",
    "EncoderDecoderConfig",
    "RecurrentConfig",
    "RNNSeq2SeqConfig",
    "TransformerXL",
    "TransformerXLOutput",
    "EncoderDecoder",
    "RecurrentLM",
    "RNNEncoderDecoder",
    "Memory",
    "MemoryState",
    "build_model",
    "load_model",
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


def __dir__() -> list[str]:
    return sorted(__all__)
