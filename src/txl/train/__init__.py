"""Training, one job per module:

- `loop`: the `Trainer` and its loop (steps, validation, signals);
- `state`: the run's directory and checkpoints (save, restore with checks, resume configuration);
- `progress`: metrics.jsonl, TensorBoard and the progress display;
- `finish`: final scores, the sample, result.json and the summary;
- `distributed`: rank, world size and device under torchrun;
- `cli`: `txl train`.
"""

from txl.train.distributed import Dist, init_distributed
from txl.train.finish import finish, print_summary, write_sample
from txl.train.loop import Trainer
from txl.train.progress import MetricsLog, Progress
from txl.train.state import (
    BEST,
    LAST,
    STATE_FILE,
    check_trainer_state,
    restore_checkpoint,
    resume_config,
    save_best,
    save_checkpoint,
)

__all__ = [
    "BEST",
    "LAST",
    "STATE_FILE",
    "Dist",
    "MetricsLog",
    "Progress",
    "Trainer",
    "check_trainer_state",
    "finish",
    "init_distributed",
    "print_summary",
    "restore_checkpoint",
    "resume_config",
    "save_best",
    "save_checkpoint",
    "write_sample",
]
