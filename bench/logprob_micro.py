"""Per-token log-probs with gradient: the naive path against posttrain's chunked one.

Usage: python bench/logprob_micro.py [--rows 16] [--tokens 128] [--hidden 128] [--vocab 151936] [--threads 2]
naive:   logits = h W^T ([rows, tokens, V]), log_softmax, gather, backward
chunked: posttrain.models.chunked.chunked_token_logprobs (row chunks, recomputed in backward)
predicted: the same with the loss gradient predicted (here: 1 per token, what the backward receives), so the
           output layer's gradient is computed in the forward and the backward recomputes nothing
Each variant runs in its own process; prints one JSON line with seconds (forward + backward, median of 3),
the extra peak RSS over the inputs, the size of the full [rows, tokens, V] float32 logits for scale, and the
largest difference between the two (log-probs and weight gradient).
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


VARIANTS = ("naive", "chunked", "predicted")


def run_variant(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    m = args.rows * args.tokens
    h = torch.randn(m, args.hidden, requires_grad=True)
    w = (torch.randn(args.vocab, args.hidden) * 0.05).requires_grad_()
    ids = torch.randint(0, args.vocab, (m,))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(3):
        h.grad = w.grad = None
        start = time.perf_counter()
        if args.variant == "naive":
            logps = (h @ w.T).log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)
        else:
            from posttrain.models.chunked import chunked_token_logprobs

            predict = (lambda rows, lp: torch.ones_like(lp)) if args.variant == "predicted" else None
            logps, _ = chunked_token_logprobs(h, w, None, ids, 1.0, with_entropy=False, predict_grad=predict)
        logps.sum().backward()
        times.append(time.perf_counter() - start)
    extra = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    torch.save({"logps": logps.detach(), "grad_w": w.grad}, args.out)
    return {"seconds": round(statistics.median(times), 3), "extra_peak_mib": round(extra, 1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variant", choices=VARIANTS)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    import tempfile

    import torch

    result = {"shape": [args.rows, args.tokens, args.vocab],
              "full_logits_mib": round(args.rows * args.tokens * args.vocab * 4 / 2**20, 1)}
    files = {}
    for variant in VARIANTS:
        files[variant] = tempfile.mktemp(suffix=".pt")
        cmd = [sys.executable, __file__, "--variant", variant, "--out", files[variant]] + \
              [f"--{k}={getattr(args, k)}" for k in ("rows", "tokens", "hidden", "vocab", "threads")]
        result[variant] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    naive = torch.load(files["naive"], weights_only=True)
    for variant in VARIANTS[1:]:
        other = torch.load(files[variant], weights_only=True)
        result[variant]["max_abs_diff_logps"] = float((naive["logps"] - other["logps"]).abs().max())
        result[variant]["max_abs_diff_grad_w"] = float((naive["grad_w"] - other["grad_w"]).abs().max())
        result[variant]["speedup_vs_naive"] = round(result["naive"]["seconds"] / result[variant]["seconds"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
