"""Attention: the layer (`layer.py`), kernels chosen by name (`registry.py`), masks (`masks.py`).

    eager.py      the reference kernel: causal, bidirectional and cross-attention, with masks
    xl_fast.py    the fast "full" kernel (Transformer-XL positions by a hand-written autograd function)
    sliding.py    Longformer's sliding window (+ dilation, global tokens)
    sparse.py     Sparse Transformer's strided pattern
    performer.py  FAVOR+ random features
    linformer.py  keys/values projected along the sequence (bidirectional)

Each kernel file holds its dense reference beside its fast version. Kernels import only the
registry and the masks; this package imports its submodules on first use, so a module anywhere
(positional encodings included) can import `txl.nn.attention.masks` without pulling in every kernel.
"""

from typing import TYPE_CHECKING, Any

from txl.nn.attention.masks import AttentionMask, causal_mask, distances
from txl.nn.attention.registry import register, resolve_kernel

if TYPE_CHECKING:
    from txl.nn.attention.layer import Attention

__all__ = ["Attention", "AttentionMask", "KERNELS", "causal_mask", "distances", "register", "resolve_kernel"]


def __getattr__(name: str) -> Any:
    if name == "KERNELS":  # with the built-in kernels registered
        from txl.nn.attention import registry

        registry.load_builtin_kernels()
        return registry.KERNELS
    if name == "Attention":
        from txl.nn.attention.layer import Attention

        return Attention
    if name == "eager_attention":
        from txl.nn.attention.eager import eager_attention

        return eager_attention
    raise AttributeError(f"module 'txl.nn.attention' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
