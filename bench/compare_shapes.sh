#!/usr/bin/env bash
# Issue 16's rows, TRL and posttrain alternately (who goes first alternates), REPEATS times each; a JSON line per run.
#   REPEATS=3 TRL_PY=/tmp/trl-venv/bin/python PT_PY=python3 bash bench/compare_shapes.sh /tmp/bench-models
# ROWS (default "natural wide wide-natural long"):
#   natural  152k model with natural lengths (bench/make_natural.py --eos-scale 4): completions end at EOS,
#            --completion 128 --steps 4; TRL through bench/trl_grpo_natural.py (the anchor without min_new_tokens)
#   wide     a body-dominated model (hidden 768, 8 layers, 12 heads / 4 KV heads, 32,768 vocabulary):
#            --completion 128 --steps 4, the anchor as it is
#   wide-natural  the wide model with natural lengths (bench/make_natural.py --eos-rate 0.02), --completion 128
#            --steps 4, TRL through bench/trl_grpo_natural.py
#   wide-prompts  the wide row with every prompt prefixed by a fixed 111-token instruction (bench/long_prompts.py,
#            both sides): 122-token prompts, as a system prompt or a chat template makes them
#   long     152k model, --completion 256, 512 and 1024 (LONG="256 512 1024"), --steps 2: peak RSS against length;
#            the model's config says 2,048 positions (v152k-long: make_tiny.py writes 1,024, and posttrain refuses a
#            completion that leaves no room for a prompt in the model's context; the weights are v152k's)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/settings.sh"
ROWS=${ROWS:-natural wide wide-natural wide-prompts long}
LONG=${LONG:-256 512 1024}
[ -d "$models/v152k" ] || $PT_PY "$shared/make_tiny.py" "$models/v152k" --model-vocab 151936 --hidden 128 --layers 2 >/dev/null
[ -d "$models/v152k-natural" ] || $PT_PY "$here/make_natural.py" "$models/v152k" "$models/v152k-natural" --eos-scale 4 >/dev/null 2>&1
if [ ! -d "$models/v152k-long" ]; then
  cp -r "$models/v152k" "$models/v152k-long"
  $PT_PY -c "import json, sys; p = sys.argv[1] + '/config.json'; c = json.load(open(p)); c['max_position_embeddings'] = 2048; json.dump(c, open(p, 'w'), indent=2)" "$models/v152k-long"
fi
[ -d "$models/wide" ] || $PT_PY "$shared/make_tiny.py" "$models/wide" --model-vocab 32768 --hidden 768 --layers 8 \
  --heads 12 --kv-heads 4 >/dev/null
[ -d "$models/wide-natural" ] || $PT_PY "$here/make_natural.py" "$models/wide" "$models/wide-natural" --eos-rate 0.02 \
  >/dev/null 2>&1

run() {  # run ROW_NAME MODEL FLAGS TRL_SCRIPT OUR_EXTRA_FLAGS [WRAPPER: a script that runs the bench script given it]
  local name=$1 model=$2 flags=$3 trl_script=$4 ours=$5 wrapper=${6:-} rep side out order
  for rep in $(seq "$REPEATS"); do
    if [ $((rep % 2)) = 1 ]; then order="trl posttrain"; else order="posttrain trl"; fi
    for side in $order; do
      if [ $side = trl ]; then out=$($TRL_PY $wrapper "$trl_script" "$models/$model" $flags 2>/dev/null | tail -n 1 || echo '"failed"')
      else out=$($PT_PY $wrapper "$here/grpo_step.py" "$models/$model" $flags $ours 2>/dev/null | tail -n 1 || echo '"failed"'); fi
      echo "{\"row\": \"$name\", \"model\": \"$model\", \"flags\": \"$flags\", \"rep\": $rep, \"side\": \"$side\", \"result\": $out}"
    done
  done
}

for row in $ROWS; do
  case $row in
    natural) run natural v152k-natural "--completion 128 --steps 4" "$here/trl_grpo_natural.py" "--natural" ;;
    wide) run wide wide "--completion 128 --steps 4" "$shared/trl_grpo.py" "" ;;
    wide-prompts) run wide-prompts wide "--completion 128 --steps 4" "$shared/trl_grpo.py" "" "$here/long_prompts.py" ;;
    wide-natural) run wide-natural wide-natural "--completion 128 --steps 4" "$here/trl_grpo_natural.py" "--natural" ;;
    long) for c in $LONG; do run "long-$c" v152k-long "--completion $c --steps 2" "$shared/trl_grpo.py" ""; done ;;
  esac
done
