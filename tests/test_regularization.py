"""Whole-word and locked (variational) dropout (txl/nn/regularization.py) in the decoder: what they drop,
that they are the identity outside training, that the fast backend draws the same masks as the
reference, and which architectures accept them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tiny_models import build
from txl import TransformerXLConfig
from txl.models.transformer_xl.config import ConfigError
from txl.models.transformer_xl.model import TransformerXL
from txl.nn.regularization import embedding_dropout, word_dropout


def test_word_dropout_draws_the_mask_of_embedding_dropout():
    """Dropping after the lookup (any embedding, adaptive input included) is the same draw as
    dropping rows of the table (AWD-LSTM's form): one Bernoulli per vocabulary entry."""
    weight = torch.randn(50, 6)
    ids = torch.randint(0, 50, (3, 40))
    torch.manual_seed(7)
    rows = F.embedding(ids, embedding_dropout(weight, 0.4, training=True))
    torch.manual_seed(7)
    after = word_dropout(F.embedding(ids, weight), ids, 50, 0.4, training=True)
    torch.testing.assert_close(after, rows)
    x = F.embedding(ids, weight)
    assert word_dropout(x, ids, 50, 0.4, training=False) is x
    assert word_dropout(x, ids, 50, 0.0, training=True) is x


def test_decoder_dropout_embed_drops_every_occurrence_of_a_word():
    model = build(dropout_embed=0.5).train()  # dropout = dropatt = 0: only the word dropout acts
    ids = torch.randint(0, model.config.vocab_size, (4, 30))
    torch.manual_seed(1)
    h0 = model(ids, output_hidden_states=True).hidden_states[0]  # the blocks' input
    clean = model.embed(ids)
    zero = (h0 == 0).all(dim=-1)  # (b, t)
    dropped = set(ids[zero].tolist())
    assert dropped and set(ids[~zero].tolist()).isdisjoint(dropped)  # a word is dropped everywhere or nowhere
    torch.testing.assert_close(h0[~zero], clean[~zero] * 2)  # the kept ones scaled by 1 / (1 - p)


def test_decoder_dropout_input_is_one_mask_per_sequence():
    model = build(dropout_input=0.5).train()
    ids = torch.randint(0, model.config.vocab_size, (3, 20))
    torch.manual_seed(2)
    h0 = model(ids, output_hidden_states=True).hidden_states[0]
    ratio = h0 / model.embed(ids)  # 0 or 2 per (sequence, feature), the same at every position
    assert torch.allclose(ratio, ratio[:, :1].expand_as(ratio))
    assert ((ratio[:, 0] == 0) | ((ratio[:, 0] - 2).abs() < 1e-5)).all() and (ratio[:, 0] == 0).any()
    assert not torch.equal(ratio[0, 0], ratio[1, 0])


def test_decoder_regularisers_change_nothing_in_eval_and_keep_the_parameters():
    plain = build()
    regularised = build(dropout_embed=0.3, dropout_input=0.3)
    assert plain.state_dict().keys() == regularised.state_dict().keys()
    regularised.load_state_dict(plain.state_dict())
    ids = torch.randint(0, plain.config.vocab_size, (2, 12))
    torch.testing.assert_close(regularised(ids).logits, plain(ids).logits, rtol=0, atol=0)


def test_fast_backend_draws_the_reference_masks():
    """Training forward and backward with both regularisers: the fast backend equals the reference
    (same seed, the same Bernoulli draws; dropout = 0 so the fast backend's own dropout RNG is unused)."""
    kwargs = dict(dropout_embed=0.2, dropout_input=0.3)
    reference = build(backend="reference", **kwargs).train()
    fast = build(backend="auto", **kwargs).train()
    fast.load_state_dict(reference.state_dict())
    ids = torch.randint(0, reference.config.vocab_size, (2, 16))
    out = {}
    for name, model in (("reference", reference), ("fast", fast)):
        torch.manual_seed(5)
        res = model(ids[:, :-1], labels=ids[:, 1:])
        res.loss.backward()
        out[name] = (res.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(out["fast"][0], out["reference"][0], rtol=1e-5, atol=1e-6)
    for n, g in out["reference"][1].items():
        torch.testing.assert_close(out["fast"][1][n], g, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("field", ["dropout_embed", "dropout_input"])
def test_decoder_accepts_them_in_range(field):
    assert getattr(TransformerXLConfig(vocab_size=10, **{field: 0.25}), field) == 0.25
    with pytest.raises(ConfigError, match=rf"config.{field} must be in \[0, 1\)"):
        TransformerXLConfig(vocab_size=10, **{field: 1.0})
    TransformerXL(TransformerXLConfig(vocab_size=10, n_layer=1, d_model=8, n_head=2, d_head=4, d_inner=8,
                                      **{field: 0.25}))
