"""Import Hugging Face TransfoXL checkpoints (`transfo-xl-wt103` and friends) without `transformers`.

Reads HF's `config.json` and `model.safetensors` or `pytorch_model.bin` (the latter only through
`torch.load(weights_only=True)`, which refuses anything but tensors and plain containers, so a
malicious pickle cannot run code) and writes our format: `config.json` + `model.safetensors`, plus
`vocab.json` from the tokenizer's `vocab.pkl` (read by `txl.data.hf_vocab` without unpickling), so that
`txl generate` and `txl eval` use the result directly.

The source is a directory or a hub repo id (`transfo-xl/transfo-xl-wt103`), fetched with
`huggingface_hub` (the `hf` extra) at a pinned revision; `HF_ENDPOINT` / `HF_HOME` are honoured.

Name map (HF -> txl), l = layer, i = cluster:
    transformer.word_emb.emb_layers.i.weight     -> embed.layers.i.weight
    transformer.word_emb.emb_projs.i             -> embed.projs.i
    transformer.layers.l.dec_attn.qkv_net.weight -> blocks.l.attn.q_proj.weight (rows [0, HD))
                                                    blocks.l.attn.kv_proj.weight (rows [HD, 3HD))
    transformer.layers.l.dec_attn.o_net.weight   -> blocks.l.attn.o_proj.weight
    transformer.layers.l.dec_attn.layer_norm.*   -> blocks.l.attn_norm.*
    transformer.layers.l.dec_attn.r_net.weight   -> pos.r_proj.l.weight
    transformer.layers.l.dec_attn.r_w_bias       -> pos.u[l]   (untie_r; else transformer.r_w_bias -> pos.u[0])
    transformer.layers.l.dec_attn.r_r_bias       -> pos.v[l]   (untie_r; else transformer.r_r_bias -> pos.v[0])
    transformer.layers.l.pos_ff.CoreNet.0.*      -> blocks.l.ff.fc1.*
    transformer.layers.l.pos_ff.CoreNet.3.*      -> blocks.l.ff.fc2.*
    transformer.layers.l.pos_ff.layer_norm.*     -> blocks.l.ff_norm.*
    crit.cluster_weight / crit.cluster_bias      -> head.cluster_weight / head.cluster_bias
    crit.out_layers.i.bias                       -> head.bias[cluster i]
    crit.out_layers.i.weight                     -> head.weights.i (only when not tied to the embedding)
    crit.out_projs.i                             -> head.projs.i (only when not tied)
"""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from txl.errors import CheckpointError, ConfigError
from txl.models.pretrained import (
    atomic_directory,
    check_header,
    check_state_dict,
    load_tensors,
    read_header,
    read_json,
    write_model_files,
)
from txl.models.registry import expected_tensors
from txl.models.transformer_xl.config import TransformerXLConfig

# TransfoXLConfig defaults of transformers 4.35.2, for keys an HF config.json leaves out.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 267735,
    "cutoffs": [20000, 40000, 200000],
    "d_model": 1024,
    "d_embed": 1024,
    "n_head": 16,
    "d_head": 64,
    "d_inner": 4096,
    "div_val": 4,
    "pre_lnorm": False,
    "n_layer": 18,
    "mem_len": 1600,
    "clamp_len": 1000,
    "same_length": True,
    "proj_share_all_but_first": True,
    "attn_type": 0,
    "dropout": 0.1,
    "dropatt": 0.0,
    "untie_r": True,
    "init_std": 0.02,
    "proj_init_std": 0.01,
    "layer_norm_epsilon": 1e-5,
    "tie_word_embeddings": True,
}


