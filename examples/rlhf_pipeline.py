"""The RLHF pipeline end to end on CPU, through the command line: SFT -> reward model -> RLOO against it.

    python examples/rlhf_pipeline.py [--output-dir rlhf-pipeline] [--sft-steps 150] [--reward-steps 800]
                                     [--rloo-steps 600] [--trainer rloo|grpo]

The task: say the first digit of a number ("472:" -> "4"). Each stage is one `posttrain` command reading the previous
stage's output directory, as a user chains `trl sft`, `trl reward` and `trl rloo`:

1. `posttrain sft`: a random 2-layer, 64-wide model learns the answer's format (a digit, then the end of the text)
   from rows whose answers are random digits, so it knows how to answer but not what: about one answer in ten is
   right.
2. `posttrain reward` from the SFT model's directory: preference pairs on 240 numbers, the right digit chosen and
   rejected each other digit, no answer, and the right digit with another after it (the answers a policy drifts to
   when its reward model never saw them); pairs on 60 other numbers are held out and evaluated before training and
   after. The EOS is its pad token, so that the reward is read at the answer's last character both here and when
   RLOO scores completions (which carry no EOS).
3. `posttrain rloo` (or `grpo`) from the SFT model's directory with `--reward_model_name_or_path` the reward model:
   the policy is paid by the reward model alone, and learns to give the answers it prefers.

It prints the reward model's held-out accuracy before and after, and the policy's reward (and its sampled answers'
accuracy by exact match, which the policy never sees: the accuracy reward at weight 0) over the first and the last
10 steps. Each stage's run draws its curves and its report as every posttrain run does: OUTPUT_DIR/<stage>/plots.png
and report.html. About a minute and a half on 2 CPU cores.
"""

import argparse
import json
import os
import random
import subprocess
import sys


def answer(prompt: str) -> str:
    """The task: the first digit of the prompt's number ("472:" -> "4")."""
    return prompt[0]


def datasets(out: str) -> dict:
    """The stages' data files: SFT rows whose answers are random digits; reward pairs on 240 numbers for training
    and 60 others held out, the right digit chosen and rejected each other digit, no answer, and the right digit with
    one more after it; the RL prompts (the training numbers)."""
    from datasets import Dataset, DatasetDict
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()  # no "Saving the dataset" bars between the stages' lines

    rng = random.Random(0)
    numbers = rng.sample(range(100, 1000), 300)
    train, held_out = [f"{n}:" for n in numbers[:240]], [f"{n}:" for n in numbers[240:]]

    def pairs(prompts: list[str]) -> list[dict]:
        return [{"prompt": p, "chosen": answer(p), "rejected": wrong} for p in prompts
                for wrong in [d for d in "0123456789" if d != answer(p)] + ["", answer(p) + rng.choice("0123456789")]]

    sft = [{"prompt": p, "completion": str(rng.randrange(10))} for p in train]
    directory = os.path.join(out, "pairs")  # a train and a test split: the command line evaluates on the test one
    DatasetDict({"train": Dataset.from_list(pairs(train)), "test": Dataset.from_list(pairs(held_out))}).save_to_disk(
        directory)
    return {"sft": write_jsonl(os.path.join(out, "sft.jsonl"), sft), "pairs": directory,
            "prompts": write_jsonl(os.path.join(out, "prompts.jsonl"), [{"prompt": p, "answer": answer(p)}
                                                                        for p in train])}


def write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def base_model(path: str) -> str:
    from posttrain.testing import save_tiny, tiny_tokenizer

    return save_tiny(path, tiny_tokenizer(all_bytes=False), seed=0, hidden=64, layers=2, max_positions=128)


def posttrain(*argv: str) -> None:
    """One `posttrain` command, as a user runs it."""
    subprocess.run([sys.executable, "-m", "posttrain.cli", *argv], check=True)


def records(directory: str) -> list[dict]:
    with open(os.path.join(directory, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return sum(values) / max(len(values), 1)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="rlhf-pipeline")
    parser.add_argument("--sft-steps", type=int, default=150)
    parser.add_argument("--reward-steps", type=int, default=800)
    parser.add_argument("--rloo-steps", type=int, default=600)
    parser.add_argument("--trainer", choices=("rloo", "grpo"), default="rloo")
    args = parser.parse_args(argv)
    out = os.path.abspath(args.output_dir)
    os.makedirs(out, exist_ok=True)
    data = datasets(out)
    common = ["--use_cpu", "true", "--report_to", "none", "--save_strategy", "no", "--seed", "0", "--quiet"]
    sft, reward, policy = (os.path.join(out, name) for name in ("sft", "reward", args.trainer))

    posttrain("sft", "--model_name_or_path", base_model(os.path.join(out, "base")), "--dataset_name", data["sft"],
              "--output_dir", sft, "--max_steps", str(args.sft_steps), "--per_device_train_batch_size", "16",
              "--learning_rate", "3e-3", "--logging_steps", "10", *common)
    posttrain("reward", "--model_name_or_path", sft, "--dataset_name", data["pairs"], "--output_dir", reward,
              "--max_steps", str(args.reward_steps), "--per_device_train_batch_size", "16", "--learning_rate", "3e-3",
              "--logging_steps", "10", "--eval_strategy", "steps", "--eval_steps", str(args.reward_steps),
              "--eval_on_start", "true", "--per_device_eval_batch_size", "100", "--pad_token", "<|im_end|>", *common)
    posttrain(args.trainer, "--model_name_or_path", sft, "--dataset_name", data["prompts"],
              "--reward_model_name_or_path", reward, "--reward_funcs", "accuracy", "--reward_weights", "1", "0",
              "--output_dir", policy, "--max_steps", str(args.rloo_steps), "--per_device_train_batch_size", "32",
              "--num_generations", "8", "--max_completion_length", "2", "--learning_rate", "1e-3",
              *(["--normalize_advantages", "true"] if args.trainer == "rloo" else []),
              "--logging_steps", "1", "--log_completions", "true", *common)

    evaluations = [r for r in records(reward) if "eval_accuracy" in r]
    steps = [r for r in records(policy) if "reward" in r]
    result = {"reward_model_held_out_accuracy": (evaluations[0]["eval_accuracy"], evaluations[-1]["eval_accuracy"]),
              "policy_reward": (mean(steps[:10], "reward"), mean(steps[-10:], "reward")),
              "policy_accuracy": (mean(steps[:10], "rewards/accuracy/mean"), mean(steps[-10:], "rewards/accuracy/mean"))}
    print(f"reward model, held-out accuracy: {result['reward_model_held_out_accuracy'][0]:.2f} before training, "
          f"{result['reward_model_held_out_accuracy'][1]:.2f} after")
    print(f"{args.trainer}, reward from the reward model: {result['policy_reward'][0]:.2f} over the first 10 steps, "
          f"{result['policy_reward'][1]:.2f} over the last 10 (answers right: {result['policy_accuracy'][0]:.0%} -> "
          f"{result['policy_accuracy'][1]:.0%})")
    drawn = [os.path.join(s, name) for s in (sft, reward, policy) for name in ("plots.png", "report.html")
             if os.path.exists(os.path.join(s, name))]
    print(f"curves and reports: {', '.join(drawn)}")
    return result


if __name__ == "__main__":
    main()
