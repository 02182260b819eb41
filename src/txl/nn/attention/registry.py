"""Attention kernels by name: `KERNELS[(attention, impl)]`, filled by the `register` decorator.

A kernel computes attention from projected queries, keys and values; the layer (`txl.nn.attention.layer`)
owns the projections. Every kernel has this one signature:

    kernel(q, k, v, *, positions, mask, dropatt, training, need_weights=False) -> (out, probs)

- q (b, h, i, d) for the queries, k and v (b, h, n, d) for the keys (the queries are the last i of
  the n keys for self-attention over [memory ; segment]; see `txl.nn.attention.masks`);
- positions: a `txl.nn.positional.LayerPositions` (the encoding's terms for this layer);
- mask: a `txl.nn.attention.masks.AttentionMask` (causal or not, a `same_length` window, key padding);
- dropatt / training: dropout on the attention probabilities;
- need_weights: also return the probabilities (b, h, i, n) over every key (else None).

out is (b, h, i, d). A kernel that cannot honour part of the request (a padding mask, the
probabilities, a window) raises `UsageError` naming itself. `impl` is "eager" for the reference (plain
PyTorch, readable top to bottom), "fast" for a faster kernel tested against it (tuned on the CPU), and
"sdpa" / "flex" for the fused GPU kernels of `txl.nn.attention.fused` (added to a registered kernel
by `add_impl`); `attention_impl="auto"` picks per call by device (`auto_impl`, `by_device`). A kernel
class (an `nn.Module`, for kernels with parameters or buffers) is built once per layer with the config.

`register` also says what a kernel can take (causal, bidirectional, score terms), declares its
options (`options=SlidingOptions`, a `txl.nn.options.Options` dataclass that validates itself; the
config holds one as `config.attention_options` and the kernel reads it there) and can add a check of
how they combine with the rest of the config (`check=fn`, `fn(config)` raising `ConfigError`); a model
config runs them when it is built (`check_config`).

This module imports only `txl.errors` and `txl.nn.options`, so kernels (which import it) never form an
import cycle; the built-in kernels are imported on first use by `load_builtin_kernels`. A kernel
registered from anywhere, e.g. a user's script or a test file, options included, is usable as
`TransformerXLConfig(attention=name, attention_options={...})`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from txl.errors import ConfigError, UsageError, did_you_mean
from txl.nn.options import NoOptions, Options

Kernel = Callable[..., Any]

KERNELS: dict[tuple[str, str], Kernel] = {}
IMPLS = ("eager", "fast", "sdpa", "flex")


@dataclass(frozen=True)
class KernelSpec:
    """What an attention kernel (both of its impls) can take, checked when a config is built."""

    causal: bool = True  # runs as a causal LM (with memory)
    bidirectional: bool = False  # runs without a causal mask (encoder, `causal=False`)
    score_terms: bool = True  # forms a score matrix, so encodings that add to it (xl, shaw, alibi) apply
    check: Callable[[Any], None] | None = None  # more checks of the config options it reads
    global_mask: bool = False  # takes a per-token global mask (`AttentionMask.global_mask`)
    memory_tokens: bool = False  # takes learned memory tokens before the keys (`AttentionMask.memory_tokens`)
    cross_attention: bool = True  # bidirectional over a separate source too (queries not the last keys)
    options: type[Options] = NoOptions  # what `config.attention_options` holds for this kernel


SPECS: dict[str, KernelSpec] = {}

# The kernels that ship with txl (each module registers its own).
BUILTIN_MODULES = (
    "eager", "xl_fast", "sliding", "sparse", "performer", "linformer", "linear", "bigbird", "lsh", "routing",
    "sinkhorn", "compressed", "synthesizer", "inducing", "image_local", "axial", "etc", "fused",  # fused last: it adds impls to the kernels above
)

# The impl `attention_impl="auto"` runs on a CUDA device, per kernel (on every other device: "fast" where
# there is one, else "eager"). A constant until a GPU measures the choice (scripts/device_check.sh times
# sdpa against flex): full takes SDPA (one dense fused kernel with the position term as a bias);
# sliding and sparse take FlexAttention, whose block mask skips the blocks outside the band, where
# SDPA would run the whole (i, n) score matrix and hold an (h, i, n) mask (txl.nn.attention.fused).
CUDA_AUTO = {"full": "sdpa", "sliding": "flex", "sparse": "flex"}


def register(
    name: str,
    impl: str,
    *,
    causal: bool = True,
    bidirectional: bool = False,
    score_terms: bool = True,
    check: Callable[[Any], None] | None = None,
    global_mask: bool = False,
    memory_tokens: bool = False,
    cross_attention: bool = True,
    options: type[Options] | None = None,
) -> Callable[[Kernel], Kernel]:
    """Decorator: make `kernel` the `impl` ("eager", "fast", "sdpa" or "flex") of attention `name`. The keyword
    arguments describe what the kernel can take (`KernelSpec`); the last registration of a name sets them.
    `options`: the kernel's options dataclass (None: keep the one an earlier registration of `name`
    gave, else `NoOptions`)."""
    if impl not in IMPLS:
        raise ValueError(f"kernel impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if options is not None and not (isinstance(options, type) and issubclass(options, Options)):
        raise TypeError(f"register({name!r}, options=...) takes a txl.nn.options.Options subclass, got {options!r}")

    def add(kernel: Kernel) -> Kernel:
        chosen = options or (SPECS[name].options if name in SPECS else NoOptions)
        if chosen is not NoOptions:
            chosen.where = "config.attention_options"
        KERNELS[(name, impl)] = kernel
        SPECS[name] = KernelSpec(causal=causal, bidirectional=bidirectional, score_terms=score_terms, check=check,
                                 global_mask=global_mask, memory_tokens=memory_tokens,
                                 cross_attention=cross_attention, options=chosen)
        return kernel

    return add


def add_impl(name: str, impl: str) -> Callable[[Kernel], Kernel]:
    """Decorator: one more impl of the registered attention `name`, which keeps what `register` said the
    kernel can take (its `KernelSpec`): the fused "sdpa" and "flex" impls of `txl.nn.attention.fused`."""
    if impl not in IMPLS:
        raise ValueError(f"kernel impl must be one of {', '.join(IMPLS)}, got {impl!r}")

    def add(kernel: Kernel) -> Kernel:
        if name not in SPECS:
            raise ValueError(f"add_impl({name!r}, {impl!r}): register the attention {name!r} first")
        KERNELS[(name, impl)] = kernel
        return kernel

    return add


def load_builtin_kernels() -> None:
    for module in BUILTIN_MODULES:
        importlib.import_module(f"txl.nn.attention.{module}")


def kernel_names() -> list[str]:
    load_builtin_kernels()
    return sorted({name for name, _ in KERNELS})


def kernel_options() -> dict[str, type[Options]]:
    """name -> the options dataclass of every registered kernel."""
    load_builtin_kernels()
    return {name: spec.options for name, spec in SPECS.items()}


def check_attention_name(attention: str) -> None:
    """`attention` names a registered kernel, else one `ConfigError` with a did-you-mean."""
    names = kernel_names()
    if attention not in names:
        hint = did_you_mean(attention, names) or f" (registered: {', '.join(names)})"
        raise ConfigError(f"config.attention={attention!r} is not a registered attention kernel{hint}")


def auto_impl(attention: str, device_type: str) -> str:
    """The impl `attention_impl="auto"` runs for `attention` on a device of this type ("cuda", "cpu",
    ...): `CUDA_AUTO`'s fused impl on CUDA where the kernel has it, else "fast" where there is one, else
    "eager"."""
    load_builtin_kernels()
    fused = CUDA_AUTO.get(attention)
    if device_type == "cuda" and (attention, fused) in KERNELS:
        return fused
    return "fast" if (attention, "fast") in KERNELS else "eager"


def resolve_kernel(attention: str, impl: str) -> Kernel:
    """The kernel for `attention` and `impl`. "auto" is `auto_impl`'s choice, made per call by the
    device of the queries (`by_device`) when it differs between CUDA and the CPU, else that kernel itself."""
    load_builtin_kernels()
    if impl == "auto":
        impl, cuda = auto_impl(attention, "cpu"), auto_impl(attention, "cuda")
        if cuda != impl and (attention, impl) in KERNELS:
            return by_device(KERNELS[(attention, impl)], KERNELS[(attention, cuda)])
    if (attention, impl) in KERNELS:
        return KERNELS[(attention, impl)]
    check_attention_name(attention)
    available = sorted(i for a, i in KERNELS if a == attention)
    raise ConfigError(
        f"config.attention_impl={impl!r} is not available for attention={attention!r} "
        f"(available: {', '.join(available)})"
    )


_BY_DEVICE: dict[tuple[Kernel, Kernel], Kernel] = {}


def by_device(cpu: Kernel, cuda: Kernel) -> Kernel:
    """One kernel that runs `cuda` when the queries are on a CUDA device and `cpu` otherwise, decided per
    call by `q.is_cuda` (one attribute read and a branch: no lookup, no import), so a model moved
    between devices after it was built runs the right one. Kernel functions give a function; kernel
    classes give a subclass of `cuda`, which must subclass `cpu` (one `__init__`, one set of
    parameters). The same pair gives the same object."""
    key = (cpu, cuda)
    if key in _BY_DEVICE:
        return _BY_DEVICE[key]
    if isinstance(cpu, type):
        if not (isinstance(cuda, type) and issubclass(cuda, cpu)):
            raise TypeError(f"by_device: {cuda!r} must subclass {cpu!r}")

        def forward(self, q, k, v, *, positions, mask, dropatt, training, need_weights=False):
            kernel = cuda if q.is_cuda else cpu
            return kernel.forward(self, q, k, v, positions=positions, mask=mask, dropatt=dropatt, training=training,
                                  need_weights=need_weights)

        chosen: Kernel = type(f"Auto{cpu.__name__}", (cuda,), {"forward": forward, "__module__": cuda.__module__,
                                                               "__doc__": f"{cpu.__name__} on the CPU, {cuda.__name__} on CUDA"})
    else:
        def chosen(q, k, v, *, positions, mask, dropatt, training, need_weights=False):
            if q.is_cuda:
                return cuda(q, k, v, positions=positions, mask=mask, dropatt=dropatt, training=training,
                            need_weights=need_weights)
            return cpu(q, k, v, positions=positions, mask=mask, dropatt=dropatt, training=training,
                       need_weights=need_weights)

        chosen.__name__ = chosen.__qualname__ = f"auto[cpu: {cpu.__name__}, cuda: {cuda.__name__}]"
    chosen.kernels = {"cpu": cpu, "cuda": cuda}  # what it chooses between (tests, reports)
    _BY_DEVICE[key] = chosen
    return chosen


def refuse(
    name: str,
    mask: Any,
    *,
    need_weights: bool = False,
    padding: bool = False,
    same_length: str | None = None,
    weights: str | None = None,
) -> None:
    """The one home of a kernel's refusals of what it cannot honour in a call, each one line naming
    the kernel (`UsageError`): `padding=True` refuses a padding mask; `same_length` (a reason, "" for
    none) refuses a `same_length` window; `weights` (why) refuses `output_attentions`."""
    if padding and mask.key_padding is not None:
        raise UsageError(f"attention={name!r} does not take a padding mask (attention_mask); use attention='full'")
    if same_length is not None and mask.window is not None:
        reason = f" ({same_length})" if same_length else ""
        raise UsageError(f"same_length is not available with attention={name!r}{reason}")
    if weights is not None and need_weights:
        raise UsageError(f"output_attentions is not available with attention={name!r}: {weights}")


def no_padding(name: str, mask: Any) -> None:
    refuse(name, mask, padding=True)


def check_no_probabilities(config: Any) -> None:
    """Config checks of a kernel that never forms a score matrix (linear, performer): no same_length
    window, no dropout on probabilities."""
    if config.same_length:
        raise ConfigError(f"config.same_length needs a windowed score matrix; attention={config.attention!r} has none")
    if config.dropatt > 0:
        raise ConfigError(f"config.dropatt must be 0 with attention={config.attention!r}: it never forms the "
                          "attention probabilities that dropatt would drop")


def check_config(config: Any) -> None:
    """Whether the config's attention kernel exists and can run it: causal or bidirectional, its
    positional encoding, and the kernel's own checks of how its options combine with the config.
    Raises `ConfigError` naming the field."""
    from txl.nn.positional import POSITIONAL_ENCODINGS  # torch: only once a config is checked

    resolve_kernel(config.attention, config.attention_impl)
    spec = SPECS[config.attention]
    if spec.check is not None:  # first: a kernel's own message says most
        spec.check(config)
    if not config.causal and not spec.bidirectional:
        able = ", ".join(name for name in kernel_names() if SPECS[name].bidirectional)
        raise ConfigError(
            f"config.causal=false (bidirectional) supports attention {able}, not {config.attention!r}"
        )
    if getattr(config, "memory_tokens", 0) and not spec.memory_tokens:
        able = ", ".join(name for name in kernel_names() if SPECS[name].memory_tokens)
        raise ConfigError(
            f"config.memory_tokens needs an attention kernel that takes them ({able}), not {config.attention!r}; "
            f"set memory_tokens=0 or change attention"
        )
    if config.causal and not spec.causal:
        raise ConfigError(f"config.attention={config.attention!r} cannot be causal; set causal=false")
    if not spec.score_terms and POSITIONAL_ENCODINGS[config.pos_encoding].score_terms:
        allowed = ", ".join(name for name, cls in POSITIONAL_ENCODINGS.items() if not cls.score_terms)
        raise ConfigError(
            f"config.pos_encoding={config.pos_encoding!r} adds a term to the attention scores, which "
            f"attention={config.attention!r} never forms; use one of {allowed}"
        )
