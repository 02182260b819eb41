#!/usr/bin/env bash
# Device check (issue 46 item 6): txl on one CUDA GPU in a few minutes, from the source tree.
#
#   bash scripts/device_check.sh [OUT_DIR] [device_check.py options...]
#
# OUT_DIR defaults to $OUT (else ./device_check_out). It needs python3 with torch (CUDA), numpy,
# safetensors, tqdm and pytest; nothing is installed into that Python and no network is used. The
# Hugging Face comparison needs transformers 4.35.2 (the last release with TransfoXL) as wheels in
# .whl/ of the repository root (or $TXL_WHEELS), fetched beforehand on a machine with a network:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl transformers==4.35.2 tokenizers==0.15.2 huggingface_hub==0.20.3 \
#     requests urllib3 idna certifi charset_normalizer regex pyyaml filelock packaging
#
# (.whl/ is git-ignored.) They go into $TXL_DEVICE_SITE (default /tmp/site), which is put first on
# PYTHONPATH with src/; the other wheels are installed only where the machine lacks the module.
# Then scripts/device_check.py runs its stages: environment and matmul peak, `pytest -m cuda`,
# training throughput of txl (attention_impl eager, fast, sdpa, flex) against Hugging Face at the tiny,
# enwik8-base and wt103-large shapes in bf16 and fp32 (MFU against the measured peak), activation
# checkpointing's peak memory, torch.compile, evaluation and generation. It writes
# OUT_DIR/device_check.json and .md after every measurement, OUT_DIR/pytest.txt, cuda_figures.jsonl,
# install.log and this run's log, device_check.log. Progress lines carry the time and the time since
# this script started. The whole run keeps to --budget-minutes (default 8, counted from here: what
# would end later is skipped and listed as skipped); `--dry-run` prints the plan with its estimates.
# A smoke run of every stage on a CPU (~20 s): bash scripts/device_check.sh /tmp/dc --device cpu --quick
set -uo pipefail
export TXL_DEVICE_CHECK_START="$(date +%s)"  # the time budget counts from here
OUT_DIR="${1:-${OUT:-device_check_out}}"
[ $# -gt 0 ] && shift
mkdir -p "$OUT_DIR" && OUT_DIR="$(cd "$OUT_DIR" && pwd)" || exit 2
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
SITE="${TXL_DEVICE_SITE:-/tmp/site}"
WHEELS="${TXL_WHEELS:-.whl}"
{
    echo "[$(date +%H:%M:%S) +0:00] device check in $(pwd), output in $OUT_DIR, $("$PY" --version 2>&1)"
    if compgen -G "$WHEELS/*.whl" > /dev/null; then
        "$PY" scripts/device_check.py --install-wheels "$WHEELS" --target "$SITE" > "$OUT_DIR/install.log" 2>&1 \
            || echo "[$(date +%H:%M:%S)] installing the wheels failed (see install.log): no Hugging Face comparison"
        tail -n 3 "$OUT_DIR/install.log"
    else
        echo "[$(date +%H:%M:%S)] no wheels in $WHEELS: no Hugging Face comparison unless transformers 4.35.2 is installed"
    fi
    export PYTHONPATH="$SITE:src${PYTHONPATH:+:$PYTHONPATH}"
    "$PY" scripts/device_check.py "$OUT_DIR" "$@"
} 2>&1 | tee "$OUT_DIR/device_check.log"
exit "${PIPESTATUS[0]}"
