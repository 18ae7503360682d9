"""Tables of bench/compare_real_shape.sh's runs: each row's medians on each side, their ratios, and the FLOP-bound time.

Usage: python bench/real_shape_table.py RUNS_JSONL [--model /tmp/bench-models/qwen05] [--rate GFLOP_PER_S]

The FLOP-bound time is the fewest matmul FLOPs the row's step needs (below) over the machine's matmul rate: without
--rate, the best float32 rate of three products measured here at the model's shapes (2,048 rows through the MLP's
up and down projections and the output layer, 2 threads), so the bound is a floor no implementation can pass on this
machine. Measure it on a quiet machine, as the runs were.

FLOPs of a step (2 per multiply-add; `flops.body_params` is the body's weights per token, `head` hidden x vocabulary):
- GRPO: the decode (each prompt once, as posttrain's shared prefill; every completion token), the reference forward
  (beta > 0) and the policy's forward and backward (2x the forward) over each prompt once and every completion,
  the output layer at completion positions only (`flops.grpo_step_flops` with the prompts shared, without the
  chunked path's recomputed output-layer forward).
- SFT (text rows): forward + backward, 3 x 2 x tokens x (body + head).
- DPO: the policy's forward + backward and the reference forward over prompt + chosen and prompt + rejected, the
  output layer at the chosen and rejected positions only.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/flops.py

from flops import body_params, grpo_step_flops  # noqa: E402

ANCHOR_PROMPTS = [f"What is {a} + {b}?" for a, b in zip(range(10, 74), range(100, 164))]  # trl_grpo.py's prompts


def flag(flags: str, name: str, default: int) -> int:
    words = flags.split()
    return int(words[words.index(name) + 1]) if name in words else default


def grpo_flops(config, flags: str, prompt_len: float) -> float:
    batch, gens, completion = flag(flags, "--batch", 16), flag(flags, "--gens", 8), flag(flags, "--completion", 64)
    words = flags.split()
    beta = float(words[words.index("--beta") + 1]) if "--beta" in words else 0.04  # the anchor's default
    groups = batch // gens
    step = grpo_step_flops(config, batch, prompt_len, completion, beta, peft=False, prefill_rows=groups,
                           trained_prompt_rows=groups)
    recomputed_head = 2 * batch * completion * config.hidden_size * config.vocab_size  # the chunked path's own cost
    return step["total"] - recomputed_head


def sft_flops(config, flags: str) -> float:
    tokens = flag(flags, "--batch", 8) * flag(flags, "--seq", 256)
    return 3 * 2 * tokens * (body_params(config) + config.hidden_size * config.vocab_size)


def dpo_flops(config, flags: str) -> float:
    pairs, prompt = flag(flags, "--pairs", 4), flag(flags, "--prompt", 192)
    chosen, rejected = flag(flags, "--chosen", 64), flag(flags, "--rejected", 64)
    body, head = body_params(config), config.hidden_size * config.vocab_size
    forward = 2 * pairs * ((2 * prompt + chosen + rejected) * body + (chosen + rejected) * head)
    return 4 * forward  # reference forward, policy forward + backward


def machine_rate(config) -> tuple[float, str]:
    """The best GFLOP/s of three float32 products at the model's shapes, 2,048 rows each."""
    import torch

    torch.set_num_threads(2)
    h, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    best = (0.0, "")
    for inner, cols in ((h, inter), (inter, h), (h, vocab)):
        a, w = torch.randn(2048, inner), torch.randn(cols, inner)
        torch.nn.functional.linear(a, w)
        repeats = max(3, int(4e11 / (2 * 2048 * inner * cols)))
        start = time.perf_counter()
        for _ in range(repeats):
            torch.nn.functional.linear(a, w)
        rate = 2 * 2048 * inner * cols * repeats / (time.perf_counter() - start) / 1e9
        best = max(best, (rate, f"[2048 x {inner}] @ [{inner} x {cols}]"))
    return best


def median(runs: list[dict], key: str):
    values = [r["result"][key] for r in runs if r["result"].get(key) is not None]
    return statistics.median(values) if values else None


