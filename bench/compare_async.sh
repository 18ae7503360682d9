#!/usr/bin/env bash
# Synchronous GRPO against async_generation at max_staleness 0, 1, 2 and 4 on the demo task (bench/async_grpo.py),
# generation and training on separate cores as separate GPUs would be: `posttrain serve` pinned to core 0, the
# trainer to core 1, one thread each. Each seed runs every setting, in an order rotated per seed; one JSON line per
# run, then bench/async_table.py's table. The default workload (a 4-layer, hidden-256 model of the demo's vocabulary,
# 16 completions of 32 tokens a step, forced to full length with every row training: --forced) does the same work
# every step whatever the policy samples, with generation and training times within 2x of each other.
#   SEEDS="0 1 2" STEPS=150 PT_PY=/tmp/venv/bin/python bash bench/compare_async.sh
#   FLAGS="--hidden 256 --layers 4 --batch 64 --completion 16" SETTINGS="-1 1 2 4" OUT=/tmp/async-reward.jsonl ...
#     (natural lengths: completions end at EOS, the reward is the demo's accuracy; for the reward curves)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
PT_PY=${PT_PY:-python3}
SEEDS=${SEEDS:-"0 1 2"}
STEPS=${STEPS:-150}
FLAGS=${FLAGS:-"--hidden 256 --layers 4 --batch 16 --gens 4 --completion 32 --forced"}
SERVER_CORE=${SERVER_CORE:-0}
TRAINER_CORE=${TRAINER_CORE:-1}
out=${OUT:-/tmp/async-bench.jsonl}
model=$($PT_PY -c "import sys; sys.path.insert(0, '$here'); import async_grpo as a; print(a.demo_vocabulary_model(*[int(x) for x in '$FLAGS'.split()[1:4:2]]))" 2>/dev/null | tail -n 1)
log=$(mktemp)
OMP_NUM_THREADS=1 taskset -c "$SERVER_CORE" $PT_PY -m posttrain.cli serve --model "$model" --port 0 > "$log" 2>/dev/null &
server=$!
trap 'kill $server 2>/dev/null' EXIT
for _ in $(seq 600); do grep -q "ready at" "$log" && break; sleep 0.1; done
url=$(sed -n 's/.*ready at //p' "$log")
: > "$out"
read -r -a settings <<< "${SETTINGS:--1 0 1 2 4}"  # -1: synchronous
n=${#settings[@]}
i=0
for seed in $SEEDS; do
  for k in $(seq 0 $((n - 1))); do
    s=${settings[$(((k + i) % n))]}
    line=$(OMP_NUM_THREADS=1 taskset -c "$TRAINER_CORE" $PT_PY "$here/async_grpo.py" "$url" $FLAGS --steps "$STEPS" \
           --staleness "$s" --seed "$seed" 2>/dev/null | tail -n 1)
    echo "{\"seed\": $seed, \"result\": $line}" | tee -a "$out"
  done
  i=$((i + 2))
done
$PT_PY "$here/async_table.py" "$out"