def convert_config(hf: dict[str, Any]) -> TransformerXLConfig:
    """HF TransfoXLConfig dict (new or pre-4.x key names) -> TransformerXLConfig.

    The dict comes from a stranger's config.json: every value is type-checked here, so a wrong one is
    a `ConfigError` naming the HF key, never a TypeError from `int(None)`.
    """
    if not isinstance(hf, dict):
        raise ConfigError(f"HF config must be a JSON object, got {type(hf).__name__}")
    if "pos_encoding" in hf:
        raise ConfigError("this is a txl config.json, not a Hugging Face one; load the directory with "
                          "TransformerXL.from_pretrained, no import needed")
    cfg = {**HF_DEFAULTS, **hf}
    if "n_token" in hf and "vocab_size" not in hf:  # pre-2020 configs
        cfg["vocab_size"] = hf["n_token"]
    if "tie_weight" in hf and "tie_word_embeddings" not in hf:
        cfg["tie_word_embeddings"] = hf["tie_weight"]

    def get(key: str, kind: type):
        value = cfg[key]
        ok = isinstance(value, bool) if kind is bool else (
            isinstance(value, int | float if kind is float else int) and not isinstance(value, bool))
        if not ok:
            raise ConfigError(f"HF config key {key!r} must be {kind.__name__}, got {value!r}")
        return kind(value)

    def get_list(key: str, kind: type) -> list:
        value = cfg[key]
        if not isinstance(value, list) or not all(isinstance(v, kind) and (kind is bool or not isinstance(v, bool))
                                                  for v in value):
            raise ConfigError(f"HF config key {key!r} must be a list of {kind.__name__}, got {value!r}")
        return value

    if get("attn_type", int) != 0:
        raise ConfigError(
            f"HF config has attn_type={cfg['attn_type']}; only attn_type 0 (relative positions) is "
            "supported by transformers and by this importer"
        )
    cutoffs = get_list("cutoffs", int)
    if hf.get("tie_projs") is not None:
        cfg["tie_projs"] = hf["tie_projs"]
        tie_projs = get_list("tie_projs", bool)
    else:
        tie_projs = [False] + [get("proj_share_all_but_first", bool)] * len(cutoffs)
    if cfg["d_embed"] is None:  # some hand-written configs: the embedding width is d_model
        cfg["d_embed"] = cfg["d_model"]
    clamp = get("clamp_len", int)
    return TransformerXLConfig(
        vocab_size=get("vocab_size", int),
        n_layer=get("n_layer", int),
        d_model=get("d_model", int),
        n_head=get("n_head", int),
        d_head=get("d_head", int),
        d_inner=get("d_inner", int),
        d_embed=get("d_embed", int),
        dropout=get("dropout", float),
        dropatt=get("dropatt", float),
        mem_len=get("mem_len", int),
        clamp_len=max(clamp, 0),  # HF/reference: <= 0 means no clamp
        same_length=get("same_length", bool),
        pre_lnorm=get("pre_lnorm", bool),
        final_norm=False,  # the reference has no final LayerNorm after pre-LN blocks
        untie_r=get("untie_r", bool),
        pos_encoding="xl",
        attention="full",
        cutoffs=tuple(cutoffs),
        div_val=get("div_val", int),
        tie_weight=get("tie_word_embeddings", bool),
        tie_projs=tuple(tie_projs),
        init_std=get("init_std", float),
        proj_init_std=get("proj_init_std", float),
        layer_norm_eps=get("layer_norm_epsilon", float),
    )


def convert_state_dict(hf: dict[str, Tensor], config: TransformerXLConfig) -> dict[str, Tensor]:
    """Map HF tensor names to ours. Raises CheckpointError naming the first missing HF tensor."""
    hf = {k.removeprefix("module."): v for k, v in hf.items()}

    def take(name: str) -> Tensor:
        if name not in hf:
            raise CheckpointError(f"HF checkpoint has no tensor {name!r}; is it a TransfoXLLMHeadModel?")
        return hf[name]

    hd = config.n_head * config.d_head
    n_clusters = len(config.cutoffs) + 1
    out: dict[str, Tensor] = {}
    emb_layers = 1 if config.div_val == 1 else n_clusters
    for i in range(emb_layers):
        out[f"embed.layers.{i}.weight"] = take(f"transformer.word_emb.emb_layers.{i}.weight")
    for i in range(n_clusters):
        name = f"transformer.word_emb.emb_projs.{i}"
        if name in hf:
            out[f"embed.projs.{i}"] = hf[name]
    for layer in range(config.n_layer):
        src = f"transformer.layers.{layer}."
        dst = f"blocks.{layer}."
        qkv = take(src + "dec_attn.qkv_net.weight")
        out[dst + "attn.q_proj.weight"] = qkv[:hd]
        out[dst + "attn.kv_proj.weight"] = qkv[hd:]
        out[dst + "attn.o_proj.weight"] = take(src + "dec_attn.o_net.weight")
        out[f"pos.r_proj.{layer}.weight"] = take(src + "dec_attn.r_net.weight")
        for kind in ("weight", "bias"):
            out[dst + f"attn_norm.{kind}"] = take(src + f"dec_attn.layer_norm.{kind}")
            out[dst + f"ff_norm.{kind}"] = take(src + f"pos_ff.layer_norm.{kind}")
            out[dst + f"ff.fc1.{kind}"] = take(src + f"pos_ff.CoreNet.0.{kind}")
            out[dst + f"ff.fc2.{kind}"] = take(src + f"pos_ff.CoreNet.3.{kind}")
    if config.untie_r:
        out["pos.u"] = torch.stack([take(f"transformer.layers.{i}.dec_attn.r_w_bias") for i in range(config.n_layer)])
        out["pos.v"] = torch.stack([take(f"transformer.layers.{i}.dec_attn.r_r_bias") for i in range(config.n_layer)])
    else:
        out["pos.u"] = take("transformer.r_w_bias")[None]
        out["pos.v"] = take("transformer.r_r_bias")[None]
    if config.cutoffs:
        out["head.cluster_weight"] = take("crit.cluster_weight")
        out["head.cluster_bias"] = take("crit.cluster_bias")
    out_layers = 1 if config.div_val == 1 else n_clusters
    out["head.bias"] = torch.cat([take(f"crit.out_layers.{i}.bias") for i in range(out_layers)])
    if not config.tie_weight:
        for i in range(out_layers):
            out[f"head.weights.{i}"] = take(f"crit.out_layers.{i}.weight")
    tie_projs = config.resolved_tie_projs
    for i in range(n_clusters):
        name = f"crit.out_projs.{i}"
        if not tie_projs[i] and name in hf:
            out[f"head.projs.{i}"] = hf[name]
    return out


