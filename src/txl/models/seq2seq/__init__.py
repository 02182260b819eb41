"""The encoder–decoder Transformer (Vaswani et al. 2017) on txl's blocks: `EncoderDecoder` (config
`EncoderDecoderConfig`, `arch = "encoder-decoder"`) and its decoding caches. Its decoding lives in
`txl.generate.seq2seq`, its pair corpora in `txl.data.seq2seq`, its metrics in `txl.eval.seq2seq_metrics`.
The model (torch) is imported on first use, so the config loads without it."""

from typing import TYPE_CHECKING, Any

from txl.models.seq2seq.config import EncoderDecoderConfig

if TYPE_CHECKING:
    from txl.models.seq2seq.model import DecoderCache, EncoderDecoder, Seq2SeqOutput

__all__ = ["DecoderCache", "EncoderDecoder", "EncoderDecoderConfig", "Seq2SeqOutput"]


def __getattr__(name: str) -> Any:
    if name in ("DecoderCache", "EncoderDecoder", "Seq2SeqOutput"):
        from txl.models.seq2seq import model

        return getattr(model, name)
    raise AttributeError(f"module 'txl.models.seq2seq' has no attribute {name!r}")
