"""posttrain's training passes against their products run alone (issue 59: "the training passes at the rate of a lone
layer's forward and backward").

Usage: python bench/passes_micro.py MODEL_DIR [--rows 8] [--gens 8] [--prompt 11] [--completion 32] [--repeats 3]
                                             [--threads 2]
The policy pass is what GRPO's step runs once per micro-batch: posttrain.models.logprobs.token_logprobs over
rows / gens distinct prompts of --prompt tokens with gens completions of --completion tokens each (prompts shared,
the output layer at completion positions only, entropy and the loss gradient predicted), then backward; the
reference pass the same without gradient; the heap kept as the trainer keeps it (training/heap.py). "Products
alone" is every matmul those passes run, each alone on fresh inputs of the same shape, in the library the passes use
(the forward through oneDNN where models/onednn.py has it, the gradients through torch's GEMM), forward and (for the
policy pass) the input's and the weight's gradients: per layer q, k, v, o, gate, up and down over the positions
the pass runs, and the output layer over the completion positions. Prints one JSON line: the medians (the first
repeat dropped) of each pass and of its products alone, their ratio (1.0: the pass runs at its products' own rate;
the rest is attention, norms, rotary, activation and bookkeeping), and the GFLOP/s of each.
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
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--gens", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=11)
    ap.add_argument("--completion", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from posttrain.models import onednn
    from posttrain.models.logprobs import token_logprobs
    from posttrain.training.heap import heap_pays, keep_freed_host_memory

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    model.train()
    if heap_pays(model):
        keep_freed_host_memory()  # as the trainer does (training/setup.py)
    config = model.config
    n, p, c = args.rows, args.prompt, args.completion
    batch, weights, prompts = rollout_batch(n, args.gens, p, c)
    body_positions, head_positions = prompts * p + n * c, n * c  # each prompt once; the head at completions only

    def policy():
        model.zero_grad(set_to_none=True)
        logps, _ = token_logprobs(model, *batch, with_entropy=True, loss_gradient=lambda lp: weights,
                                  share_prompts=True)
        (logps * weights).sum().backward()

    def reference():
        with torch.no_grad():
            token_logprobs(model, *batch, share_prompts=True)

    hidden, inner, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_out, kv_out = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    layer_shapes = [(hidden, q_out), (hidden, kv_out), (hidden, kv_out), (q_out, hidden), (hidden, inner),
                    (hidden, inner), (inner, hidden)]
    shapes = [(body_positions, i, o) for i, o in layer_shapes] * config.num_hidden_layers + \
        [(head_positions, hidden, vocab)]
    operands = [(torch.randn(t, i), torch.randn(o, i) * 0.02, torch.randn(t, o)) for t, i, o in shapes]

    forward = onednn.linear if onednn.linear_op() else F.linear  # the passes' forward library (models/onednn.py)

    def products(backward: bool):
        for x, w, g in operands:
            forward(x, w)
            if backward:
                g @ w  # d/dx
                g.t() @ x  # d/dW

    runs = {"policy": policy, "reference": reference, "policy_products": lambda: products(True),
            "reference_products": lambda: products(False)}
    times = {name: [] for name in runs}
    for repeat in range(args.repeats + 1):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            if repeat:
                times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    forward_gflop = sum(2 * t * i * o for t, i, o in shapes) / 1e9
    print(json.dumps({
        "rows": n, "prompt": p, "completion": c, "body_positions": body_positions,
        **{f"{name}_s": round(s, 3) for name, s in median.items()},
        "policy_over_products": round(median["policy"] / median["policy_products"], 3),
        "reference_over_products": round(median["reference"] / median["reference_products"], 3),
        "policy_gflop_per_s": round(3 * forward_gflop / median["policy"], 1),
        "policy_products_gflop_per_s": round(3 * forward_gflop / median["policy_products"], 1),
        "reference_gflop_per_s": round(forward_gflop / median["reference"], 1),
        "reference_products_gflop_per_s": round(forward_gflop / median["reference_products"], 1),
    }))


if __name__ == "__main__":
    main()
