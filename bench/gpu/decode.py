"""Generation timed on its own, on one device: posttrain's in-process decode (growing shapes, and fixed shapes with
cache_implementation="static", replayed from a CUDA graph on CUDA) beside transformers' `generate` (what TRL's
in-process GRPO calls), then a profiler summary of one decode step.

Usage: python bench/gpu/decode.py MODEL_DIR --device cuda|cpu --precision bf16|fp32 [--weights bf16|fp32]
                                  [--rows 64] [--tokens 1024] [--threads N]

Each side samples `rows` completions of exactly `tokens` tokens (min_new_tokens) from the bench prompts, after a
16-token warm-up; in a bf16 run each decodes under the bf16 autocast (posttrain's KV cache in bf16), as in training.
Prints one JSON line:
    {"decode": {"device", "rows", "tokens", "precision", "weights",
                SIDE: {"s", "ms_per_token", "tokens_per_s", "peak_allocated_mib", "peak_reserved_mib"} | {"error"},
                "step_profile": {"kernels_per_step", "cpu_ms_per_step", "device_ms_per_step", "top": [...]}}}
ms_per_token: wall time over `tokens` (one token of every row); tokens_per_s: rows x tokens over the wall time.
step_profile: the growing lean decoder's step under torch.profiler (3 steps after the prefill): operators launched
per step, the host's and the device's time per step, and the 8 operators taking the most device time (CPU time on a
CPU).
"""

import argparse
import json
import time

SIDES = ("posttrain", "posttrain_static", "transformers_generate")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--device", choices=["cuda", "cpu"], required=True)
    ap.add_argument("--precision", choices=["bf16", "fp32"], required=True)
    ap.add_argument("--weights", choices=["bf16", "fp32"], default="fp32")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.models.loading import raised

    dtype = torch.bfloat16 if args.weights == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = [tokenizer(f"What is {10 + i // 8} + {100 + i // 8}?").input_ids for i in range(args.rows)]
    compute = torch.bfloat16 if args.precision == "bf16" and args.device == "cuda" else None
    out = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "rows": args.rows,
           "tokens": args.tokens, "precision": args.precision, "weights": args.weights}
    for side in SIDES:
        try:
            run = _runner(side, model, tokenizer, prompts, compute)
            run(16)  # warm-up: kernels, allocator, the lean decoder's one-time check
            out[side] = _timed(run, args.tokens, args.rows, args.device)
        except Exception as err:  # noqa: BLE001 - a side that fails is reported, the others still run
            out[side] = {"error": raised(err)[:200]}
    try:
        out["step_profile"] = _step_profile(model, prompts, args.device, compute)
    except Exception as err:  # noqa: BLE001
        out["step_profile"] = {"error": raised(err)[:200]}
    print(json.dumps({"decode": out}), flush=True)


def _runner(side: str, model, tokenizer, prompts, compute):
    """tokens -> one decode of every prompt, `tokens` tokens each."""
    import torch

    from posttrain.generation import SamplingParams
    from posttrain.generation.transformers_backend import TransformersGenerator

    if side == "transformers_generate":
        from posttrain.generation.protocol import left_pad

        ids, mask = left_pad(prompts, tokenizer.pad_token_id, model.device)

        def generate(tokens: int):
            with torch.no_grad(), torch.autocast(model.device.type, dtype=compute or torch.float32,
                                                 enabled=compute is not None):
                model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=True, max_new_tokens=tokens,
                               min_new_tokens=tokens, pad_token_id=tokenizer.pad_token_id)
        return generate

    def decode(tokens: int):
        params = SamplingParams(max_new_tokens=tokens, min_new_tokens=tokens)
        TransformersGenerator(model, tokenizer, params, seed=0, fixed_shape=side == "posttrain_static",
                              compute_dtype=compute).generate(prompts)
    return decode


def _timed(run, tokens: int, rows: int, device: str) -> dict:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    run(tokens)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"s": round(seconds, 3), "ms_per_token": round(seconds * 1000 / tokens, 3),
            "tokens_per_s": round(rows * tokens / seconds, 1),
            "peak_allocated_mib": round(torch.cuda.max_memory_allocated() / 2**20) if device == "cuda" else None,
            "peak_reserved_mib": round(torch.cuda.max_memory_reserved() / 2**20) if device == "cuda" else None}


def _step_profile(model, prompts, device: str, compute, steps: int = 3) -> dict:
    """The growing lean decoder's step under torch.profiler: operators and time per step, the 8 costliest."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from posttrain.generation.lean_decoder import LeanDecoder, supports
    from posttrain.generation.protocol import left_pad
    from posttrain.models.forwards import positions_from_mask

    if not supports(model):
        return {"error": "the lean decoder does not run this model"}
    ids, mask = left_pad(prompts, 0, model.device)
    positions = positions_from_mask(mask)
    with torch.inference_mode():
        decoder = LeanDecoder(model, mask, steps + 1, compute_dtype=compute)
        logits = decoder.prefill(ids, positions)
        token = logits.argmax(-1)
        positions = positions[:, -1:] + 1
        decoder.step(token, positions)  # one step outside the profile (first-call work)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                positions = positions + 1
                decoder.step(token, positions)
            if device == "cuda":
                torch.cuda.synchronize()
    events = prof.key_averages()
    on_device = device == "cuda"

    def device_us(e) -> float:
        return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)) if on_device else 0.0

    kernels = sum(e.count for e in events if on_device and device_us(e) > 0 and not e.key.startswith("aten::"))
    launched = kernels if on_device else sum(e.count for e in events if e.key.startswith("aten::"))
    top = sorted(events, key=lambda e: device_us(e) if on_device else e.self_cpu_time_total, reverse=True)[:8]
    return {"kernels_per_step": round(launched / steps, 1),
            "cpu_ms_per_step": round(sum(e.self_cpu_time_total for e in events) / 1000 / steps, 3),
            "device_ms_per_step": round(sum(device_us(e) for e in events) / 1000 / steps, 3) if on_device else None,
            "top": [{"name": e.key[:60], "count_per_step": round(e.count / steps, 1),
                     "ms_per_step": round((device_us(e) if on_device else e.self_cpu_time_total) / 1000 / steps, 3)}
                    for e in top]}


if __name__ == "__main__":
    main()