def read_hf_weight_table(src: Path) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], dict[str, Tensor] | None]:
    """name -> (dtype, shape) of the HF weights, from model.safetensors' header alone (no tensor read:
    None is returned with it); a pytorch_model.bin has no header, so its tensors are read (no more than
    the file holds) and returned with the table."""
    if _weights_file(src).name == "model.safetensors":
        return read_header(src / "model.safetensors", "HF weights")[0], None
    tensors = read_hf_weights(src)
    return {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}, tensors


def check_hf_weights(config: TransformerXLConfig, table: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                     src: Path) -> None:
    """The HF weights' names, shapes and dtypes against what config.json implies, before anything is built
    or allocated: a config.json that declares a far larger model than its weights (vocab_size 2**21 next to
    96 KB of tensors cost 2.3 GB when the model was built first) is refused in one line."""
    # the tensors that grow with vocab_size first, from the config alone: building even a meta model costs
    # ~75 MB (torch's meta kernels), which a vocab_size bomb should not be worth
    for name, want in _embedding_shapes(config).items():
        found = table.get(name)
        if found is not None and found[1] != want:
            raise CheckpointError(f"{src}: tensor {name!r} has shape {found[1]} but config.json (vocab_size="
                                  f"{config.vocab_size}, cutoffs {list(config.cutoffs)}) implies {want}; the weights "
                                  "and config.json disagree")
    held = sum(math.prod(shape) for _, shape in table.values())
    if config.num_parameters_estimate() > 8 * held:  # far off: not worth even a model on the meta device
        raise CheckpointError(f"{src}: config.json describes a model of at least {config.num_parameters_estimate():,} "
                              f"parameters but the HF weights hold {held:,}; the weights and config.json disagree")
    # the conversion itself, on tensors that hold no memory: names, splits and stacks as the real ones
    meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (dtype, shape) in table.items()}
    try:
        converted = convert_state_dict(meta, config)
    except (RuntimeError, IndexError) as err:  # torch.stack / torch.cat of tensors whose shapes disagree
        msg = str(err).splitlines()[0][:200]
        raise CheckpointError(f"{src}: the HF tensors do not have the shapes config.json implies ({msg})") from None
    check_header(expected_tensors(config), {k: (v.dtype, tuple(v.shape)) for k, v in converted.items()}, src)


def _embedding_shapes(config: TransformerXLConfig) -> dict[str, tuple[int, ...]]:
    """The HF embedding tables config.json implies (one per cluster, or one when div_val is 1)."""
    from txl.models.transformer_xl.adaptive import cluster_bounds, cluster_dims

    bounds, dims = cluster_bounds(config), cluster_dims(config)
    if config.div_val == 1:
        return {"transformer.word_emb.emb_layers.0.weight": (config.vocab_size, dims[0])}
    return {f"transformer.word_emb.emb_layers.{i}.weight": (hi - lo, d)
            for i, ((lo, hi), d) in enumerate(zip(bounds, dims))}


