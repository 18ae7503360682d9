#!/usr/bin/env bash
# Run TRL's KTOTrainer (bench/trl_kto.py) and posttrain's (bench/kto_step.py) on the 152k-vocabulary model,
# alternating TRL and posttrain REPEATS times in one session (who goes first alternates too); print a JSON line per
# run (take the medians). The workload: 8 steps of 8 unpaired examples (prompt 192, completion 64), loss_type kto.
#   REPEATS=3 TRL_PY=/tmp/venv/bin/python PT_PY=/tmp/venv/bin/python bash bench/compare_kto.sh /tmp/bench-models
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/settings.sh"
[ -d "$models/v152k" ] || $PT_PY "$shared/make_tiny.py" "$models/v152k" --model-vocab 151936 --hidden 128 --layers 2 >/dev/null
for rep in $(seq "$REPEATS"); do
  order="trl posttrain"; [ $((rep % 2)) = 0 ] && order="posttrain trl"
  for side in $order; do
    if [ $side = trl ]; then out=$($TRL_PY "$here/trl_kto.py" "$models/v152k" ${FLAGS:-} 2>/dev/null | tail -n 1)
    else out=$($PT_PY "$here/kto_step.py" "$models/v152k" ${FLAGS:-} 2>/dev/null | tail -n 1); fi
    echo "{\"row\": \"kto\", \"rep\": $rep, \"result\": $out}"
  done
done
