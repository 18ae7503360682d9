#!/usr/bin/env bash
# Run TRL's anchor (../shared/bench/trl_grpo.py) and bench/grpo_step.py on the four rows of
# ../shared/bench/README.md, alternating TRL and posttrain REPEATS times per row in one session (TRL first in odd
# repeats, posttrain first in even ones); print a JSON line per run (take the medians).
#   REPEATS=3 TRL_PY=/tmp/trl-venv/bin/python PT_PY=python3 bash bench/compare.sh /tmp/bench-models
# ONLY=v152k (a model directory name) runs just that model's rows.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/settings.sh"
[ -d "$models/default" ] || $PT_PY "$shared/make_tiny.py" "$models/default" >/dev/null
[ -d "$models/v65k" ] || $PT_PY "$shared/make_tiny.py" "$models/v65k" --model-vocab 65536 >/dev/null
[ -d "$models/v152k" ] || $PT_PY "$shared/make_tiny.py" "$models/v152k" --model-vocab 151936 --hidden 128 --layers 2 >/dev/null
rows=(
  "default|--completion 64 --steps 6"
  "v65k|--completion 128 --steps 4"
  "v65k|--completion 128 --steps 4 --peft"
  "v152k|--completion 128 --steps 4"
)
for row in "${rows[@]}"; do
  model=${row%%|*}; flags=${row#*|}
  if [ -n "${ONLY:-}" ] && [ "$model" != "$ONLY" ]; then continue; fi
  for rep in $(seq "$REPEATS"); do
    order="trl posttrain"; [ $((rep % 2)) = 0 ] && order="posttrain trl"  # who goes first alternates
    for side in $order; do
      if [ $side = trl ]; then out=$($TRL_PY "$shared/trl_grpo.py" "$models/$model" $flags 2>/dev/null | tail -n 1)
      else out=$($PT_PY "$here/grpo_step.py" "$models/$model" $flags 2>/dev/null | tail -n 1); fi
      echo "{\"model\": \"$model\", \"flags\": \"$flags\", \"rep\": $rep, \"result\": $out}"
    done
  done
done