def _weights_file(src: Path) -> Path:
    for name in WEIGHT_FILES:
        if os.path.lexists(src / name):
            return src / name
    raise CheckpointError(f"{src} has neither model.safetensors nor pytorch_model.bin")


def read_hf_weights(src: Path) -> dict[str, Tensor]:
    safetensors_file = src / "model.safetensors"
    bin_file = src / "pytorch_model.bin"
    if _weights_file(src) == safetensors_file:
        tensors, _ = load_tensors(safetensors_file, "HF weights")
        return tensors
    if bin_file.is_file():
        if _torch_version() < (2, 6):  # weights_only=True could be bypassed before 2.6 (CVE-2025-32434)
            raise CheckpointError(f"refusing to read {bin_file} with torch {torch.__version__}: its weights_only "
                                  "loader can be bypassed (CVE-2025-32434); upgrade to torch>=2.6 or use "
                                  "model.safetensors")
        try:
            # weights_only=True: tensors and plain containers only; never executes pickled code.
            state = torch.load(bin_file, map_location="cpu", weights_only=True)
        except Exception as err:  # torch raises UnpicklingError, RuntimeError, EOFError... for bad files
            # Never echo torch's own advice here: it suggests turning weights_only off, i.e. running the code.
            found = re.search(r"GLOBAL ([\w.]+)", str(err))
            why = (f"it refers to the Python object {found.group(1)}, and unpickling it could run code" if found
                   else "it is damaged or not a PyTorch file")
            raise CheckpointError(f"cannot read {bin_file} as a tensor-only checkpoint: {why}; refused (use the "
                                  "model.safetensors of the same model instead)") from None
        if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
            raise CheckpointError(f"{bin_file} is not a state dict of tensors")
        return state
    raise CheckpointError(f"{bin_file} is not a regular file; replace it with the weights file")


def _torch_version() -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


# Revisions known to hold the published weights; a repo id given without --revision is fetched at these.
KNOWN_REVISIONS = {"transfo-xl/transfo-xl-wt103": "40a186da79458c9f9de846edfaea79c412137f97"}
LEGACY_IDS = {"transfo-xl-wt103": "transfo-xl/transfo-xl-wt103"}  # the pre-2023 names, as transformers knew them
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")


def looks_like_repo_id(text: str) -> bool:
    """owner/name, or one of the legacy bare names (a bare word is more likely a mistyped directory)."""
    if text in LEGACY_IDS:
        return True
    return "/" in text and bool(_REPO_ID.fullmatch(text)) and ".." not in text and not text.endswith((".", "-"))


def download_hf(repo_id: str, revision: str | None = None) -> Path:
    """Fetch config.json, the weights, vocab.pkl, tokenizer_config.json and added_tokens.json of `repo_id`
    into the hub cache; returns the snapshot directory. One-line `CheckpointError` for every failure (no
    network included)."""
    try:
        import huggingface_hub
        from huggingface_hub.utils import EntryNotFoundError, HfHubHTTPError
        from huggingface_hub.utils import logging as hub_logging
    except ImportError:
        raise CheckpointError(f"{repo_id!r} is not a directory; to download it by repo id install the optional "
                              "dependency huggingface_hub: pip install 'txl[hf]'") from None
    repo_id = LEGACY_IDS.get(repo_id, repo_id)
    revision = revision or KNOWN_REVISIONS.get(repo_id, "main")
    # Read at call time (huggingface_hub reads them once, at import).
    endpoint = os.environ.get("HF_ENDPOINT") or None
    cache_dir = os.environ.get("HF_HUB_CACHE") or (
        os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None)
    where = f"{repo_id} (revision {revision}) from {endpoint or 'https://huggingface.co'}"

    def fetch(filename: str, required: bool) -> Path | None:
        if re.fullmatch(r"[0-9a-f]{40}", revision):  # a commit never changes: its cached files need no request
            cached = huggingface_hub.try_to_load_from_cache(repo_id, filename, cache_dir=cache_dir, revision=revision)
            if isinstance(cached, str):
                return Path(cached)
            if cached is not None and not required:  # the cache recorded that the commit has no such file
                return None
        try:
            return Path(huggingface_hub.hf_hub_download(repo_id, filename, revision=revision, endpoint=endpoint,
                                                        cache_dir=cache_dir))
        except huggingface_hub.utils.LocalEntryNotFoundError:
            raise CheckpointError(f"cannot download {where}: the hub is unreachable (no network?) and the files "
                                  "are not in the local cache; connect, or download the repository's files "
                                  "yourself and pass their directory") from None
        except EntryNotFoundError:
            if required:
                raise CheckpointError(f"cannot download {where}: the repository has no {filename}") from None
            return None
        except huggingface_hub.utils.RepositoryNotFoundError:
            raise CheckpointError(f"cannot download {where}: no such repository (or it is private), and no local "
                                  f"directory {repo_id} either; check the repo id or the path") from None
        except huggingface_hub.utils.RevisionNotFoundError:
            raise CheckpointError(f"cannot download {where}: no such revision; check --revision") from None
        except (HfHubHTTPError, OSError) as err:
            why = " ".join(str(err).split()) or type(err).__name__
            raise CheckpointError(f"cannot download {where}: {why[:300]}") from None

    verbosity = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()  # its retry warnings would bury our one line; progress bars stay
    try:
        config = fetch("config.json", True)
        if fetch(WEIGHT_FILES[0], False) is None:
            fetch(WEIGHT_FILES[1], True)
        fetch("vocab.pkl", False)
        fetch("tokenizer_config.json", False)
        fetch("added_tokens.json", False)  # tokens added beyond vocab.pkl (transformers < 4.34 lists them only here)
    finally:
        hub_logging.set_verbosity(verbosity)
    return config.parent


