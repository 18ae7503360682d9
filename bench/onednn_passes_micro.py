"""GRPO's log-prob passes with the model's products through oneDNN (models/onednn.py) against torch's GEMM.

Usage: python bench/onednn_passes_micro.py MODEL_DIR [--rows 16] [--gens 8] [--prompt 11] [--completion 128]
                                                     [--repeats 5] [--threads 2]
rows / gens distinct prompts of --prompt random tokens, each with gens completions of --completion random tokens.
oneDNN is used whatever the model's width here (the trainer uses it from onednn.MIN_HIDDEN and, for the chunked
logits, chunked.ONEDNN_LOGITS_MIN_HIDDEN), so that narrower models can be measured too.
Per repeat, alternating the two libraries: the policy pass (token_logprobs with entropy and the loss gradient
predicted, then backward) and the reference pass (no gradient), as the trainer runs them on one process. Prints one
JSON line: the median seconds of each (the first repeat, a warm-up, dropped), their ratios, and the largest
differences between the two libraries' log-probs and (relative to each parameter's largest) gradients.
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
    ap.add_argument("--prompt", type=int, default=11)
    ap.add_argument("--completion", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.models import chunked, onednn
    from posttrain.models.logprobs import token_logprobs

    onednn.MIN_HIDDEN = chunked.ONEDNN_LOGITS_MIN_HIDDEN = 0

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if onednn.linear_op() is None:
        raise SystemExit("this torch has no oneDNN linear")
    model = AutoModelForCausalLM.from_pretrained(args.model)
    model.train()
    n, p, c = args.rows, args.prompt, args.completion
    batch, weights, _ = rollout_batch(n, args.gens, p, c)

    def policy():
        model.zero_grad(set_to_none=True)
        logps, _ = token_logprobs(model, *batch, with_entropy=True, loss_gradient=lambda lp: weights,
                                  share_prompts=True)
        (logps * weights).sum().backward()
        return logps.detach(), [q.grad.clone() for q in model.parameters()]

    def reference():
        with torch.no_grad():
            token_logprobs(model, *batch, share_prompts=True)

    times = {(lib, kind): [] for lib in ("gemm", "onednn") for kind in ("policy", "reference")}
    results = {}
    for repeat in range(args.repeats + 1):
        for lib in ("gemm", "onednn"):
            onednn._OP = False if lib == "gemm" else None  # None: probe again, found
            for kind, run in (("policy", policy), ("reference", reference)):
                start = time.perf_counter()
                out = run()
                if repeat:
                    times[(lib, kind)].append(time.perf_counter() - start)
                if out is not None:
                    results[lib] = out
    median = {f"{lib}_{kind}_s": round(statistics.median(t), 3) for (lib, kind), t in times.items()}
    (lp_gemm, g_gemm), (lp_dnn, g_dnn) = results["gemm"], results["onednn"]
    print(json.dumps({
        "rows": n, "prompt": p, "completion": c, **median,
        "policy_ratio": round(median["onednn_policy_s"] / median["gemm_policy_s"], 3),
        "reference_ratio": round(median["onednn_reference_s"] / median["gemm_reference_s"], 3),
        "max_logp_diff": float((lp_gemm - lp_dnn).abs().max()),
        "max_grad_rel_diff": max(float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))
                                 for a, b in zip(g_gemm, g_dnn)),
    }))


if __name__ == "__main__":
    main()
