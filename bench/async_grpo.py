"""Synchronous against asynchronous GRPO on the demo task (posttrain demo's addition prompts and its `accuracy`
reward), generation through a `posttrain serve` at URL, one JSON line.

Usage: python bench/async_grpo.py URL [--model DIR] [--steps 40] [--staleness -1] [--batch 64] [--gens 8]
                                      [--completion 3] [--threads 1] [--seed 0]
--staleness -1 runs synchronous GRPO (the weights pushed before every round, the trainer idle while the server
samples); 0, 1, 2, 4 run async_generation with that max_staleness. bench/compare_async.sh starts the server on one
core and this script on the other (taskset), as separate GPUs would be, and rotates the settings.

Prints: the median seconds per optimizer step (the first two steps left out: start-up), each step's end time and
reward (for reward after the same number of steps and after the same wall-clock time), the run's wall seconds, and
the async/* means (staleness, seconds the trainer waited for rounds, seconds the worker waited for weights).
"""

import argparse
import json
import statistics
import tempfile
import time


def demo_vocabulary_model(hidden: int, layers: int) -> str:
    """A random Qwen2 of the demo's 17-token vocabulary at `hidden` x `layers`, saved once under /tmp."""
    import os

    from posttrain.demo import DEMO_CHARS
    from posttrain.testing import save_tiny, tiny_tokenizer

    path = f"/tmp/async-bench-demo-{hidden}x{layers}"
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        save_tiny(path, tiny_tokenizer(DEMO_CHARS, all_bytes=False), seed=0, hidden=hidden, layers=layers,
                  max_positions=64)
    return path


def spread_accuracy(completions, answer, **kwargs):
    """The demo's accuracy reward plus a spread below 0.001 from the completion's characters (ties are rare)."""
    from posttrain.rewards.builtin import accuracy

    return [r + (sum(map(ord, c)) % 997) / 997e3 for r, c in zip(accuracy(completions, answer=answer), completions)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--model", default=None, help="default: the demo's tiny model (posttrain demo builds it)")
    ap.add_argument("--hidden", type=int, default=None,
                    help="instead: a model of the demo's vocabulary at this hidden size (built once, in /tmp)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--staleness", type=int, default=-1, help="-1: synchronous")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--gens", type=int, default=8)
    ap.add_argument("--completion", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--forced", action="store_true",
                    help="the same work every step whatever the policy samples, for comparing step times: every "
                         "completion forced to --completion tokens (min_new_tokens), and the reward given a spread "
                         "below 0.001 (from the completion's characters) so that every row has a nonzero advantage "
                         "and trains (rows of advantage 0 are skipped)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from transformers import TrainerCallback

    from posttrain import GRPOConfig, GRPOTrainer
    from posttrain.demo import demo_dataset, demo_model_path

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_end(self, a, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    extra = {} if args.staleness < 0 else {"async_generation": True, "max_staleness": args.staleness}
    if args.forced:
        extra["generation_kwargs"] = {"min_new_tokens": args.completion}
    config = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="async-bench-"), max_steps=args.steps, seed=args.seed,
                        learning_rate=1e-3, lr_scheduler_type="constant", per_device_train_batch_size=args.batch,
                        num_generations=args.gens, max_completion_length=args.completion, logging_steps=1,
                        save_strategy="no", gradient_checkpointing=False, use_cpu=True, use_vllm=True,
                        vllm_mode="server", vllm_server_base_url=args.url, report_to="none", **extra)
    clock = Clock()
    model = args.model or (demo_vocabulary_model(args.hidden, args.layers) if args.hidden else demo_model_path())
    reward = spread_accuracy if args.forced else "accuracy"
    trainer = GRPOTrainer(model, reward, config, train_dataset=demo_dataset(),
                          callbacks=[clock])
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    trainer.close()
    records = [r for r in trainer.state.log_history if "reward" in r and "train_runtime" not in r]
    ends = [t - start for t in clock.ends]
    durations = [b - a for a, b in zip(ends, ends[1:])][1:]  # from the third step's on

    def mean(key):
        values = [r[key] for r in records if key in r]
        return round(sum(values) / len(values), 4) if values else None

    print(json.dumps({
        "staleness": args.staleness, "steps": args.steps, "batch": args.batch, "completion": args.completion,
        "forced": args.forced,
        "median_step_s": round(statistics.median(durations), 4), "wall_s": round(wall, 2),
        "step_end_s": [round(t, 3) for t in ends], "reward": [round(r["reward"], 4) for r in records],
        "staleness_mean": mean("async/staleness_mean"), "trainer_wait_s": mean("async/trainer_wait_s"),
        "generator_wait_s": mean("async/generator_wait_s"), "stale_dropped": mean("async/stale_dropped")}))


if __name__ == "__main__":
    main()
