"""A soak of `posttrain serve`: many completions requests, a few at a time, with complete weight updates between
phases, and the server's memory before and after.

Usage: python bench/serve_soak.py [MODEL_DIR] [--requests 500] [--concurrency 8] [--updates 3] [--n 4]
                                  [--prompt-tokens 16] [--max-tokens 16]
Without MODEL_DIR, a tiny model is built offline (posttrain.testing.save_tiny; --hidden, --layers) in a temporary
directory. The server runs on loopback (`posttrain serve --port 0`). The requests are split into `updates + 1`
phases; after each phase but the last, the trainer's own client pushes a complete, verified weight update (the
model's weights, perturbed). Prints one JSON line: requests, errors, p50/p99 latency in ms (of each completions
request, seen by the client), the server's RSS (VmRSS of /proc/<pid>/status) at start (ready, before any request),
after the first phase and at the end, and its growth.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor


def rss_mib(pid: int) -> float:
    """The process's resident memory (VmRSS), in MiB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def start_server(model_dir: str) -> tuple[subprocess.Popen, str]:
    """`posttrain serve` on a free loopback port; (process, base URL) once it prints that it is ready."""
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli", "serve", "--model", model_dir, "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if not line.startswith("posttrain serve: ready at "):
        proc.kill()
        raise RuntimeError(f"posttrain serve did not start: {line!r}")
    return proc, line.split("ready at ")[1].strip()


def request_bodies(count: int, args, vocab: int) -> list[dict]:
    rng = random.Random(0)
    return [{"prompt": [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]], "n": args.n,
             "max_tokens": args.max_tokens, "seed": rng.randrange(1 << 31), "return_token_ids": True}
            for _ in range(count)]


def run_phase(sessions, url: str, bodies: list[dict], concurrency: int) -> tuple[list[float], int]:
    """Send `bodies` `concurrency` at a time; (latencies in ms of the answered ones, errors)."""
    import threading

    local = threading.local()

    def one(body):
        session = getattr(local, "session", None)
        if session is None:
            import requests

            session = local.session = requests.Session()
            session.trust_env = False
            sessions.append(session)
        start = time.perf_counter()
        try:
            response = session.post(f"{url}/v1/completions", json=body, timeout=120)
            ok = response.status_code == 200 and len(response.json()["choices"]) == body["n"]
        except Exception:  # counted, not raised: a soak reports its errors
            ok = False
        return (time.perf_counter() - start) * 1000, ok

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(one, bodies))
    return [ms for ms, ok in results if ok], sum(not ok for _, ok in results)


def percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="A model directory (default: a tiny one, built here).")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--updates", type=int, default=3, help="Complete weight updates between phases (0: none).")
    ap.add_argument("--n", type=int, default=4, help="Completions per request (its prompt's copies).")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=64, help="The built model's width (without MODEL_DIR).")
    ap.add_argument("--layers", type=int, default=2, help="The built model's depth (without MODEL_DIR).")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.generation.server import ServerClient
    from posttrain.weights import export_weights

    with tempfile.TemporaryDirectory(prefix="serve-soak-") as tmp:
        model_dir = args.model
        if model_dir is None:
            from posttrain.testing import save_tiny

            model_dir = save_tiny(os.path.join(tmp, "tiny"), hidden=args.hidden, layers=args.layers)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        proc, url = start_server(model_dir)
        sessions: list = []
        try:
            rss_start = rss_mib(proc.pid)
            client = ServerClient(url, connect_timeout=60, request_timeout=120, sync_timeout=600)
            client.wait_until_up()
            bodies = request_bodies(args.requests, args, model.config.vocab_size)
            phases = args.updates + 1
            latencies, errors, rss_first, pushes = [], 0, None, []
            started = time.perf_counter()
            for phase in range(phases):
                part = bodies[phase * len(bodies) // phases:(phase + 1) * len(bodies) // phases]
                answered, failed = run_phase(sessions, url, part, args.concurrency)
                latencies += answered
                errors += failed
                rss_first = rss_first if rss_first is not None else rss_mib(proc.pid)
                if phase + 1 < phases:
                    with torch.no_grad():
                        for parameter in model.parameters():
                            parameter.add_(torch.randn_like(parameter) * 1e-3)
                    start = time.perf_counter()
                    client.push(export_weights(model), f"soak-{phase + 1}")  # verified by digest, or it raises
                    pushes.append(round(time.perf_counter() - start, 3))
            seconds = time.perf_counter() - started
            rss_end = rss_mib(proc.pid)
        finally:
            for session in sessions:
                session.close()
            proc.terminate()
            proc.wait(30)
    print(json.dumps({"requests": args.requests, "errors": errors, "concurrency": args.concurrency, "n": args.n,
                      "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                      "p50_ms": round(percentile(latencies, 0.5), 1) if latencies else None,
                      "p99_ms": round(percentile(latencies, 0.99), 1) if latencies else None,
                      "seconds": round(seconds, 2), "updates": len(pushes), "push_s": pushes,
                      "rss_start_mib": round(rss_start, 1), "rss_after_first_phase_mib": round(rss_first, 1),
                      "rss_end_mib": round(rss_end, 1), "rss_growth_mib": round(rss_end - rss_start, 1)}),
          flush=True)


if __name__ == "__main__":
    main()
