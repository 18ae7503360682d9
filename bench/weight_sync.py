"""One weight push of a model to a running `posttrain serve`: seconds, MB/s, buckets, and the digest check.

Usage: python bench/weight_sync.py MODEL_DIR URL [--repeats 3] [--bucket-mib 256]
Prints one JSON line: the model's bytes, each push's seconds (export, encode, HTTP, load and the verified digest
included), the median and the MB/s it gives.
"""

import argparse
import json
import statistics
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("url")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mib", type=int, default=256)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from posttrain.generation.server import ServerClient
    from posttrain.serving import wire
    from posttrain.weights import export_weights

    model = AutoModelForCausalLM.from_pretrained(args.model)
    client = ServerClient(args.url, connect_timeout=60, max_bucket_bytes=args.bucket_mib << 20)
    client.wait_until_up()
    sent = sum(t.numel() * t.element_size() for bucket, _ in wire.buckets(export_weights(model)) for _, t in bucket)
    times = []
    for i in range(args.repeats):
        start = time.perf_counter()
        client.push(export_weights(model), f"bench-{time.time()}-{i}")
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    print(json.dumps({"model_mib": round(sent / 2 ** 20, 1), "push_s": [round(t, 3) for t in times],
                      "median_s": round(median, 3), "mb_per_s": round(sent / 1e6 / median, 1)}), flush=True)


if __name__ == "__main__":
    main()
