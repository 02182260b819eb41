"""Config validation and its JSON round-trip (`txl.models.transformer_xl.config`)."""

from __future__ import annotations

import pytest

from txl import ConfigError, TransformerXLConfig

SMALL = dict(vocab_size=50, n_layer=2, d_model=16, n_head=2, d_head=8, d_inner=32, mem_len=8)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n_layer", 0),
        ("n_head", 0),
        ("d_model", -4),
        ("d_head", 0),
        ("d_inner", 0),
        ("vocab_size", 0),
        ("mem_len", -1),
        ("clamp_len", -1),
        ("position_options", {"max_distance": -2}),  # pos_encoding="shaw" (below)
        ("dropout", 1.0),
        ("dropatt", -0.1),
        ("init_std", 0.0),
        ("pos_encoding", "absolute"),
        ("attention", "quantum"),
        ("attention_impl", "turbo"),
        ("cutoffs", (30, 20)),
        ("cutoffs", (20, 20)),
        ("cutoffs", (20, 50)),  # >= vocab_size
        ("cutoffs", (0, 20)),
        ("div_val", 0),
        ("tie_projs", (False, True, True)),  # one cutoff -> two clusters
        ("n_layer", "12"),  # wrong type
        ("same_length", "yes"),
        ("cutoffs", "20,40"),
        ("d_embed", 0),
    ],
)
def test_invalid_field_raises_value_error_naming_it(field, value):
    kwargs = {**SMALL, field: value}
    if field == "tie_projs":
        kwargs["cutoffs"] = (20,)
    if field == "position_options":
        kwargs["pos_encoding"] = "shaw"
    with pytest.raises(ValueError, match=field):
        TransformerXLConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        (dict(same_length=True, mem_len=0), "same_length"),
        (dict(div_val=2), "div_val"),
        (dict(pos_encoding="rope", d_head=7), "d_head"),
        (dict(position_options={"values": True}), "position_options.values"),
        (dict(untie_r=True, pos_encoding="alibi"), "untie_r"),
        (dict(cutoffs=(10, 20, 40), div_val=8, d_embed=64), "div_val"),
    ],
)
def test_impossible_combinations_are_rejected(kwargs, named):
    with pytest.raises(ConfigError, match=named):
        TransformerXLConfig(**{**SMALL, **kwargs})


def test_json_round_trip_and_unknown_keys():
    config = TransformerXLConfig(**SMALL, cutoffs=(10, 30), div_val=2, tie_projs=(False, True, False))
    again = TransformerXLConfig.from_json(config.to_json())
    assert again == config
    data = config.to_dict()
    data["n_layers"] = 3
    with pytest.raises(ConfigError, match="n_layers"):
        TransformerXLConfig.from_dict(data)
    with pytest.raises(ConfigError, match="not valid JSON"):
        TransformerXLConfig.from_json("{not json")
