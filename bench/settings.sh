# The settings every bench/compare*.sh shares; sourced after the script sets `here` (the bench folder), so that
# $1 is the script's own first argument (the models folder).
set -euo pipefail
shared=${SHARED:-$here/../../shared/bench}
models=${1:-/tmp/bench-models}
TRL_PY=${TRL_PY:-/tmp/trl-venv/bin/python}
PT_PY=${PT_PY:-python3}
REPEATS=${REPEATS:-1}
mkdir -p "$models"
