"""The one migration of model configs: the flat shape of txl before issue 44 -> one config per architecture.

Until commit 775862b (and on main up to the restructuring) every model, whatever its architecture, was
one `TransformerXLConfig` of 76 keys, and `config.json` listed all of them, defaults included. Now each
architecture has its own config (`txl.models.registry`) and each attention kernel and positional
encoding its own options (`attention_options`, `position_options`). `migrate(data)` turns the old shape
into the new one; every path that reads a config from a dict runs it (a checkpoint's config.json, the
model section of a run's run.json on resume, presets, TOML files and `--set`), so old files and old keys
keep working. It is a pure function of the dict, frozen as of this change (a later change of the configs
adds its own step rather than editing this one), and it leaves a new-shape dict as it is.

Per key of the old shape:

1. an option of a kernel or an encoding (`sliding_window`, `t5_buckets`, ... : `OPTION_KEYS`) moves into
   `attention_options` / `position_options` under its new name when that kernel or encoding is the
   selected one. Otherwise it is dropped, as the old config ignored it (`sliding_window=8` with
   attention='full' was accepted and never read), except the five the old checks refused for another
   kernel or encoding (`CHECKED_BEFORE`: sliding_dilation, global_tokens, hierarchical, position_merge,
   shaw_values), which are dropped only when they hold the old default. For a recurrent LM (no kernel at
   all) every one is dropped only when it holds the old default, as the old checks refused any other value;
2. a field the architecture's new config does not have (`KEPT`; e.g. `universal` for the
   encoder-decoder, `n_head` for the LSTM) is dropped when it holds the old default (or, for the
   encoder-decoder, the only value the old checks allowed: mem_len = 0);
3. everything else stays as it is, so a value the new config cannot take reaches its constructor, which
   refuses it in one line naming the field and the fix (`config.same_length only applies to
   arch='decoder'; the encoder-decoder has no such option: remove it`).

A legacy option key and its new name given together (`sliding_window` and `attention_options.window`)
are refused: nothing says which one was meant.
"""

from __future__ import annotations

from typing import Any

from txl.errors import ConfigError

# Every key of the old flat config and its default (TransformerXLConfig at 775862b and at main before issue 44).
LEGACY_DEFAULTS: dict[str, Any] = {
    "arch": "decoder", "vocab_size": 256, "n_layer": 12, "d_model": 512, "n_head": 8, "d_head": 64, "d_inner": 2048,
    "d_embed": None, "dropout": 0.1, "dropatt": 0.0, "mem_len": 512, "clamp_len": 0, "same_length": False,
    "pre_lnorm": False, "final_norm": True, "untie_r": False, "pos_encoding": "xl", "max_relative_distance": 64,
    "shaw_values": False, "max_positions": 1024, "hierarchical": 0.0, "position_merge": "add", "t5_buckets": 32,
    "t5_max_distance": 128, "xpos_scale_base": 512, "attention": "full", "attention_impl": "auto",
    "backend": "auto", "causal": True, "sliding_window": 256, "sliding_dilation": [], "global_tokens": 0,
    "sparse_stride": 128, "performer_features": 256, "performer_redraw_interval": 1000, "linformer_k": 256,
    "linformer_max_len": 512, "linear_feature": "elu", "bigbird_block": 64, "bigbird_window": 1,
    "bigbird_global": 1, "bigbird_random": 2, "bucket_window": 64, "lsh_buckets": 32, "lsh_hashes": 2,
    "routing_clusters": 16, "routing_decay": 0.999, "sinkhorn_block": 64, "sinkhorn_iters": 8,
    "sinkhorn_temperature": 0.75, "compress_ratio": 4, "synthesizer_mode": "dense", "synthesizer_max_len": 256,
    "inducing_points": 32, "memory_tokens": 0, "cmem_len": 0, "cmem_ratio": 4, "cmem_fn": "conv",
    "universal": False, "act_threshold": 0.99, "ponder_cost": 0.01, "cutoffs": [], "div_val": 1,
    "tie_weight": True, "tie_projs": None, "n_encoder_layer": 0, "source_vocab_size": 0,
    "share_embeddings": True, "dropout_embed": 0.0, "dropout_input": 0.0, "dropout_hidden": 0.0,
    "weight_drop": 0.0, "rnn_attention": "penultimate", "init_std": 0.02, "proj_init_std": 0.01,
    "layer_norm_eps": 1e-5,
}

