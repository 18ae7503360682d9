"""`posttrain demo`: GRPO teaches a tiny random model single-digit addition, on CPU, in about a minute.

The model (a 2-layer Qwen2 with a 17-token character vocabulary, random weights) and its tokenizer are
built offline once and cached. The task: prompts "a+b=" for a, b in 0..4; the built-in `accuracy` reward
gives 1 when the completion's number equals a + b. A random model is right about 1 time in 13; to do
better it must learn which digit each of the 25 prompts asks for: real learning, not a reward that
rises by construction.
"""

import json
import os
import time

DEMO_CHARS = "0123456789+= "
MAX_DIGIT = 4


def cache_dir() -> str:
    root = os.environ.get("POSTTRAIN_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "posttrain"))
    return os.path.join(root, "demo-model-v2")  # v2: byte-level tokens, which survive reloading by path


def demo_model_path() -> str:
    """Build (once) and return the directory of the demo's tiny model and tokenizer."""
    from posttrain.models.loading import without_progress_bars
    from posttrain.testing import save_tiny, tiny_tokenizer

    path = cache_dir()
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path

    def build(where: str) -> None:
        with without_progress_bars():  # no "Writing model shards" bar
            save_tiny(where, tiny_tokenizer(DEMO_CHARS, all_bytes=False), seed=0, hidden=64, layers=2,
                      max_positions=64)

    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        build(tmp)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.replace(tmp, path)  # atomic: a concurrent or killed build never leaves half a model
        return path
    except OSError as err:  # a read-only or full HOME: the demo still runs, from a model built for this run only
        import shutil
        import tempfile

        from posttrain.errors import storage_error

        shutil.rmtree(tmp, ignore_errors=True)
        try:
            elsewhere = tempfile.mkdtemp(prefix="posttrain-demo-model-")
            build(elsewhere)
        except OSError as again:
            raise storage_error(again, "build the demo's model in", tempfile.gettempdir(),
                                fix="set POSTTRAIN_CACHE to a writable directory") from None
        reason = str(storage_error(err, "cache the demo's model at", os.path.dirname(path))).split(". ")[0]
        print(f"posttrain: {reason}; built it in {elsewhere} for this run (set POSTTRAIN_CACHE to a writable "
              "directory to keep it).", flush=True)
        return elsewhere


def demo_dataset():
    from datasets import Dataset

    pairs = [(a, b) for a in range(MAX_DIGIT + 1) for b in range(MAX_DIGIT + 1)]
    return Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in pairs], "answer": [str(a + b) for a, b in pairs]})


def demo_config(output_dir: str, max_steps: int, seed: int):
    from posttrain.configs import GRPOConfig

    return GRPOConfig(output_dir=output_dir, max_steps=max_steps, seed=seed, learning_rate=1e-3,
                      lr_scheduler_type="constant", per_device_train_batch_size=64, num_generations=8,
                      max_completion_length=3, logging_steps=1, save_strategy="no", gradient_checkpointing=False,
                      use_cpu=True)


def _sum_of(prompt: str) -> int:
    """The answer to a demo prompt "a+b=": a + b."""
    return sum(int(x) for x in prompt.rstrip("=").split("+"))


def sampled_accuracy(trainer, prompts: list[str], samples: int = 16) -> list[tuple[float, str]]:
    """For each prompt: the share of `samples` sampled completions that the reward scores correct,
    and the most common answer, drawn with the trainer's own generator (what GRPO trains)."""
    from collections import Counter

    from posttrain.rewards import reward_inputs
    from posttrain.rewards.builtin import accuracy, extract_answer

    out = []
    for prompt in prompts:
        ids = trainer.tokenizer(prompt, add_special_tokens=False).input_ids
        _, texts, _ = reward_inputs(trainer.tokenizer, trainer.generator.generate([ids] * samples), False)
        correct = accuracy(texts, answer=[str(_sum_of(prompt))] * samples)
        common = Counter(extract_answer(t) or "-" for t in texts).most_common(1)[0][0]
        out.append((sum(correct) / samples, common))
    return out


