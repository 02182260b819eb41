"""The `txl` command line: one module per command, shared argument types in `arguments`."""
