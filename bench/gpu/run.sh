#!/usr/bin/env bash
# The GPU kit, in two calls, on a machine with one NVIDIA GPU (Python 3.12 with torch, transformers, accelerate and
# peft preinstalled; no network), from the repository root or anywhere:
#   bash bench/gpu/fetch_wheels.sh        # first, on a machine with the package index: bench/gpu/offline/
#   bash bench/gpu/run.sh --call 1        # on the GPU machine, with bench/gpu/offline/ beside the working tree; then --call 2
#   bash bench/gpu/run.sh --call 1 --dry-run   # every part of a call on this CPU, small and in float32 (no GPU needed)
# Options: --call 1|2 (required: the two calls of under 5 minutes each), --work DIR (the model and the logs; default
# under the temp folder), --deadline SECONDS (285 a call on a GPU).
# PYTHON picks the interpreter (default python3). posttrain runs from this checkout (PYTHONPATH), not installed.
# What it prints and how long it takes: bench/README.md, "The GPU kit".
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
PY=${PYTHON:-python3}
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "run.sh: $PY is not on PATH: set PYTHON to the Python that has torch installed." >&2
  exit 2
fi
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" "$here/kit.py" "$@"
