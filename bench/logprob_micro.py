"""Per-token log-probs with gradient: the naive path against posttrain's chunked one.

Usage: python bench/logprob_micro.py [--rows 16] [--tokens 128] [--hidden 128] [--vocab 151936] [--threads 2]
naive:   logits = h W^T ([rows, tokens, V]), log_softmax, gather, backward
chunked: posttrain.models.chunked.chunked_token_logprobs (row chunks, recomputed in backward)
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

            logps, _ = chunked_token_logprobs(h, w, None, ids, 1.0, with_entropy=False)
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
    ap.add_argument("--variant", choices=["naive", "chunked"])
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
    for variant in ("naive", "chunked"):
        files[variant] = tempfile.mktemp(suffix=".pt")
        cmd = [sys.executable, __file__, "--variant", variant, "--out", files[variant]] + \
              [f"--{k}={getattr(args, k)}" for k in ("rows", "tokens", "hidden", "vocab", "threads")]
        result[variant] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    a, b = (torch.load(files[v], weights_only=True) for v in ("naive", "chunked"))
    result["max_abs_diff_logps"] = float((a["logps"] - b["logps"]).abs().max())
    result["max_abs_diff_grad_w"] = float((a["grad_w"] - b["grad_w"]).abs().max())
    result["speedup"] = round(result["naive"]["seconds"] / result["chunked"]["seconds"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
