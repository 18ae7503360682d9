"""Decode speed of the transformers generator: LeanDecoder (with oneDNN's linear, and with torch's GEMM) against
the model's own forward.

Usage: python bench/decode_micro.py MODEL_DIR [--rows 16] [--tokens 64] [--repeats 5] [--threads 2]
Samples `rows` completions of exactly `tokens` tokens (min_new_tokens) from the bench prompts, alternating
the two steppers `repeats` times, and prints one JSON line: median ms per decoded token (prefill, forward,
sampling and bookkeeping included) for each, and their ratio.
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
    ms = {"lean": [], "lean_gemm": [], "model_forward": []}
    for _ in range(args.repeats + 1):  # the first round warms up and is dropped
        for name in ms:
            onednn._OP = False if name == "lean_gemm" else None  # None: probe oneDNN again
            gen = TransformersGenerator(model, tokenizer, params, seed=0, lean=name != "model_forward")
            start = time.perf_counter()
            gen.generate(prompts)
            ms[name].append((time.perf_counter() - start) * 1000 / args.tokens)
    result = {name: round(statistics.median(v[1:]), 2) for name, v in ms.items()}
    print(json.dumps({"rows": args.rows, "tokens": args.tokens, "lean_supported": supports(model),
                      "ms_per_token": result, "ratio": round(result["lean"] / result["model_forward"], 2)}))


if __name__ == "__main__":
    main()
