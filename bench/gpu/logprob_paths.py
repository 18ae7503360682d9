"""Per-token log-probs with gradient through the output layer, four ways, on one device and precision.

Usage: python bench/gpu/logprob_paths.py [--device cuda] [--precision bf16] [--positions 8192] [--hidden 896]
                                        [--vocab 151936] [--repeats 3]

The output layer of a training forward: final hidden states h [M, H] (float32, as the model's last norm gives them
under autocast), the layer's float32 master weight W [V, H], chosen ids [M]; loss = sum of the M log-probs,
backward to h and W. Under --precision bf16 each path runs inside bf16 autocast, as bf16=True trains.
  whole-logits:   logits = h W^T ([M, V]), then log_softmax in float32 and gather (the formula everyone starts from);
  trl-selective:  the same logits through TRL's selective_log_softmax (trl.trainer.utils; a Triton kernel on CUDA);
  trl-fused-head: TRL's ChunkedLogProbFunction (trl.kernels), the fused LM head its GRPOTrainer puts on the model;
  posttrain:      posttrain.models.chunked.chunked_token_logprobs (row chunks, float32 inside autocast).
Prints one JSON line: per path the median seconds of forward + backward (after one warm-up run, which holds any
kernel compilation), the peak GPU memory above what the inputs hold (torch.cuda.max_memory_allocated; None on a CPU),
and the largest errors against a float64 computation on the same inputs: log-probs (absolute) and the gradients of
h and W (relative to the largest reference entry). A path that cannot run here says why in one line.
"""

import argparse
import json
import statistics
import time

PATHS = ("whole-logits", "trl-selective", "trl-fused-head", "posttrain")


def whole_logits(h, w, ids):
    """log softmax(h W^T)[ids] through the whole [M, V] logits."""
    logits = h @ w.T
    return logits.float().log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)


def trl_selective(h, w, ids):
    from trl.trainer.utils import selective_log_softmax

    return selective_log_softmax(h @ w.T, ids)


def trl_fused_head(h, w, ids):
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer import utils

    chunk = getattr(utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 32768)
    return ChunkedLogProbFunction.apply(h, w, None, ids, 1.0, chunk, None, 1.0, ("log_probs",))[0]


def posttrain_chunked(h, w, ids):
    from posttrain.models.chunked import chunked_token_logprobs

    return chunked_token_logprobs(h, w, None, ids, 1.0, with_entropy=False)[0]


FUNCTIONS = {"whole-logits": whole_logits, "trl-selective": trl_selective, "trl-fused-head": trl_fused_head,
             "posttrain": posttrain_chunked}


def float64_reference(h, w, ids, rows_per_chunk: int = 1024):
    """(log-probs [M], d/dh [M, H], d/dW [V, H]) of sum(log-probs) in float64, row chunk by row chunk:
    d logits = onehot(id) - softmax."""
    import torch

    w64 = w.detach().double()
    logps = torch.empty(h.size(0), dtype=torch.float64, device=h.device)
    grad_h = torch.empty(h.shape, dtype=torch.float64, device=h.device)
    grad_w = torch.zeros(w.shape, dtype=torch.float64, device=w.device)
    for start in range(0, h.size(0), rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        h64 = h.detach()[rows].double()
        log_p = (h64 @ w64.T).log_softmax(-1)
        logps[rows] = log_p.gather(-1, ids[rows, None]).squeeze(-1)
        d_logits = log_p.exp_().neg_()
        d_logits.scatter_add_(-1, ids[rows, None], torch.ones_like(logps[rows, None]))
        grad_h[rows] = d_logits @ w64
        grad_w.addmm_(d_logits.T, h64)
    return logps, grad_h, grad_w


def run_path(name: str, h, w, ids, device: str, precision: str, repeats: int) -> dict:
    """Time forward + backward of one path; return its figures and its last outputs."""
    import torch

    function = FUNCTIONS[name]
    on_gpu = device == "cuda"

    def once():
        h.grad = w.grad = None
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=precision == "bf16"):
            logps = function(h, w, ids)
        logps.sum().backward()
        return logps

    once()  # warm-up: kernel compilation, allocator
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        logps = once()
        if on_gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1) if on_gpu else None
    return {"seconds": round(statistics.median(times), 4), "peak_extra_mib": peak,
            "outputs": (logps.detach().double(), h.grad.double(), w.grad.double())}


def errors(outputs, reference) -> dict:
    (logps, grad_h, grad_w), (ref_logps, ref_h, ref_w) = outputs, reference
    return {"max_abs_err_logp": float((logps - ref_logps).abs().max()),
            "max_rel_err_grad_h": float((grad_h - ref_h).abs().max() / ref_h.abs().max()),
            "max_rel_err_grad_w": float((grad_w - ref_w).abs().max() / ref_w.abs().max())}


def one_line_reason(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else 'no message'}"[:200]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--positions", type=int, default=8192, help="M: rows of hidden states (completion tokens)")
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for and torch sees no CUDA device: use --device cpu.")
    torch.manual_seed(0)
    h = torch.randn(args.positions, args.hidden, device=args.device, requires_grad=True)
    w = (torch.randn(args.vocab, args.hidden, device=args.device) * 0.05).requires_grad_()
    ids = torch.randint(0, args.vocab, (args.positions,), device=args.device)
    reference = float64_reference(h, w, ids)
    result = {"positions": args.positions, "hidden": args.hidden, "vocab": args.vocab, "device": args.device,
              "precision": args.precision,
              "whole_logits_mib": round(args.positions * args.vocab * (2 if args.precision == "bf16" else 4) / 2**20)}
    for name in PATHS:
        try:
            figures = run_path(name, h, w, ids, args.device, args.precision, args.repeats)
        except Exception as err:  # noqa: BLE001 - each path reports its own failure and the others still run
            result[name] = {"error": one_line_reason(err)}
            continue
        result[name] = {"seconds": figures["seconds"], "peak_extra_mib": figures["peak_extra_mib"],
                        **errors(figures.pop("outputs"), reference)}
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
