"""Dynamic sampling on the demo task: the sampled accuracy a run reaches for a fixed number of generated completions,
with and without it, and without it for as many optimizer steps as the dynamic run took (several seeds; one JSON
line per run, then one per setting with the mean).

    python bench/dynamic_sampling.py [--completions 19200] [--seeds 0 1 2]

The demo's model, data and config (posttrain/demo.py: 8 prompts x 8 completions per step, the `accuracy` reward);
each run stops once it has generated --completions completions (without dynamic sampling: that many / 64 steps; with
it, every generation round counts, kept or not), then samples 16 answers to each of the 25 prompts with the trained
model and reports the share that is correct. The reward logged during a dynamic-sampling run describes the kept
groups only, so the comparison is made on this common evaluation.
"""

import argparse
import json
import os
import statistics
import tempfile
import time


class StopAfterCompletions:
    """Stops training once the trainer has generated `budget` completions (every round counts)."""

    def __init__(self, budget: int):
        self.budget, self.trainer = budget, None

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer.rounds_consumed * args.generation_batch_size >= self.budget:
            control.should_training_stop = True


def run(dynamic: bool, seed: int, budget: int, out: str, steps: int | None = None) -> dict:
    """One demo run, stopped after `budget` generated completions (or after `steps` optimizer steps)."""
    import torch

    from posttrain.demo import MAX_DIGIT, demo_config, demo_dataset, demo_model_path, sampled_accuracy
    from posttrain.grpo.trainer import GRPOTrainer

    config = demo_config(out, max_steps=steps or 10 * budget // 64, seed=seed)
    config.dynamic_sampling = dynamic
    config.disable_tqdm = True
    config.plot_on_end = False
    stop = StopAfterCompletions(budget if steps is None else 10 ** 12)
    trainer = GRPOTrainer(demo_model_path(), "accuracy", config, train_dataset=demo_dataset(), callbacks=[stop])
    stop.trainer = trainer
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    prompts = [f"{x}+{y}=" for x in range(MAX_DIGIT + 1) for y in range(MAX_DIGIT + 1)]
    torch.manual_seed(1234)
    accuracy = statistics.mean(share for share, _ in sampled_accuracy(trainer, prompts))
    return {"dynamic_sampling": dynamic, "seed": seed, "generated_completions": trainer.rounds_consumed * 64,
            "optimizer_steps": trainer.state.global_step, "sampled_accuracy": round(accuracy, 4),
            "train_seconds": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--completions", type=int, default=19200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results = {"plain, same completions": [], "dynamic": [], "plain, same optimizer steps": []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:  # the settings interleaved
            for name in results:
                steps = results["dynamic"][-1]["optimizer_steps"] if name.endswith("steps") else None
                result = run(name == "dynamic", seed, args.completions, os.path.join(tmp, f"{len(results[name])}"
                                                                                          f"-{name[:5]}-{seed}"), steps)
                results[name].append(result)
                print(json.dumps({"setting": name, **result}), flush=True)
    for name, rows in results.items():
        print(json.dumps({"setting": name, "seeds": args.seeds,
                          "mean_generated_completions": statistics.mean(r["generated_completions"] for r in rows),
                          "mean_optimizer_steps": statistics.mean(r["optimizer_steps"] for r in rows),
                          "mean_sampled_accuracy": round(statistics.mean(r["sampled_accuracy"] for r in rows), 4)}),
              flush=True)


if __name__ == "__main__":
    main()
