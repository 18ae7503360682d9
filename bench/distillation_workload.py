"""The on-policy distillation workload that bench/trl_distillation.py (TRL's DistillationTrainer) and
bench/distillation_step.py (posttrain's) both import, so the two sides run the same prompts, settings and accounting.
Importable without torch or TRL.

The student is the 152k-vocabulary benchmark model (hidden 128, 2 layers), the teacher the same vocabulary and
tokenizer at hidden 256, 4 layers (bench/compare_distillation.sh builds both with ../shared/bench/make_tiny.py). The
prompts are the RLOO/GRPO anchors' ("What is a + b?"); every completion runs to --completion tokens
(generation_kwargs min_new_tokens), so both sides train on the same number of tokens. Settings as TRL's distillation
defaults (beta 1.0, temperature 1.0) except: fp32, gradient checkpointing off unless asked, learning rate 1e-5,
seed 0, one micro-batch a step.
"""

import argparse
import contextlib
import importlib
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from reward_workload import cpu_seconds, peak_rss_mib  # noqa: E402
from step_clock import median_step_s, step_clock  # noqa: E402


def parse_args(side: str):
    ap = argparse.ArgumentParser(description=f"{side}'s side of the distillation benchmark")
    ap.add_argument("model")
    ap.add_argument("teacher")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="prompts (one completion each) per step")
    ap.add_argument("--completion", type=int, default=128)
    ap.add_argument("--beta", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    return ap.parse_args()


def dataset(rows: int):
    from datasets import Dataset

    pairs = [(10 + i % 64, 100 + (7 * i) % 64) for i in range(rows)]
    return Dataset.from_dict({"prompt": [f"What is {a} + {b}?" for a, b in pairs]})


def config_values(args, output_dir: str) -> dict:
    return dict(output_dir=output_dir, use_cpu=True, bf16=False, max_steps=args.steps,
                per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
                max_completion_length=args.completion, beta=args.beta, learning_rate=1e-5, logging_steps=1,
                report_to="none", save_strategy="no", seed=0, generation_kwargs={"min_new_tokens": args.completion},
                dataloader_num_workers=0, gradient_checkpointing=args.gradient_checkpointing)


def main(impl: str) -> None:
    """Run the workload with `impl`'s DistillationTrainer ("trl" or "posttrain") and print its JSON line."""
    args = parse_args(impl)
    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    library = importlib.import_module(impl)
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"  # TRL's DistillationTrainer asks for it
    out_dir = tempfile.mkdtemp(prefix=f"{impl}-bench-distillation-")
    clock = step_clock()
    with contextlib.redirect_stdout(sys.stderr):  # the trainers' own output goes to stderr
        data, config = dataset(args.steps * args.batch), library.DistillationConfig(**config_values(args, out_dir))
        rss_before = peak_rss_mib()
        start = time.perf_counter()
        trainer = library.DistillationTrainer(model=args.model, teacher_model=args.teacher, args=config,
                                              train_dataset=data, processing_class=tok, callbacks=[clock])
        init_s = time.perf_counter() - start
        cpu0, start = cpu_seconds(), time.perf_counter()
        trainer.train()
        wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu0
    shutil.rmtree(out_dir, ignore_errors=True)
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    print(json.dumps({
        "impl": impl, "steps": args.steps, "batch": args.batch, "completion": args.completion,
        "wall_s": round(wall, 2), "s_per_step": round(wall / args.steps, 3), "median_step_s": median_step_s(clock),
        "cpu_s": round(cpu, 2), "init_s": round(init_s, 2), "peak_rss_mib": peak_rss_mib(),
        "peak_rss_before_trainer_mib": rss_before, "loss_step1": logs[0]["loss"], "loss_last": logs[-1]["loss"],
        "entropy_step1": logs[0].get("entropy")}))
