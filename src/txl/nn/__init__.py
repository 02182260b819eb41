"""Building blocks shared by the models: attention kernels, positional encodings, memory, regularisation."""
