#!/usr/bin/env bash
# Run TRL's DPO anchor (../shared/bench/trl_dpo.py) and bench/dpo_step.py on the issue's rows, alternating TRL and
# posttrain REPEATS times per row in one session (which side goes first alternates too); print a JSON line per run
# (take the medians).
#   REPEATS=3 TRL_PY=/tmp/trl-venv/bin/python PT_PY=python3 bash bench/compare_dpo.sh /tmp/bench-models
# ROWS picks rows by name: dpo (4 pairs, prompt 192, chosen 64, rejected 64), ld (rejected 32, ld_alpha 0.5),
# precompute (precompute_ref_log_probs), peft (LoRA r16 all-linear, reference = adapters off).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/settings.sh"
ROWS=${ROWS:-"dpo ld precompute peft"}
[ -d "$models/v152k" ] || $PT_PY "$shared/make_tiny.py" "$models/v152k" --model-vocab 151936 --hidden 128 --layers 2 >/dev/null
declare -A flags=([dpo]="" [ld]="--rejected 32 --ld-alpha 0.5" [precompute]="--precompute-ref" [peft]="--peft")
for row in $ROWS; do
  for rep in $(seq "$REPEATS"); do
    order="trl posttrain"; [ $((rep % 2)) = 0 ] && order="posttrain trl"
    for side in $order; do
      if [ $side = trl ]; then out=$($TRL_PY "$shared/trl_dpo.py" "$models/v152k" ${flags[$row]} 2>/dev/null | tail -n 1)
      else out=$($PT_PY "$here/dpo_step.py" "$models/v152k" ${flags[$row]} 2>/dev/null | tail -n 1); fi
      echo "{\"row\": \"$row\", \"rep\": $rep, \"result\": $out}"
    done
  done
done
