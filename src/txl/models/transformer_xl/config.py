"""The Transformer-XL config (`arch = "decoder"`): the LM of Dai et al. 2019 and, with `causal=false`,
the bidirectional encoder (masked LM) on the same blocks.

Only what `TransformerXL` reads is a field. The selected attention kernel and positional encoding bring
their own options (`attention_options`, `position_options`: a dict here, the kernel's or encoding's
dataclass once built, e.g. `attention="sliding", attention_options={"window": 128}`); the paper's own
hyper-parameters (`clamp_len`, `untie_r`, `same_length`) stay fields, where a reader of the paper and
of the reference code looks for them. Every field is checked when the config is built: an impossible
value or combination raises `ConfigError` (a `ValueError`) naming the field; a key this config does not
have is refused by name (`txl.models.configuration`). The other architectures have their own configs:
`txl.models.seq2seq.config.EncoderDecoderConfig`, `txl.models.rnn.config.RecurrentConfig`.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal, get_args

from txl.errors import ConfigError
from txl.models.configuration import ModelConfig, check_positive, check_probability, model_config
from txl.nn.options import MAX_LENGTH, MAX_WIDTH

# Names, not integer codes (the reference's `attn_type` 0..3 maps to xl, shaw, sinusoidal, learned).
# These are the built-in entries of the registries (`txl.nn.positional.register_encoding`,
# `txl.nn.attention.register`); a name registered from user code is accepted too.
PositionalName = Literal["xl", "shaw", "sinusoidal", "learned", "rope", "alibi", "t5", "xpos", "nezha"]
# The long-text arena (docs/guide/models.md, "The arena"): every kernel takes the same inputs, see txl/nn/attention/.
AttentionName = Literal[
    "full", "sliding", "sparse", "performer", "linformer", "linear", "bigbird", "lsh", "routing", "sinkhorn",
    "compressed", "synthesizer", "inducing", "image-local", "axial", "etc",
]
# eager = the reference; fast = the CPU-tuned kernel; sdpa / flex = fused GPU kernels (torch SDPA with the
# position term as a bias / FlexAttention with a score_mod); auto = chosen per call by device (txl.nn.attention.registry)
AttentionImpl = Literal["auto", "eager", "fast", "sdpa", "flex"]
Backend = Literal["auto", "reference"]
CompressionName = Literal["conv", "mean", "max"]
# Recurrence and block options (docs/guide/models.md, "Block options and recurrence variants")
MemorySource = Literal["previous-layer", "same-layer"]
Residual = Literal["add", "gru-gate"]
NormName = Literal["layernorm", "rmsnorm"]
FeedForwardName = Literal["relu", "gelu", "swiglu", "geglu"]

POSITIONAL_NAMES: tuple[str, ...] = get_args(PositionalName)
ATTENTION_NAMES: tuple[str, ...] = get_args(AttentionName)
ATTENTION_IMPLS: tuple[str, ...] = get_args(AttentionImpl)


@model_config("decoder")
class TransformerXLConfig(ModelConfig):
    FAMILY: ClassVar[str] = "the decoder (Transformer-XL)"
    OPTION_FIELDS: ClassVar[dict[str, str]] = {"attention_options": "attention", "position_options": "position"}
    # decoder = the Transformer-XL LM (`TransformerXL`); causal=false makes it the bidirectional encoder.
    arch: Literal["decoder"] = "decoder"
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
    # AWD-LSTM's dropoute/dropouti (txl/nn/regularization.py), shared with the recurrent LMs
    dropout_embed: float = 0.0  # whole-word dropout: a dropped word's embedding is zero everywhere in the batch
    dropout_input: float = 0.0  # locked (variational) dropout on the embeddings, instead of `dropout` there
    # --- recurrence and positions (Dai et al. 2019) -------------------------------------------
    mem_len: int = 512  # hidden states kept per layer; 0 = vanilla Transformer LM (Al-Rfou et al.)
    clamp_len: int = 0  # relative distances beyond this share one position vector; 0 = no clamp
    same_length: bool = False  # every query sees exactly mem_len keys (kimiyoung's convention)
    pre_lnorm: bool = False  # pre-LN blocks; default post-LN as the paper
    final_norm: bool = True  # with pre_lnorm: a final LayerNorm (the reference lacks it; HF imports turn it off)
    untie_r: bool = False  # per-layer u, v biases (TF large models) instead of shared (PyTorch ref); xl only
    pos_encoding: PositionalName = "xl"
    position_options: Any = None  # the encoding's options: a dict, e.g. {"buckets": 8} for t5 (txl/nn/positional.py)
    # --- attention kernel ---------------------------------------------------------------------
    attention: AttentionName = "full"
    attention_options: Any = None  # the kernel's options: a dict, e.g. {"window": 128} for sliding (txl/nn/attention/)
    attention_impl: AttentionImpl = "auto"  # the kernel: eager = the reference einsum; fast = fused/strided; auto = fast if any
    backend: Backend = "auto"  # auto = the CPU fast backend (txl/fast: dropout RNG, oneDNN linears, caches); reference = plain PyTorch
    causal: bool = True  # False = bidirectional encoder (masked LM): no memory, no causal mask
    # --- recurrence variant and block options (defaults: the paper's) ---------------------------
    # previous-layer: layer l attends over [its own input of the previous segment ; its input] (Dai et al.);
    # same-layer: over [its own OUTPUT of the previous segment ; its input] (ERNIE-Doc's enhanced recurrence,
    # Ding et al. 2021): a longer effective context, at the price of segment invariance
    memory_source: MemorySource = "previous-layer"
    # add: x + sublayer(x); gru-gate: GTrXL's gated residual (Parisotto et al. 2019), GRU gate g(x, ReLU(sublayer)),
    # with the identity-map reordering (needs pre_lnorm=true); the gate starts near identity (b_g = 2)
    residual: Residual = "add"
    norm: NormName = "layernorm"  # every block norm and the final one; rmsnorm: x / rms(x) * g, no bias and no centring
    # relu (the paper) | gelu: Linear(d_model, d_inner) -> act -> Linear(d_inner, d_model); swiglu | geglu (Shazeer
    # 2020): d_inner is the gated width, fc1 makes value and gate (2·d_inner): 3·d_model·d_inner weights, not 2·
    ffn: FeedForwardName = "relu"
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); None = n_head, 1 = multi-query
    qk_norm: bool = False  # RMSNorm of q and k per head (learned d_head scale) before the scores
    # sequence classification (issue 47, txl.models.transformer_xl.classify): 0 = a language model only; N > 0 adds
    # a head of N classes over the final hidden states of a document's last segment, read with the memory
    num_labels: int = 0
    # the last segment's real tokens averaged, its last one, or a learned summary token appended after them
    classifier_pooling: Literal["mean", "last", "summary"] = "mean"
    # all: every segment in turn, the memory carrying the earlier ones; first: the first segment alone (the
    # no-memory baseline: what a fixed-context classifier reads)
    classifier_segments: Literal["all", "first"] = "all"
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
    # how the steps' states are combined (tensor2tensor's act_type): basic = t2t's default interpolation of the
    # state by the halting weights; accumulated = the weighted sum of every step's output (txl before issue 48)
    act_type: Literal["basic", "accumulated"] = "basic"
    # what is added to the state before each step (t2t's step_preprocess): every-step = the timestep sinusoid
    # and the absolute position rows before every step (t2t); after-first = the timestep from step 1 on only
    # (txl before issue 48, what an older universal config loads as: txl.models.migration)
    universal_signals: Literal["every-step", "after-first"] = "every-step"
    # reversible blocks (Gomez et al. 2017, Reformer): y1 = x1 + attn(x2), y2 = x2 + ffn(y1); the backward
    # recomputes each block's input from its output instead of storing it (txl.nn.reversible)
    reversible: bool = False
    # --- adaptive input / softmax (Baevski & Auli 2019; Grave et al. 2017) ---------------------
    cutoffs: tuple[int, ...] = ()  # empty = one full softmax; e.g. (20000, 40000, 200000) for wt103
    div_val: int = 1  # cluster i has d_embed // div_val**i dims
    tie_weight: bool = True  # output cluster weights = input embedding weights
    tie_projs: tuple[bool, ...] | None = None  # per cluster; None = (False, True, True, ...) as wt103
    # sampled softmax (Jean et al. 2015; the reference's --sample_softmax): training scores the targets against
    # this many shared negatives drawn log-uniformly; evaluation always uses the full softmax; 0 = off
    sample_softmax: int = 0
    # --- initialisation (reference: normal init) ----------------------------------------------
    init_std: float = 0.02
    proj_init_std: float = 0.01
    layer_norm_eps: float = 1e-5

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

    def validate(self) -> None:
        if any(v > MAX_LENGTH for v in self.cutoffs):
            raise ConfigError(f"config.cutoffs values must be <= {MAX_LENGTH:,}")
        check_positive(self, "vocab_size", "n_layer", "d_model", "n_head", "d_head", "d_inner", "div_val")
        if self.d_embed is not None and self.d_embed < 1:
            raise ConfigError(f"config.d_embed must be >= 1 (or null for d_model), got {self.d_embed}")
        check_positive(self, "mem_len", "clamp_len", "memory_tokens", "cmem_len", low=0)
        check_positive(self, "cmem_ratio")
        check_probability(self, "dropout", "dropatt", "dropout_embed", "dropout_input")
        for name in ["init_std", "proj_init_std", "layer_norm_eps"]:
            if not 0 < getattr(self, name) < math.inf:
                raise ConfigError(f"config.{name} must be > 0, got {getattr(self, name)}")
        if self.same_length and self.mem_len < 1:
            raise ConfigError(
                "config.same_length needs mem_len >= 1 (each query sees exactly mem_len keys); "
                "set mem_len or same_length=false"
            )
        self._validate_adaptive()
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
        self._validate_memory()
        self._validate_block_options()
        check_layers(self)

    def _validate_adaptive(self) -> None:
        cut = list(self.cutoffs)
        if cut:
            if any(c <= 0 for c in cut) or any(b <= a for a, b in zip(cut, cut[1:])):
                raise ConfigError(f"config.cutoffs must be positive and strictly increasing, got {cut}")
            if cut[-1] >= self.vocab_size:
                raise ConfigError(f"config.cutoffs must all be < vocab_size={self.vocab_size}, got {cut}")
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
        if not 0 <= self.sample_softmax <= MAX_LENGTH:
            raise ConfigError(f"config.sample_softmax must be 0 (full softmax) to {MAX_LENGTH:,} sampled negatives, "
                              f"got {self.sample_softmax}")
        if self.sample_softmax and cut:
            raise ConfigError("config.sample_softmax samples the negatives of one full softmax; the adaptive softmax "
                              "(cutoffs) has clusters instead: set sample_softmax=0 or cutoffs=[]")

    def _validate_memory(self) -> None:
        """The bidirectional encoder has no memory; compressive memory sits behind the plain memory."""
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

    def _validate_block_options(self) -> None:
        """Grouped-query heads divide the query heads; the GTrXL gate sits in pre-LN blocks; compressive
        memory's reconstruction loss re-runs the paper's block, so it takes the paper's options."""
        if self.n_kv_head is not None and not (1 <= self.n_kv_head <= self.n_head and self.n_head % self.n_kv_head == 0):
            raise ConfigError(f"config.n_kv_head={self.n_kv_head} must divide n_head={self.n_head} "
                              "(each key/value head serves n_head/n_kv_head query heads); null = n_head")
        if self.num_labels < 0 or self.num_labels > 100_000:
            raise ConfigError(f"config.num_labels must be 0 (a language model) to 100,000, got {self.num_labels}")
        if self.num_labels and not self.causal:
            raise ConfigError("config.num_labels: the classifier reads a document segment by segment with the causal "
                              "decoder's memory; set causal=true")
        if self.residual == "gru-gate" and not self.pre_lnorm:
            raise ConfigError("config.residual='gru-gate' is GTrXL's gate on the identity-map (pre-LN) block: "
                              "set pre_lnorm=true")
        if self.reversible:  # y1 = x1 + F(x2), y2 = x2 + G(y1) inverts only around plain pre-LN sublayers
            refused = [f"{name}={value!r}" for name, value, wanted in (
                ("pre_lnorm", self.pre_lnorm, True), ("residual", self.residual, "add"),
                ("memory_source", self.memory_source, "previous-layer"), ("universal", self.universal, False),
                ("cmem_len", self.cmem_len, 0)) if value != wanted]
            if refused:
                raise ConfigError(f"config.reversible needs pre-LN blocks with plain residuals (pre_lnorm=true, "
                                  f"residual='add', memory_source='previous-layer', universal=false, cmem_len=0), "
                                  f"got {', '.join(refused)}")
            if self.attention in ("performer", "routing"):  # their state moves in every training forward
                raise ConfigError(f"config.reversible cannot take attention={self.attention!r}: its random features / "
                                  "centroids change in each training forward, so the backward's recompute would not "
                                  "rebuild the forward's blocks")
        if self.cmem_len:
            changed = [f"{name}={value!r}" for name, value, default in (
                ("memory_source", self.memory_source, "previous-layer"), ("norm", self.norm, "layernorm"),
                ("n_kv_head", self.kv_heads, self.n_head), ("qk_norm", self.qk_norm, False)) if value != default]
            if changed:
                raise ConfigError(f"config.cmem_len (compressive memory) takes the paper's attention, not "
                                  f"{', '.join(changed)}: its reconstruction loss re-runs it; set cmem_len=0")

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head, or n_head (multi-head attention) when it is None."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def glu(self) -> bool:
        """A gated feed-forward (swiglu, geglu): fc1 makes 2·d_inner features, value and gate."""
        return self.ffn in ("swiglu", "geglu")

    def num_parameters_estimate(self) -> int:
        """A lower bound of the non-embedding parameter count (attention and feed-forward weights), in
        Python integers: a checkpoint loader compares it with the weights on disk before building
        anything (an absurd config.json is refused without allocating)."""
        per_layer = 2 * self.d_model * (self.n_head + self.kv_heads) * self.d_head  # q, o; k, v
        per_layer += (3 if self.glu else 2) * self.d_model * self.d_inner
        per_layer += 2 * self.memory_tokens * self.kv_heads * self.d_head
        return self.n_layer * per_layer


def check_layers(config: Any) -> None:
    """The selected kernel and encoding can run this config (causal or bidirectional, score terms, their
    own combination checks); used by the decoder and, through its views, the encoder-decoder."""
    from txl.nn.attention.registry import check_config
    from txl.nn.positional import POSITIONAL_ENCODINGS  # torch: only once a config is built

    encoding = POSITIONAL_ENCODINGS[config.pos_encoding]
    if not config.causal and encoding.causal_only:
        allowed = ", ".join(name for name, cls in POSITIONAL_ENCODINGS.items() if not cls.causal_only)
        raise ConfigError(
            f"config.pos_encoding={config.pos_encoding!r} is defined for causal distances only; a "
            f"bidirectional encoder (causal=false) takes {allowed}"
        )
    encoding.check_config(config)
    check_config(config)


__all__ = [
    "ATTENTION_IMPLS",
    "ATTENTION_NAMES",
    "MAX_LENGTH",
    "MAX_WIDTH",
    "POSITIONAL_NAMES",
    "TransformerXLConfig",
    "check_layers",
]
