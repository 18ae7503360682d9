"""GRPO's log-prob passes with each distinct prompt run once (models/prompt_sharing.py), as a row per prompt
(models/prefix_rows.py) and as two forwards (the prompts with a cache, the completions against it), against the
rollouts run whole.

Usage: python bench/prompt_sharing_micro.py MODEL_DIR [--rows 16] [--gens 8] [--prompt 10] [--completion 128]
                                                      [--repeats 5] [--threads 2]
rows / gens distinct prompts of --prompt random tokens, each with gens completions of --completion random tokens
(every row full length, so packing has nothing to remove). Per repeat, each layout in turn (the order rotating): the
policy pass (token_logprobs with entropy and the loss gradient predicted, then backward) and the reference pass (no
gradient). Prints one JSON line: the median seconds of each, their ratios to the unshared pass's, the positions each
runs the body over, and the largest difference of each shared layout's log-probs from the unshared ones.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/micro_batch.py
from micro_batch import rollout_batch  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--gens", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=10)
    ap.add_argument("--completion", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.models import logprobs
    from posttrain.models.chunked_check import fast_path_available
    from posttrain.models.logprobs import prompt_sharing_works, token_logprobs
    from posttrain.models.packed_layouts import packed_layouts
    from posttrain.models.prefix_rows import prefix_rows_work, row_width_limit

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    model.train()
    if not (fast_path_available(model) and packed_layouts(model).rows and prompt_sharing_works(model)):
        raise SystemExit(f"{args.model}: the shared-prompt pass does not reproduce this model's hidden states")
    n, p, c = args.rows, args.prompt, args.completion
    batch, weights, distinct = rollout_batch(n, args.gens, p, c)

    rows_allowed = prefix_rows_work(model) and p + args.gens * c <= row_width_limit(model)
    layouts = ("unshared", "rows", "two_forwards") if rows_allowed else ("unshared", "two_forwards")
    times = {(layout, kind): [] for layout in layouts for kind in ("policy", "reference")}
    logps = {}
    for repeat in range(args.repeats):
        for layout in layouts[repeat % len(layouts):] + layouts[:repeat % len(layouts)]:
            logprobs.prefix_rows_work = prefix_rows_work if layout == "rows" else (lambda model: False)
            share = layout != "unshared"
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            lp, _ = token_logprobs(model, *batch, with_entropy=True, loss_gradient=lambda x: weights,
                                   share_prompts=share)
            (lp * weights).sum().backward()
            times[(layout, "policy")].append(time.perf_counter() - start)
            with torch.no_grad():
                start = time.perf_counter()
                logps[layout] = token_logprobs(model, *batch, share_prompts=share)[0]
                times[(layout, "reference")].append(time.perf_counter() - start)
    median = {f"{layout}_{kind}_s": round(statistics.median(t), 3) for (layout, kind), t in times.items()}
    ratios = {f"{layout}_{kind}_ratio": round(median[f"{layout}_{kind}_s"] / median[f"unshared_{kind}_s"], 3)
              for layout in layouts[1:] for kind in ("policy", "reference")}
    print(json.dumps({
        "rows": n, "distinct_prompts": distinct, "prompt": p, "completion": c, **median, **ratios,
        "unshared_positions": n * (p + c), "two_forwards_positions": distinct * p + n * c,
        "rows_positions": distinct * (p + args.gens * c) if rows_allowed else None,
        **{f"{layout}_max_logp_diff": float((logps[layout] - logps["unshared"]).abs().max()) for layout in layouts[1:]},
    }))


if __name__ == "__main__":
    main()
