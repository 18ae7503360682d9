"""TRL's GRPO documentation examples run here with only the import line changed.

Each example below is quoted from TRL's documentation (huggingface/trl, Apache-2.0; the page and section are named
above each), byte for byte except `from trl` -> `from posttrain`. Three things the offline machine needs are
substituted around the code, not in it: the hub model id becomes a local tiny model (a character-level tokenizer of
20 tokens, so completions end by themselves), `datasets.load_dataset` returns a small local dataset with the columns
of the hub dataset named, and helper functions a doc snippet leaves undefined are defined before it runs.
"""

import asyncio
import json
import os
import sys
import types

import pytest

# docs/source/grpo_trainer.md, "Quick start" (TRL 1.9 - 1.16)
QUICKSTART = '''
# train_grpo.py
from datasets import load_dataset
from trl import GRPOTrainer
from trl.rewards import accuracy_reward

dataset = load_dataset("trl-lib/DeepMath-103K", split="train")

trainer = GRPOTrainer(
    model="Qwen/Qwen2.5-0.5B-Instruct",
    reward_funcs=accuracy_reward,
    train_dataset=dataset,
)
trainer.train()
'''

# docs/source/grpo_trainer.md, "Quick start" (TRL 0.14 - 0.21): a custom reward and a GRPOConfig
QUICKSTART_REWARD_LEN = '''
# train_grpo.py
from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer

dataset = load_dataset("trl-lib/tldr", split="train")

# Define the reward function, which rewards completions that are close to 20 characters
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]

training_args = GRPOConfig(output_dir="Qwen2-0.5B-GRPO")
trainer = GRPOTrainer(
    model="Qwen/Qwen2-0.5B-Instruct",
    reward_funcs=reward_len,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
'''

# docs/source/grpo_trainer.md, "Quick start" (TRL 0.22 - 0.25): a conversational dataset
CONVERSATIONAL = '''
# train_grpo.py
from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer

dataset = load_dataset("trl-lib/ultrafeedback-prompt", split="train")

# Dummy reward function for demonstration purposes
def reward_num_unique_letters(completions, **kwargs):
    """Reward function that rewards completions with more unique letters."""
    completion_contents = [completion[0]["content"] for completion in completions]
    return [float(len(set(content))) for content in completion_contents]

training_args = GRPOConfig(output_dir="Qwen2-0.5B-GRPO")
trainer = GRPOTrainer(
    model="Qwen/Qwen2-0.5B-Instruct",
    reward_funcs=reward_num_unique_letters,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
'''

# docs/source/grpo_trainer.md, "Example 4: Multi-task reward functions"
MULTI_TASK = '''
from datasets import Dataset
from trl import GRPOTrainer

# Define a dataset that contains both math and coding problems
dataset = Dataset.from_list(
    [
        {"prompt": "What is 2+2?", "task": "math"},
        {"prompt": "Write a function that returns the sum of two numbers.", "task": "code"},
        {"prompt": "What is 3*4?", "task": "math"},
        {"prompt": "Write a function that returns the product of two numbers.", "task": "code"},
    ]
)

# Math-specific reward function
def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            # Calculate math-specific reward
            correct = check_math_solution(prompt, completion)
            reward = 1.0 if correct else -1.0
            rewards.append(reward)
        else:
            # Return None for non-math tasks
            rewards.append(None)
    return rewards

# Coding-specific reward function
def coding_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "coding":
            # Calculate coding-specific reward
            works = test_code_solution(prompt, completion)
            reward = 1.0 if works else -1.0
            rewards.append(reward)
        else:
            # Return None for non-coding tasks
            rewards.append(None)
    return rewards

# Use both task-specific reward functions
trainer = GRPOTrainer(
    model="Qwen/Qwen2.5-0.5B-Instruct",
    reward_funcs=[math_reward_func, coding_reward_func],
    train_dataset=dataset,
)

trainer.train()
'''

