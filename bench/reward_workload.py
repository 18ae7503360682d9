"""The reward-model workload that bench/trl_reward.py (TRL's RewardTrainer) and bench/reward_step.py (posttrain's)
both import, so that the two sides run the same pairs, settings and accounting. Importable without torch or TRL.

Rows are make_rows() of ../shared/bench/trl_dpo.py (the DPO anchor's data contract: words that are single tokens),
explicit-prompt pairs of exact token lengths: prompt + chosen and prompt + rejected are --prompt + --chosen and
--prompt + --rejected tokens, the EOS included (checked on each side's prepared rows). Settings as TRL's defaults
except: fp32, gradient checkpointing off unless asked (TRL turns it on), learning rate 1e-5, seed 0, the dataset's
order (step k takes pairs k*B .. (k+1)*B - 1), max_length large enough that no pair is dropped.
"""

import argparse
import contextlib
import importlib
import json
import os
import resource
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from step_clock import median_step_s, step_clock  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.environ.get("SHARED", os.path.join(HERE, "..", "..", "shared", "bench"))


def parse_args(side: str):
    ap = argparse.ArgumentParser(description=f"{side}'s side of the reward-model benchmark")
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=8, help="pairs per step (per_device_train_batch_size)")
    ap.add_argument("--prompt", type=int, default=192)
    ap.add_argument("--chosen", type=int, default=64, help="chosen tokens, EOS included")
    ap.add_argument("--rejected", type=int, default=64, help="rejected tokens, EOS included")
    ap.add_argument("--peft", action="store_true", help="LoRA r16 on every linear layer, the score head trained")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    return ap.parse_args()


def rows(args) -> dict:
    sys.path.insert(0, SHARED)
    from trl_dpo import make_rows  # the data contract; imports without TRL

    return make_rows(args.steps * args.pairs, args.prompt, args.chosen, args.rejected)


def config_values(args, output_dir: str) -> dict:
    return dict(output_dir=output_dir, use_cpu=True, bf16=False, max_steps=args.steps,
                per_device_train_batch_size=args.pairs, gradient_accumulation_steps=1,
                max_length=args.prompt + max(args.chosen, args.rejected), learning_rate=1e-5, logging_steps=1,
                report_to="none", save_strategy="no", seed=0, train_sampling_strategy="sequential",
                dataloader_num_workers=0, gradient_checkpointing=args.gradient_checkpointing)


def lora_config(args):
    if not args.peft:
        return None
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="SEQ_CLS")


def check_prepared(prepared, args, eos_id: int) -> None:
    """The pairs as the trainer prepared them: every one kept, each sequence of its exact length, ending in EOS."""
    assert len(prepared) == args.steps * args.pairs, len(prepared)
    for c, r in zip(prepared["chosen_ids"], prepared["rejected_ids"]):
        assert (len(c), len(r)) == (args.prompt + args.chosen, args.prompt + args.rejected), (len(c), len(r))
        assert c[-1] == eos_id and r[-1] == eos_id


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed_train(trainer) -> tuple[float, float]:
    cpu0, start = cpu_seconds(), time.perf_counter()
    trainer.train()
    return time.perf_counter() - start, cpu_seconds() - cpu0


def peak_rss_mib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def print_line(impl: str, args, wall: float, cpu: float, init_s: float, logs: list[dict], step_s,
               rss_before: float) -> None:
    """One JSON line; `peak_rss_before_trainer_mib` is the process's peak before the trainer was built (Python,
    torch, transformers, datasets, the library, the tokenizer and the rows): the floor both sides share."""
    tokens = args.steps * args.pairs * (2 * args.prompt + args.chosen + args.rejected)
    first, last = logs[0], logs[-1]
    print(json.dumps({
        "impl": impl, "steps": args.steps, "wall_s": round(wall, 2), "s_per_step": round(wall / args.steps, 3),
        "median_step_s": step_s,
        "tok_per_s": round(tokens / wall, 1), "cpu_s": round(cpu, 2), "init_s": round(init_s, 2),
        "peak_rss_mib": peak_rss_mib(), "peak_rss_before_trainer_mib": rss_before,
        "loss_step1": first["loss"], "accuracy_step1": first["accuracy"], "margin_step1": first["margin"],
        "mean_reward_step1": first["mean_reward"], "loss_last": last["loss"], "margin_last": last["margin"]}))


def main(impl: str) -> None:
    """Run the workload with `impl`'s RewardTrainer ("trl" or "posttrain") and print its JSON line."""
    args = parse_args(impl)
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoTokenizer

    library = importlib.import_module(impl)
    tok = AutoTokenizer.from_pretrained(args.model)
    out_dir = tempfile.mkdtemp(prefix=f"{impl}-bench-reward-")
    clock = step_clock()
    with contextlib.redirect_stdout(sys.stderr):  # the trainers' own output goes to stderr
        dataset, config, peft_config = Dataset.from_dict(rows(args)), library.RewardConfig(**config_values(
            args, out_dir)), lora_config(args)
        rss_before = peak_rss_mib()
        start = time.perf_counter()
        trainer = library.RewardTrainer(model=args.model, args=config, train_dataset=dataset, processing_class=tok,
                                        peft_config=peft_config, callbacks=[clock])
        init_s = time.perf_counter() - start
        check_prepared(trainer.train_dataset, args, tok.eos_token_id)
        wall, cpu = timed_train(trainer)
    shutil.rmtree(out_dir, ignore_errors=True)
    print_line(impl, args, wall, cpu, init_s, [h for h in trainer.state.log_history if "loss" in h],
               median_step_s(clock), rss_before)

