"""posttrain's side of the DPO anchor benchmark: DPO on CPU on a local tiny model, fixed workload.

Usage: python bench/dpo_step.py MODEL_DIR [--steps 4] [--pairs 4] [--prompt 192] [--chosen 64] [--rejected 64]
                                          [--ld-alpha X] [--precompute-ref] [--peft] [--threads 2]
                                          [--gradient-checkpointing]
Same flags, rows (make_rows() of ../shared/bench/trl_dpo.py) and JSON keys as TRL's side, so the two lines read as a
ratio: wall seconds of train(), seconds/step, tokens/s, label tokens/s, peak RSS MiB, CPU seconds, step-1 loss,
rewards and log-probs, last loss and margin, trainer construction seconds (and precompute_ref_s, the reference pass
of --precompute-ref, timed on its own).
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
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=192)
    ap.add_argument("--chosen", type=int, default=64)
    ap.add_argument("--rejected", type=int, default=64)
    ap.add_argument("--ld-alpha", type=float, default=None)
    ap.add_argument("--precompute-ref", action="store_true")
    ap.add_argument("--peft", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gradient-checkpointing", action="store_true", help="off unless asked, as in trl_dpo.py")
    args = ap.parse_args()

    sys.path.insert(0, SHARED)
    from trl_dpo import make_rows  # the data contract; imports without TRL

    import torch

    torch.set_num_threads(args.threads)
    os.environ["POSTTRAIN_CACHE"] = tempfile.mkdtemp(prefix="posttrain-bench-cache-")  # never a warm cache
    from datasets import Dataset
    from transformers import AutoTokenizer

    from posttrain import DPOConfig, DPOTrainer
    from posttrain.dpo import trainer as dpo_trainer

    tok = AutoTokenizer.from_pretrained(args.model)
    n_rows = args.pairs * args.steps
    data = make_rows(n_rows, args.prompt, args.chosen, args.rejected)
    out_dir = tempfile.mkdtemp(prefix="posttrain-bench-dpo-")
    cfg = DPOConfig(output_dir=out_dir, use_cpu=True, bf16=False, max_steps=args.steps,
                    per_device_train_batch_size=args.pairs, gradient_accumulation_steps=1,
                    max_length=args.prompt + max(args.chosen, args.rejected), ld_alpha=args.ld_alpha,
                    precompute_ref_log_probs=args.precompute_ref, learning_rate=1e-5, logging_steps=1,
                    report_to="none", save_strategy="no", seed=0, train_sampling_strategy="sequential",
                    gradient_checkpointing=args.gradient_checkpointing)
    peft_config = None
    if args.peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    precompute_s = []
    original = dpo_trainer.DPOTrainer._precomputed_reference

    def timed(self, *a, **kw):
        t0 = time.perf_counter()
        out = original(self, *a, **kw)
        precompute_s.append(time.perf_counter() - t0)
        return out

    dpo_trainer.DPOTrainer._precomputed_reference = timed
    with contextlib.redirect_stdout(sys.stderr):
        t = time.perf_counter()
        trainer = DPOTrainer(model=args.model, args=cfg, train_dataset=Dataset.from_dict(data), processing_class=tok,
                             peft_config=peft_config)
        init_s = time.perf_counter() - t
        prepared = trainer.train_dataset  # the workload as prepared, in TRL's columns
        assert len(prepared) == n_rows, (len(prepared), n_rows)
        for p, c, r in zip(prepared["prompt_ids"], prepared["chosen_ids"], prepared["rejected_ids"]):
            assert (len(p), len(c), len(r)) == (args.prompt, args.chosen, args.rejected), (len(p), len(c), len(r))
            assert c[-1] == tok.eos_token_id and r[-1] == tok.eos_token_id
        cpu0, t = cpu_seconds(), time.perf_counter()
        trainer.train()
        wall, cpu = time.perf_counter() - t, cpu_seconds() - cpu0
    shutil.rmtree(out_dir, ignore_errors=True)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    first, last = logs[0], logs[-1]
    assert trainer.state.global_step == args.steps and first["step"] == 1
    tokens = args.steps * args.pairs * (2 * args.prompt + args.chosen + args.rejected)
    label_tokens = args.steps * args.pairs * (args.chosen + args.rejected)
    res = {"impl": "posttrain", "steps": args.steps, "wall_s": round(wall, 2),
           "s_per_step": round(wall / args.steps, 3),
           "tok_per_s": round(tokens / wall, 1), "label_tok_per_s": round(label_tokens / wall, 1),
           "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
           "cpu_s": round(cpu, 2), "loss_step1": first["loss"]}
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        res[key.replace("/", "_") + "_step1"] = first[key]
    res["loss_last"] = last["loss"]
    res["rewards_margins_last"] = last["rewards/margins"]
    res["init_s"] = round(init_s, 2)
    if precompute_s:
        res["precompute_ref_s"] = round(sum(precompute_s), 2)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
