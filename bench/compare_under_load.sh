#!/usr/bin/env bash
# TRL 1.16 and posttrain on a quiet machine and beside a fixed CPU load (issue 59): each row runs quiet, then beside
# LOAD busy single-threaded processes (default 1: "one other busy process"), the two sides alternately (which goes
# first alternates by repeat). Both sides start with the same thread count (--threads 2, torch's default on the
# 2-core machine); posttrain then sets its own per step (posttrain/training/threads.py), TRL keeps it.
#   REPEATS=3 TRL_PY=.venv/bin/python PT_PY=.venv/bin/python bash bench/compare_under_load.sh /tmp/bench-models
# Rows (ROWS="default demo v152k"):
#   default  GRPO, ../shared/bench/trl_grpo.py / bench/grpo_step.py on the default tiny model, --completion 64 --steps 6
#   v152k    the same scripts on the 152k-vocabulary tiny model, --completion 128 --steps 4
#   demo     `posttrain demo`'s task and config through bench/time_to_accuracy.py --impl trl|posttrain --seed 0
#            --steps 300 (no final evaluation); posttrain demo itself takes one thread unless OMP_NUM_THREADS is set,
#            so this row gives both sides --threads 2 and lets posttrain's per-step choice act
# Prints one JSON line per run: row, side, load (the busy processes beside it), rep, load1, and the script's line.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/settings.sh"
ROWS=${ROWS:-default demo}
LOAD=${LOAD:-1}
[ -d "$models/default" ] || $PT_PY "$shared/make_tiny.py" "$models/default" >/dev/null
[ -d "$models/v152k" ] || $PT_PY "$shared/make_tiny.py" "$models/v152k" --model-vocab 151936 --hidden 128 --layers 2 >/dev/null

busy=()
start_load() { for _ in $(seq "$1"); do python3 -c "while True: pass" & busy+=($!); done; sleep 1; }
stop_load() { [ ${#busy[@]} -gt 0 ] && kill "${busy[@]}" 2>/dev/null; wait "${busy[@]}" 2>/dev/null || true; busy=(); }
trap stop_load EXIT

command_of() {  # row side -> the command line of one run
  local py=$PT_PY; [ "$2" = trl ] && py=$TRL_PY
  case "$1-$2" in
    default-trl) echo "$py $shared/trl_grpo.py $models/default --completion 64 --steps 6 --threads 2" ;;
    default-posttrain) echo "$py $here/grpo_step.py $models/default --completion 64 --steps 6 --threads 2" ;;
    v152k-trl) echo "$py $shared/trl_grpo.py $models/v152k --completion 128 --steps 4 --threads 2" ;;
    v152k-posttrain) echo "$py $here/grpo_step.py $models/v152k --completion 128 --steps 4 --threads 2" ;;
    demo-*) echo "$py $here/time_to_accuracy.py --impl $2 --seed 0 --steps 300 --threads 2 --no-final-eval" ;;
  esac
}

for row in $ROWS; do
  for rep in $(seq "$REPEATS"); do
    order="trl posttrain"; [ $((rep % 2)) = 0 ] && order="posttrain trl"
    for load in 0 "$LOAD"; do
      [ "$load" = 0 ] || start_load "$load"
      for side in $order; do
        out=$($(command_of "$row" "$side") 2>/dev/null | tail -n 1)
        echo "{\"row\": \"$row\", \"side\": \"$side\", \"load\": $load, \"rep\": $rep, \"load1\": $(cut -d' ' -f1 /proc/loadavg), \"result\": $out}"
      done
      stop_load
    done
  done
done
