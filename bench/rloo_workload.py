"""The RLOO workload that bench/trl_rloo.py (TRL's RLOOTrainer) and bench/rloo_step.py (posttrain's) both import:
the GRPO anchor's workload (../shared/bench/trl_grpo.py: its prompts, digit reward, flags and forced full-length
completions, so both sides do identical work) run through each library's RLOOTrainer. Importable without torch.

Settings: fp32, gradient checkpointing off unless asked, learning rate 1e-5, seed 0, one micro-batch a step
(steps_per_generation 1), beta 0.05 (TRL's RLOO default: a reference model is loaded and its log-probs taken).
"""

import argparse
import contextlib
import importlib
import json
import resource
import shutil
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from step_clock import median_step_s, step_clock  # noqa: E402


def parse_args(side: str):
    ap = argparse.ArgumentParser(description=f"{side}'s side of the RLOO benchmark")
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--gens", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--completion", type=int, default=64)
    ap.add_argument("--beta", type=float, default=0.05)
    ap.add_argument("--peft", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    return ap.parse_args()


def reward_digits(completions, answer, **kw):
    """The GRPO anchor's reward: the share of digits, plus 1 when the answer appears."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) + (1.0 if a in c else 0.0)
            for c, a in zip(completions, answer)]


def dataset():
    from datasets import Dataset

    pairs = list(zip(range(10, 74), range(100, 164)))
    return Dataset.from_dict({"prompt": [f"What is {a} + {b}?" for a, b in pairs],
                              "answer": [str(a + b) for a, b in pairs]})


def config_values(args, output_dir: str) -> dict:
    return dict(output_dir=output_dir, use_cpu=True, bf16=False, max_steps=args.steps, num_generations=args.gens,
                per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
                max_completion_length=args.completion, beta=args.beta, learning_rate=1e-5, logging_steps=1,
                report_to="none", save_strategy="no", seed=0, generation_kwargs={"min_new_tokens": args.completion},
                dataloader_num_workers=0, gradient_checkpointing=args.gradient_checkpointing)


def main(impl: str) -> None:
    """Run the workload with `impl`'s RLOOTrainer ("trl" or "posttrain") and print one JSON line: wall seconds of
    train(), seconds/step, the median step, completion tokens/s, CPU seconds, peak RSS MiB, step-1 and last reward and
    loss."""
    args = parse_args(impl)
    import torch

    torch.set_num_threads(args.threads)
    library = importlib.import_module(impl)
    peft_config = None
    if args.peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    out_dir = tempfile.mkdtemp(prefix=f"{impl}-bench-rloo-")
    clock = step_clock()
    with contextlib.redirect_stdout(sys.stderr):
        trainer = library.RLOOTrainer(model=args.model, reward_funcs=reward_digits,
                                      args=library.RLOOConfig(**config_values(args, out_dir)),
                                      train_dataset=dataset(), peft_config=peft_config, callbacks=[clock])
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu0, start = usage.ru_utime + usage.ru_stime, time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
        usage = resource.getrusage(resource.RUSAGE_SELF)
    shutil.rmtree(out_dir, ignore_errors=True)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    print(json.dumps({
        "impl": impl, "steps": args.steps, "wall_s": round(wall, 2), "s_per_step": round(wall / args.steps, 3),
        "median_step_s": median_step_s(clock),
        "completion_tok_per_s": round(args.steps * args.batch * args.completion / wall, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime - cpu0, 2),
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1), "reward_step1": logs[0]["reward"],
        "reward_last": logs[-1]["reward"], "kl_last": logs[-1].get("kl"), "loss_last": logs[-1]["loss"]}))

