"""posttrain's side of the SFT anchor benchmark: SFT on CPU on a local tiny model, fixed workload.

Usage: python bench/sft_step.py MODEL_DIR [--steps 4] [--batch 8] [--mode text|completion] [--seq 256] [--prompt 192]
                                         [--completion 64] [--peft] [--packing] [--threads 2] [--gradient-checkpointing]
Same flags, rows (make_rows() of ../shared/bench/trl_sft.py) and JSON keys as TRL's side, so the two lines read as a
ratio: wall seconds of train(), seconds/step, tokens/s, label tokens/s, peak RSS MiB, CPU seconds, step-1 and last
loss, trainer construction seconds.
"""

import argparse
import contextlib
import json
import os
import resource
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.environ.get("SHARED", os.path.join(HERE, "..", "..", "shared", "bench"))


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--mode", choices=["text", "completion"], default="text")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=192)
    ap.add_argument("--completion", type=int, default=64)
    ap.add_argument("--peft", action="store_true")
    ap.add_argument("--packing", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gradient-checkpointing", action="store_true", help="off unless asked, as in trl_sft.py")
    args = ap.parse_args()

    sys.path.insert(0, SHARED)
    from trl_sft import make_rows  # the data contract; imports without TRL

    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoTokenizer

    from posttrain import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(args.model)
    n_rows = args.batch * args.steps
    data = make_rows(args.mode, n_rows, args.seq, args.prompt, args.completion)
    if args.mode == "text":
        row_len, label_len = args.seq, args.seq
    else:
        row_len, label_len = args.prompt + args.completion, args.completion
    out_dir = tempfile.mkdtemp(prefix="posttrain-bench-sft-")
    cfg = SFTConfig(output_dir=out_dir, use_cpu=True, bf16=False, max_steps=args.steps,
                    per_device_train_batch_size=args.batch, gradient_accumulation_steps=1, max_length=row_len,
                    packing=args.packing, learning_rate=1e-5, logging_steps=1, report_to="none", save_strategy="no",
                    seed=0, train_sampling_strategy="sequential", gradient_checkpointing=args.gradient_checkpointing)
    peft_config = None
    if args.peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    with contextlib.redirect_stdout(sys.stderr):
        t = time.perf_counter()
        trainer = SFTTrainer(model=args.model, args=cfg, train_dataset=Dataset.from_dict(data), processing_class=tok,
                             peft_config=peft_config)
        init_s = time.perf_counter() - t
        rows = trainer.batches.rows  # the workload as prepared: every row row_len tokens, label_len labelled
        assert len(rows) == n_rows and (rows.lengths == row_len).all(), (len(rows), set(rows.lengths.tolist()))
        assert int(rows.labels.sum()) == n_rows * label_len
        cpu0, t = cpu_seconds(), time.perf_counter()
        trainer.train()
        wall, cpu = time.perf_counter() - t, cpu_seconds() - cpu0
    shutil.rmtree(out_dir, ignore_errors=True)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert trainer.state.global_step == args.steps and logs[0]["step"] == 1
    tokens, label_tokens = args.steps * args.batch * row_len, args.steps * args.batch * label_len
    print(json.dumps({
        "impl": "posttrain", "steps": args.steps, "wall_s": round(wall, 2), "s_per_step": round(wall / args.steps, 3),
        "tok_per_s": round(tokens / wall, 1), "label_tok_per_s": round(label_tokens / wall, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1), "cpu_s": round(cpu, 2),
        "loss_step1": logs[0]["loss"], "loss_last": logs[-1]["loss"], "init_s": round(init_s, 2),
    }), flush=True)


if __name__ == "__main__":
    main()
