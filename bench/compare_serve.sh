#!/usr/bin/env bash
# GRPO through `posttrain serve` against in-process generation, on the default and 152k-vocabulary models:
# in-process, through the server with TRL's default importance-sampling correction (one more no-grad forward per
# round, as TRL computes), and through the server without it (the transport alone); the three rotate REPEATS times
# per model, one JSON line per run, then one weight push measurement per model (bench/weight_sync.py). The server
# runs on this machine, loopback, started per model.
#   REPEATS=3 PT_PY=/tmp/pt-venv/bin/python bash bench/compare_serve.sh /tmp/bench-models
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
models=${1:-/tmp/bench-models}
PT_PY=${PT_PY:-python3}
REPEATS=${REPEATS:-1}
MODELS=${MODELS:-"default v152k"}
for name in $MODELS; do
  log=$(mktemp)
  $PT_PY -m posttrain.cli serve --model "$models/$name" --port 0 > "$log" 2>/dev/null &
  server=$!
  trap 'kill $server 2>/dev/null' EXIT
  for _ in $(seq 600); do grep -q "ready at" "$log" && break; sleep 0.1; done
  url=$(sed -n 's/.*ready at //p' "$log")
  for rep in $(seq "$REPEATS"); do
    case $((rep % 3)) in 1) order="local serve bare";; 2) order="serve bare local";; *) order="bare local serve";; esac
    for side in $order; do
      case $side in
        local) out=$($PT_PY "$here/grpo_step.py" "$models/$name" 2>/dev/null | tail -n 1);;
        serve) out=$($PT_PY "$here/grpo_step.py" "$models/$name" --server "$url" 2>/dev/null | tail -n 1);;
        bare) out=$($PT_PY "$here/grpo_step.py" "$models/$name" --server "$url" --no-sampling-correction \
                    2>/dev/null | tail -n 1);;
      esac
      echo "{\"model\": \"$name\", \"rep\": $rep, \"result\": $out}"
    done
  done
  echo "{\"model\": \"$name\", \"sync\": $($PT_PY "$here/weight_sync.py" "$models/$name" "$url" 2>/dev/null | tail -n 1)}"
  kill $server; wait $server 2>/dev/null || true
done
