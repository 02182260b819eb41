"""Ceilings of decoding settings that the decoders check and the command line's argument types read
(`txl.cli.arguments`), kept here without torch so that importing them starts nothing heavy."""

MAX_BEAM = 256  # beam search width: GNMT used 10; every hypothesis holds the decoder's cache of every layer
MAX_LENGTH_PENALTY = 10.0  # GNMT's alpha; Wu et al. (2016) tuned it in [0.6, 1]
