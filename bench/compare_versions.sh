#!/usr/bin/env bash
# One row, interleaved: TRL's anchor, this checkout, and another posttrain checkout (e.g. a git worktree of an
# earlier commit), REPEATS times, the two posttrain versions swapping order each time; a JSON line per run.
#   BASE=/tmp/pt-base REPEATS=4 bash bench/compare_versions.sh /tmp/bench-models/default --completion 64 --steps 6
# WITH_TRL=0 leaves TRL's anchor out (a refactor's before/after, where only the two posttrain versions matter).
# STEP and ANCHOR pick the trainer (default: STEP=grpo_step.py ANCHOR=trl_grpo.py; e.g. STEP=dpo_step.py
# ANCHOR=trl_dpo.py, each side's bench/ script and ../shared/bench's anchor taking the same flags).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
shared=${SHARED:-$here/../shared/bench}
TRL_PY=${TRL_PY:-/tmp/trl-venv/bin/python}
PT_PY=${PT_PY:-python3}
BASE=${BASE:?set BASE to the other checkout}
model=$1; shift
for rep in $(seq "${REPEATS:-3}"); do
  if [ "${WITH_TRL:-1}" != 0 ]; then
    echo "{\"side\": \"trl\", \"rep\": $rep, \"result\": $($TRL_PY "$shared/${ANCHOR:-trl_grpo.py}" "$model" "$@" 2>/dev/null | tail -n 1)}"
  fi
  order="this base"; [ $((rep % 2)) = 0 ] && order="base this"
  for side in $order; do
    dir=$here; [ $side = base ] && dir=$BASE
    out=$(cd "$dir" && PYTHONPATH="$dir" $PT_PY "bench/${STEP:-grpo_step.py}" "$model" "$@" 2>/dev/null | tail -n 1)
    echo "{\"side\": \"$side\", \"rep\": $rep, \"result\": $out}"
  done
done
