"""Typed model configuration with validation and a JSON round-trip.

`TransformerXLConfig` holds the shape of a model and the settings its forward pass reads. Every field
is checked when the config is built: an impossible value raises `ConfigError` (a `ValueError`) whose
message names the field. `from_dict` also rejects unknown keys and wrong types by name, so a typo in
a `config.json` or a TOML preset is never silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args, get_origin

from txl.errors import ConfigError, did_you_mean, parse_json
from txl.io import CONFIG_LIMIT, read_text, write_text

# Names, not integer codes (the reference's `attn_type` 0..3 maps to xl, shaw, sinusoidal, learned).
# These are the built-in entries of the registries (`txl.nn.positional.register_encoding`,
# `txl.nn.attention.register`); a name registered from user code is accepted too.
PositionalName = Literal["xl", "shaw", "sinusoidal", "learned", "rope", "alibi", "t5", "xpos"]
# The long-text arena (README "The arena"): every kernel takes the same inputs, see txl/nn/attention/.
AttentionName = Literal[
    "full", "sliding", "sparse", "performer", "linformer", "linear", "bigbird", "lsh", "routing", "sinkhorn",
    "compressed", "synthesizer", "inducing",
]
AttentionImpl = Literal["auto", "eager", "fast"]
Backend = Literal["auto", "reference"]
CompressionName = Literal["conv", "mean", "max"]
LinearFeature = Literal["elu", "relu"]
SynthesizerMode = Literal["dense", "random"]
PositionMerge = Literal["add", "mul", "concat"]
Arch = Literal["decoder", "encoder-decoder", "lstm", "sha-rnn"]
RNNAttention = Literal["penultimate", "all"]
RNN_ARCHS = ("lstm", "sha-rnn")
# What the recurrent LMs (txl.models.rnn.model) read; any other field set away from its default is refused for them.
RNN_FIELDS = {
    "lstm": {"arch", "vocab_size", "n_layer", "d_model", "d_inner", "dropout", "mem_len", "tie_weight",
             "dropout_embed", "dropout_input", "dropout_hidden", "weight_drop"},
    "sha-rnn": {"arch", "vocab_size", "n_layer", "d_model", "d_inner", "dropout", "dropatt", "mem_len", "tie_weight",
                "layer_norm_eps", "dropout_embed", "dropout_input", "dropout_hidden", "weight_drop",
                "rnn_attention"},
}
RNN_ONLY_FIELDS = ("dropout_embed", "dropout_input", "dropout_hidden", "weight_drop", "rnn_attention")
DECODER_TOO = ("dropout_embed", "dropout_input")  # of RNN_ONLY_FIELDS, what arch = "decoder" reads as well

POSITIONAL_NAMES: tuple[str, ...] = get_args(PositionalName)
ATTENTION_NAMES: tuple[str, ...] = get_args(AttentionName)
ATTENTION_IMPLS: tuple[str, ...] = get_args(AttentionImpl)
REGISTRY_FIELDS = ("attention", "pos_encoding")  # Literal fields that also accept registered names

# Upper bounds, checked at validation: far above any published model (enwik8-large: 24 layers,
# d_model 1024, d_inner 3072; lm1b: vocabulary 793k), low enough that a config.json from a stranger
# cannot make txl compute sizes that overflow or allocate before its weights are checked.
MAX_LAYERS = 1024
MAX_WIDTH = 65536  # d_model, d_embed, n_head × d_head
MAX_INNER = 1 << 20  # d_inner
MAX_VOCAB = 1 << 24
MAX_LENGTH = 1 << 24  # mem_len, clamp_len, cmem_len, windows, max_positions, ... (tokens)
UPPER_BOUNDS: dict[str, int] = {
    "vocab_size": MAX_VOCAB, "n_layer": MAX_LAYERS, "d_model": MAX_WIDTH, "n_head": 4096, "d_head": MAX_WIDTH,
    "d_inner": MAX_INNER, "d_embed": MAX_WIDTH, "div_val": 1 << 10, "mem_len": MAX_LENGTH, "clamp_len": MAX_LENGTH,
    "max_relative_distance": MAX_LENGTH, "max_positions": MAX_LENGTH, "sliding_window": MAX_LENGTH,
    "global_tokens": MAX_LENGTH, "sparse_stride": MAX_LENGTH, "performer_features": MAX_WIDTH,
    "performer_redraw_interval": 1 << 40, "linformer_k": MAX_LENGTH, "linformer_max_len": MAX_LENGTH,
    "cmem_len": MAX_LENGTH, "cmem_ratio": MAX_LENGTH, "memory_tokens": MAX_LENGTH,
}


@dataclass
class TransformerXLConfig:
    REGISTRY_FIELDS: ClassVar[tuple[str, ...]] = REGISTRY_FIELDS
    # decoder = the Transformer-XL LM (`TransformerXL`); encoder-decoder = Vaswani et al. 2017 for
    # sequence-to-sequence tasks (`txl.models.seq2seq.EncoderDecoder`): n_layer decoder blocks with
    # cross-attention over n_encoder_layer bidirectional blocks. lstm = AWD-LSTM (Merity et al. 2018),
    # sha-rnn = SHA-RNN (Merity 2019), both `txl.models.rnn.model.RecurrentLM`: n_layer LSTMs, d_model = embedding and
    # softmax width, d_inner = the LSTM width of all but the last lstm layer / sha-rnn's Boom width,
    # mem_len = sha-rnn's attention memory (0: nothing carried across segments), dropout = on the output.
    arch: Arch = "decoder"
    # --- shape --------------------------------------------------------------------------------
    vocab_size: int = 256
    n_layer: int = 12
    d_model: int = 512
    n_head: int = 8
    d_head: int = 64
    d_inner: int = 2048  # FFN width: Linear(d_model, d_inner) -> ReLU -> Linear(d_inner, d_model)
    d_embed: int | None = None  # embedding width before projection to d_model; None = d_model
    # --- regularisation -----------------------------------------------------------------------
    dropout: float = 0.1  # on embeddings, position embeddings, attention output, FFN
    dropatt: float = 0.0  # on attention probabilities
    # --- recurrence and positions -------------------------------------------------------------
    mem_len: int = 512  # hidden states kept per layer; 0 = vanilla Transformer LM (Al-Rfou et al.)
    clamp_len: int = 0  # relative distances beyond this share one position vector; 0 = no clamp
    same_length: bool = False  # every query sees exactly mem_len keys (kimiyoung's convention)
    pre_lnorm: bool = False  # pre-LN blocks; default post-LN as the paper
    final_norm: bool = True  # with pre_lnorm: a final LayerNorm (the reference lacks it; HF imports turn it off)
    untie_r: bool = False  # per-layer u, v biases (TF large models) instead of shared (PyTorch ref)
    pos_encoding: PositionalName = "xl"
    max_relative_distance: int = 64  # shaw: distances beyond this share one embedding
    shaw_values: bool = False  # shaw: also add the distance embedding on the value side
    max_positions: int = 1024  # learned: rows of the absolute table (inputs longer than this fail)
    hierarchical: float = 0.0  # learned: α of Su's decomposition, reaching max_positions²; 0 = off
    position_merge: PositionMerge = "add"  # learned: add | mul (x·(e+1)) | concat (projected back to d_model)
    t5_buckets: int = 32  # t5: relative-position buckets (half exact, half log-spaced)
    t5_max_distance: int = 128  # t5: distances beyond this share the last bucket
    xpos_scale_base: int = 512  # xpos: B in the decay ζ^(distance/B); larger = slower decay
    # --- attention kernel ---------------------------------------------------------------------
    attention: AttentionName = "full"
    attention_impl: AttentionImpl = "auto"  # the kernel: eager = the reference einsum; fast = fused/strided; auto = fast if any
    backend: Backend = "auto"  # auto = the CPU fast backend (txl/fast: dropout RNG, oneDNN linears, caches); reference = plain PyTorch
    causal: bool = True  # False = bidirectional encoder (masked LM): no memory, no causal mask
    # sliding (Longformer): O(n·w) time and memory instead of O(n²)
    sliding_window: int = 256  # keys each query sees, itself included (counted in dilated steps)
    sliding_dilation: tuple[int, ...] = ()  # per head (or one value for all); () = 1: no gaps
    global_tokens: int = 0  # the first g positions of each segment attend to and are seen by all
    # sparse (Child et al. 2019, strided): half the heads local, half every sparse_stride-th key
    sparse_stride: int = 128  # l: local window and stride; the paper picks l ≈ sqrt(context)
    # performer (FAVOR+): more features = closer to softmax, cost O(n·features·d_head)
    performer_features: int = 256
    performer_redraw_interval: int = 1000  # redraw features every N training forwards; 0 = never
    # linformer: keys/values projected along the sequence to linformer_k rows (bidirectional only)
    linformer_k: int = 256
    linformer_max_len: int = 512  # longest input the projections cover (their number of columns)
    # linear (Katharopoulos et al. 2020): φ(q)·φ(k) by prefix sums, O(n·d²)
    linear_feature: LinearFeature = "elu"  # elu = elu+1 (Katharopoulos); relu = Performer's generalised kernel
    # bigbird (Zaheer et al. 2020): blocks of bigbird_block; each query block sees its window, global, random blocks
    bigbird_block: int = 64  # tokens per block: the unit of the pattern
    bigbird_window: int = 1  # blocks on each side of a query block (causal: before it) it sees; 0 = its own only
    bigbird_global: int = 1  # the first g blocks of the keys see and are seen by all
    bigbird_random: int = 2  # r random (earlier, when causal) blocks per query block, a fixed hash pattern
    # lsh (Kitaev et al. 2020) / routing (Roy et al. 2021): shared-QK, each query sees the bucket_window
    # most recent keys of its hash bucket (lsh) or k-means cluster (routing); O(n·bucket_window)
    bucket_window: int = 64  # keys per query within its bucket (the sorted chunk length)
    lsh_buckets: int = 32  # hash buckets per round (even: random rotations ±)
    lsh_hashes: int = 2  # hash rounds: a query sees the union of its buckets over the rounds
    routing_clusters: int = 16  # k-means centroids per layer
    routing_decay: float = 0.999  # EMA decay of the centroids (updated in training)
    # sinkhorn (Tay et al. 2020): each block sees itself and one learned-sorted mix of (earlier) blocks
    sinkhorn_block: int = 64
    sinkhorn_iters: int = 8  # Sinkhorn balancing steps (bidirectional; causal normalises rows only)
    sinkhorn_temperature: float = 0.75
    # compressed (Liu et al. 2018): keys/values compressed compress_ratio:1 by a strided convolution
    compress_ratio: int = 4
    # synthesizer (Tay et al. 2021): scores synthesised per query (dense) or learned (random) by distance
    synthesizer_mode: SynthesizerMode = "dense"
    synthesizer_max_len: int = 256  # distances a query can see (its window, itself included)
    # inducing (Set Transformer ISAB, Lee et al. 2019): queries attend to m learned summaries (bidirectional)
    inducing_points: int = 32
    # memory tokens (Sukhbaatar et al. 2019 persistent memory; ETC-style global memory): m learned key/value
    # vectors per layer and head that every query attends to, beside [memory ; segment]; 0 = off
    memory_tokens: int = 0
    # compressive memory (Rae et al. 2020): states leaving mem_len are compressed cmem_ratio:1
    cmem_len: int = 0  # compressed states kept per layer; 0 = off (plain Transformer-XL memory)
    cmem_ratio: int = 4  # c: states per compressed state
    cmem_fn: CompressionName = "conv"  # conv (learned, with the attention-reconstruction loss) | mean | max
    # universal transformer (Dehghani et al. 2019): one shared block, up to n_layer steps, ACT halting
    universal: bool = False  # n_layer becomes the maximum depth (max_depth) of the shared block
    act_threshold: float = 0.99  # a position halts once its summed halting probability reaches this
    ponder_cost: float = 0.01  # τ: weight of the ponder cost (steps + remainder) in the training loss
    # --- adaptive input / softmax (Baevski & Auli 2019; Grave et al. 2017) ---------------------
    cutoffs: tuple[int, ...] = ()  # empty = one full softmax; e.g. (20000, 40000, 200000) for wt103
    div_val: int = 1  # cluster i has d_embed // div_val**i dims
    tie_weight: bool = True  # output cluster weights = input embedding weights
    tie_projs: tuple[bool, ...] | None = None  # per cluster; None = (False, True, True, ...) as wt103
    # --- encoder-decoder (arch = "encoder-decoder") --------------------------------------------
    n_encoder_layer: int = 0  # encoder blocks; 0 = n_layer
    source_vocab_size: int = 0  # source ids; 0 = one vocabulary shared with the target (vocab_size)
    share_embeddings: bool = True  # one vocabulary: source and target read one embedding table
    # --- AWD-LSTM's dropoute/dropouti (txl/nn/regularization.py): the recurrent LMs and arch = "decoder"
    dropout_embed: float = 0.0  # whole-word dropout: a dropped word's embedding is zero everywhere in the batch
    dropout_input: float = 0.0  # locked (variational) dropout on the embeddings: one mask per sequence
    # (decoder: instead of `dropout` on the embeddings)
    # --- recurrent LMs only (arch = "lstm" | "sha-rnn", txl/models/rnn/model.py; AWD-LSTM's dropouth/wdrop)
    dropout_hidden: float = 0.0  # lstm: locked dropout between layers; sha-rnn: dropout inside the blocks
    weight_drop: float = 0.0  # DropConnect on the LSTM hidden-to-hidden matrices (training only)
    rnn_attention: RNNAttention = "penultimate"  # sha-rnn: attention on the penultimate block (the paper) or all
    # --- initialisation (reference: normal init) ----------------------------------------------
    init_std: float = 0.02
    proj_init_std: float = 0.01
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        # Accept lists from JSON/TOML for tuple fields.
        if isinstance(self.cutoffs, list):
            self.cutoffs = tuple(self.cutoffs)
        if isinstance(self.sliding_dilation, list):
            self.sliding_dilation = tuple(self.sliding_dilation)
        if isinstance(self.tie_projs, list):
            self.tie_projs = tuple(self.tie_projs)
        _check_types(self)
        self._validate()

    # ------------------------------------------------------------------------------------------
    @property
    def embed_dim(self) -> int:
        return self.d_model if self.d_embed is None else self.d_embed

    @property
    def adaptive(self) -> bool:
        return len(self.cutoffs) > 0

    @property
    def resolved_tie_projs(self) -> tuple[bool, ...]:
        if self.tie_projs is not None:
            return self.tie_projs
        return (False,) + (True,) * len(self.cutoffs)

    def _validate(self) -> None:
        for name, limit in UPPER_BOUNDS.items():
            value = getattr(self, name)
            if value is not None and value > limit:
                value = f"{value:,}" if value < 10**15 else f"{value:.3g}"
                raise ConfigError(f"config.{name} must be <= {limit:,}, got {value}; no model txl can build "
                                  "has that size (is the config damaged?)")
        if self.n_head * self.d_head > MAX_WIDTH:
            raise ConfigError(f"config.n_head × d_head must be <= {MAX_WIDTH:,}, got {self.n_head * self.d_head:,}")
        if any(v > MAX_LENGTH for v in (*self.cutoffs, *self.sliding_dilation)):
            raise ConfigError(f"config.cutoffs and sliding_dilation values must be <= {MAX_LENGTH:,}")
        positive = ["vocab_size", "n_layer", "d_model", "n_head", "d_head", "d_inner", "div_val"]
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"config.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_embed is not None and self.d_embed < 1:
            raise ConfigError(f"config.d_embed must be >= 1 (or null for d_model), got {self.d_embed}")
        for name in ["mem_len", "clamp_len", "max_relative_distance"]:
            if getattr(self, name) < 0:
                raise ConfigError(f"config.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_positions < 1:
            raise ConfigError(f"config.max_positions must be >= 1, got {self.max_positions}")
        for name in ["dropout", "dropatt"]:
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ConfigError(f"config.{name} must be in [0, 1), got {p}")
        for name in ["init_std", "proj_init_std", "layer_norm_eps"]:
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"config.{name} must be > 0, got {getattr(self, name)}")
        if self.same_length and self.mem_len < 1:
            raise ConfigError(
                "config.same_length needs mem_len >= 1 (each query sees exactly mem_len keys); "
                "set mem_len or same_length=false"
            )
        cut = list(self.cutoffs)
        if cut:
            if any(c <= 0 for c in cut) or any(b <= a for a, b in zip(cut, cut[1:])):
                raise ConfigError(f"config.cutoffs must be positive and strictly increasing, got {cut}")
            if cut[-1] >= self.vocab_size:
                raise ConfigError(
                    f"config.cutoffs must all be < vocab_size={self.vocab_size}, got {cut}"
                )
            if self.div_val > 1 and self.embed_dim // self.div_val ** len(cut) < 1:
                raise ConfigError(
                    f"config.div_val={self.div_val} leaves a cluster with 0 embedding dims "
                    f"(d_embed={self.embed_dim}, {len(cut)} tail clusters); lower div_val"
                )
        elif self.div_val != 1:
            raise ConfigError("config.div_val > 1 needs cutoffs (adaptive input/softmax clusters)")
        if self.tie_projs is not None and len(self.tie_projs) != len(cut) + 1:
            raise ConfigError(
                f"config.tie_projs needs one entry per cluster ({len(cut) + 1}), got {len(self.tie_projs)}"
            )
        if self.pos_encoding == "sinusoidal" and self.d_model % 2:
            raise ConfigError("config.d_model must be even for pos_encoding='sinusoidal'")
        if self.pos_encoding == "rope" and self.d_head % 2:
            raise ConfigError("config.d_head must be even for pos_encoding='rope'")
        if self.pos_encoding == "xpos" and self.d_head % 2:
            raise ConfigError("config.d_head must be even for pos_encoding='xpos'")
        if not 0.0 <= self.hierarchical < 1.0:
            raise ConfigError(f"config.hierarchical must be in [0, 1) (α; 0 = off), got {self.hierarchical}")
        for name, default in (("hierarchical", 0.0), ("position_merge", "add")):
            if getattr(self, name) != default and self.pos_encoding != "learned":
                raise ConfigError(f"config.{name} only applies to pos_encoding='learned'")
        for name in ("t5_buckets", "t5_max_distance", "xpos_scale_base"):
            if getattr(self, name) < 1:
                raise ConfigError(f"config.{name} must be >= 1, got {getattr(self, name)}")
        if self.pos_encoding == "t5" and (self.t5_buckets < 4 or self.t5_max_distance <= self.t5_buckets // 2):
            raise ConfigError(
                f"config.t5_buckets must be >= 4 and t5_max_distance > t5_buckets/2 (got {self.t5_buckets}, "
                f"{self.t5_max_distance}): half the buckets are exact distances, the rest log-spaced beyond"
            )
        if self.shaw_values and self.pos_encoding != "shaw":
            raise ConfigError("config.shaw_values only applies to pos_encoding='shaw'")
        if self.untie_r and self.pos_encoding != "xl":
            raise ConfigError("config.untie_r only applies to pos_encoding='xl' (the u, v biases)")
        if not 0.0 < self.act_threshold <= 1.0:
            raise ConfigError(f"config.act_threshold must be in (0, 1], got {self.act_threshold}")
        if not 0.0 <= self.ponder_cost < math.inf:
            raise ConfigError(f"config.ponder_cost must be >= 0, got {self.ponder_cost}")
        if self.universal and self.d_model % 2:
            raise ConfigError("config.d_model must be even with universal=true (the sinusoidal step signal)")
        if self.universal and self.cmem_len:
            raise ConfigError("config.cmem_len (compressive memory) is not available with universal=true")
        self._validate_arena()
        self._validate_arch()

    def _validate_arch(self) -> None:
        """The encoder-decoder's own fields, and what it cannot take (yet): memory, adaptive softmax."""
        for name in ["n_encoder_layer", "source_vocab_size"]:
            if getattr(self, name) < 0:
                raise ConfigError(f"config.{name} must be >= 0, got {getattr(self, name)}")
        self._validate_rnn()
        if self.arch in RNN_ARCHS:
            return
        if self.arch == "decoder":
            for name, default in [("n_encoder_layer", 0), ("source_vocab_size", 0)]:
                if getattr(self, name) != default:
                    raise ConfigError(f"config.{name} only applies to arch='encoder-decoder'")
            return
        from txl.nn.attention.registry import SPECS
        from txl.nn.positional import POSITIONAL_ENCODINGS

        for name in ["mem_len", "cmem_len", "memory_tokens"]:
            if getattr(self, name):
                raise ConfigError(f"config.{name} must be 0 with arch='encoder-decoder' (no segment memory); "
                                  f"set {name}=0")
        if self.cutoffs:
            raise ConfigError("config.cutoffs (adaptive softmax) does not apply to arch='encoder-decoder'; set cutoffs=[]")
        if not self.causal:
            raise ConfigError("config.causal must be true with arch='encoder-decoder' (its decoder is causal, its "
                              "encoder bidirectional by construction)")
        if POSITIONAL_ENCODINGS[self.pos_encoding].causal_only:
            allowed = ", ".join(name for name, cls in POSITIONAL_ENCODINGS.items() if not cls.causal_only)
            raise ConfigError(f"config.pos_encoding={self.pos_encoding!r} is defined for causal distances only; "
                              f"the encoder of arch='encoder-decoder' is bidirectional: use one of {allowed}")
        if not (SPECS[self.attention].bidirectional and SPECS[self.attention].cross_attention):
            able = ", ".join(sorted(name for name, spec in SPECS.items()
                                    if spec.bidirectional and spec.causal and spec.cross_attention))
            raise ConfigError(f"config.attention={self.attention!r} cannot run the bidirectional encoder and "
                              f"cross-attention of arch='encoder-decoder'; use one of {able}")
        if self.share_embeddings and self.source_vocab_size not in (0, self.vocab_size):
            raise ConfigError(f"config.share_embeddings needs one vocabulary, but source_vocab_size="
                              f"{self.source_vocab_size} != vocab_size={self.vocab_size}; set share_embeddings=false")

    def _validate_rnn(self) -> None:
        """The recurrent LMs' fields (txl/models/rnn/model.py); a Transformer setting given to them is refused by name
        rather than silently ignored."""
        for name in ["dropout_embed", "dropout_input", "dropout_hidden", "weight_drop"]:
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ConfigError(f"config.{name} must be in [0, 1), got {p}")
        if self.arch not in RNN_ARCHS:
            for f in dataclasses.fields(self):
                if f.name in RNN_ONLY_FIELDS and getattr(self, f.name) != f.default:
                    if f.name in DECODER_TOO and self.arch == "decoder":
                        continue
                    able = "'decoder', 'lstm' or 'sha-rnn'" if f.name in DECODER_TOO else "'lstm' or 'sha-rnn' (recurrent LMs)"
                    raise ConfigError(f"config.{f.name} only applies to arch={able}")
            return
        used = RNN_FIELDS[self.arch]
        for f in dataclasses.fields(self):
            if f.name not in used and getattr(self, f.name) != f.default:
                raise ConfigError(f"config.{f.name} does not apply to arch={self.arch!r} (the recurrent LM reads "
                                  f"only {', '.join(sorted(used - {'arch'}))}); remove it")
        if self.arch == "sha-rnn" and self.d_inner % self.d_model:
            raise ConfigError(f"config.d_inner must be a multiple of d_model with arch='sha-rnn' (the Boom sums "
                              f"d_inner/d_model chunks back to d_model), got {self.d_inner} and {self.d_model}")

    def _validate_arena(self) -> None:
        """The long-text attention variants and the bidirectional encoder (README "The arena"). What a
        kernel can take is checked by the kernel's registry entry (`txl.nn.attention.registry.check_config`)."""
        for name in ["sliding_window", "sparse_stride", "performer_features", "linformer_k",
                     "linformer_max_len", "cmem_ratio"]:
            if getattr(self, name) < 1:
                raise ConfigError(f"config.{name} must be >= 1, got {getattr(self, name)}")
        for name in ["bigbird_block", "bucket_window", "lsh_buckets", "lsh_hashes",
                     "routing_clusters", "sinkhorn_block", "sinkhorn_iters", "compress_ratio", "synthesizer_max_len",
                     "inducing_points"]:
            if getattr(self, name) < 1:
                raise ConfigError(f"config.{name} must be >= 1, got {getattr(self, name)}")
        for name in ["bigbird_window", "bigbird_global", "bigbird_random"]:
            if getattr(self, name) < 0:
                raise ConfigError(f"config.{name} must be >= 0, got {getattr(self, name)}")
        if self.lsh_buckets % 2:
            raise ConfigError(f"config.lsh_buckets must be even (random rotations ±), got {self.lsh_buckets}")
        if not 0.0 <= self.routing_decay < 1.0:
            raise ConfigError(f"config.routing_decay must be in [0, 1), got {self.routing_decay}")
        if not 0.0 < self.sinkhorn_temperature < math.inf:
            raise ConfigError(f"config.sinkhorn_temperature must be > 0, got {self.sinkhorn_temperature}")
        for name in ["global_tokens", "performer_redraw_interval", "cmem_len", "memory_tokens"]:
            if getattr(self, name) < 0:
                raise ConfigError(f"config.{name} must be >= 0, got {getattr(self, name)}")
        if self.attention != "sliding" and (self.sliding_dilation or self.global_tokens):
            field = "sliding_dilation" if self.sliding_dilation else "global_tokens"
            raise ConfigError(f"config.{field} only applies to attention='sliding'")
        self._validate_registries()
        if not self.causal:
            for name in ["mem_len", "cmem_len"]:
                if getattr(self, name):
                    raise ConfigError(f"config.{name} must be 0 with causal=false: an encoder has no memory")
            if self.same_length:
                raise ConfigError("config.same_length only applies to a causal LM with memory (causal=true)")
        if self.cmem_len:
            if self.mem_len < 1:
                raise ConfigError("config.cmem_len needs mem_len >= 1: only states leaving the memory are compressed")
            if self.same_length:
                raise ConfigError(
                    "config.same_length limits every query to mem_len keys, which hides the compressed memory; "
                    "set cmem_len=0 or same_length=false"
                )

    def _validate_registries(self) -> None:
        """`pos_encoding` and `attention` name registered entries, which can run this config."""
        from txl.nn.attention.registry import check_config  # torch: only once a config is built
        from txl.nn.positional import POSITIONAL_ENCODINGS

        if self.pos_encoding not in POSITIONAL_ENCODINGS:
            names = sorted(POSITIONAL_ENCODINGS)
            hint = did_you_mean(self.pos_encoding, names) or f" (registered: {', '.join(names)})"
            raise ConfigError(f"config.pos_encoding={self.pos_encoding!r} is not a registered positional encoding{hint}")
        encoding = POSITIONAL_ENCODINGS[self.pos_encoding]
        if not self.causal and encoding.causal_only:
            allowed = ", ".join(name for name, cls in POSITIONAL_ENCODINGS.items() if not cls.causal_only)
            raise ConfigError(
                f"config.pos_encoding={self.pos_encoding!r} is defined for causal distances only; a "
                f"bidirectional encoder (causal=false) takes {allowed}"
            )
        check_config(self)

    # ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformerXLConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            hint = did_you_mean(str(unknown[0]), known) or "; remove it (the keys are the TransformerXLConfig fields)"
            raise ConfigError(f"unknown config key {unknown[0]!r}{hint}")
        return cls(**data)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"
        if path is not None:
            write_text(path, text)
        return text

    @classmethod
    def from_json(cls, source: str | Path) -> TransformerXLConfig:
        """Read a config from a JSON string or a path to a JSON file."""
        path = Path(source) if not str(source).lstrip().startswith("{") else None
        try:
            # a regular file of at most CONFIG_LIMIT bytes (a 1 GB sparse config.json is refused unread)
            text = read_text(path, what="config file", limit=CONFIG_LIMIT, error=ConfigError,
                             follow_links=True) if path is not None else str(source)
        except ValueError as err:  # a NUL in the path
            raise ConfigError(f"cannot read config file {path}: {err}") from None
        try:
            data = parse_json(text)
        except (ValueError, RecursionError) as err:  # duplicate keys, a 5000-digit number, [[[[... too deep
            where = f" in {path}" if path else ""
            raise ConfigError(f"config is not valid JSON{where}: {str(err)[:200]}") from None
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> TransformerXLConfig:
        return dataclasses.replace(self, **changes)

    def num_parameters_estimate(self) -> int:
        """A lower bound of the non-embedding parameter count (attention and feed-forward weights), in
        Python integers: a checkpoint loader compares it with the weights on disk before building
        anything (an absurd config.json is refused without allocating)."""
        if self.arch in RNN_ARCHS:
            return self._rnn_parameters()
        per_layer = 4 * self.d_model * self.n_head * self.d_head + 2 * self.d_model * self.d_inner
        per_layer += 2 * self.memory_tokens * self.n_head * self.d_head
        return self.n_layer * per_layer

    def _rnn_parameters(self) -> int:
        """Exactly `txl.models.rnn.model.RecurrentLM(self).num_parameters(exclude_embeddings=True)`."""
        d, n = self.d_model, self.n_layer

        def lstm(inputs: int, hidden: int) -> int:  # W_ih, W_hh, two biases
            return 4 * hidden * (inputs + hidden) + 8 * hidden

        if self.arch == "lstm":
            sizes = [self.d_inner] * (n - 1) + [d]
            return sum(lstm(i, o) for i, o in zip([d] + sizes[:-1], sizes))
        # q projection + its LayerNorm, three gates, the value over-parameterisation, ln_mem, ln_mid
        attention = (d * d + d) + 2 * d + 3 * d + (2 * d * d + 2 * d) + 2 * 2 * d
        blocks_with_attention = n if self.rnn_attention == "all" else 1
        # ln_start, LSTM, ln_ff, ln_xff, Boom's up-projection
        block = 2 * d + lstm(d, d) + 2 * 2 * d + (d * self.d_inner + self.d_inner)
        return n * block + blocks_with_attention * attention


