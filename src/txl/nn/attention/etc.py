"""ETC's global-local attention (Ainslie et al. 2020): registered by issue 48's kernel work."""
