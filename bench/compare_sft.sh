#!/usr/bin/env bash
# Run TRL's SFT anchor (../shared/bench/trl_sft.py) and bench/sft_step.py on the issue's rows, alternating TRL and
# posttrain REPEATS times per row in one session (which side goes first alternates too); print a JSON line per run
# (take the medians).
#   REPEATS=3 TRL_PY=/tmp/trl-venv/bin/python PT_PY=python3 bash bench/compare_sft.sh /tmp/bench-models
# ROWS="text completion" picks rows by name: text (8 x 256, whole-sequence loss), completion (8 x (192 + 64),
# completion-only), packed (text, packing=True).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/settings.sh"
ROWS=${ROWS:-"text completion"}
[ -d "$models/v152k" ] || $PT_PY "$shared/make_tiny.py" "$models/v152k" --model-vocab 151936 --hidden 128 --layers 2 >/dev/null
declare -A flags=([text]="--mode text" [completion]="--mode completion" [packed]="--mode text --packing")
for row in $ROWS; do
  for rep in $(seq "$REPEATS"); do
    order="trl posttrain"; [ $((rep % 2)) = 0 ] && order="posttrain trl"
    for side in $order; do
      if [ $side = trl ]; then out=$($TRL_PY "$shared/trl_sft.py" "$models/v152k" ${flags[$row]} 2>/dev/null | tail -n 1)
      else out=$($PT_PY "$here/sft_step.py" "$models/v152k" ${flags[$row]} 2>/dev/null | tail -n 1); fi
      echo "{\"row\": \"$row\", \"rep\": $rep, \"result\": $out}"
    done
  done
done
