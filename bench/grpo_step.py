"""posttrain's side of the anchor benchmark: GRPO on CPU on a local tiny model, fixed workload.

Usage: python bench/grpo_step.py MODEL_DIR [--steps 6] [--gens 8] [--batch 16] [--completion 64] [--beta 0.04]
                                          [--peft] [--gradient-checkpointing] [--threads 2] [--server URL]
                                          [--max-completion-tokens-per-pass N|auto|none]
(--server URL: generate through `posttrain serve` at URL, weights pushed before every round: bench/compare_serve.sh.)
Same flags, workload and JSON keys as ../shared/bench/trl_grpo.py (TRL's GRPOTrainer), so the two print
lines that read as a ratio: wall seconds of train(), seconds/step, completion tokens/s, peak RSS MiB.
Every completion is forced to full length (min_new_tokens) so both sides do identical work; with --natural
completions end at EOS (beside bench/trl_grpo_natural.py, on a model from bench/make_natural.py), and the JSON
line adds the completions' mean/min/max length and the share of the run's matmul FLOPs spent on padding and on
finished rows (flops.padding_waste, from each round's lengths, the rows the decoder actually ran and the positions
the packed training passes ran: one micro-batch per round, as here).
Beside the anchor's keys it prints `step_gflop` (matmul FLOPs of one step as posttrain ran it, a prompt that the
decode's prefill or a training pass ran once for its num_generations rollouts counted once; bench/flops.py),
`achieved_gflop_per_s` (those FLOPs over the measured s/step) and `matmul_gflop_per_s` (what a
[2048 x hidden] @ [hidden x vocab] float32 product reaches here, i.e. the machine's own limit for the
step's dominant shape).
"""

import argparse
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/flops.py


def trained_positions(prompt: list[int], completion: list[int]) -> int:
    """Positions the training passes run the model's body over for one micro-batch of rollouts of these lengths:
    the packed rows' when posttrain packs them (models/packing.py), else the padded block's."""
    from posttrain.models.packing import packing_plan

    sequences = [p + c for p, c in zip(prompt, completion)]
    padded_width = max(prompt) + max(completion)
    plan = packing_plan(sequences, padded_width)  # the benchmark's models pack in rows (models/packed_layouts.py)
    return len(sequences) * padded_width if plan is None else len(plan[0]) * plan[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--gens", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--completion", type=int, default=64)
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--peft", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-completion-tokens-per-pass", default="auto",
                    help="posttrain's max_completion_tokens_per_pass: a count, auto (its default) or none, as the "
                         "config converts them")
    ap.add_argument("--gradient-checkpointing", action="store_true", help="off unless asked, as in trl_grpo.py")
    ap.add_argument("--server", default=None, help="generate through the posttrain serve at this base URL")
    ap.add_argument("--no-sampling-correction", action="store_true",
                    help="with --server: vllm_importance_sampling_correction=False (TRL's default is True)")
    ap.add_argument("--natural", action="store_true",
                    help="completions end at EOS (no min_new_tokens); with a model from bench/make_natural.py")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset

    from posttrain import GRPOConfig, GRPOTrainer
    from posttrain.generation.transformers_backend import TransformersGenerator

    rounds = []  # per generation round: prompt and completion lengths, rows decoded per token (summed)
    generate_seeded = TransformersGenerator.generate_seeded

    def recorded(self, prompts, seed, row_keys=None, model_inputs=None):
        out = generate_seeded(self, prompts, seed, row_keys, model_inputs)
        lengths = {"prompt": [len(p) for p in prompts], "completion": out.completion_mask.sum(1).tolist()}
        rounds.append(dict(lengths, decoded_row_steps=getattr(self, "decoded_row_steps", None),
                           trained_positions=trained_positions(**lengths)))
        return out

    TransformersGenerator.generate_seeded = recorded

    from posttrain.generation import lean_decoder
    from posttrain.models import logprobs

    shared_passes = []  # per training pass that ran each distinct prompt once (in rows or two forwards): how many
    through_shared, supports = logprobs._through_shared, lean_decoder.supports

    def recorded_sharing(model, shared, *rest):
        if shared.source.numel() == args.batch:  # a pass over the step's rollouts, not the one-time model check
            shared_passes.append(shared.prompt_ids.size(0))
        return through_shared(model, shared, *rest)

    logprobs._through_shared = recorded_sharing
    lean_decodes = []  # per decode in this process: whether the lean decoder ran it (it prefills each prompt once)
    lean_decoder.supports = lambda model: lean_decodes.append(supports(model)) or lean_decodes[-1]

    pairs = list(zip(range(10, 74), range(100, 164)))
    ds = Dataset.from_dict({"prompt": [f"What is {a} + {b}?" for a, b in pairs], "answer": [str(a + b) for a, b in pairs]})

    def reward_digits(completions, answer, **kw):
        return [sum(ch.isdigit() for ch in c) / max(1, len(c)) + (1.0 if a in c else 0.0)
                for c, a in zip(completions, answer)]

    cfg = GRPOConfig(
        output_dir="/tmp/posttrain-bench-out", use_cpu=True, bf16=False, max_steps=args.steps,
        num_generations=args.gens, per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
        max_completion_length=args.completion, beta=args.beta, learning_rate=1e-5, logging_steps=1,
        save_strategy="no", seed=0, generation_kwargs={} if args.natural else {"min_new_tokens": args.completion},
        gradient_checkpointing=args.gradient_checkpointing, plot_on_end=False,  # a one-off end-of-run cost, not a step
        max_completion_tokens_per_pass=args.max_completion_tokens_per_pass,
        **({"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": args.server,
            "vllm_importance_sampling_correction": not args.no_sampling_correction} if args.server else {}))
    peft_config = None
    if args.peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=args.model, reward_funcs=reward_digits, args=cfg, train_dataset=ds,
                          peft_config=peft_config)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    tokens = sum(sum(r["completion"]) for r in rounds) if rounds else args.steps * args.batch * args.completion
    peak = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    from flops import grpo_step_flops, matmul_gflops, padding_waste

    config = trainer.policy.config
    prompt_len = max(len(ids) for ids in trainer.prompts.prompt_ids)
    passes = args.steps * (2 if args.beta > 0 else 1)  # the policy's and the reference's (no old-policy pass here)
    trained_prompt_rows = (sum(shared_passes) + (passes - len(shared_passes)) * args.batch) / passes
    prefill_rows = args.batch // args.gens if lean_decodes and all(lean_decodes) else None
    flops = grpo_step_flops(config, args.batch, prompt_len, args.completion, args.beta, args.peft, prefill_rows,
                            trained_prompt_rows)
    natural = {}
    if args.natural and rounds:
        natural = padding_waste(config, rounds, args.beta, head_on_real_tokens=True)
        flops = {"total": natural["useful_gflop"] * 1e9 / len(rounds)}  # a step's work: the real tokens' FLOPs
    print(json.dumps({
        "impl": ("posttrain-serve" + ("-uncorrected" if args.no_sampling_correction else "")) if args.server
        else "posttrain", "steps": args.steps, "wall_s": round(wall, 2), "s_per_step": round(wall / args.steps, 3),
        "completion_tok_per_s": round(tokens / wall, 1), "peak_rss_mib": peak,
        "step_gflop": round(flops["total"] / 1e9, 1),
        "achieved_gflop_per_s": round(flops["total"] / 1e9 / (wall / args.steps), 1),
        "matmul_gflop_per_s": round(matmul_gflops(2048, config.hidden_size, config.vocab_size), 1), **natural,
    }))


if __name__ == "__main__":
    main()
