"""The KTO workload that bench/trl_kto.py (TRL's KTOTrainer) and bench/kto_step.py (posttrain's) both import, so that
the two sides run the same examples, settings and accounting. Importable without torch or TRL.

Rows are make_rows() of ../shared/bench/trl_dpo.py (the DPO anchor's data contract: words that are single tokens), as
unpaired examples: each row's prompt and its chosen text as the completion, labelled desirable on even rows and
undesirable on odd ones; prompt + completion is --prompt + --completion tokens, the EOS included (checked on each
side's prepared rows). Settings as TRL's KTO defaults (loss_type kto, beta 0.1, sequential order) except: fp32,
gradient checkpointing off unless asked (TRL turns it on), learning rate 1e-5, seed 0, max_length large enough that
nothing is cut. Each step is one micro-batch of --batch examples with its --batch KL pairs.
"""

import argparse
import contextlib
import importlib
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from reward_workload import cpu_seconds, peak_rss_mib  # noqa: E402
from step_clock import median_step_s, step_clock  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.environ.get("SHARED", os.path.join(HERE, "..", "..", "shared", "bench"))


def parse_args(side: str):
    ap = argparse.ArgumentParser(description=f"{side}'s side of the KTO benchmark")
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="examples per step (per_device_train_batch_size)")
    ap.add_argument("--prompt", type=int, default=192)
    ap.add_argument("--completion", type=int, default=64, help="completion tokens, EOS included")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    return ap.parse_args()


def rows(args) -> dict:
    sys.path.insert(0, SHARED)
    from trl_dpo import make_rows  # the data contract; imports without TRL

    pairs = make_rows(args.steps * args.batch, args.prompt, args.completion, args.completion)
    return {"prompt": pairs["prompt"], "completion": pairs["chosen"],
            "label": [i % 2 == 0 for i in range(len(pairs["prompt"]))]}


def config_values(args, output_dir: str) -> dict:
    return dict(output_dir=output_dir, use_cpu=True, bf16=False, max_steps=args.steps,
                per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
                max_length=args.prompt + args.completion, learning_rate=1e-5, logging_steps=1, report_to="none",
                save_strategy="no", seed=0, dataloader_num_workers=0,
                gradient_checkpointing=args.gradient_checkpointing)


def check_prepared(prepared, args, eos_id: int) -> None:
    """The examples as the trainer prepared them: every one kept, each of its exact length, ending in EOS."""
    assert len(prepared) == args.steps * args.batch, len(prepared)
    for p, c in zip(prepared["prompt_ids"], prepared["completion_ids"]):
        assert len(p) + len(c) == args.prompt + args.completion, (len(p), len(c))
        assert c[-1] == eos_id


def main(impl: str) -> None:
    """Run the workload with `impl`'s KTOTrainer ("trl" or "posttrain") and print its JSON line."""
    import json

    args = parse_args(impl)
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoTokenizer

    library = importlib.import_module(impl)
    tok = AutoTokenizer.from_pretrained(args.model)
    out_dir = tempfile.mkdtemp(prefix=f"{impl}-bench-kto-")
    clock = step_clock()
    with contextlib.redirect_stdout(sys.stderr):  # the trainers' own output goes to stderr
        dataset, config = Dataset.from_dict(rows(args)), library.KTOConfig(**config_values(args, out_dir))
        rss_before = peak_rss_mib()
        start = time.perf_counter()
        trainer = library.KTOTrainer(model=args.model, args=config, train_dataset=dataset, processing_class=tok,
                                     callbacks=[clock])
        init_s = time.perf_counter() - start
        check_prepared(trainer.train_dataset, args, tok.eos_token_id)
        cpu0, start = cpu_seconds(), time.perf_counter()
        trainer.train()
        wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu0
    shutil.rmtree(out_dir, ignore_errors=True)
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    tokens = args.steps * args.batch * (args.prompt + args.completion)
    print(json.dumps({
        "impl": impl, "steps": args.steps, "wall_s": round(wall, 2), "s_per_step": round(wall / args.steps, 3),
        "median_step_s": median_step_s(clock), "tok_per_s": round(tokens / wall, 1), "cpu_s": round(cpu, 2),
        "init_s": round(init_s, 2), "peak_rss_mib": peak_rss_mib(), "peak_rss_before_trainer_mib": rss_before,
        "loss_step1": logs[0]["loss"], "loss_step2": logs[1]["loss"], "kl_step2": logs[1]["kl"],
        "loss_last": logs[-1]["loss"], "margin_last": logs[-1].get("rewards/margins")}))
