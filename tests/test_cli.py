import json
import re
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

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
                          str(tmp_path / "out"), "--max_steps", "2", "--logging_steps", "1", "--save_steps", "1",
                          "--reward_weights", "1.0", "0.5"],  # numbers from flags (they once arrived as strings)
                         capture_output=True, text=True, env=_env())
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2] and "rewards/accuracy/mean" in records[0]
    assert yaml.safe_load((tmp_path / "out" / "posttrain_config.yaml").read_text())["reward_weights"] == [1.0, 0.5]
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


def test_a_trl_config_file_runs_unchanged(tmp_path, tiny_model_dir):
    """A YAML written for `trl grpo`: TRL's field names (some at values posttrain only accepts), TRL's reward names,
    fractional logging and evaluation on the dataset's test split."""
    from datasets import Dataset, DatasetDict

    rows = {"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)],
            "solution": [str(a + b) for a in range(4) for b in range(4)]}
    DatasetDict({"train": Dataset.from_dict(rows), "test": Dataset.from_dict(rows).select(range(2))}).save_to_disk(
        str(tmp_path / "data"))
    cfg = tmp_path / "trl.yaml"
    cfg.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset_name: {tmp_path / 'data'}\n"
                   "reward_funcs: [think_format_reward, get_soft_overlong_punishment]\n"
                   "per_device_train_batch_size: 8\nnum_generations: 4\nmax_completion_length: 4\nmax_steps: 2\n"
                   "logging_steps: 0.5\neval_strategy: steps\neval_steps: 2\nper_device_eval_batch_size: 4\n"
                   "use_vllm: false\nvllm_mode: colocate\nbf16: false\nuse_liger_kernel: false\n"
                   "dataloader_num_workers: 2\nreport_to: none\nrun_name: trl-style\noptim: adamw_torch\n"
                   "lr_scheduler_type: cosine\nwarmup_steps: 0.1\ngradient_checkpointing: false\nuse_cpu: true\n"
                   "save_strategy: 'no'\nlog_completions: true\nnum_completions_to_print: 2\n")
    out = subprocess.run([sys.executable, "-m", "posttrain.cli", "grpo", "--config", str(cfg), "--output_dir",
                          str(tmp_path / "out")], capture_output=True, text=True, env=_env())
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert "rewards/think_format_reward/mean" in records[0]
    assert "rewards/soft_overlong_punishment_reward/mean" in records[0]
    assert [r["step"] for r in records if "eval_loss" in r] == [2]
    assert "Completions at step 2" in out.stderr  # log_completions prints a sample at each logging step


@pytest.mark.parametrize("flags,message", [
    (["--use_vllm", "true", "--max_completion_length", "8"],
     "vllm_mode='colocate' needs the optional package 'vllm': install it with `pip install 'posttrain[vllm]'`"),
    (["--torch_compile", "true"], "torch_compile=True is not supported"),
    (["--eval_strategyy", "steps"], "Unknown argument '--eval_strategyy'. Did you mean eval_strategy?"),
    (["--evaluate_every", "5"], "Unknown argument '--evaluate_every'. `posttrain grpo --help`"),
    (["--eval_strategy", "steps"], "Evaluation needs a 'test' split, and the single file"),
])
def test_trl_flags_are_honoured_or_refused_in_one_sentence(tmp_path, tiny_model_dir, flags, message):
    out = subprocess.run([sys.executable, "-m", "posttrain.cli", "grpo", "--model_name_or_path", tiny_model_dir,
                          "--dataset_name", str(_write_data(tmp_path)), "--reward_funcs", "accuracy",
                          "--per_device_eval_batch_size", "8", "--use_cpu", "true", *flags],
                         capture_output=True, text=True, env=_env())
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert message in out.stderr and out.stderr.count("posttrain: error:") == 1
    assert "Did you mean save_strategy" not in out.stderr


