"""Packed rows against each rollout alone, under every attention kernel this machine has: posttrain's GRPO log-prob
pass (models/logprobs.py `token_logprobs`, packing rollouts into shared rows where the model keeps them apart)
against the same rollouts one at a time, with no padding and no packing.

Usage: python bench/gpu/packed_rows.py MODEL_DIR --device cuda|cpu [--weights bf16|fp32] [--rows 4,16]
                                       [--threads N]

For each attention implementation that loads here (eager, sdpa, flash_attention_2, flash_attention_3; flash needs
bf16 or fp16 weights and its package; on CUDA also sdpa held to each of its backends: flash, efficient, cudnn), and
each row count, rollouts of varied prompt and completion lengths are
scored both ways. Prints one JSON line:
    {"packed_rows": {"device", "weights", KERNEL: {"layouts": {"rows", "one_row"}, ROWS: {"packed_taken",
     "max_abs_diff", "tokens"}} | {"error"}}}
layouts: what posttrain's one-time check decided for the model under that kernel (models/packed_layouts.py);
packed_taken: whether the pass packed (False: it ran padded rows, as a model that keeps no layout apart does);
max_abs_diff: the largest difference of a completion token's log-prob, packed against alone (rounding of the
weights' dtype is expected; a sequence that saw another's tokens differs by whole units).
"""

import argparse
import json

KERNELS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")
SDPA_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")  # CUDA's, each forced in turn


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--device", choices=["cuda", "cpu"], required=True)
    ap.add_argument("--weights", choices=["bf16", "fp32"], default="fp32")
    ap.add_argument("--rows", default="4,16")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from posttrain.models.loading import raised

    out = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "weights": args.weights}
    variants = [(kernel, None) for kernel in KERNELS]
    if args.device == "cuda":
        variants += [("sdpa", backend) for backend in SDPA_BACKENDS]
    for kernel, backend in variants:
        name = kernel if backend is None else f"sdpa:{backend.lower()}"
        try:
            with _sdpa_held_to(backend):
                out[name] = _kernel(args, kernel, [int(n) for n in args.rows.split(",")])
        except Exception as err:  # noqa: BLE001 - a kernel that cannot run here is reported, the others still run
            out[name] = {"error": raised(err)[:200]}
    print(json.dumps({"packed_rows": out}), flush=True)


def _sdpa_held_to(backend: str | None):
    """A context holding SDPA to one backend (None: its own choice)."""
    import contextlib

    if backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, backend))


def _kernel(args, kernel: str, row_counts: list[int]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.models.logprobs import token_logprobs
    from posttrain.models.packed_layouts import packed_layouts

    dtype = torch.bfloat16 if args.weights == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation=kernel)
    model = model.to(args.device).eval()
    layouts = packed_layouts(model)
    result = {"layouts": {"rows": bool(layouts.rows), "one_row": bool(layouts.one_row)}}
    for n in row_counts:
        prompt_ids, prompt_mask, completion_ids, completion_mask = _rollouts(n, model.config.vocab_size, args.device)
        with torch.no_grad():
            packed, _ = token_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, packing=True)
            alone = torch.zeros_like(packed)
            for i in range(n):
                p, c = int(prompt_mask[i].sum()), int(completion_mask[i].sum())
                row, _ = token_logprobs(model, prompt_ids[i:i + 1, -p:], prompt_mask[i:i + 1, -p:],
                                        completion_ids[i:i + 1, :c], completion_mask[i:i + 1, :c], packing=False)
                alone[i, :c] = row[0]
        mask = completion_mask.bool()
        result[str(n)] = {"packed_taken": bool(layouts.rows or layouts.one_row),
                          "max_abs_diff": float((packed[mask] - alone[mask]).abs().max()),
                          "tokens": int(mask.sum() + prompt_mask.sum())}
    return result


def _rollouts(n: int, vocab: int, device: str):
    """n left-padded prompts (24-96 tokens) and right-padded completions (16-256 tokens), seeded."""
    import torch

    gen = torch.Generator().manual_seed(n)
    prompt_lengths = torch.randint(24, 97, (n,), generator=gen)
    completion_lengths = torch.randint(16, 257, (n,), generator=gen)
    p, c = int(prompt_lengths.max()), int(completion_lengths.max())
    prompt_ids = torch.randint(3, vocab, (n, p), generator=gen)
    completion_ids = torch.randint(3, vocab, (n, c), generator=gen)
    prompt_mask = torch.arange(p)[None] >= (p - prompt_lengths)[:, None]
    completion_mask = torch.arange(c)[None] < completion_lengths[:, None]
    prompt_ids, completion_ids = prompt_ids * prompt_mask, completion_ids * completion_mask
    return (prompt_ids.to(device), prompt_mask.long().to(device), completion_ids.to(device),
            completion_mask.long().to(device))


if __name__ == "__main__":
    main()
