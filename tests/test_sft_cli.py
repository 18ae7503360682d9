"""`posttrain sft`: YAML and flags, TRL's script names, dataset mixtures, accelerate's launch flags and relaunch."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import run_posttrain
from test_cli import _env

from posttrain.cli import parse_command, parse_sft
from posttrain.configs import ConfigError
from posttrain.launch import LAUNCH_FLAGS, SHIPPED, accelerate_config_path, split_launch_args


def _pairs(path, n=16, offset=0):
    with open(path, "w") as f:
        for i in range(n):
            a, b = divmod(i + offset, 4)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "completion": str(a + b), "note": "x"}) + "\n")
    return str(path)


def _in_process(capfd, *argv):
    """`posttrain sft ARGV` in this process (conftest.run_posttrain): .returncode, .stderr."""
    return run_posttrain(["sft", *argv], capfd)


def _run_cli(*argv, **env):
    return subprocess.run([sys.executable, "-m", "posttrain.cli", "sft", *argv], capture_output=True, text=True,
                          env=_env(**env), timeout=600)


COMMON = ("--max_steps", "2", "--logging_steps", "1", "--use_cpu", "--gradient_checkpointing", "false",
          "--save_strategy", "no")


def test_sft_from_yaml_with_trl_script_names(tmp_path, tiny_model_dir, capfd):
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset_name: {_pairs(tmp_path / 'd.jsonl')}\n"
                   "dataset_train_split: train\nper_device_train_batch_size: 4\nlearning_rate: 1.0e-3\n"
                   "packing: true\nmax_length: 32\nenv:\n  POSTTRAIN_TEST_MARK: '1'\n")
    out = _in_process(capfd, "--config", str(cfg), "--output_dir", str(tmp_path / "out"), *COMMON)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2] and "mean_token_accuracy" in records[0]
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_sft_flags_and_errors_are_one_sentence(tmp_path, tiny_model_dir, capfd):
    script, lora, cfg = parse_sft(["--model_name_or_path", "m", "--dataset_name", "d", "--use_peft", "--lora_r", "4",
                                   "--completion_only_loss", "false", "--packing_strategy", "bfd_split"])
    assert cfg.completion_only_loss is False and cfg.packing_strategy == "bfd_split" and lora.lora_r == 4
    with pytest.raises(ConfigError, match=r"Unknown argument '--reward_funcs'"):
        parse_sft(["--reward_funcs", "accuracy"])  # a grpo script field is not an sft one
    with pytest.raises(ConfigError, match=r"packing_strategy='bfdd' is not one of: bfd, bfd_split, wrapped"):
        parse_sft(["--packing_strategy", "bfdd"])
    with pytest.raises(ConfigError, match=r"Unknown argument '--num_processess'.*Did you mean num_processes\?"):
        parse_sft(["--num_processess", "2"])
    out = _in_process(capfd, "--model_name_or_path", tiny_model_dir, "--dataset_name", _pairs(tmp_path / "d.jsonl"),
                      "--max_length", "2", "--output_dir", str(tmp_path / "o"), *COMMON)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "no token left to train on after truncation to max_length=2" in out.stderr


def test_dataset_mixture_with_fractions_and_a_test_split(tmp_path):
    from posttrain.dataset_loading import load_mixture

    a, b = _pairs(tmp_path / "a.jsonl", 16), _pairs(tmp_path / "b.jsonl", 8, offset=100)
    train, test = load_mixture([{"path": a, "fraction": 3, "columns": ["prompt", "completion"]},
                                {"path": b, "fraction": 1, "columns": ["prompt", "completion"]}],
                               test_split_size=0.25, seed=0)
    # shares 3/4 and 1/4; the largest mixture taking no row twice is 16 / (3/4) = 21.3 rows: 16 + 5
    assert len(train) + len(test) == 21 and len(test) == 6 and "note" not in train.column_names
    again, _ = load_mixture([{"path": a, "fraction": 3}, {"path": b, "fraction": 1}], test_split_size=0.25, seed=0)
    assert train["prompt"] == again["prompt"]  # the split is seeded
    with pytest.raises(ConfigError, match="fraction is set on some datasets entries and not others"):
        parse_sft(["--datasets", json.dumps({"path": a, "fraction": 1}), json.dumps({"path": b})])


def test_mixture_from_yaml_trains(tmp_path, tiny_model_dir, capfd):
    cfg = tmp_path / "mix.yaml"
    cfg.write_text(f"model_name_or_path: {tiny_model_dir}\ndatasets:\n  - path: {_pairs(tmp_path / 'a.jsonl')}\n"
                   f"    fraction: 0.5\n  - path: {_pairs(tmp_path / 'b.jsonl', offset=16)}\n    fraction: 0.5\n"
                   "per_device_train_batch_size: 8\n")
    out = _in_process(capfd, "--config", str(cfg), "--output_dir", str(tmp_path / "out"), *COMMON)
    assert out.returncode == 0, out.stderr[-3000:]


def test_launch_flags_exist_in_accelerate_and_are_split_off():
    from accelerate.commands.launch import launch_command_parser

    theirs = {opt.lstrip("-").replace("-", "_") for a in launch_command_parser()._actions for opt in a.option_strings}
    assert set(LAUNCH_FLAGS) <= theirs
    launch, rest = split_launch_args(["--num_processes", "2", "--max_steps", "3", "--multi_gpu",
                                      "--accelerate_config", "multi_gpu", "--main_process_port=1234"])
    assert rest == ["--max_steps", "3"]
    assert launch == ["--num_processes", "2", "--multi_gpu", "--config_file", accelerate_config_path("multi_gpu"),
                      "--main_process_port=1234"]
    for name in SHIPPED:
        assert os.path.isfile(accelerate_config_path(name))
    with pytest.raises(ConfigError, match="accelerate_config 'zero9' is neither a shipped config"):
        accelerate_config_path("zero9")
    *_, launch = parse_command("sft", ["--config", _yaml_with_launch_keys()])
    assert launch[:2] == ["--config_file", accelerate_config_path("multi_gpu")] and "--num_processes" in launch


def _yaml_with_launch_keys():
    import tempfile

    path = os.path.join(tempfile.mkdtemp(), "c.yaml")
    with open(path, "w") as f:
        f.write("accelerate_config: multi_gpu\nnum_processes: 2\nmax_steps: 3\n")
    return path


def test_a_sharded_launch_that_would_not_shard_is_refused_in_one_sentence(tmp_path, tiny_model_dir):
    """accelerate drops FSDP on a CPU (use_cpu): the run would silently be unsharded, so it stops before loading."""
    out = _run_cli("--model_name_or_path", tiny_model_dir, "--dataset_name", _pairs(tmp_path / "d.jsonl"),
                   "--output_dir", str(tmp_path / "o"), *COMMON, ACCELERATE_USE_FSDP="true")
    lines = [line for line in out.stderr.splitlines() if line.startswith("posttrain:")]
    assert out.returncode == 2 and lines == [
        "posttrain: error: This run was launched with FSDP, but accelerate set up a single process instead, as it "
        "does on a machine without a GPU or with use_cpu=True, so nothing would be sharded: run it on GPUs without "
        "use_cpu, or launch with DDP (accelerate_config multi_gpu)."], out.stderr[-2000:]


@pytest.mark.multiproc
def test_two_processes_give_the_one_process_update(tmp_path, tiny_model_dir):
    """`posttrain sft --accelerate_config multi_gpu --num_processes 2`: 2 processes x 4 rows train like 1 x 8 (same
    loss, learning rate and final weights)."""
    from safetensors.torch import load_file

    data = _pairs(tmp_path / "d.jsonl")
    args = ("--model_name_or_path", tiny_model_dir, "--dataset_name", data, "--learning_rate", "1e-3",
            "--train_sampling_strategy", "sequential", "--max_steps", "2", "--logging_steps", "1", "--use_cpu",
            "--gradient_checkpointing", "false", "--save_strategy", "no", "--optim", "sgd")
    one = _run_cli(*args, "--per_device_train_batch_size", "8", "--output_dir", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-3000:]
    two = _run_cli(*args, "--per_device_train_batch_size", "4", "--accelerate_config", "multi_gpu",
                   "--num_processes", "2", "--output_dir", str(tmp_path / "two"))
    assert two.returncode == 0, two.stderr[-3000:]
    logs = [[json.loads(line) for line in open(tmp_path / run / "metrics.jsonl")] for run in ("one", "two")]
    for a, b in zip(*logs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["learning_rate"] == b["learning_rate"]
        assert a["num_tokens"] == b["num_tokens"]
    w1, w2 = (load_file(tmp_path / run / "model.safetensors") for run in ("one", "two"))
    for name in w1:
        assert torch.allclose(w1[name], w2[name], rtol=1e-5, atol=1e-7), name