# ---------------------------------------------------------------------------------------------
# A small runtime type check for dataclass fields (JSON and TOML give us untyped values).


def _check_types(obj: Any) -> None:
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        hint = str if f.name in getattr(obj, "REGISTRY_FIELDS", ()) else hints[f.name]  # checked against the registry
        if not _matches(value, hint):
            raise ConfigError(
                f"config.{f.name} must be {_describe(hint)}, got {value!r} ({type(value).__name__})"
            )


def _matches(value: Any, tp: Any) -> bool:
    origin = get_origin(tp)
    if tp is Any:
        return True
    if origin is Literal:
        return isinstance(value, str) and value in get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in get_args(tp))
    if tp is type(None):
        return value is None
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_matches(v, args[0]) for v in value)
        return len(args) == len(value) and all(_matches(v, a) for v, a in zip(value, args))
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    if origin is tuple:
        args = get_args(tp)
        return f"a list of {_describe(args[0])}" if len(args) == 2 and args[1] is Ellipsis else "a list"
    return getattr(tp, "__name__", str(tp))


def check_dataclass_types(obj: Any) -> None:
    """Public helper for other config dataclasses (trainer, data) to share the type check."""
    _check_types(obj)


__all__ = [
    "TransformerXLConfig",
    "POSITIONAL_NAMES",
    "ATTENTION_NAMES",
    "ATTENTION_IMPLS",
    "check_dataclass_types",
]
