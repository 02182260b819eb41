"""Training, one job per module:

- `loop`: the `Trainer` and its loop (steps, validation, signals);
- `objectives`: what a run trains for (language modelling, masked LM, sequence-to-sequence): each owns
  its corpus, batches, step (with memory where the model has one) and evaluation;
- `checkpoint`: the `Checkpointer` over components that save and restore their own state (`last`, `best`);
- `state`: the checkpoint's state files and their checks, and the configuration a resumed run continues;
- `rundir`: the run's directory (checked, locked once per run), `run.json`, `--init-from` weights;
- `progress`: metrics.jsonl, TensorBoard and the progress display;
- `finish`: final scores, the sample, result.json and the summary;
- `config`, `optim`, `averaging`, `distributed`: the run's configuration, optimisers and schedules, the
  weight average, rank and device under torchrun.
The command line is `txl.cli.train`.
"""

from txl.train.checkpoint import Checkpointer
from txl.train.distributed import Dist, init_distributed
from txl.train.finish import finish, print_summary, write_sample
from txl.train.loop import Trainer
from txl.train.progress import MetricsLog, Progress
from txl.train.rundir import BEST, LAST, open_run_dir
from txl.train.state import STATE_FILE, check_trainer_state, resume_config

__all__ = [
    "BEST",
    "LAST",
    "STATE_FILE",
    "Checkpointer",
    "Dist",
    "MetricsLog",
    "Progress",
    "Trainer",
    "check_trainer_state",
    "finish",
    "init_distributed",
    "open_run_dir",
    "print_summary",
    "resume_config",
    "write_sample",
]
