#!/usr/bin/env bash
# Run TRL's and posttrain's trainers on the vision-language workload (bench/vlm_workload.py: a tiny Qwen2.5-VL, rows
# of IMAGES images), alternating TRL and posttrain REPEATS times in one session (who goes first alternates too); print
# a JSON line per run (take the medians). TRAINERS: which (default all six).
#   REPEATS=3 TRL_PY=.venv/bin/python PT_PY=.venv/bin/python bash bench/compare_vlm.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/settings.sh"
for trainer in ${TRAINERS:-sft dpo kto grpo rloo distillation}; do
  for rep in $(seq "$REPEATS"); do
    order="trl posttrain"; [ $((rep % 2)) = 0 ] && order="posttrain trl"
    for side in $order; do
      py=$TRL_PY; [ $side = posttrain ] && py=$PT_PY
      out=$($py "$here/vlm_step.py" --impl $side --trainer $trainer --images ${IMAGES:-3} ${FLAGS:-} 2>/dev/null | tail -n 1)
      echo "{\"row\": \"vlm-$trainer\", \"rep\": $rep, \"result\": $out}"
    done
  done
done
