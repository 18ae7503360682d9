"""Time to draw one token per row from [rows, V] logits: torch.multinomial, the exponential race, and
posttrain's two-level inverse CDF (posttrain.generation.sampling.sample), for the benchmark vocabularies.

Usage: python bench/sampling_micro.py [--rows 16] [--threads 2]
Prints one JSON line per vocabulary size: milliseconds per draw (median of 30) for each method.
"""

import argparse
import json
import statistics
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch

    from posttrain.generation.sampling import sample

    torch.set_num_threads(args.threads)

    def multinomial(logits):
        probs = logits.softmax(-1)
        tokens = torch.multinomial(probs, 1).squeeze(-1)
        return tokens, probs.gather(-1, tokens[:, None]).log()

    def race(logits):
        logp = logits.log_softmax(-1)
        tokens = (logp - torch.empty_like(logp).exponential_().log_()).argmax(-1)
        return tokens, logp.gather(-1, tokens[:, None])

    for vocab in (2274, 65536, 151936):
        logits = torch.randn(args.rows, vocab) * 3
        row = {"rows": args.rows, "vocab": vocab}
        for name, fn in (("multinomial_ms", multinomial), ("exponential_race_ms", race), ("posttrain_ms", sample)):
            fn(logits)
            times = []
            for _ in range(30):
                start = time.perf_counter()
                fn(logits)
                times.append((time.perf_counter() - start) * 1000)
            row[name] = round(statistics.median(times), 3)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
