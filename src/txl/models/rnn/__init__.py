"""The recurrent LMs: AWD-LSTM and SHA-RNN."""