@pytest.mark.multiproc
def test_a_failed_push_reaches_both_processes(tmp_path, tiny_model_dir):
    """push_to_hub runs on the main process and fails there (no token): the other process is told the same
    sentence instead of waiting for it, and both go on to finish."""
    env = _env(HF_HOME=str(tmp_path / "hf"))
    env.pop("HF_TOKEN", None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           os.path.join(TESTS, "multiproc_push.py"), tiny_model_dir, str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    told = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert told[0].startswith("push_to_hub needs a Hugging Face token and network access")
    assert told[1] == f"on process 0: {told[0]}"  # told by the process that failed


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_at_the_step_with_a_checkpoint_and_one_line(tmp_path, tiny_model_dir, signum):
    from safetensors.torch import load_file

    common = ["--model_name_or_path", tiny_model_dir, "--dataset_name", str(_write_data(tmp_path)),
              "--reward_funcs", "length", "--per_device_train_batch_size", "8", "--num_generations", "4",
              "--max_completion_length", "6", "--max_steps", "40", "--logging_steps", "1", "--save_strategy", "no",
              "--gradient_checkpointing", "false", "--use_cpu", "true"]
    run = [sys.executable, "-m", "posttrain.cli", "grpo", *common]
    out = tmp_path / "interrupted"
    proc = subprocess.Popen([*run, "--output_dir", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env())
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.read_text().strip()) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, stderr[-2000:]
    step = len(metrics.read_text().splitlines())
    lines = [line for line in stderr.splitlines() if line.startswith("posttrain:")]
    assert lines == [f"posttrain: Interrupted ({signal.Signals(signum).name}) at step {step} of 40; the newest "
                     f"checkpoint is {out}/checkpoint-{step}: resume with resume_from_checkpoint=true."]
    assert step < 40 and "Traceback" not in stderr
    resumed = subprocess.run([*run, "--output_dir", str(out), "--resume_from_checkpoint", "true"],
                             capture_output=True, text=True, env=_env())
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    straight = subprocess.run([*run, "--output_dir", str(tmp_path / "straight")], capture_output=True, text=True,
                              env=_env())
    assert straight.returncode == 0
    a, b = load_file(out / "model.safetensors"), load_file(tmp_path / "straight" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # interrupted and resumed = never interrupted


def test_the_terminal_without_a_tty_shows_what_to_watch_and_nothing_else(tmp_path, tiny_model_dir):
    """Without a terminal: one line per logging step with GRPO's reward and its moving average (not the loss, about
    0 on-policy), the elapsed time and the time left; no per-save or per-load progress bars. --quiet: nothing."""
    base = [sys.executable, "-m", "posttrain.cli", "grpo", "--model_name_or_path", tiny_model_dir, "--dataset_name",
            str(_write_data(tmp_path)), "--reward_funcs", "length", "--per_device_train_batch_size", "8",
            "--num_generations", "4", "--max_completion_length", "4", "--max_steps", "3", "--logging_steps", "1",
            "--save_steps", "1", "--gradient_checkpointing", "false", "--use_cpu", "true", "--plot_on_end", "false"]
    out = subprocess.run([*base, "--output_dir", str(tmp_path / "out")], capture_output=True, text=True, env=_env())
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stderr.splitlines()
    assert len(lines) == 3, out.stderr
    records = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    average = 0.0
    for i, (line, record) in enumerate(zip(lines, records), 1):
        average = 0.9 * average + 0.1 * record["reward"]
        assert re.fullmatch(rf"step {i}/3  reward={record['reward']:.4g} \(avg {average / (1 - 0.9 ** i):.4g}\)  "
                            r"entropy=\S+  length=\S+  \d+:\d\d elapsed(, \d+:\d\d left)?", line), line
    assert lines[-1].endswith("elapsed") and "loss" not in out.stderr and "Writing model shards" not in out.stderr
    assert "Loading weights" not in out.stderr
    quiet = subprocess.run([*base, "--output_dir", str(tmp_path / "quiet"), "--quiet"], capture_output=True,
                           text=True, env=_env())
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    both = subprocess.run([*base, "--output_dir", str(tmp_path / "both"), "--quiet", "--verbose"],
                          capture_output=True, text=True, env=_env())
    assert both.returncode == 2 and both.stderr.strip().splitlines()[-1] == (
        "posttrain: error: --quiet and --verbose both given: choose one.")