def resolve_source(src: str | Path, revision: str | None = None) -> Path:
    """A local HF directory as it is, or a repo id downloaded (see `download_hf`)."""
    path = Path(src)
    if path.is_dir():
        if revision is not None:
            raise CheckpointError(f"--revision applies to a hub repo id, but {src} is a local directory")
        return path
    text = str(src)
    if path.exists() or not looks_like_repo_id(text) or text.startswith((".", "~")):
        raise CheckpointError(f"HF checkpoint directory not found: {src} (give a directory with config.json, or a "
                              "hub repo id such as transfo-xl/transfo-xl-wt103)")
    return download_hf(text, revision)


def read_source_vocab(src: Path, vocab_size: int):
    """vocab.json content from `src/vocab.pkl` and the tokens added beyond it (None when there is no
    vocab.pkl); checked against the model."""
    from txl.data.hf_vocab import read_added_tokens, read_hf_vocab, read_tokenizer_config

    pkl = src / "vocab.pkl"
    if not os.path.lexists(pkl):
        return None
    tokenizer_config = read_tokenizer_config(src / "tokenizer_config.json")
    added = read_added_tokens(src, tokenizer_config)
    vocab = read_hf_vocab(pkl, tokenizer_config=tokenizer_config, added_tokens=added)
    if vocab.size != vocab_size:
        with_added = f" (with the tokens of {added.source.name})" if added is not None else ""
        raise CheckpointError(f"{pkl} has {vocab.size} symbols{with_added} but config.json has "
                              f"vocab_size={vocab_size}; they are not the same model's")
    return vocab


def import_hf(src: str | Path, out: str | Path, *, revision: str | None = None) -> TransformerXLConfig:
    """Convert HF directory or repo id `src` into a txl checkpoint directory `out` (written atomically)."""
    from txl.models.transformer_xl.model import TransformerXL

    src = resolve_source(src, revision)
    try:
        config = convert_config(read_json(src / "config.json", "HF config"))
    except ConfigError as err:
        raise CheckpointError(f"{src / 'config.json'}: {err}") from None
    # the vocabulary first: it costs least to refuse (checking the weights builds a model on the meta device)
    vocab = read_source_vocab(src, config.vocab_size)  # before anything is written: a refused file leaves nothing
    table, tensors = read_hf_weight_table(src)
    check_hf_weights(config, table, src)  # before anything is built or allocated
    tensors = convert_state_dict(tensors if tensors is not None else read_hf_weights(src), config)
    model = TransformerXL(config)
    expected = model.state_dict()
    check_state_dict(expected, tensors, src)
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in tensors.items()})
    with atomic_directory(out) as tmp:
        write_model_files(model, tmp)
        if vocab is not None:
            vocab.save(tmp / "vocab.json")
    if vocab is None:
        print(f"note: {src} has no vocab.pkl, so {out} has no vocab.json: `txl generate` needs one, and `txl eval` "
              "can only check the vocabulary size", file=sys.stderr)
    return config
