"""The encoder–decoder Transformer (Vaswani et al. 2017) on txl's blocks: `EncoderDecoder` (config
`arch = "encoder-decoder"`) and its decoding caches. Its decoding lives in `txl.generate.seq2seq`, its
pair corpora in `txl.data.seq2seq`, its metrics in `txl.eval.seq2seq_metrics`."""

from txl.models.seq2seq.model import DecoderCache, EncoderDecoder, Seq2SeqOutput

__all__ = ["DecoderCache", "EncoderDecoder", "Seq2SeqOutput"]
