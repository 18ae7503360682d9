"""FLOP accounting for a GRPO step, and the matmul throughput this machine reaches for its shapes.

Matmul FLOPs only (2 per multiply-add); attention scores, norms and softmax are left out, so the step's
"achieved" rate is a lower bound on the work done per second.
"""

import time


def body_params(config) -> int:
    """Multiply-add weights per token in the transformer body (attention + MLP projections), no embeddings."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or h // heads
    attention = h * heads * head_dim * 2 + h * kv * head_dim * 2  # q, o and k, v
    mlp = 3 * h * inter  # gate, up, down
    return layers * (attention + mlp)


def grpo_step_flops(config, batch: int, prompt_len: int, completion_len: int, beta: float, peft: bool,
                    prefill_rows: int | None = None, trained_prompt_rows: int | None = None) -> dict:
    """FLOPs of one step: sampling, the policy's forward + backward, and the reference forward (beta > 0).

    `prefill_rows` / `trained_prompt_rows`: how many prompts the decode's prefill / the training passes run, where
    the num_generations copies of a prompt run once (posttrain's shared prompts); default every row's."""
    body, head = body_params(config), config.hidden_size * config.vocab_size

    def forward(prompt_rows: int | None) -> float:
        prompt_positions = (batch if prompt_rows is None else prompt_rows) * prompt_len
        return 2 * ((prompt_positions + batch * completion_len) * body + batch * completion_len * head)

    gen, fwd = forward(prefill_rows), forward(trained_prompt_rows)
    # backward: gradients w.r.t. activations and weights, 2x the forward; the chunked output layer also
    # recomputes its forward; with LoRA the frozen weights get no weight gradient (about 1x forward)
    backward = (1 if peft else 2) * fwd + 2 * batch * completion_len * head
    ref = fwd if beta > 0 else 0
    return {"generation": gen, "policy": fwd + backward, "reference": ref, "total": gen + fwd + backward + ref}


def matmul_gflops(rows: int, inner: int, cols: int, repeats: int = 5) -> float:
    """Measured GFLOP/s of a [rows, inner] @ [inner, cols] float32 product on this machine."""
    import torch

    a, b = torch.randn(rows, inner), torch.randn(cols, inner)
    a @ b.T
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b.T
    return 2 * rows * inner * cols * repeats / (time.perf_counter() - start) / 1e9


def padding_waste(config, rounds: list[dict], beta: float, head_on_real_tokens: bool) -> dict:
    """The completions' lengths and the share of a run's matmul FLOPs spent on padding and on finished rows.

    Each round is {"prompt": [N] prompt lengths, "completion": [N] completion lengths (EOS included),
    "decoded_row_steps": rows run through the model per decode token, summed (None: every row to the longest
    row's end), and optionally "trained_positions": the positions the training passes run the body over (posttrain
    packs the rollouts' real tokens, models/packing.py; absent: the padded [N, max prompt + max completion] block)}.
    The training passes are the policy forward + backward (3x) and the reference (1x with beta > 0); the output
    layer runs over every padded completion position unless `head_on_real_tokens` (posttrain's chunked log-probs
    take the real positions only).
    """
    body, head = body_params(config), config.hidden_size * config.vocab_size
    passes = 3 + (1 if beta > 0 else 0)
    useful = wasted = 0
    for r in rounds:
        n, width = len(r["completion"]), max(r["completion"])
        real_completion = sum(r["completion"])
        decoded = r["decoded_row_steps"] if r["decoded_row_steps"] is not None else n * width
        useful += 2 * real_completion * (body + head)
        wasted += 2 * (decoded - real_completion) * (body + head)
        padded = r.get("trained_positions") or n * (max(r["prompt"]) + width)
        real = sum(r["prompt"]) + real_completion
        useful += passes * 2 * (real * body + real_completion * head)
        padded_head = 0 if head_on_real_tokens else (n * width - real_completion) * head
        wasted += passes * 2 * ((padded - real) * body + padded_head)
    lengths = [length for r in rounds for length in r["completion"]]
    return {"completion_mean": round(sum(lengths) / len(lengths), 1), "completion_min": min(lengths),
            "completion_max": max(lengths), "padding_flop_fraction": round(wasted / (useful + wasted), 4),
            "useful_gflop": round(useful / 1e9, 1), "padding_gflop": round(wasted / 1e9, 1)}
