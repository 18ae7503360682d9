#!/usr/bin/env bash
# GRPO through `posttrain grpo` on one process, on 2 processes with DDP, and on 2 processes with accelerate's FSDP1,
# FSDP2, DeepSpeed ZeRO-2 and ZeRO-3 (the shipped configs, through the test-only CPU patch, tests/multiproc_sharded.py),
# same global batch (16 rows), SGD, 2 steps, on
# MODEL_DIR; one JSON line per run: s/step (median of the steps' step_time), peak RSS of the largest process (MiB,
# GNU time's maximum resident set size over the launcher's children), and the largest parameter difference from the
# one-process run after the 2 steps (and how far the weights moved). The reward is bench/sharded_rewards.py's.
#   PT_PY=/tmp/pt-venv/bin/python bash bench/sharded.sh /tmp/bench-models/v152k
# RUNS="one fsdp2" runs only those (one, the reference, always runs); PYTHONPATH=<another checkout> runs its posttrain.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
model=${1:?model dir}
PT_PY=${PT_PY:-python3}
out=$(mktemp -d)
data="$out/prompts.jsonl"
$PT_PY -c "
import json
with open('$data', 'w') as f:
    for a in range(4):
        for b in range(4):
            f.write(json.dumps({'prompt': f'{a}+{b}='}) + '\n')"
args=(--model_name_or_path "$model" --dataset_name "$data" --reward_funcs sharded_rewards.distinct_tokens --num_generations 4
      --max_completion_length 64 --max_steps 2 --logging_steps 1 --save_strategy no --gradient_checkpointing false
      --optim sgd --learning_rate 0.1 --use_cpu true)
launch=("$PT_PY" -m accelerate.commands.launch --num_processes 2 --num_machines 1 --mixed_precision no
        --dynamo_backend no)
run() {  # name, command...
  local name=$1; shift
  /usr/bin/time -f "%M" -o "$out/$name.rss" "$@" --output_dir "$out/$name" > "$out/$name.log" 2>&1
  MODEL="$model" $PT_PY - "$out" "$name" <<'EOF'
import json, os, statistics, sys
from safetensors.torch import load_file
out, name = sys.argv[1], sys.argv[2]
steps = [json.loads(line)["step_time"] for line in open(os.path.join(out, name, "metrics.jsonl"))]
weights = load_file(os.path.join(out, name, "model.safetensors"))
ref = load_file(os.path.join(out, "one", "model.safetensors"))
diff = max(float((weights[k] - ref[k]).abs().max()) for k in ref)
rss = int(open(os.path.join(out, name + ".rss")).read().split()[-1]) / 1024
base = load_file(os.path.join(os.environ["MODEL"], "model.safetensors"))
moved = max(float((ref[k] - base[k]).abs().max()) for k in ref if k in base)
print(json.dumps({"run": name, "s_per_step": round(statistics.median(steps), 3), "peak_rss_mib_per_process":
                  round(rss, 1), "max_param_diff_vs_one": diff, "max_param_change_one": moved}), flush=True)
EOF
}
cd "$here"
export PYTHONPATH="$here/bench${PYTHONPATH:+:$PYTHONPATH}"
RUNS=${RUNS:-"one ddp fsdp1 fsdp2 zero2 zero3"}
wanted() { [[ " $RUNS " == *" $1 "* ]]; }
run one "$PT_PY" -m posttrain.cli grpo "${args[@]}" --per_device_train_batch_size 16
if wanted ddp; then
  run ddp "${launch[@]}" --multi_gpu -m posttrain.cli grpo "${args[@]}" --per_device_train_batch_size 8
fi
# FSDP1 as tests/test_sharded.py runs it: the shipped fsdp1.yaml without RAM-efficient loading (GPU-only in torch)
sed -e 's/fsdp_cpu_ram_efficient_loading: true/fsdp_cpu_ram_efficient_loading: false/' \
  -e 's/fsdp_sync_module_states: true/fsdp_sync_module_states: false/' \
  posttrain/accelerate_configs/fsdp1.yaml > "$out/fsdp1.yaml"
for config in fsdp1 fsdp2 zero2 zero3; do
  wanted $config || continue
  file=posttrain/accelerate_configs/$config.yaml
  [ "$config" = fsdp1 ] && file="$out/fsdp1.yaml"
  run $config "${launch[@]}" --config_file "$file" tests/multiproc_sharded.py grpo \
    "${args[@]}" --per_device_train_batch_size 8
done
rm -rf "$out"
