"""One trainer's run on the vision-language workload (bench/vlm_workload.py), on CPU: TRL 1.16's (the anchor,
--impl trl) or posttrain's (--impl posttrain), the same classes by name, config fields and data.

Usage: python vlm_step.py --impl trl|posttrain --trainer sft|dpo|kto|grpo|rloo|distillation [--steps 4] [--batch 8]
                          [--images 3] [--words 24] [--completion 16] [--generations 4] [--threads 2]
Prints one JSON line on stdout (the trainer's own logs go to stderr): wall seconds of train(), seconds/step (the median
of steps 2 to N, from step begin to step end as a callback sees them: what a longer run's steps cost, without the
run's start and end, and without TRL's collation, which transformers' loop runs before a step begins), the trainer's
construction (init_s: posttrain processes the images there) and init + train (total_s), peak RSS MiB, step-1 and last
loss. The model is loaded by path (bench/vlm_workload.py). bench/compare_vlm.sh runs both sides, interleaved.
"""
import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vlm_workload as workload  # noqa: E402


class StepClock:
    """A TrainerCallback (TRL's and posttrain's both call it) timing each optimizer step."""

    def __init__(self):
        self.times, self._start = [], None

    def __getattr__(self, name):  # every other event: nothing to do
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def on_step_begin(self, *args, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, *args, **kwargs):
        self.times.append(time.perf_counter() - self._start)


def trainer_for(args, model, processor, data, out_dir):
    import importlib

    trl = importlib.import_module(args.impl)  # trl or posttrain: the same names

    values = workload.common_config(args, out_dir)
    name = {"sft": "SFT", "dpo": "DPO", "kto": "KTO", "grpo": "GRPO", "rloo": "RLOO",
            "distillation": "Distillation"}[args.trainer]
    config = getattr(trl, f"{name}Config")(**values)
    cls = getattr(trl, f"{name}Trainer")
    if args.trainer in ("grpo", "rloo"):
        return cls(model, workload.length_reward, args=config, train_dataset=data, processing_class=processor)
    if args.trainer == "distillation":
        teacher, _ = workload.model_and_processor(seed=1)
        return cls(model, teacher, args=config, train_dataset=data, processing_class=processor)
    return cls(model, args=config, train_dataset=data, processing_class=processor)  # DPO, KTO: the reference from
    # the same path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["trl", "posttrain"], required=True)
    workload.add_arguments(ap)
    args = ap.parse_args()

    import torch
    torch.set_num_threads(args.threads)
    from datasets import Dataset

    model, processor = workload.model_and_processor()
    data = Dataset.from_list(workload.rows(args.trainer, workload.rows_needed(args), args.images, args.words))
    out_dir = tempfile.mkdtemp(prefix=f"{args.impl}-bench-vlm-")
    with contextlib.redirect_stdout(sys.stderr):
        t = time.perf_counter()
        trainer = trainer_for(args, model, processor, data, out_dir)
        init = time.perf_counter() - t
        clock = StepClock()
        trainer.add_callback(clock)
        t = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t
    shutil.rmtree(out_dir, ignore_errors=True)
    assert trainer.state.global_step == args.steps
    logs = [h for h in trainer.state.log_history if "loss" in h]
    print(json.dumps({"impl": args.impl, "trainer": args.trainer, "steps": args.steps, "wall_s": round(wall, 2),
                      "s_per_step": round(statistics.median(clock.times[1:] or clock.times), 4),
                      "init_s": round(init, 2), "total_s": round(init + wall, 2),
                      "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                      "loss_step1": logs[0]["loss"], "loss_last": logs[-1]["loss"]}), flush=True)


if __name__ == "__main__":
    main()
