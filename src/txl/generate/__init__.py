"""Generation: the decoder loop, token pickers and sequence-to-sequence decoding."""
