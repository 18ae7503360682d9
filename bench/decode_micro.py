"""Decode speed of the transformers generator: LeanDecoder (with oneDNN's linear, and with torch's GEMM; growing
shapes, and at fixed shapes as cache_implementation="static" runs it) against the model's own forward.

Usage: python bench/decode_micro.py MODEL_DIR [--rows 16] [--tokens 64] [--repeats 5] [--threads 2]
                                   [--steppers lean,lean_fixed,lean_gemm,model_forward]
Samples `rows` completions of exactly `tokens` tokens (min_new_tokens) from the bench prompts, alternating
the steppers `repeats` times (each round in another order), and prints one JSON line: median ms per decoded token
(prefill, forward, sampling and bookkeeping included) and tokens/s for each, and the lean decoder's ratio to the
model's forward (when both ran) and the fixed-shape decoder's to the growing one.
"""

import argparse
import json
import statistics
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steppers", default="lean,lean_fixed,lean_gemm,model_forward")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.generation import SamplingParams
    from posttrain.generation.lean_decoder import supports
    from posttrain.generation.transformers_backend import TransformersGenerator
    from posttrain.models import onednn

    model = AutoModelForCausalLM.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = [tokenizer(f"What is {10 + i // 8} + {100 + i // 8}?").input_ids for i in range(args.rows)]
    params = SamplingParams(max_new_tokens=args.tokens, min_new_tokens=args.tokens)
    ms = {name: [] for name in args.steppers.split(",")}
    for repeat in range(args.repeats + 1):  # the first round warms up and is dropped
        order = list(ms) if repeat % 2 == 0 else list(reversed(ms))
        for name in order:
            onednn._OP = False if name == "lean_gemm" else None  # None: probe oneDNN again
            gen = TransformersGenerator(model, tokenizer, params, seed=0, lean=name != "model_forward",
                                        fixed_shape=name == "lean_fixed")
            start = time.perf_counter()
            gen.generate(prompts)
            ms[name].append((time.perf_counter() - start) * 1000 / args.tokens)
    result = {name: round(statistics.median(v[1:]), 2) for name, v in ms.items()}
    out = {"rows": args.rows, "tokens": args.tokens, "threads": args.threads, "lean_supported": supports(model),
           "ms_per_token": result, "tokens_per_s": {k: round(args.rows * 1000 / v, 1) for k, v in result.items()}}
    if "lean" in result and "model_forward" in result:
        out["ratio"] = round(result["lean"] / result["model_forward"], 2)
    if "lean" in result and "lean_fixed" in result:
        out["fixed_over_growing"] = round(result["lean_fixed"] / result["lean"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
