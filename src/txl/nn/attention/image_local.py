"""Image Transformer 1-D local block attention (Parmar et al. 2018): registered by issue 48's kernel work."""
