#!/bin/sh
# Remakes this fixture with the code of the commit before issue 44 (b278d1b) checked out at $BEFORE.
# Run from this directory: BEFORE=<a checkout of b278d1b> sh make.sh
set -e
export OMP_NUM_THREADS=1 PYTHONPATH="$BEFORE/src" TXL_CACHE_DIR="$(mktemp -d)"
rm -rf run full
python -m txl train --config config.toml --out full --quiet                 # uninterrupted: 8 steps
python -m txl train --config config.toml --out run --max-steps 4 --quiet    # the same run, stopped at step 4
python - <<'PY'
import json, os
from pathlib import Path
here = str(Path.cwd().absolute())
# the uninterrupted run's records (train losses and validations), the reference the resumed run must equal
Path("expected_metrics.jsonl").write_text(Path("full/metrics.jsonl").read_text())
# the run records the corpus as an absolute path (DataSpec.canonical); write it as typed, relative to this
# directory (trainer_state.json's "data" and "run" are outside its progress digest, PROGRESS_KEYS)
for name in ["run.json", "result.json", "last/trainer_state.json", "best/trainer_state.json"]:
    path = Path("run") / name
    path.write_text(path.read_text().replace(here + "/", ""))
PY
rm -rf full "$TXL_CACHE_DIR"
