#!/usr/bin/env bash
# Run TRL's DistillationTrainer (bench/trl_distillation.py) and posttrain's (bench/distillation_step.py): the student
# is the 152k-vocabulary model (hidden 128, 2 layers), the teacher the same vocabulary and tokenizer at hidden 256,
# 4 layers. Alternates TRL and posttrain REPEATS times in one session (who goes first alternates too); prints a JSON
# line per run (take the medians).
#   REPEATS=3 TRL_PY=/tmp/venv/bin/python PT_PY=/tmp/venv/bin/python bash bench/compare_distillation.sh /tmp/bench-models
# ROWS: step (4 steps of 8 prompts, completions of 128 tokens) and/or lengths (LENGTHS, one step of one prompt at each
# completion length: the peak RSS it takes, for the longest completion within a memory budget; with LIMIT_GIB each
# length run is bounded by `ulimit -v` (address space, which is above the RSS), and one that fails says so).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/settings.sh"
ROWS=${ROWS:-step}
LENGTHS=${LENGTHS:-"1024 2048 4096 8192"}
[ -d "$models/v152k" ] || $PT_PY "$shared/make_tiny.py" "$models/v152k" --model-vocab 151936 --hidden 128 --layers 2 >/dev/null
[ -d "$models/v152k-teacher" ] || $PT_PY "$shared/make_tiny.py" "$models/v152k-teacher" --model-vocab 151936 --hidden 256 --layers 4 >/dev/null
# the length rows need a context longer than make_tiny's 1024 positions: the same weights with 32768 (RoPE positions)
for m in v152k v152k-teacher; do
  [ -d "$models/$m-long" ] || { cp -r "$models/$m" "$models/$m-long" && $PT_PY -c "import json, sys; p = sys.argv[1] + '/config.json'; c = json.load(open(p)); c['max_position_embeddings'] = 32768; json.dump(c, open(p, 'w'))" "$models/$m-long"; }
done
run() {  # suffix (the models), side, flags...
  local suffix=$1 side=$2; shift 2
  if [ "$side" = trl ]; then $TRL_PY "$here/trl_distillation.py" "$models/v152k$suffix" "$models/v152k-teacher$suffix" "$@" 2>/dev/null | tail -n 1
  else $PT_PY "$here/distillation_step.py" "$models/v152k$suffix" "$models/v152k-teacher$suffix" "$@" 2>/dev/null | tail -n 1; fi
}
for row in $ROWS; do
  for rep in $(seq "$REPEATS"); do
    order="trl posttrain"; [ $((rep % 2)) = 0 ] && order="posttrain trl"
    for side in $order; do
      if [ "$row" = step ]; then echo "{\"row\": \"step\", \"rep\": $rep, \"result\": $(run "" $side)}"
      else for n in $LENGTHS; do
        out=$( (if [ -n "${LIMIT_GIB:-}" ]; then ulimit -v $((LIMIT_GIB * 1024 * 1024)); fi
                run -long $side --steps 1 --batch 1 --completion "$n") || true)
        [ -n "$out" ] || out='{"failed": true}'
        echo "{\"row\": \"length\", \"rep\": $rep, \"side\": \"$side\", \"completion\": $n, \"result\": $out}"
      done; fi
    done
  done
done
