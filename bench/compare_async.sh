#!/usr/bin/env bash
# Synchronous GRPO against async_generation at max_staleness 0, 1, 2 and 4 on the demo task (bench/async_grpo.py),
# generation and training on separate cores as separate GPUs would be: `posttrain serve` pinned to core 0, the
# trainer to core 1, one thread each. Each seed runs every setting, in an order rotated per seed; one JSON line per
# run, then bench/async_table.py's table.
#   SEEDS="0 1 2" STEPS=150 PT_PY=/tmp/venv/bin/python bash bench/compare_async.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
PT_PY=${PT_PY:-python3}
SEEDS=${SEEDS:-"0 1 2"}
STEPS=${STEPS:-150}
FLAGS=${FLAGS:-"--hidden 256 --layers 4 --batch 64 --completion 24"}
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
settings=(-1 0 1 2 4)
i=0
for seed in $SEEDS; do
  for k in 0 1 2 3 4; do
    s=${settings[$(((k + i) % 5))]}
    line=$(OMP_NUM_THREADS=1 taskset -c "$TRAINER_CORE" $PT_PY "$here/async_grpo.py" "$url" $FLAGS --steps "$STEPS" \
           --staleness "$s" --seed "$seed" 2>/dev/null | tail -n 1)
    echo "{\"seed\": $seed, \"result\": $line}" | tee -a "$out"
  done
  i=$((i + 2))
done
$PT_PY "$here/async_table.py" "$out"
