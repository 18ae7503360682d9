#!/usr/bin/env bash
# GRPO through `posttrain grpo` on 2 DDP processes (accelerate launch --multi_gpu, gloo on CPU, 1 thread each), the
# benchmark's prompts prefixed by bench/long_prompts.py's 111-token instruction (122-token prompts on make_tiny.py's
# tokenizer), 8 rows a process (one prompt's 8 completions), completions forced to MAX_COMPLETION tokens, beta 0.04,
# STEPS steps; each checkout in turn, REPEATS rounds. One JSON line per run: the checkout, its steps' step_time and
# their median without the first step (which runs the one-time checks).
#   REPEATS=2 PT_PY=/tmp/pt-venv/bin/python bash bench/ddp_long_prompts.sh /tmp/bench-models/wide . /tmp/base-checkout
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
model=${1:?model dir}
shift
checkouts=("${@:?one or more posttrain checkouts}")
PT_PY=${PT_PY:-python3}
REPEATS=${REPEATS:-2}
STEPS=${STEPS:-4}
MAX_COMPLETION=${MAX_COMPLETION:-128}
out=$(mktemp -d)
PYTHONPATH="$here/bench" $PT_PY -c "
import json
from long_prompts import PREFIX
with open('$out/prompts.jsonl', 'w') as f:
    for a, b in zip(range(10, 74), range(100, 164)):
        f.write(json.dumps({'prompt': PREFIX + f'What is {a} + {b}?'}) + '\n')"
for round in $(seq "$REPEATS"); do
  for checkout in "${checkouts[@]}"; do
    run="$out/run-$round-$(basename "$(cd "$checkout" && pwd)")"
    (cd "$checkout" && PYTHONPATH="$here/bench" $PT_PY -m accelerate.commands.launch --multi_gpu --num_processes 2 \
      --num_machines 1 --mixed_precision no --dynamo_backend no -m posttrain.cli grpo --model_name_or_path "$model" \
      --dataset_name "$out/prompts.jsonl" --reward_funcs sharded_rewards.distinct_tokens --num_generations 8 \
      --per_device_train_batch_size 8 --max_completion_length "$MAX_COMPLETION" \
      --generation_kwargs "{\"min_new_tokens\": $MAX_COMPLETION}" --beta 0.04 --max_steps "$STEPS" --logging_steps 1 \
      --save_strategy no --gradient_checkpointing false --use_cpu true --plot_on_end false \
      --output_dir "$run" > "$run.log" 2>&1) || { tail -20 "$run.log"; exit 1; }
    $PT_PY - "$run" "$checkout" <<'EOF'
import json, statistics, sys
run, checkout = sys.argv[1], sys.argv[2]
steps = [json.loads(line)["step_time"] for line in open(f"{run}/metrics.jsonl")]
print(json.dumps({"checkout": checkout, "step_time": [round(s, 2) for s in steps],
                  "median_after_first": round(statistics.median(steps[1:]), 2)}))
EOF
  done
done
