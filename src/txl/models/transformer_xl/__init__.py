"""The Transformer-XL decoder (and its bidirectional encoder): config, model, adaptive softmax, compressive memory, universal depth."""
