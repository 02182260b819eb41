"""The RNN encoder-decoder with attention (`arch = "rnn-seq2seq"`: Bahdanau et al. 2015, Luong et al. 2015;
seed 003's Attention_study): config `RNNSeq2SeqConfig`, model `RNNEncoderDecoder`. It keeps the Transformer
encoder-decoder's contract, so its training, decoding (`txl.generate.seq2seq`) and scores
(`txl.eval.seq2seq`) are the same code. The model (torch) is imported on first use."""

from typing import TYPE_CHECKING, Any

from txl.models.rnn_seq2seq.config import RNNSeq2SeqConfig

if TYPE_CHECKING:
    from txl.models.rnn_seq2seq.model import RNNDecoderCache, RNNEncoderDecoder

__all__ = ["RNNDecoderCache", "RNNEncoderDecoder", "RNNSeq2SeqConfig"]


def __getattr__(name: str) -> Any:
    if name in ("RNNDecoderCache", "RNNEncoderDecoder"):
        from txl.models.rnn_seq2seq import model

        return getattr(model, name)
    raise AttributeError(f"module 'txl.models.rnn_seq2seq' has no attribute {name!r}")
