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
    return os.path.join(root, "demo-model-v1")


def demo_model_path() -> str:
    """Build (once) and return the directory of the demo's tiny model and tokenizer."""
    from posttrain.testing import save_tiny, tiny_tokenizer

    path = cache_dir()
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        tmp = f"{path}.tmp-{os.getpid()}"
        save_tiny(tmp, tiny_tokenizer(DEMO_CHARS), seed=0, hidden=64, layers=2, max_positions=64)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.replace(tmp, path)  # atomic: a concurrent or killed build never leaves half a model
    return path


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


def greedy_answers(model, tokenizer, prompts: list[str]) -> list[str]:
    """The model's most likely completion of each prompt (for the before/after table)."""
    import torch

    model.eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
            gen = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            out.append(tokenizer.decode(gen[0, ids.size(1):], skip_special_tokens=True))
    model.train()
    return out


def summarize(history: list[dict]) -> dict:
    """Mean reward over the first and the last 10% of steps."""
    rewards = [r["reward"] for r in history if "reward" in r]
    k = max(1, len(rewards) // 10)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    return {"reward_first_10pct": round(first, 4), "reward_last_10pct": round(last, 4),
            "reward_gain": round(last - first, 4), "steps": len(rewards)}


def run_demo(output_dir: str = "posttrain-demo", max_steps: int = 1200, seed: int = 0) -> dict:
    """Train the demo and print a before/after summary; returns the summary (also in metrics.jsonl)."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from posttrain.grpo.trainer import GRPOTrainer

    torch.set_num_threads(min(os.cpu_count() or 1, 4))
    console = Console()
    path = demo_model_path()
    console.print(f"[bold]posttrain demo[/]: GRPO on '{MAX_DIGIT}+{MAX_DIGIT}'-style addition, tiny model at {path}")
    trainer = GRPOTrainer(path, "accuracy", demo_config(output_dir, max_steps, seed), train_dataset=demo_dataset())
    probes = ["1+2=", "3+4=", "4+4=", "0+3="]
    before = greedy_answers(trainer.policy, trainer.tokenizer, probes)
    start = time.perf_counter()
    trainer.train()
    summary = summarize(trainer.state.log_history)
    summary["train_seconds"] = round(time.perf_counter() - start, 1)
    after = greedy_answers(trainer.policy, trainer.tokenizer, probes)
    if trainer.accelerator.is_main_process:
        trainer.logger.write({"summary": summary})
        table = Table(title="Greedy answers before and after GRPO")
        for col in ("prompt", "before", "after", "correct"):
            table.add_column(col)
        for p, b, a in zip(probes, before, after):
            table.add_row(p, repr(b), repr(a), str(eval(p[:-1])))
        console.print(table)
        console.print(f"mean reward, first 10% of steps: {summary['reward_first_10pct']:.3f}   "
                      f"last 10%: {summary['reward_last_10pct']:.3f}   gain: {summary['reward_gain']:+.3f}   "
                      f"({summary['train_seconds']} s)")
        console.print(f"metrics: {os.path.join(output_dir, 'metrics.jsonl')}   model: {output_dir}")
    return summary


def main(argv=None):
    run_demo(**(argv or {}))
    return 0


if __name__ == "__main__":
    print(json.dumps(run_demo()))
