"""Model families: each architecture's config, model and registry entry (`txl.models.registry`).

The config modules are imported here (no torch), so the table of architectures
(`txl.models.configuration.CONFIGS`) is complete whenever any config is built: a key of another
architecture is then refused with the architecture that has it.
"""

from txl.models.rnn import config as _rnn_config  # noqa: F401
from txl.models.rnn_seq2seq import config as _rnn_seq2seq_config  # noqa: F401
from txl.models.seq2seq import config as _seq2seq_config  # noqa: F401
from txl.models.transformer_xl import config as _decoder_config  # noqa: F401
