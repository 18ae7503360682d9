#!/usr/bin/env bash
# Multi-turn GRPO with tools (issue 34): TRL's GRPOTrainer (bench/trl_grpo_tools.py) and posttrain's
# (bench/grpo_tools_step.py) on the 152k-vocabulary model, with the same tool, scripted parsing and data
# (bench/tools_workload.py), alternately REPEATS times (default 3; which side goes first alternates too). Prints a
# JSON line per run, then each side's medians and posttrain / TRL ratios (targets: time <= 1/3, peak RSS <= 1/2), and
# each side's share of completion positions spent on tool-result tokens and on padding.
#   REPEATS=3 TRL_PY=/tmp/trl-venv/bin/python PT_PY=python3 bash bench/compare_tools.sh /tmp/bench-models
# FLAGS: extra flags for both scripts (e.g. "--steps 2 --turn 16"). Both render with qwen2_5.jinja of TRL_PY's TRL.
# With the defaults (16 rollouts of 3 turns of 32 tokens and 2 tool results, 4 steps), TRL takes minutes a step here.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
REPEATS=${REPEATS:-3}
source "$here/settings.sh"
FLAGS=${FLAGS:-}
[ -d "$models/v152k" ] || $PT_PY "$shared/make_tiny.py" "$models/v152k" --model-vocab 151936 --hidden 128 --layers 2 >/dev/null
template=$($TRL_PY -c "import importlib.util, os
print(os.path.join(list(importlib.util.find_spec('trl').submodule_search_locations)[0], 'chat_templates', 'qwen2_5.jinja'))")
logs=$(mktemp -d /tmp/compare-tools.XXXXXX)
for rep in $(seq "$REPEATS"); do
  order="trl posttrain"; [ $((rep % 2)) = 0 ] && order="posttrain trl"
  for side in $order; do
    if [ $side = trl ]; then cmd=("$TRL_PY" "$here/trl_grpo_tools.py"); else cmd=("$PT_PY" "$here/grpo_tools_step.py"); fi
    if ! "${cmd[@]}" "$models/v152k" --chat-template "$template" $FLAGS >"$logs/$side-$rep.out" 2>"$logs/$side-$rep.err"; then
      echo "$side (repeat $rep) failed; the end of its log ($logs/$side-$rep.err):" >&2
      tail -n 20 "$logs/$side-$rep.err" >&2
      exit 1
    fi
    echo "{\"row\": \"tools\", \"rep\": $rep, \"side\": \"$side\", \"result\": $(tail -n 1 "$logs/$side-$rep.out")}" | tee -a "$logs/runs.jsonl"
  done
done
$PT_PY - "$logs/runs.jsonl" <<'EOF'
import json, statistics, sys

runs = [json.loads(line) for line in open(sys.argv[1])]
keys = ("s_per_step", "wall_s", "peak_rss_mib", "tool_token_fraction", "padding_fraction", "prompt_padding_fraction",
        "tool_calls_per_step")
med = {side: {k: round(statistics.median(r["result"][k] for r in runs if r["side"] == side), 4) for k in keys}
       for side in ("trl", "posttrain")}
for side in ("trl", "posttrain"):
    print(json.dumps({"median": side, "runs": sum(r["side"] == side for r in runs), **med[side]}))
time, rss = (med["posttrain"][k] / med["trl"][k] for k in ("s_per_step", "peak_rss_mib"))
print(json.dumps({"ratio": "posttrain/trl", "s_per_step": round(time, 3), "peak_rss_mib": round(rss, 3),
                  "time_target_met": time <= 1 / 3, "rss_target_met": rss <= 1 / 2}))
EOF
