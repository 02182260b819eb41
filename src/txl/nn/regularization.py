"""Dropout that acts on whole words and whole sequences (AWD-LSTM §4; Merity et al. 2018).

Shared by the recurrent LMs (txl/models/rnn/model.py, where AWD-LSTM uses them) and the decoder (txl/models/transformer_xl/model.py,
where `dropout_embed` and `dropout_input` regularise small corpora such as PTB words: the
Transformer-XL paper trains its PTB model with variational dropout). Each is the identity outside
training or at p = 0.
"""

from __future__ import annotations

from torch import Tensor


def embedding_dropout(weight: Tensor, p: float, training: bool) -> Tensor:
    """Whole-word dropout on an embedding table: a dropped word's row is zero at every position of
    the batch (Gal & Ghahramani 2016), the kept rows scaled by 1 / (1 - p)."""
    if not training or p == 0.0:
        return weight
    keep = weight.new_empty(weight.shape[0], 1).bernoulli_(1 - p) / (1 - p)  # (V, 1)
    return weight * keep


def word_dropout(x: Tensor, input_ids: Tensor, vocab_size: int, p: float, training: bool) -> Tensor:
    """`embedding_dropout` applied after the lookup, for embeddings that are not one table (adaptive
    input): one keep/drop draw per vocabulary entry, so every occurrence of a dropped word in the
    batch is zero. x (b, t, d) = the embeddings of input_ids (b, t)."""
    if not training or p == 0.0:
        return x
    keep = x.new_empty(vocab_size).bernoulli_(1 - p) / (1 - p)  # (V,)
    return x * keep[input_ids].unsqueeze(-1)


def locked_dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """Variational dropout: one mask per sequence and feature, shared by every time step. x (b, t, d)."""
    if not training or p == 0.0:
        return x
    mask = x.new_empty(x.shape[0], 1, x.shape[2]).bernoulli_(1 - p) / (1 - p)  # (b, 1, d)
    return x * mask


__all__ = ["embedding_dropout", "locked_dropout", "word_dropout"]
