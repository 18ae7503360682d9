#!/usr/bin/env bash
# Issue 38's rows on Qwen2.5-0.5B's shape (bench/make_qwen_shape.py: 494M parameters, random weights), TRL 1.16 and
# posttrain alternately (which side goes first alternates too), each run through bench/clocked.py (the JSON line gains
# the steps' own times, `step_s` and `median_step_s`, the first step's one-time work left out).
#   ROWS="grpo sft dpo" REPEATS=3 PT_PY=/tmp/venv/bin/python TRL_PY=/tmp/venv/bin/python bash bench/compare_real_shape.sh
#   ROWS=memory LENGTHS="256 512 1024 2048" bash bench/compare_real_shape.sh
# Rows (override a row's flags with GRPO_FLAGS, SFT_FLAGS, DPO_FLAGS):
#   grpo    ../shared/bench/trl_grpo.py / bench/grpo_step.py  --completion 32 --batch 8 --gens 8 --steps 4
#   sft     ../shared/bench/trl_sft.py / bench/sft_step.py    --batch 4 --seq 256 --steps 4
#   dpo     ../shared/bench/trl_dpo.py / bench/dpo_step.py    --pairs 2 --prompt 96 --chosen 32 --rejected 32 --steps 4
#   memory  GRPO, 8 completions (one group) of each of LENGTHS tokens, one step, activation checkpointing on (TRL's
#           default), under a 20 GiB RSS ceiling (RSS_LIMIT_GIB): peak RSS, or where the ceiling was passed; AdamW's
#           states made up front (clocked.py --optimizer-states-first), so that the one step holds them as a later
#           step would; posttrain's side with PT_MEMORY_FLAGS (default none: its own default,
#           max_completion_tokens_per_pass "auto", which runs the micro-batch in passes where the model's shape says
#           they lower the peak; "--max-completion-tokens-per-pass none" runs it whole, a count caps each pass);
#           RANDOM_COMPLETIONS=1: both sides' decode replaced by random full-length completions (clocked.py
#           --random-completions), the training's peak in the training's time only (the long lengths' hours)
# Every JSON line goes to stdout and to $OUT/runs.jsonl (OUT defaults to a new /tmp/real-shape.* folder); then
# `python bench/real_shape_table.py $OUT/runs.jsonl` prints the tables with the FLOP-bound column.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
REPEATS=${REPEATS:-3}
source "$here/settings.sh"
ROWS=${ROWS:-grpo sft dpo}
LENGTHS=${LENGTHS:-256 512 1024 2048}
RSS_LIMIT_GIB=${RSS_LIMIT_GIB:-20}
SIDES=${SIDES:-trl posttrain}  # the memory row's sides, in this order
RANDOM_COMPLETIONS=${RANDOM_COMPLETIONS:-0}  # 1: the memory row without the decode (both sides)
PT_MEMORY_FLAGS=${PT_MEMORY_FLAGS:-}  # posttrain's own, on the memory row
GRPO_FLAGS=${GRPO_FLAGS:---completion 32 --batch 8 --gens 8 --steps 4}
SFT_FLAGS=${SFT_FLAGS:---batch 4 --seq 256 --steps 4}
DPO_FLAGS=${DPO_FLAGS:---pairs 2 --prompt 96 --chosen 32 --rejected 32 --steps 4}
OUT=${OUT:-$(mktemp -d /tmp/real-shape.XXXXXX)}
mkdir -p "$OUT"
model="$models/qwen05"
[ -f "$model/model.safetensors" ] || $PT_PY "$here/make_qwen_shape.py" "$model" >/dev/null

scripts() {  # row side -> the script a side runs for a row
  case "$1-$2" in
    grpo-trl|memory-trl) echo "$shared/trl_grpo.py" ;;  grpo-posttrain|memory-posttrain) echo "$here/grpo_step.py" ;;
    sft-trl) echo "$shared/trl_sft.py" ;;               sft-posttrain) echo "$here/sft_step.py" ;;
    dpo-trl) echo "$shared/trl_dpo.py" ;;               dpo-posttrain) echo "$here/dpo_step.py" ;;
  esac
}

run() {  # row side rep label flags... : one run, its JSON line tagged
  local row=$1 side=$2 rep=$3 label=$4; shift 4
  local py=$PT_PY; [ "$side" = trl ] && py=$TRL_PY
  local limit=(); [ "$row" = memory ] && limit=(--rss-limit-gib "$RSS_LIMIT_GIB" --optimizer-states-first)
  [ "$row" = memory ] && [ "$RANDOM_COMPLETIONS" = 1 ] && limit+=(--random-completions)
  local log="$OUT/$row-$label-$side-$rep"; [ "$RANDOM_COMPLETIONS" = 1 ] && log="$log-random"
  local status=0
  "$py" "$here/clocked.py" "${limit[@]}" "$(scripts "$row" "$side")" "$model" "$@" >"$log.out" 2>"$log.err" || status=$?
  if [ ! -s "$log.out" ]; then
    echo "$side $row $label (repeat $rep) failed with status $status; the end of its log ($log.err):" >&2
    tail -n 20 "$log.err" >&2
    return 1
  fi
  echo "{\"row\": \"$row\", \"label\": \"$label\", \"rep\": $rep, \"side\": \"$side\", \"flags\": \"$*\", \"status\": $status, \"load1\": $(cut -d' ' -f1 /proc/loadavg), \"result\": $(tail -n 1 "$log.out")}" | tee -a "$OUT/runs.jsonl"
}

for row in $ROWS; do
  if [ "$row" = memory ]; then
    for length in $LENGTHS; do
      for side in $SIDES; do
        own=(); [ "$side" = posttrain ] && read -ra own <<<"$PT_MEMORY_FLAGS"
        run memory "$side" 1 "$length" --completion "$length" --batch 8 --gens 8 --steps 1 --gradient-checkpointing \
          "${own[@]}"
      done
    done
    continue
  fi
  flags_var="${row^^}_FLAGS"
  for rep in $(seq "$REPEATS"); do
    order="trl posttrain"; [ $((rep % 2)) = 0 ] && order="posttrain trl"
    for side in $order; do
      # shellcheck disable=SC2086
      run "$row" "$side" "$rep" "$row" ${!flags_var}
    done
  done
done
echo "runs: $OUT/runs.jsonl" >&2
