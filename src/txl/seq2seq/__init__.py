"""Sequence-to-sequence: the encoder–decoder Transformer (Vaswani et al. 2017) on txl's blocks.

- `model`: `EncoderDecoder` (config `arch = "encoder-decoder"`) and its decoding caches;
- `decode`: greedy, beam search and sampling, batched and cached;
- `data`: pair corpora (`pairs:`, `reverse`, `pydoc-summaries`), vocabularies and length-bucketed batches;
- `metrics`: token accuracy, exact match, ROUGE-1/2/L, BLEU.
"""

from txl.seq2seq.model import DecoderCache, EncoderDecoder, Seq2SeqOutput

__all__ = ["DecoderCache", "EncoderDecoder", "Seq2SeqOutput"]
