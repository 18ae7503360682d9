"""Dynamic sampling (DAPO, grpo/dynamic_sampling.py): groups whose rewards do not differ are dropped and further rounds
fill the batch before the optimizer step; the batch size never changes; a batch the data cannot fill stops the run in
one sentence; resume is exact; two processes train on the batch one process would."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import StopAt, tiny_config

from posttrain.configs import ConfigError
from posttrain.data import DataError
from posttrain.grpo.dynamic_sampling import groups_to_keep
from posttrain.grpo.trainer import GRPOTrainer
from posttrain.testing import tiny_model

TESTS = os.path.dirname(os.path.abspath(__file__))


def odd_only_reward(prompts, completions, **kwargs):
    """1.0 for every completion of a prompt whose first number is even (a group with nothing to learn); the
    completion's length otherwise."""
    return [1.0 if int(p[0]) % 2 == 0 else float(len(c)) for p, c in zip(prompts, completions)]


def keep_high_mean(rewards):
    """A user filter: groups whose mean reward is above 2."""
    return float(rewards.nanmean()) > 2.0


def _trainer(tokenizer, dataset, out, reward=odd_only_reward, callbacks=None, **overrides):
    values = dict(max_steps=3, dynamic_sampling=True, log_completions=True, beta=0.0)
    values.update(overrides)
    return GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), reward, tiny_config(out, **values),
                       train_dataset=dataset, processing_class=tokenizer, callbacks=callbacks)


def _steps(out) -> dict[int, list[dict]]:
    rows = [json.loads(line) for line in open(out / "out" / "completions.jsonl")]
    steps = {}
    for row in rows:
        steps.setdefault(row["step"], []).append(row)
    return steps


def test_groups_to_keep():
    weights = torch.ones(2)
    rewards = torch.tensor([[1.0, 0.0], [1.0, 0.0],      # equal: dropped
                            [1.0, 0.0], [0.0, 1.0],      # each function differs, totals equal: dropped
                            [1.0, 0.0], [2.0, 0.0],      # differ: kept
                            [math.nan, math.nan], [1.0, 0.0],  # a NaN total (a skipped group): dropped
                            [math.nan, 1.0], [math.nan, 3.0]])  # one function applies and differs: kept
    assert groups_to_keep(rewards, weights, 2).tolist() == [False, False, True, False, True]
    assert groups_to_keep(rewards, torch.tensor([1.0, 2.0]), 2).tolist() == [False, True, True, False, True]
    seen = []
    assert groups_to_keep(rewards, weights, 2, lambda g: seen.append(g.shape) or bool(g[0, 0] == 1.0)).tolist() == [
        True, True, True, False, False]
    assert seen == [torch.Size([2, 2])] * 5


def test_only_groups_whose_rewards_differ_fill_every_batch(tokenizer, addition_dataset, tmp_path):
    trainer = _trainer(tokenizer, addition_dataset, tmp_path)
    trainer.train()
    records = [r for r in trainer.state.log_history if "loss" in r]
    assert len(records) == 3
    batch = trainer.args.generation_batch_size  # 8 completions: 2 prompts x 4
    for step, rows in _steps(tmp_path).items():
        assert len(rows) == batch  # the batch size never changes
        for g in range(0, batch, 4):
            group = rows[g:g + 4]
            assert len({r["prompt"] for r in group}) == 1 and int(group[0]["prompt"][0]) % 2 == 1
            assert len({r["rewards"]["odd_only_reward"] for r in group}) > 1
    for r in records:
        assert r["frac_reward_zero_std"] == 0.0
        assert r["sampling/generation_rounds"] >= 1 and r["sampling/groups_filtered"] >= 0
    # the even prompts (half of them) are drawn and dropped: some batch needed a second round
    assert sum(r["sampling/groups_filtered"] for r in records) >= 2
    assert max(r["sampling/generation_rounds"] for r in records) >= 2
    assert trainer.rounds_consumed == sum(r["sampling/generation_rounds"] for r in records)


def test_a_user_filter_decides_which_groups_are_kept(tokenizer, addition_dataset, tmp_path):
    trainer = _trainer(tokenizer, addition_dataset, tmp_path, reward=lambda completions, **kw: [
        float(len(c)) for c in completions], dynamic_sampling_filter="test_dynamic_sampling.keep_high_mean",
        max_steps=2)
    trainer.train()
    for rows in _steps(tmp_path).values():
        for g in range(0, len(rows), 4):
            assert sum(r["rewards"]["<lambda>"] for r in rows[g:g + 4]) / 4 > 2.0
    assert trainer.args.to_dict()["dynamic_sampling_filter"] == "test_dynamic_sampling.keep_high_mean"