def _grid(results: list[tuple[float, str]]):
    from rich.table import Table

    table = Table()
    table.add_column("a \\ b")
    for y in range(MAX_DIGIT + 1):
        table.add_column(str(y), justify="right")
    for x in range(MAX_DIGIT + 1):
        row = results[x * (MAX_DIGIT + 1):(x + 1) * (MAX_DIGIT + 1)]
        table.add_row(str(x), *(f"{share:.0%}" for share, _ in row))
    return table


def summarize(history: list[dict]) -> dict:
    """Mean reward over the first and the last 10% of steps (the end-of-training summary, which repeats the last
    window's, is not a step)."""
    rewards = [r["reward"] for r in history if "reward" in r and "train_runtime" not in r]
    k = max(1, len(rewards) // 10)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    return {"reward_first_10pct": round(first, 4), "reward_last_10pct": round(last, 4),
            "reward_gain": round(last - first, 4), "steps": len(rewards)}


def run_demo(output_dir: str = "posttrain-demo", max_steps: int = 1200, seed: int = 0) -> dict:
    """Train the demo and print a before/after summary; returns the summary (also in metrics.jsonl)."""
    import torch

    threads = torch.get_num_threads()
    # One thread, unless the user chose a count: the tiny model's operations are too small for a second thread to pay
    # (the same time on a quiet 2-core machine), and beside other work it would spin against it (2.6x slower measured
    # beside one busy process)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    try:
        return _train_and_show(output_dir, max_steps, seed)
    finally:
        torch.set_num_threads(threads)  # the caller's setting, as it was


def _report_again(trainer) -> None:
    """report.html again, now that the final summary holds the sampled accuracy (the curves as drawn at the end)."""
    import importlib.util

    if trainer.args.plot_on_end is not False and importlib.util.find_spec("matplotlib") is not None:
        from posttrain.report import write_report

        write_report(trainer.args.output_dir)


def _train_and_show(output_dir: str, max_steps: int, seed: int) -> dict:
    from rich.console import Console

    from posttrain.grpo.trainer import GRPOTrainer
    from posttrain.training.logging import hide_deepspeed_cpu_notice

    console = Console()
    hide_deepspeed_cpu_notice()  # building the model (first run) imports DeepSpeed too, when installed
    path = demo_model_path()
    console.print(f"[bold]posttrain demo[/]: GRPO on '{MAX_DIGIT}+{MAX_DIGIT}'-style addition", highlight=False)
    console.print(f"tiny model: {path}", highlight=False)
    trainer = GRPOTrainer(path, "accuracy", demo_config(output_dir, max_steps, seed), train_dataset=demo_dataset())
    prompts = [f"{x}+{y}=" for x in range(MAX_DIGIT + 1) for y in range(MAX_DIGIT + 1)]
    before = sampled_accuracy(trainer, prompts)
    start = time.perf_counter()
    trainer.train()
    summary = summarize(trainer.state.log_history)
    summary["train_seconds"] = round(time.perf_counter() - start, 1)
    after = sampled_accuracy(trainer, prompts)
    summary["sampled_accuracy_before"] = round(sum(share for share, _ in before) / len(before), 4)
    summary["sampled_accuracy_after"] = round(sum(share for share, _ in after) / len(after), 4)
    # into all_results.json, and the report written again with it: its headline is the sampled accuracy's change
    trainer.save_metrics("demo", {k: summary[k] for k in ("sampled_accuracy_before", "sampled_accuracy_after")})
    if trainer.accelerator.is_main_process:
        trainer.logger.write({"summary": summary})
        _report_again(trainer)
        console.print("After GRPO, the share of 16 sampled answers that are right (row a + column b):",
                      highlight=False)
        console.print(_grid(after))
        console.print(f"sampled accuracy over all 25 prompts: before {summary['sampled_accuracy_before']:.0%}, "
                      f"after {summary['sampled_accuracy_after']:.0%}", highlight=False)
        console.print(f"mean reward: first 10% of steps {summary['reward_first_10pct']:.3f}, last 10% "
                      f"{summary['reward_last_10pct']:.3f} ({summary['reward_gain']:+.3f}) in "
                      f"{summary['train_seconds']:.0f} s", highlight=False)
    return summary


if __name__ == "__main__":
    print(json.dumps(run_demo()))
