"""The migration of the old flat model config (txl.models.migration) and the one-config-per-architecture
split: config.json written before issue 44 (tests/data/legacy), old keys in --set, the shapes each
architecture's config has, and what a family refuses."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from txl import ConfigError, EncoderDecoderConfig, RecurrentConfig, TransformerXLConfig
from txl.errors import CheckpointError
from txl.models.checkpoint import RUN_SETTINGS, check_run_setting
from txl.models.configuration import CONFIGS
from txl.models.migration import (
    ADDED_SINCE,
    KEPT,
    LEGACY_DEFAULTS,
    NEWER_ARCHS,
    OPTION_KEYS,
    REGAINED,
    migrate,
)
from txl.models.registry import config_from_dict, load_config
from txl.train.config import build_run_config, check_train_value

LEGACY = Path(__file__).resolve().parent / "data" / "legacy"
OPTION_FIELDS = {"attention_options", "position_options"}


def legacy_config(name: str) -> dict:
    return json.loads((LEGACY / name / "config.json").read_text())


def test_each_architecture_has_only_its_own_fields():
    """76 fields in one config before; then 39 (decoder), 23 (encoder-decoder), 15 (recurrent LMs); the
    decoder has 6 more since (issue 47's block options: defaults = the old behaviour, so no migration step) and 3
    for sequence classification (num_labels = 0: a language model, as before), and 4 of issue 48 (act_type,
    universal_signals, reversible, sample_softmax: a config saved before them loads with its old behaviour); the
    encoder-decoder 9 of issue 48 (the block options norm, ffn, n_kv_head, qk_norm and the Universal Transformer's
    universal, act_threshold, ponder_cost, act_type, universal_signals; the first three of those were old keys it
    ignored: REGAINED)."""
    assert len(LEGACY_DEFAULTS) == 76
    counts = {cls.__name__: len(dataclasses.fields(cls)) for cls in (TransformerXLConfig, EncoderDecoderConfig,
                                                                    RecurrentConfig)}
    assert counts == {"TransformerXLConfig": 39 + 6 + 3 + 4, "EncoderDecoderConfig": 23 + 9, "RecurrentConfig": 15}
    for arch, cls in CONFIGS.items():  # the migration's frozen table is this change's shapes
        if arch in NEWER_ARCHS:  # added after the migration: no old-shape config names it
            assert arch not in KEPT and migrate({"arch": arch, "mem_len": 512}) == {"arch": arch, "mem_len": 512}
            continue
        added = ADDED_SINCE.get(arch, frozenset())
        regained = REGAINED.get(arch, frozenset())
        assert regained <= set(LEGACY_DEFAULTS) and not regained & KEPT[arch], arch
        assert set(cls.field_names()) - OPTION_FIELDS - added - regained == KEPT[arch], arch
        assert not added & set(LEGACY_DEFAULTS), arch  # new keys: never in a legacy config.json


@pytest.mark.parametrize("name", sorted(p.name for p in LEGACY.iterdir() if (p / "config.json").is_file()))
def test_every_legacy_config_json_migrates_and_round_trips(name):
    data = legacy_config(name)
    assert len(data) == 76
    config = config_from_dict(data)
    assert type(config) is CONFIGS[data["arch"]]
    again = config.to_dict()
    assert migrate(again) == again  # a new-shape dict is left as it is
    assert config_from_dict(again) == config
    assert load_config(LEGACY / name) == config


def test_kernel_and_encoding_options_move_into_their_tables():
    sliding = config_from_dict(legacy_config("decoder-sliding"))
    # (issue 48: a config written before Longformer's separate global projections keeps them off)
    assert sliding.to_dict()["attention_options"] == {"window": 3, "dilation": [], "global_tokens": 1,
                                                      "global_projections": False, "global_positions": False}
    t5 = config_from_dict(legacy_config("decoder-t5-memory-tokens"))
    assert t5.to_dict()["position_options"] == {"buckets": 8, "max_distance": 16}
    shaw = config_from_dict(legacy_config("decoder-shaw-pre-ln"))
    # (issue 48: Shaw's tables gained sharing across heads and layers, off as before)
    assert shaw.to_dict()["position_options"] == {"max_distance": 4, "values": True, "share_heads": False,
                                                  "share_layers": False}
    bigbird = config_from_dict(legacy_config("decoder-bigbird"))
    assert bigbird.to_dict()["attention_options"] == {"block": 2, "window": 1, "global_blocks": 1, "random_blocks": 1}
    assert config_from_dict(legacy_config("decoder-xl")).to_dict()["attention_options"] == {}


def test_migrate_is_pure_and_keeps_unknown_keys_for_the_config_to_refuse():
    data = {**legacy_config("lstm"), "n_layers": 3}
    before = json.dumps(data, sort_keys=True)
    out = migrate(data)
    assert json.dumps(data, sort_keys=True) == before and out["n_layers"] == 3
    with pytest.raises(ConfigError, match="unknown config key 'n_layers'; did you mean 'n_layer'"):
        config_from_dict(data)


@pytest.mark.parametrize(("changes", "message"), [
    # a family field the new architecture does not have, set away from its default
    (dict(d_embed=64), "config.d_embed only applies to arch='decoder'; the encoder-decoder has no such option"),
    (dict(mem_len=16), "config.mem_len must be 0 with arch='encoder-decoder'"),
])
def test_an_old_encoder_decoder_config_with_what_it_ignored_is_refused_in_one_line(changes, message, tmp_path):
    data = {**legacy_config("encoder-decoder"), **changes}
    with pytest.raises(ConfigError, match=message) as err:
        config_from_dict(data)
    assert "\n" not in str(err.value)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=message):
        load_config(tmp_path / "ckpt")


def test_the_encoder_decoder_config_takes_universal_everywhere_and_an_old_dump_loads_as_trained(tmp_path):
    """Issue 48: `universal` is an option of the encoder-decoder (the Universal Transformer encoder-decoder);
    it was refused here since issue 44 and ignored by the flat config before. A complete old dump (every key of
    the flat config) that says universal=true was trained without it: it loads as the plain encoder-decoder."""
    for build in (lambda: EncoderDecoderConfig(universal=True),
                  lambda: EncoderDecoderConfig.from_dict({"universal": True}),
                  lambda: EncoderDecoderConfig.from_json('{"arch": "encoder-decoder", "universal": true}'),
                  lambda: build_run_config(preset="seq2seq-reverse", sets=["model.universal=true"]).model_config(10)):
        assert build().universal is True
    data = {**legacy_config("encoder-decoder"), "universal": True, "act_threshold": 0.5, "ponder_cost": 0.3}
    config = config_from_dict(data)
    assert (config.universal, config.act_threshold, config.ponder_cost) == (False, 0.99, 0.01)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(data))
    assert load_config(tmp_path / "ckpt") == config


def test_old_keys_in_set_are_migrated_and_the_new_ones_work_too():
    """`--set model.sliding_window=3` (the old key) moves into attention_options when sliding is chosen;
    `--set model.attention_options.window=3` is the new spelling; an old option of a kernel that is not
    chosen is ignored as before, unless the old config checked it (global_tokens)."""
    old = build_run_config(preset="tiny", sets=["model.attention=sliding", "model.sliding_window=3"])
    new = build_run_config(preset="tiny", sets=["model.attention=sliding", "model.attention_options.window=3"])
    assert old.model_config(50) == new.model_config(50)
    assert new.model_config(50).attention_options.window == 3
    assert build_run_config(preset="tiny", sets=["model.sliding_window=3"]).model_config(50).attention == "full"
    with pytest.raises(ConfigError, match=r"config.global_tokens is now attention_options.global_tokens, an option "
                                          r"of attention='sliding'.*\(in --set model.global_tokens=2\)"):
        build_run_config(preset="tiny", sets=["model.global_tokens=2"])
    with pytest.raises(ConfigError, match="config.attention_options.window is an option of attention='bigbird' or "
                                          "'sliding', not of attention='full'; set attention to one of them or remove it"):
        build_run_config(preset="tiny", sets=["model.attention_options.window=3"])
    later = build_run_config(preset="tiny", sets=["model.attention=sliding", "model.attention_options.window=3",
                                                  "model.sliding_window=4"])  # one name after the other: the last
    assert later.model_config(50).attention_options.window == 4
    with pytest.raises(ConfigError, match="config.sliding_window and config.attention_options.window are both set"):
        config_from_dict({"attention": "sliding", "sliding_window": 4, "attention_options": {"window": 3}})


def test_a_later_source_replaces_an_earlier_option_under_either_name(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\nattention = "sliding"\nsliding_window = 8\n')
    run = build_run_config(config_file=toml, sets=["model.attention_options.window=3"])
    assert run.model_config(50).attention_options.window == 3
    toml.write_text('[model]\nattention = "sliding"\n[model.attention_options]\nwindow = 8\nglobal_tokens = 1\n')
    run = build_run_config(config_file=toml, sets=["model.sliding_window=3"])
    assert run.model_config(50).attention_options == type(run.model_config(50).attention_options)(window=3, global_tokens=1)
    run = build_run_config(config_file=toml, sets=["model.attention=sparse"])  # a new kernel drops the old options
    assert run.model_config(50).attention_options.stride == 128


def test_every_old_option_key_has_an_option_of_that_name():
    from txl.nn.attention.registry import kernel_options
    from txl.nn.positional import encoding_options

    tables = {"attention": kernel_options(), "position": encoding_options()}
    for key, (kind, owners, new) in OPTION_KEYS.items():
        for owner in owners:
            options = tables[kind][owner]
            assert new in options.names(), key
            assert getattr(options(), new) == (tuple(LEGACY_DEFAULTS[key]) if isinstance(LEGACY_DEFAULTS[key], list)
                                               else LEGACY_DEFAULTS[key]), key


@pytest.mark.parametrize("key", sorted(RUN_SETTINGS))
@pytest.mark.parametrize("value", [None, 0, 1, 12, -1, 0.5, 1.5, "8", True, 1 << 30])
def test_the_checkpoint_loader_checks_run_settings_as_the_train_config_does(key, value):
    def outcome(check):
        try:
            return "ok", check(key, value)
        except ConfigError as err:
            return "error", str(err)

    assert outcome(check_run_setting) == outcome(check_train_value)
