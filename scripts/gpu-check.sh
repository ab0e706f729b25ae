#!/usr/bin/env bash
# The GPU check on a lent machine, in one command from the repository root:
#
#   OUT=/where/results/go scripts/gpu-check.sh [sparsebalance gpu-check options, e.g. --force]
#
# Runs with the machine's own python3 (its torch and triton; GPU_CHECK_PYTHON picks another), never
# reaches the network (pip is told there is no index; Hugging Face is offline), creates no .venv and
# installs nothing but the project's pure-Python dependencies that this python lacks, from the wheels
# carried in wheels/, into a temporary folder. Records the environment first, then runs
# `sparsebalance gpu-check` under a hard deadline of GPU_CHECK_SECONDS (default 480 = 8 minutes) for
# the whole script, the steps sharing all but 30 s of it. Everything lands in $OUT (default
# results/gpu-check) as flat files: summary.md (rewritten after every step), accuracy.csv,
# speed.csv, stages.csv, rest.tar.gz (logs, profiles, per-step results), gpu-check.log (this
# script's output) and the results marker -- at most 8 files, what a lent machine gives back.
#
# Exit codes: 0 every step ok, skipped or partial; 1 a step failed or timed out; 2 no CUDA GPU (or
# bad input): nothing was run, gpu-check left no results directory and this script's summary.md
# holds its one line and the environment; 124 the hard deadline hit.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT="${OUT:-results/gpu-check}"
SECS="${GPU_CHECK_SECONDS:-480}"
PY="${GPU_CHECK_PYTHON:-python3}"

if ! [[ "$SECS" =~ ^[0-9]+$ ]] || (( SECS < 90 )); then
    echo "gpu-check.sh: GPU_CHECK_SECONDS must be a whole number of seconds >= 90, got '$SECS'" >&2
    exit 2
fi
if ! command -v "$PY" >/dev/null 2>&1; then
    echo "gpu-check.sh: GPU_CHECK_PYTHON: no such interpreter '$PY'" >&2
    exit 2
fi

# offline, whatever the machine's configuration says
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 MPLBACKEND=Agg

WORK=$(mktemp -d "${TMPDIR:-/tmp}/sparsebalance-gpu-check-sh.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
LOG="$WORK/gpu-check.log"
touch "$WORK/started"
# OUT is ours to write into when it is new or empty, or once gpu-check has taken it (its marker is
# then newer than this script's start): a folder of someone else's files is never written into
[[ -z "$(ls -A "$OUT" 2>/dev/null)" ]] && out_fresh=1 || out_fresh=0
mkdir -p "$OUT" || { echo "gpu-check.sh: OUT: cannot create '$OUT'" >&2; exit 2; }

# the project's pure-Python dependencies this python lacks, from wheels/ (never from an index)
installed=""
missing=$("$PY" - <<'EOF'
import importlib.util
print(" ".join(m for m in ("simpy", "tqdm") if importlib.util.find_spec(m) is None))
EOF
)
if [[ -n "$missing" ]]; then
    mkdir -p "$WORK/site"
    for m in $missing; do
        whl=$(ls "$ROOT"/wheels/"$m"-*.whl 2>/dev/null | head -n 1)
        if [[ -z "$whl" ]]; then
            echo "gpu-check.sh: $m is missing and no wheel of it is in wheels/" | tee -a "$LOG"
            continue
        fi
        if "$PY" -m pip install --quiet --no-index --no-deps --no-compile --target "$WORK/site" "$whl" >>"$LOG" 2>&1; then
            installed+="${installed:+, }$(basename "$whl")"
        else
            echo "gpu-check.sh: could not install $(basename "$whl") (see gpu-check.log)" | tee -a "$LOG"
        fi
    done
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export SPARSEBALANCE_WHEELS_INSTALLED="$installed"
echo "gpu-check.sh: $("$PY" -V 2>&1) at $(command -v "$PY"); from wheels/: ${installed:-nothing}; deadline ${SECS} s; OUT=$OUT" | tee -a "$LOG"

timeout --kill-after=15 "$SECS" "$PY" -m sparsebalance gpu-check --out "$OUT" --budget-s $((SECS - 30)) "$@" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
if (( out_fresh == 0 )) && ! [[ "$OUT/.sparsebalance.json" -nt "$WORK/started" ]]; then
    echo "gpu-check.sh: $OUT was not written (it held files before); nothing else left there" >&2
    exit "$rc"
fi
if (( rc == 124 || rc == 137 )); then
    rc=124
    echo "gpu-check.sh: the hard deadline (${SECS} s) hit; summary.md holds the steps that finished" | tee -a "$LOG"
    [[ -f "$OUT/summary.md" ]] && echo "- hard deadline (${SECS} s) hit: the run was stopped there" >>"$OUT/summary.md"
fi
if [[ ! -f "$OUT/summary.md" ]]; then  # gpu-check wrote none (no CUDA, bad input, an early death): leave one
    said=$(grep -m1 "^sparsebalance gpu-check: error: " "$LOG" | sed 's/^sparsebalance gpu-check: error: //')
    "$PY" - "$OUT/summary.md" "$rc" "$said" >>"$LOG" 2>&1 <<'EOF' || {
import sys
from pathlib import Path

from sparsebalance.commands.gpu_check import cuda_device
from sparsebalance.gpucheck.report import environment, write_summary

path, rc, said = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
env = {"device": cuda_device() or "no CUDA device"} | environment()
write_summary([], env, path, [f"gpu-check exited {rc} before any step" + (f": {said}" if said else "")
                              + "; its output is in gpu-check.log"])
EOF
        {
            echo "# sparsebalance gpu-check"
            echo
            echo "- gpu-check exited $rc before writing its summary; its output is in gpu-check.log"
            echo "- python: $("$PY" -V 2>&1) ($(command -v "$PY"))"
            echo "- gpus (nvidia-smi -L): $(nvidia-smi -L 2>&1 | tr '\n' ';')"
        } >"$OUT/summary.md"
    }
fi
cp "$LOG" "$OUT/gpu-check.log"
exit "$rc"
