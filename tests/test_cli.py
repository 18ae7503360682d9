import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]),
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def _write_data(tmp_path):
    path = tmp_path / "prompts.jsonl"
    with open(path, "w") as f:
        for a in range(4):
            for b in range(4):
                f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return path


def test_help_is_fast_and_version():
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "posttrain.cli", "--help"], capture_output=True, text=True, check=True)
    assert time.perf_counter() - start < 2.0 and "grpo" in out.stdout
    out = subprocess.run([sys.executable, "-m", "posttrain.cli", "--version"], capture_output=True, text=True)
    assert out.stdout.startswith("posttrain ")
    for name in os.listdir(os.path.join(ROOT, "posttrain", "configs")):
        if name.endswith(".py"):
            source = open(os.path.join(ROOT, "posttrain", "configs", name)).read()
            assert "import torch" not in source and "import transformers" not in source, name


def test_env_lists_versions():
    out = subprocess.run([sys.executable, "-m", "posttrain.cli", "env"], capture_output=True, text=True, check=True)
    for name in ("torch", "transformers", "accelerate", "peft", "vllm", "device"):
        assert name in out.stdout


def test_grpo_from_yaml_with_overrides(tmp_path, tiny_model_dir):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset_name: {_write_data(tmp_path)}\n"
                   "reward_funcs: [accuracy, length]\nper_device_train_batch_size: 8\nnum_generations: 4\n"
                   "max_completion_length: 4\nmax_steps: 5\ngradient_checkpointing: false\nuse_cpu: true\n")
    out = subprocess.run([sys.executable, "-m", "posttrain.cli", "grpo", "--config", str(cfg), "--output_dir",
                          str(tmp_path / "out"), "--max_steps", "2", "--logging_steps", "1", "--save_steps", "1"],
                         capture_output=True, text=True, env=_env())
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2] and "rewards/accuracy/mean" in records[0]
    assert (tmp_path / "out" / "checkpoint-1" / "model.safetensors").exists()
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_user_errors_are_one_sentence(tmp_path):
    out = subprocess.run([sys.executable, "-m", "posttrain.cli", "grpo", "--model_name_or_path", "./nope",
                          "--dataset_name", str(_write_data(tmp_path)), "--reward_funcs", "accuracy"],
                         capture_output=True, text=True, env=_env())
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "Model path './nope' does not exist" in out.stderr


@pytest.mark.multiproc
def test_two_processes_ddp_on_cpu(tmp_path, tiny_model_dir):
    """accelerate launch --num_processes 2: prompts sharded, rewards gathered before advantages."""
    logs = tmp_path / "logs"
    logs.mkdir()
    # `--cpu` would start one process: `--multi_gpu` is the torchrun launcher, and use_cpu makes it gloo on CPU.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "posttrain.cli", "grpo",
           "--model_name_or_path", tiny_model_dir, "--dataset_name", str(_write_data(tmp_path)),
           "--reward_funcs", "multiproc_rewards.recording_length_reward", "--per_device_train_batch_size", "4",
           "--num_generations", "4", "--max_completion_length", "6", "--max_steps", "2", "--logging_steps", "1",
           "--gradient_checkpointing", "false", "--use_cpu", "true", "--save_strategy", "no",
           "--output_dir", str(tmp_path / "out")]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(POSTTRAIN_TEST_LOG=str(logs)), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = [[json.loads(line) for line in open(logs / f"rank{r}.jsonl")] for r in (0, 1)]
    records = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert len(records) == 2  # written by the main process only
    for step in (0, 1):
        a, b = ranks[0][step], ranks[1][step]
        assert set(a["prompts"]).isdisjoint(b["prompts"])  # each process got its own group of prompts
        everyone = a["rewards"] + b["rewards"]
        # the logged reward is the mean over both processes' completions: rewards were gathered
        assert abs(records[step]["reward"] - sum(everyone) / len(everyone)) < 1e-5
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_reward_errors_are_reported_with_the_user_traceback(tmp_path, tiny_model_dir):
    (tmp_path / "bad_rewards.py").write_text("def broken(completions, **kw):\n    return 1 / 0\n")
    common = ["--model_name_or_path", tiny_model_dir, "--dataset_name", str(_write_data(tmp_path)),
              "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "4",
              "--max_steps", "1", "--gradient_checkpointing", "false", "--use_cpu", "true",
              "--output_dir", str(tmp_path / "out")]
    env = _env(PYTHONPATH=os.pathsep.join([str(tmp_path), TESTS]))
    out = subprocess.run([sys.executable, "-m", "posttrain.cli", "grpo", "--reward_funcs", "acuracy", *common],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 2 and "Did you mean accuracy?" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "posttrain.cli", "grpo", "--reward_funcs", "bad_rewards.broken",
                          *common], capture_output=True, text=True, env=env)
    assert out.returncode == 2
    assert "return 1 / 0" in out.stderr  # the user's own traceback
    assert "posttrain: error: Reward function 'broken' raised ZeroDivisionError at step 1" in out.stderr