def step_table(runs: list[dict], config, tokenizer, rate: float) -> list[str]:
    prompt_len = statistics.mean(len(tokenizer(p).input_ids) for p in ANCHOR_PROMPTS)
    lines = ["| row | flags | TRL s/step | posttrain s/step | ratio | TRL peak RSS | posttrain peak RSS | ratio | "
             "step GFLOP | FLOP-bound s/step | posttrain / bound | runs |", "|---" * 12 + "|"]
    for row in ("grpo", "sft", "dpo"):
        sides = {side: [r for r in runs if r["row"] == row and r["side"] == side] for side in ("trl", "posttrain")}
        if not all(sides.values()):
            continue
        flags = sides["trl"][0]["flags"]
        flops = {"grpo": lambda: grpo_flops(config, flags, prompt_len), "sft": lambda: sft_flops(config, flags),
                 "dpo": lambda: dpo_flops(config, flags)}[row]()
        t, p = (median(sides[s], "median_step_s") for s in ("trl", "posttrain"))
        m_t, m_p = (median(sides[s], "peak_rss_mib") for s in ("trl", "posttrain"))
        bound = flops / 1e9 / rate
        lines.append(f"| {row.upper()} | `{flags}` | {t:.2f} | {p:.2f} | {p / t:.2f} | {m_t:,.0f} MiB | {m_p:,.0f} MiB | "
                     f"{m_p / m_t:.2f} | {flops / 1e9:,.0f} | {bound:.2f} | {p / bound:.2f} | "
                     f"{len(sides['trl'])} + {len(sides['posttrain'])} |")
    return lines


def states_mib(model_dir: str) -> float:
    """The model's states on either side: the policy, the reference, the gradients and AdamW's two moments, each the
    size of the float32 weights file."""
    return 5 * os.path.getsize(os.path.join(model_dir, "model.safetensors")) / 2**20


def memory_cells(run: dict | None, states: float) -> tuple[list[str], float | None]:
    """One side's cells (peak, beyond the states, seconds) and its MiB beyond the states."""
    if run is None:
        return ["-", "-", "-"], None
    result = run["result"]
    if result.get("out_of_memory"):  # its part beyond the states, negative: at least that much
        where = result["where"][-1] if result["where"] else "?"
        over = result["rss_limit_gib"] * 1024 - states
        return [f"**over {result['rss_limit_gib']:.0f} GiB** after {result['after_s']} s, in `{where}`",
                f"over {over:,.0f} MiB", "-"], -over
    beyond = result["peak_rss_mib"] - states
    return [f"{result['peak_rss_mib']:,.0f} MiB", f"{beyond:,.0f} MiB", f"{result['wall_s']:.0f}"], beyond


def _ratio(posttrain: float | None, trl: float | None) -> str:
    """posttrain's part beyond the states over TRL's; a side past the ceiling (negative: at least that much) bounds
    it from one side."""
    if posttrain is None or trl is None or (posttrain < 0 and trl < 0):
        return "-"
    if trl < 0:
        return f"under {posttrain / -trl:.2f}"
    if posttrain < 0:
        return f"over {-posttrain / trl:.2f}"
    return f"{posttrain / trl:.2f}"


def memory_table(runs: list[dict], states: float) -> list[str]:
    lines = [f"states: 5 x the weights = {states:,.0f} MiB on both sides",
             "| completion tokens | decode | TRL peak RSS | beyond the states | TRL s | posttrain peak RSS | "
             "beyond the states | posttrain s | posttrain / TRL beyond |",
             "|---|---|---|---|---|---|---|---|---|"]
    memory = [r for r in runs if r["row"] == "memory"]
    for length, random in sorted({(int(r["label"]), bool(r["result"].get("random_completions"))) for r in memory}):
        cells, beyond = [], {}
        for side in ("trl", "posttrain"):
            run = next((r for r in memory if r["side"] == side and int(r["label"]) == length
                        and bool(r["result"].get("random_completions")) == random), None)
            side_cells, beyond[side] = memory_cells(run, states)
            cells += side_cells
        ratio = _ratio(beyond["posttrain"], beyond["trl"])
        decode = "random, full length" if random else "real, full length"
        lines.append(f"| {length:,} | {decode} | " + " | ".join(cells) + f" | {ratio} |")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs")
    ap.add_argument("--model", default="/tmp/bench-models/qwen05")
    ap.add_argument("--rate", type=float, default=None, help="GFLOP/s; measured here when left out")
    args = ap.parse_args()
    from transformers import AutoConfig, AutoTokenizer

    runs = [json.loads(line) for line in open(args.runs)]
    config, tokenizer = AutoConfig.from_pretrained(args.model), AutoTokenizer.from_pretrained(args.model)
    rate, shape = (args.rate, "given") if args.rate else machine_rate(config)
    print(f"machine matmul rate: {rate:.0f} GFLOP/s ({shape}); load average {os.getloadavg()[0]:.2f}")
    for r in runs:
        if r["row"] != "memory":
            print(f"{r['row']} {r['side']} rep {r['rep']}: median_step_s {r['result'].get('median_step_s')} "
                  f"steps {r['result'].get('step_s')} s_per_step {r['result'].get('s_per_step')} "
                  f"rss {r['result'].get('peak_rss_mib')} load1 {r['load1']}")
    print("\n".join(step_table(runs, config, tokenizer, rate)))
    if any(r["row"] == "memory" for r in runs):
        print()
        print("\n".join(memory_table(runs, states_mib(args.model))))


if __name__ == "__main__":
    main()
