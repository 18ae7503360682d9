#!/usr/bin/env bash
# Run TRL's RLOOTrainer and RewardTrainer (bench/trl_rloo.py, bench/trl_reward.py) and posttrain's
# (bench/rloo_step.py, bench/reward_step.py) on the 152k-vocabulary model, alternating TRL and posttrain REPEATS times
# per row in one session (who goes first alternates too); print a JSON line per run (take the medians).
#   REPEATS=3 TRL_PY=/tmp/venv/bin/python PT_PY=/tmp/venv/bin/python bash bench/compare_rloo_reward.sh /tmp/bench-models
# ROWS picks rows by name: rloo (16 completions of 128 tokens a step, 8 per prompt, beta 0.05), reward (8 steps of 8 pairs a
# step, prompt 192, chosen 64, rejected 64), reward-peft (the same with LoRA r16 on every linear layer).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/settings.sh"
ROWS=${ROWS:-"rloo reward"}
[ -d "$models/v152k" ] || $PT_PY "$shared/make_tiny.py" "$models/v152k" --model-vocab 151936 --hidden 128 --layers 2 >/dev/null
declare -A scripts=([rloo]="rloo" [reward]="reward" [reward-peft]="reward")
declare -A flags=([rloo]="--completion 128 --steps 4" [reward]="" [reward-peft]="--peft")
for row in $ROWS; do
  for rep in $(seq "$REPEATS"); do
    order="trl posttrain"; [ $((rep % 2)) = 0 ] && order="posttrain trl"
    for side in $order; do
      if [ $side = trl ]; then out=$($TRL_PY "$here/trl_${scripts[$row]}.py" "$models/v152k" ${flags[$row]} 2>/dev/null | tail -n 1)
      else out=$($PT_PY "$here/${scripts[$row]}_step.py" "$models/v152k" ${flags[$row]} 2>/dev/null | tail -n 1); fi
      echo "{\"row\": \"$row\", \"rep\": $rep, \"result\": $out}"
    done
  done
done