# old key -> (what selects its owner: "attention" | "position", the owners, its name in the options)
OPTION_KEYS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "max_relative_distance": ("position", ("shaw",), "max_distance"),
    "shaw_values": ("position", ("shaw",), "values"),
    "max_positions": ("position", ("learned",), "max_positions"),
    "hierarchical": ("position", ("learned",), "hierarchical"),
    "position_merge": ("position", ("learned",), "merge"),
    "t5_buckets": ("position", ("t5",), "buckets"),
    "t5_max_distance": ("position", ("t5",), "max_distance"),
    "xpos_scale_base": ("position", ("xpos",), "scale_base"),
    "sliding_window": ("attention", ("sliding",), "window"),
    "sliding_dilation": ("attention", ("sliding",), "dilation"),
    "global_tokens": ("attention", ("sliding",), "global_tokens"),
    "sparse_stride": ("attention", ("sparse",), "stride"),
    "performer_features": ("attention", ("performer",), "features"),
    "performer_redraw_interval": ("attention", ("performer",), "redraw_interval"),
    "linformer_k": ("attention", ("linformer",), "k"),
    "linformer_max_len": ("attention", ("linformer",), "max_len"),
    "linear_feature": ("attention", ("linear",), "feature"),
    "bigbird_block": ("attention", ("bigbird",), "block"),
    "bigbird_window": ("attention", ("bigbird",), "window"),
    "bigbird_global": ("attention", ("bigbird",), "global_blocks"),
    "bigbird_random": ("attention", ("bigbird",), "random_blocks"),
    "bucket_window": ("attention", ("lsh", "routing"), "bucket_window"),
    "lsh_buckets": ("attention", ("lsh",), "buckets"),
    "lsh_hashes": ("attention", ("lsh",), "hashes"),
    "routing_clusters": ("attention", ("routing",), "clusters"),
    "routing_decay": ("attention", ("routing",), "decay"),
    "sinkhorn_block": ("attention", ("sinkhorn",), "block"),
    "sinkhorn_iters": ("attention", ("sinkhorn",), "iters"),
    "sinkhorn_temperature": ("attention", ("sinkhorn",), "temperature"),
    "compress_ratio": ("attention", ("compressed",), "ratio"),
    "synthesizer_mode": ("attention", ("synthesizer",), "mode"),
    "synthesizer_max_len": ("attention", ("synthesizer",), "max_len"),
    "inducing_points": ("attention", ("inducing",), "points"),
}
SELECTOR = {"attention": ("attention", "full"), "position": ("pos_encoding", "xl")}
# Options the old config refused when their kernel or encoding was not selected (every other one it ignored).
CHECKED_BEFORE = frozenset({"sliding_dilation", "global_tokens", "hierarchical", "position_merge", "shaw_values"})

# The old keys each architecture's new config keeps as fields (besides attention_options and
# position_options, which the Transformer families gained). tests/test_migration.py checks them against
# the config classes of this change.
_SHARED = ("arch", "vocab_size", "n_layer", "d_model", "d_inner", "dropout", "dropatt", "tie_weight", "layer_norm_eps")
_TRANSFORMER = ("n_head", "d_head", "pre_lnorm", "final_norm", "pos_encoding", "attention", "attention_impl",
                "backend", "init_std")