# docs/source/grpo_trainer.md, "Example 1: Reward longer completions", "Example 3: Reward completions based on a
# reference", "Example 5: Asynchronous reward functions", "Example 6: Logging extra columns and metrics", passed
# together as "Passing the reward function to the trainer" shows (reward_funcs=[reward_func, async_reward_func1, ...])
MULTI_REWARD = r'''
import re
import asyncio

def length_reward_func(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]

def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]

async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]

def logging_reward_func(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
    extracted = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
    extracted = [m.group(1) if m else None for m in extracted]
    rewards = [1.0 if e == gt else 0.0 for e, gt in zip(extracted, ground_truth)]

    if log_extra:
        log_extra("golden_answer", list(ground_truth))
        log_extra("extracted_answer", [e or "[none]" for e in extracted])

    if log_metric:
        log_metric("accuracy", sum(rewards) / len(rewards))

    return rewards

from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer

trainer = GRPOTrainer(
    model="Qwen/Qwen2.5-0.5B-Instruct",
    reward_funcs=[length_reward_func, reward_func, async_reward_func, logging_reward_func],
    args=GRPOConfig(output_dir="multi", reward_weights=[0.01, 1.0, 0.5, 1.0], max_steps=2, log_completions=True),
    train_dataset=load_dataset("trl-lib/boxed-answers", split="train"),
)
trainer.train()
'''

# docs/source/lora_without_regret.md, "Reinforcement Learning (GRPO)"
LORA = '''

from datasets import load_dataset
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer
from trl.rewards import reasoning_accuracy_reward

dataset = load_dataset("HuggingFaceH4/OpenR1-Math-220k-default-verified", split="train")

peft_config = LoraConfig(
    r=1,
    lora_alpha=32,
    target_modules="all-linear"
)

training_args = GRPOConfig(
    learning_rate=5e-5,
    per_device_train_batch_size=1,
    gradient_accumulation_steps=4,
    num_train_epochs=1,
    num_generations=8,
    generation_batch_size=8,
    report_to=["trackio"],
)

trainer = GRPOTrainer(
    model="Qwen/Qwen3-0.6B",
    reward_funcs=reasoning_accuracy_reward,
    args=training_args,
    train_dataset=dataset,
    peft_config=peft_config,
)

trainer.train()

'''


def _user(text):
    return [{"role": "user", "content": text}]


# The hub datasets the examples load, as small local stand-ins with the same columns.
DATASETS = {
    "trl-lib/DeepMath-103K": {"prompt": [_user("1+2"), _user("3+3")], "solution": ["3", "6"]},
    "trl-lib/tldr": {"prompt": ["post: a b c. tl;dr:", "post: 1 2 3. tl;dr:"]},
    "trl-lib/ultrafeedback-prompt": {"prompt": [_user("say abc"), _user("say 123")]},
    "trl-lib/boxed-answers": {"prompt": ["1+1=", "2+2=", "3+3=", "4+4="], "ground_truth": ["2", "4", "6", "8"]},
    "HuggingFaceH4/OpenR1-Math-220k-default-verified": {"prompt": [_user("1+1"), _user("2+1")],
                                                        "solution": ["2", "3"]},
}


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    """A tiny model whose tokenizer has 20 tokens: EOS is drawn about 1 token in 20, so completions end early."""
    from posttrain.testing import save_tiny, tiny_tokenizer

    path = str(tmp_path_factory.mktemp("tiny-small-vocab"))
    return save_tiny(path, tiny_tokenizer("0123456789+= abc{}\\", all_bytes=False), hidden=16, layers=1,
                     max_positions=1024)


@pytest.fixture
def offline(monkeypatch, tmp_path, small_vocab_model):
    """Run an example in tmp_path with the hub's models and datasets replaced by local ones."""
    import datasets

    def load_dataset(name, *args, split=None, **kwargs):
        return datasets.Dataset.from_dict(DATASETS[name])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.chdir(tmp_path)

    def run(source: str, **helpers) -> dict:
        code = source.replace("from trl import", "from posttrain import").replace(
            "from trl.rewards import", "from posttrain.rewards import")
        for model_id in ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2-0.5B-Instruct", "Qwen/Qwen3-0.6B"):
            code = code.replace(f'"{model_id}"', repr(small_vocab_model))
        namespace = {"__name__": "__example__", **helpers}
        exec(compile(code, "<trl example>", "exec"), namespace)
        return namespace

    return run


