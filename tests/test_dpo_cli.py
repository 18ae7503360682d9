"""`posttrain dpo`: YAML and flags with TRL's names, mixtures, errors in one sentence, and 2 processes x 4 pairs
training like 1 x 8."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import run_posttrain
from test_cli import _env

from posttrain.cli import parse_dpo
from posttrain.configs import ConfigError


def _pairs(path, n=16, offset=0):
    with open(path, "w") as f:
        for i in range(n):
            a, b = divmod(i + offset, 4)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "chosen": str(a + b) * (1 + i % 3),
                                "rejected": str(a + b + 1)}) + "\n")
    return str(path)


def _in_process(capfd, *argv):
    """`posttrain dpo ARGV` in this process (conftest.run_posttrain): .returncode, .stderr."""
    return run_posttrain(["dpo", *argv], capfd)


def _run_cli(*argv, **env):
    return subprocess.run([sys.executable, "-m", "posttrain.cli", "dpo", *argv], capture_output=True, text=True,
                          env=_env(**env), timeout=600)


COMMON = ("--max_steps", "2", "--logging_steps", "1", "--use_cpu", "--gradient_checkpointing", "false",
          "--save_strategy", "no")


def test_dpo_from_yaml_with_a_mixture(tmp_path, tiny_model_dir, capfd):
    cfg = tmp_path / "dpo.yaml"
    cfg.write_text(f"model_name_or_path: {tiny_model_dir}\ndatasets:\n  - path: {_pairs(tmp_path / 'a.jsonl')}\n"
                   f"    fraction: 0.5\n  - path: {_pairs(tmp_path / 'b.jsonl', offset=16)}\n    fraction: 0.5\n"
                   "per_device_train_batch_size: 4\nlearning_rate: 1.0e-3\nloss_type: [sigmoid, sft]\n"
                   "loss_weights: [1.0, 0.5]\nld_alpha: 0.5\npadding_free: true\n")
    out = _in_process(capfd, "--config", str(cfg), "--output_dir", str(tmp_path / "out"), *COMMON)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2] and "rewards/margins" in records[0]
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_dpo_flags_and_errors_are_one_sentence(tmp_path, tiny_model_dir, capfd):
    script, lora, cfg = parse_dpo(["--model_name_or_path", "m", "--dataset_name", "d", "--use_peft", "--beta", "0.2",
                                   "--loss_type", "ipo", "--precompute_ref_log_probs"])
    assert cfg.loss_type == ["ipo"] and cfg.beta == 0.2 and cfg.precompute_ref_log_probs and lora.use_peft
    with pytest.raises(ConfigError, match=r"Unknown argument '--packing'"):
        parse_dpo(["--packing", "true"])  # an sft field is not a dpo one
    with pytest.raises(ConfigError, match=r"ld_alpha=2.0 must be in \[0, 1\]"):
        parse_dpo(["--ld_alpha", "2"])
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "chosen": "2"}) + "\n")
    out = _in_process(capfd, "--model_name_or_path", tiny_model_dir, "--dataset_name", str(data), "--output_dir",
                      str(tmp_path / "o"), *COMMON)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "is in no preference format: its columns are prompt, chosen" in out.stderr


@pytest.mark.multiproc
def test_two_processes_give_the_one_process_update(tmp_path, tiny_model_dir):
    """`posttrain dpo --accelerate_config multi_gpu --num_processes 2`: 2 processes x 4 pairs train like 1 x 8 (same
    loss, rewards, learning rate and final weights), with the reference precomputed across the processes."""
    from safetensors.torch import load_file

    data = _pairs(tmp_path / "d.jsonl")
    args = ("--model_name_or_path", tiny_model_dir, "--dataset_name", data, "--learning_rate", "1e-2",
            "--train_sampling_strategy", "sequential", "--max_steps", "2", "--logging_steps", "1", "--use_cpu",
            "--gradient_checkpointing", "false", "--save_strategy", "no", "--optim", "sgd",
            "--precompute_ref_log_probs", "--loss_type", "sigmoid", "sft")
    env = {"POSTTRAIN_CACHE": str(tmp_path / "cache")}
    one = _run_cli(*args, "--per_device_train_batch_size", "8", "--output_dir", str(tmp_path / "one"), **env)
    assert one.returncode == 0, one.stderr[-3000:]
    env = {"POSTTRAIN_CACHE": str(tmp_path / "cache2")}  # computed again, by two processes
    two = _run_cli(*args, "--per_device_train_batch_size", "4", "--accelerate_config", "multi_gpu",
                   "--num_processes", "2", "--output_dir", str(tmp_path / "two"), **env)
    assert two.returncode == 0, two.stderr[-3000:]
    logs = [[json.loads(line) for line in open(tmp_path / run / "metrics.jsonl")] for run in ("one", "two")]
    for a, b in zip(*logs):
        for key in ("loss", "rewards/margins", "logps/chosen", "num_tokens"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
        assert a["learning_rate"] == b["learning_rate"]
    w1, w2 = (load_file(tmp_path / run / "model.safetensors") for run in ("one", "two"))
    for name in w1:
        assert torch.allclose(w1[name], w2[name], rtol=1e-5, atol=1e-7), name