_RECURRENT = (*_SHARED, "mem_len", "dropout_embed", "dropout_input", "dropout_hidden", "weight_drop", "rnn_attention")
KEPT: dict[str, frozenset[str]] = {
    "decoder": frozenset((*_SHARED, *_TRANSFORMER, "d_embed", "mem_len", "clamp_len", "same_length", "untie_r",
                          "causal", "memory_tokens", "cmem_len", "cmem_ratio", "cmem_fn", "universal", "act_threshold",
                          "ponder_cost", "cutoffs", "div_val", "tie_projs", "dropout_embed", "dropout_input",
                          "proj_init_std")),
    "encoder-decoder": frozenset((*_SHARED, *_TRANSFORMER, "n_encoder_layer", "source_vocab_size", "share_embeddings")),
    "lstm": frozenset(_RECURRENT),
    "sha-rnn": frozenset(_RECURRENT),
}
# Fields added to an architecture's config after this migration (issue 47: the recurrence variant and the
# block options). They need no step: a config written before them lacks the keys and gets the defaults, which
# are the behaviour it was trained with (the paper's recurrence, residual, LayerNorm, ReLU, n_head k/v heads).
ADDED_SINCE: dict[str, frozenset[str]] = {
    "decoder": frozenset(("memory_source", "residual", "norm", "ffn", "n_kv_head", "qk_norm",
                          "num_labels", "classifier_pooling", "classifier_segments",
                          # issue 48: the UT's combination and signals (a step below), reversible blocks, sampled softmax
                          "act_type", "universal_signals", "reversible", "sample_softmax")),
    # issue 48: the block options and the Universal Transformer's ACT settings of the decoder, now honoured by the
    # encoder-decoder (defaults = its behaviour before)
    "encoder-decoder": frozenset(("norm", "ffn", "n_kv_head", "qk_norm", "act_type", "universal_signals")),
}
# Old keys an architecture's config gained after this migration (issue 48: the Universal Transformer
# encoder-decoder). The old flat config accepted them for that architecture and ignored them, so a complete old
# dump (every key of LEGACY_DEFAULTS: a config.json or run.json written before issue 44) drops them whatever
# their value, and its model loads as it was trained; any other dict keeps them (a preset or --set asking for
# the Universal Transformer encoder-decoder gets it).
REGAINED: dict[str, frozenset[str]] = {"encoder-decoder": frozenset(("universal", "act_threshold", "ponder_cost"))}
# Architectures added after this migration (issue 48: the RNN encoder-decoder): no config of the old shape
# names them, so `migrate` leaves their dicts as they are (a key they lack reaches the constructor, which
# refuses it by name).
NEWER_ARCHS = frozenset({"rnn-seq2seq", "style-transformer"})
# Values the old checks forced on an architecture (besides the defaults): dropped like defaults.
FORCED: dict[str, dict[str, Any]] = {"encoder-decoder": {"mem_len": 0}}


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _same(value: Any, expected: Any) -> bool:
    if isinstance(value, bool) or isinstance(expected, bool):  # True is not 1
        return value is expected
    return _plain(value) == expected


def _is_default(key: str, value: Any, arch: str) -> bool:
    forced = FORCED.get(arch, {})
    return (key in forced and _same(value, forced[key])) or _same(value, LEGACY_DEFAULTS[key])


def migrate(data: Any) -> Any:
    """The new-shape dict of a model config dict of either shape (see the module docstring). Anything
    that is not a dict is returned as it is, for the config to refuse by its type."""
    if not isinstance(data, dict):
        return data
    arch = data.get("arch", "decoder")
    if isinstance(arch, str) and arch in NEWER_ARCHS:
        return dict(data)
    kept = KEPT.get(arch) if isinstance(arch, str) else None
    regained = REGAINED.get(arch, frozenset()) if isinstance(arch, str) else frozenset()
    flat_dump = LEGACY_DEFAULTS.keys() <= data.keys()
    out = dict(data)
    for key, value in data.items():
        if key in OPTION_KEYS:
            kind, owners, new = OPTION_KEYS[key]
            selector, default = SELECTOR[kind]
            options_key = f"{kind}_options"
            if kept is not None and selector in kept and out.get(selector, default) in owners:
                options = out.get(options_key)
                if options is None:
                    options = {}
                if not isinstance(options, dict):
                    continue  # the config refuses the options by their type
                if new in options:
                    raise ConfigError(f"config.{key} and config.{options_key}.{new} are both set (the first is "
                                      f"the old name of the second); keep one")
                out[options_key] = {**options, new: value}
                del out[key]
            elif kept is not None and selector not in kept:  # a recurrent LM: the old checks refused any value
                if _is_default(key, value, arch):
                    del out[key]
            elif key not in CHECKED_BEFORE or _is_default(key, value, arch):
                del out[key]
        elif key in regained:
            if flat_dump:
                del out[key]
        elif kept is not None and key in LEGACY_DEFAULTS and key not in kept and _is_default(key, value, arch):
            del out[key]
    return _universal_before_issue_48(_learned_concat_before_issue_48(_sliding_before_issue_48(out)))


