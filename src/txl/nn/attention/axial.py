"""Axial attention (Ho et al. 2019): registered by issue 48's kernel work."""