def test_a_batch_the_data_cannot_fill_stops_in_one_sentence(tokenizer, addition_dataset, tmp_path):
    trainer = _trainer(tokenizer, addition_dataset, tmp_path, reward=lambda completions, **kw: [1.0] * len(completions),
                       dynamic_sampling_max_rounds=3)
    with pytest.raises(DataError) as err:
        trainer.train()
    assert str(err.value) == (
        "dynamic_sampling: 3 generation rounds gave 0 of the 2 prompt groups a batch needs whose rewards differ "
        "(dynamic_sampling_max_rounds=3): raise dynamic_sampling_max_rounds, use prompts that are neither always "
        "solved nor never solved by the model, or set dynamic_sampling=False.")


def test_filter_settings_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="dynamic_sampling_filter is set but dynamic_sampling is False"):
        tiny_config(tmp_path, dynamic_sampling_filter="test_dynamic_sampling.keep_high_mean")
    with pytest.raises(ConfigError, match="dynamic_sampling_filter='nowhere.at_all' is not an importable function"):
        from posttrain.grpo.dynamic_sampling import resolve_filter

        resolve_filter("nowhere.at_all")


def test_resume_is_exact(tokenizer, addition_dataset, tmp_path):
    """A checkpoint inside a generation batch that took several rounds (16 completions per batch, 8 per step)."""
    overrides = dict(max_steps=4, save_strategy="steps", save_steps=1, generation_batch_size=16)
    straight = _trainer(tokenizer, addition_dataset, tmp_path / "a", **{**overrides, "save_strategy": "no"})
    straight.train()
    first = _trainer(tokenizer, addition_dataset, tmp_path / "b", callbacks=[StopAt(1)], **overrides)
    first.train()
    resumed = _trainer(tokenizer, addition_dataset, tmp_path / "b", **overrides)
    resumed.train(resume_from_checkpoint=True)
    a = dict(straight.policy.named_parameters())
    assert all(torch.equal(a[n], p) for n, p in resumed.policy.named_parameters())
    assert [r.get("loss") for r in straight.state.log_history] == [r.get("loss") for r in resumed.state.log_history]
    assert straight.rounds_consumed == resumed.rounds_consumed > 2


@pytest.mark.multiproc
def test_two_processes_train_on_the_batch_one_process_would(tmp_path, tiny_model_dir):
    """Filtering decided on the gathered rewards, the kept rows shared out again in order."""
    data = tmp_path / "prompts.jsonl"
    with open(data, "w") as f:
        for a in range(4):
            for b in range(4):
                f.write(json.dumps({"prompt": f"{a}+{b}="}) + "\n")
    common = ["grpo", "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(data), "--reward_funcs",
              "test_dynamic_sampling.odd_only_reward", "--dynamic_sampling", "true", "--num_generations", "4",
              "--max_completion_length", "8", "--max_steps", "3", "--logging_steps", "1", "--save_strategy", "no",
              "--gradient_checkpointing", "false", "--optim", "sgd", "--learning_rate", "0.5", "--use_cpu", "true",
              "--plot_on_end", "false", "--beta", "0.04"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    one = subprocess.run([sys.executable, "-m", "posttrain.cli", *common, "--per_device_train_batch_size", "8",
                          "--output_dir", str(tmp_path / "one")], capture_output=True, text=True, env=env, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", "0",
                          "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                          "--dynamo_backend", "no", "-m",
                          "posttrain.cli", *common, "--per_device_train_batch_size", "4", "--output_dir",
                          str(tmp_path / "two")], capture_output=True, text=True, env=env, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    records = [[json.loads(line) for line in open(tmp_path / run / "metrics.jsonl")] for run in ("one", "two")]
    assert len(records[0]) == len(records[1]) == 3
    for a, b in zip(*records):
        for key in ("loss", "reward", "kl", "sampling/generation_rounds", "sampling/groups_filtered",
                    "completions/mean_length"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    assert sum(r["sampling/groups_filtered"] for r in records[0]) >= 2
    from safetensors.torch import load_file

    w1, w2 = (load_file(tmp_path / run / "model.safetensors") for run in ("one", "two"))
    assert all(torch.allclose(w1[k], w2[k], rtol=1e-5, atol=1e-7) for k in w1)
