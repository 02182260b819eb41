"""The Style Transformer (Dai et al. 2019): `StyleTransformer` (config `StyleTransformerConfig`,
`arch = "style-transformer"`), style transfer without disentangled latent representations on txl's
encoder-decoder. Its corpora live in `txl.data.style`, its training in `txl.train.style`. The model (torch)
is imported on first use, so the config loads without it."""

from typing import TYPE_CHECKING, Any

from txl.models.style.config import StyleTransformerConfig

if TYPE_CHECKING:
    from txl.models.style.model import StyleTransformer

__all__ = ["StyleTransformer", "StyleTransformerConfig"]


def __getattr__(name: str) -> Any:
    if name == "StyleTransformer":
        from txl.models.style import model

        return model.StyleTransformer
    raise AttributeError(f"module 'txl.models.style' has no attribute {name!r}")