def _steps(trainer) -> list[dict]:
    return [r for r in trainer.state.log_history if "loss" in r]


def test_quickstart(offline):
    pytest.importorskip("math_verify")
    trainer = offline(QUICKSTART)["trainer"]
    # TRL's defaults: 8 completions per prompt, 8 per batch, 3 epochs of 2 prompts
    assert trainer.args.num_generations == 8 and trainer.state.global_step == 6
    assert all("rewards/accuracy_reward/mean" in r for r in _steps(trainer))
    # no args: TRL names the output directory after the model
    assert trainer.args.output_dir == os.path.basename(trainer.policy.config._name_or_path) + "-GRPO"
    assert os.path.exists(os.path.join(trainer.args.output_dir, "model.safetensors"))


def test_quickstart_with_a_custom_reward(offline):
    trainer = offline(QUICKSTART_REWARD_LEN)["trainer"]
    assert trainer.state.global_step == 6 and os.path.exists("Qwen2-0.5B-GRPO/model.safetensors")
    assert all(r["rewards/reward_len/mean"] <= 0 for r in _steps(trainer))


def test_conversational_dataset(offline):
    trainer = offline(CONVERSATIONAL)["trainer"]
    assert trainer.state.global_step == 6
    assert _steps(trainer)[-1]["rewards/reward_num_unique_letters/mean"] > 0


def test_multi_task_rewards_with_none(offline):
    # the doc leaves these two checks undefined; as in the doc, "code" rows never match "coding"
    trainer = offline(MULTI_TASK, check_math_solution=lambda prompt, completion: "4" in completion,
                      test_code_solution=lambda prompt, completion: True)["trainer"]
    records = _steps(trainer)
    assert trainer.state.global_step == 12  # 4 prompts, one per generation batch of 8, 3 epochs
    math_means = [r["rewards/math_reward_func/mean"] for r in records if "rewards/math_reward_func/mean" in r]
    # logged every 10 steps (TRL's logging_steps) and at the last: means over windows holding math prompts
    assert [r["step"] for r in records] == [10, 12] and len(math_means) == 2
    assert all(-1.0 <= m <= 1.0 for m in math_means)
    # coding_reward_func returns None for every row: its mean is left out (never NaN in the log)
    assert all("rewards/coding_reward_func/mean" not in r for r in records)


def test_several_rewards_async_logging_and_weights(offline):
    trainer = offline(MULTI_REWARD)["trainer"]
    last = _steps(trainer)[-1]
    for name in ("length_reward_func", "reward_func", "async_reward_func", "logging_reward_func"):
        assert f"rewards/{name}/mean" in last
    assert 0.0 <= last["accuracy"] <= 1.0  # log_metric
    rows = [json.loads(line) for line in open("multi/completions.jsonl")]
    assert {"golden_answer", "extracted_answer"} <= set(rows[0])  # log_extra


def test_lora_without_regret(offline, monkeypatch):
    pytest.importorskip("peft")
    pytest.importorskip("math_verify")
    logged = []  # report_to=["trackio"]: a stand-in module (the real one syncs to the Hub)
    trackio = types.SimpleNamespace(init=lambda **kw: logged.append(("init", kw["project"])),
                                    log=lambda record, step: logged.append(("log", step)),
                                    finish=lambda: logged.append(("finish",)))
    monkeypatch.setitem(sys.modules, "trackio", trackio)
    trainer = offline(LORA)["trainer"]
    assert type(trainer.policy).__name__.startswith("PeftModel")
    # 2 prompts x 8 completions, 1 per micro-batch, 4 micro-batches per step: 4 steps
    assert trainer.state.global_step == 4
    assert logged[0] == ("init", "huggingface") and ("log", 4) in logged and logged[-1] == ("finish",)
    assert os.path.exists(os.path.join(trainer.args.output_dir, "adapter_model.safetensors"))
