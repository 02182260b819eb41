"""Positional encodings (`txl.nn.positional`): the registry, absolute encodings' temporal confusion, the
learned table's length limit. (Segment invariance of the relative encodings is in test_model.py.)"""

from __future__ import annotations

import pytest
import torch

from tiny_models import build, two_segments_vs_one_pass
from txl.nn.positional import CONTENT_ONLY, POSITIONAL_ENCODINGS, PositionalEncoding, register_encoding

ABSOLUTE = [name for name, cls in POSITIONAL_ENCODINGS.items() if not cls.relative]


@pytest.mark.parametrize("pos", ABSOLUTE)
def test_absolute_positions_show_temporal_confusion(pos):
    # Positions restart each segment, so the second segment is not what one long pass computes.
    assert two_segments_vs_one_pass(build(pos_encoding=pos)) > 1e-3


def test_learned_positions_reject_too_long_input():
    from txl.errors import UsageError

    model = build(pos_encoding="learned", position_options=dict(max_positions=8))
    with pytest.raises(UsageError, match="max_positions"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_a_registered_encoding_is_usable_by_name(tiny):
    @register_encoding("toy-absolute")
    class ToyAbsolute(PositionalEncoding):
        """Position index times a learned vector, added to the input."""

        def __init__(self, config):
            super().__init__(config)
            self.direction = torch.nn.Parameter(torch.zeros(config.d_model))

        def embed(self, x):
            return x + torch.arange(x.shape[1], dtype=x.dtype)[:, None] * self.direction

    try:
        from txl.models.transformer_xl.model import TransformerXL

        model = TransformerXL(tiny(pos_encoding="toy-absolute"))
        assert isinstance(model.pos, ToyAbsolute) and "pos.direction" in model.state_dict()
        out = model(torch.randint(0, 61, (2, 6)), labels=torch.randint(0, 61, (2, 6)))
        out.loss.backward()
        assert model.pos.direction.grad is not None
    finally:
        del POSITIONAL_ENCODINGS["toy-absolute"]


def test_content_only_positions_add_nothing():
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4)
    assert CONTENT_ONLY.content(q, k) == (q, k)
    assert CONTENT_ONLY.score_bias(q, k_len=5) is None and CONTENT_ONLY.xl_terms(q, k_len=5) is None