# Issue 48 (Longformer as published): attention='sliding' gained `global_projections` (Longformer's separate
# Q_g, K_g, V_g; default on with global_tokens) and `global_positions` (the encoding's score term on global
# pairs outside the window; default on). A config written before them is a complete dump (config.json,
# run.json: every field of KEPT) whose sliding options lack both: it gets both off, the behaviour and the
# weights it was trained with (global rows from the local projections, global pairs scored by content). A
# partial dict (a preset, a TOML file, --set) takes the new defaults.
SLIDING_ADDED_48 = ("global_projections", "global_positions")


def _sliding_before_issue_48(out: dict) -> dict:
    if out.get("arch", "decoder") != "decoder" or out.get("attention") != "sliding" or not KEPT["decoder"] <= out.keys():
        return out
    options = out.get("attention_options")
    if options is None:
        options = {}
    if not isinstance(options, dict) or options.keys() & set(SLIDING_ADDED_48):
        return out
    return {**out, "attention_options": {**options, **dict.fromkeys(SLIDING_ADDED_48, False)}}


# Issue 48 (bert4keras's merge modes): the learned encoding's merge='concat' now widens [x ; e] as bert4keras does
# and needs `dim` (the positions' width); txl's former concat, W [x ; e] projected back to d_model, is named
# 'concat-project'. A complete dump written before (config.json, run.json: every field of KEPT) says 'concat'
# without `dim`: it gets 'concat-project', the behaviour and the weights (pos.merge_proj) it was trained with. A
# partial dict (a preset, a TOML file, --set) saying 'concat' without dim is refused by name (both fixes named).


def _learned_concat_before_issue_48(out: dict) -> dict:
    arch = out.get("arch", "decoder")
    if arch not in ("decoder", "encoder-decoder") or out.get("pos_encoding") != "learned" or not KEPT[arch] <= out.keys():
        return out
    options = out.get("position_options")
    if not isinstance(options, dict) or options.get("merge") != "concat" or "dim" in options:
        return out
    return {**out, "position_options": {**options, "merge": "concat-project"}}


# Issue 48 (the Universal Transformer as tensor2tensor): `act_type` (basic = t2t's default interpolation, now the
# default; accumulated = the weighted sum of the steps' outputs, txl's only combination before) and
# `universal_signals` (every-step = the timestep and position signals before every step, now the default;
# after-first = the timestep signal from step 1 on, txl's before). A complete decoder dump written before them
# (config.json, run.json: every field of KEPT) with universal=true lacks both: it gets accumulated and
# after-first, the behaviour it was trained with. A partial dict (a preset, a TOML file, --set) takes the new
# defaults.
UNIVERSAL_BEFORE_48 = {"act_type": "accumulated", "universal_signals": "after-first"}


def _universal_before_issue_48(out: dict) -> dict:
    if out.get("arch", "decoder") != "decoder" or out.get("universal") is not True or not KEPT["decoder"] <= out.keys():
        return out
    if out.keys() & UNIVERSAL_BEFORE_48.keys():
        return out
    return {**out, **UNIVERSAL_BEFORE_48}


def legacy_option(key: str) -> tuple[str, tuple[str, ...], str] | None:
    """(kind, owners, new name) of an old option key, e.g. 'sliding_window' -> ('attention', ('sliding',),
    'window'); None for any other key. Used by the messages about old keys given to a new config."""
    return OPTION_KEYS.get(key)


__all__ = ["ADDED_SINCE", "KEPT", "REGAINED", "LEGACY_DEFAULTS", "NEWER_ARCHS", "OPTION_KEYS", "legacy_option", "migrate"]
