import argparse
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
from conftest import run_posttrain

from posttrain.configs import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.dirname(os.path.abspath(__file__))


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]),
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def _posttrain(argv: list[str], capfd) -> tuple[int, str, str]:
    """`posttrain ARGV` in this process (conftest.run_posttrain): (exit code, stdout, stderr)."""
    run = run_posttrain(argv, capfd)
    return run.returncode, run.stdout, run.stderr


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


def test_grpo_from_yaml_with_overrides(tmp_path, tiny_model_dir, capfd):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset_name: {_write_data(tmp_path)}\n"
                   "reward_funcs: [accuracy, length]\nper_device_train_batch_size: 8\nnum_generations: 4\n"
                   "max_completion_length: 4\nmax_steps: 5\ngradient_checkpointing: false\nuse_cpu: true\n")
    code, _, err = _posttrain(["grpo", "--config", str(cfg), "--output_dir", str(tmp_path / "out"), "--max_steps",
                               "2", "--logging_steps", "1", "--save_steps", "1",
                               "--reward_weights", "1.0", "0.5"], capfd)  # numbers from flags (once strings)
    assert code == 0, err[-2000:]
    records = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2] and "rewards/accuracy/mean" in records[0]
    assert yaml.safe_load((tmp_path / "out" / "posttrain_config.yaml").read_text())["reward_weights"] == [1.0, 0.5]
    assert (tmp_path / "out" / "checkpoint-1" / "model.safetensors").exists()
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_user_errors_are_one_sentence(tmp_path, capfd):
    code, _, err = _posttrain(["grpo", "--model_name_or_path", "./nope", "--dataset_name", str(_write_data(tmp_path)),
                               "--reward_funcs", "accuracy"], capfd)
    assert code == 2 and "Traceback" not in err
    assert "Model path './nope' does not exist" in err


def _broken_jsonl(tmp_path):
    (tmp_path / "broken.jsonl").write_text('{"prompt": "1+1="}\n{"prompt": "2+2=\n')
    return ["--dataset_name", str(tmp_path / "broken.jsonl")]


def _binary_config(tmp_path):
    (tmp_path / "config.yaml").write_bytes(bytes(range(128, 256)))
    return ["--config", str(tmp_path / "config.yaml")]


@pytest.mark.parametrize("bad,message", [
    (_broken_jsonl, "Line 2 of "),  # datasets logged "Failed to load JSON from file ..." above it
    (lambda tmp_path: ["--model_init_kwargs", '{"attn_implementation": "flash_attention_9"}'],
     "model_init_kwargs attn_implementation='flash_attention_9' does not work"),  # transformers' traceback above it
    (_binary_config, "is not text (not UTF-8)"),  # yaml's UnicodeDecodeError traceback in its place
], ids=["broken-jsonl-line", "unknown-attention", "binary-config"])
def test_a_mistake_whose_cause_is_a_librarys_error_is_one_line_without_its_traceback(bad, message, tmp_path,
                                                                                      tiny_model_dir, capfd):
    """A user's mistake that a library reports by raising (or logging, then raising) is the message's one line; the
    library's traceback or error line is not printed above it (a user's own code's traceback is: see
    test_reward_errors_are_reported_with_the_user_traceback)."""
    flags = ["--model_name_or_path", tiny_model_dir, "--dataset_name", str(_write_data(tmp_path)), "--reward_funcs",
             "accuracy", "--use_cpu", "true", "--output_dir", str(tmp_path / "out")]
    extra = bad(tmp_path)
    for i in range(0, len(extra), 2):  # the mistake replaces the good flag of its name
        if extra[i] in flags:
            del flags[flags.index(extra[i]):flags.index(extra[i]) + 2]
    code, out, err = _posttrain(["grpo", *flags, *extra], capfd)
    lines = [line for line in err.splitlines() if line.strip() and "Setting accelerator to CPU" not in line]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("posttrain: error: ") and message in lines[0], err


@pytest.mark.multiproc
def test_two_processes_ddp_on_cpu(tmp_path, tiny_model_dir):
    """`posttrain grpo --accelerate_config multi_gpu --num_processes 2` on a machine without a GPU (none visible) and
    without use_cpu: the 2 processes run together on the CPU over gloo, saying so in one line; prompts sharded,
    rewards gathered before advantages; each micro-batch as passes of whole rows (at most 6 completion tokens a
    pass), as many on each process: DDP broadcasts the model's buffers at every forward."""
    logs = tmp_path / "logs"
    logs.mkdir()
    cmd = [sys.executable, "-m", "posttrain.cli", "grpo", "--accelerate_config", "multi_gpu", "--num_processes", "2",
           "--model_name_or_path", tiny_model_dir, "--dataset_name", str(_write_data(tmp_path)),
           "--reward_funcs", "multiproc_rewards.recording_length_reward", "--per_device_train_batch_size", "4",
           "--num_generations", "4", "--max_completion_length", "6", "--max_steps", "2", "--logging_steps", "1",
           "--gradient_checkpointing", "false", "--save_strategy", "no", "--output_dir", str(tmp_path / "out"),
           "--max_completion_tokens_per_pass", "6"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env=_env(POSTTRAIN_TEST_LOG=str(logs), CUDA_VISIBLE_DEVICES=""))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "posttrain: no GPU found: running the 2 processes on the CPU over gloo (add --cpu to say so and silence " \
           "this line)." in out.stderr.splitlines() and "Traceback" not in out.stderr
    assert yaml.safe_load((tmp_path / "out" / "posttrain_config.yaml").read_text())["use_cpu"] is True
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


def test_reward_errors_are_reported_with_the_user_traceback(tmp_path, tiny_model_dir, capfd, monkeypatch):
    (tmp_path / "bad_rewards.py").write_text("def broken(completions, **kw):\n    return 1 / 0\n")
    common = ["--model_name_or_path", tiny_model_dir, "--dataset_name", str(_write_data(tmp_path)),
              "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "4",
              "--max_steps", "1", "--gradient_checkpointing", "false", "--use_cpu", "true",
              "--output_dir", str(tmp_path / "out")]
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = _posttrain(["grpo", "--reward_funcs", "acuracy", *common], capfd)
    assert code == 2 and "Did you mean accuracy?" in err and "Traceback" not in err
    code, _, err = _posttrain(["grpo", "--reward_funcs", "bad_rewards.broken", *common], capfd)
    assert code == 2
    assert "return 1 / 0" in err  # the user's own traceback
    assert "posttrain: error: Reward function 'broken' raised ZeroDivisionError at step 1" in err


def test_a_trl_config_file_runs_unchanged(tmp_path, tiny_model_dir, capfd):
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
    code, _, err = _posttrain(["grpo", "--config", str(cfg), "--output_dir", str(tmp_path / "out")], capfd)
    assert code == 0, err[-2000:]
    records = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert "rewards/think_format_reward/mean" in records[0]
    assert "rewards/soft_overlong_punishment_reward/mean" in records[0]
    assert [r["step"] for r in records if "eval_loss" in r] == [2]
    assert "Completions at step 2" in err  # log_completions prints a sample at each logging step


@pytest.mark.parametrize("flags,message", [
    (["--use_vllm", "true", "--max_completion_length", "8"],
     "vllm_mode='colocate' needs the optional package 'vllm': install it with `pip install 'posttrain[vllm]'`"),
    (["--torch_compile", "true"], "torch_compile=True is not supported"),
    (["--eval_strategyy", "steps"], "Unknown argument '--eval_strategyy'. Did you mean eval_strategy?"),
    (["--evaluate_every", "5"], "Unknown argument '--evaluate_every'. `posttrain grpo --help-all`"),
    (["--eval_strategy", "steps"], "Evaluation needs a 'test' split, and the single file"),
])
def test_trl_flags_are_honoured_or_refused_in_one_sentence(tmp_path, tiny_model_dir, flags, message, capfd):
    code, _, err = _posttrain(["grpo", "--model_name_or_path", tiny_model_dir, "--dataset_name",
                               str(_write_data(tmp_path)), "--reward_funcs", "accuracy", "--per_device_eval_batch_size",
                               "8", "--use_cpu", "true", "--output_dir", str(tmp_path / "out"), *flags], capfd)
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert message in err and err.count("posttrain: error:") == 1
    assert "Did you mean save_strategy" not in err


@pytest.mark.multiproc
def test_a_failed_push_reaches_both_processes(tmp_path, tiny_model_dir):
    """push_to_hub runs on the main process and fails there (no token): the other process is told the same
    sentence instead of waiting for it, and both go on to finish."""
    env = _env(HF_HOME=str(tmp_path / "hf"))
    env.pop("HF_TOKEN", None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", "0", "--multi_gpu",
           "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           os.path.join(TESTS, "multiproc_push.py"), tiny_model_dir, str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    told = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert told[0].startswith("push_to_hub needs a Hugging Face token and network access")
    assert told[1] == f"on process 0: {told[0]}"  # told by the process that failed


def _signal_test_run(data, model_dir) -> list[str]:
    return [sys.executable, "-m", "posttrain.cli", "grpo", "--model_name_or_path", model_dir, "--dataset_name",
            str(data), "--reward_funcs", "length", "--per_device_train_batch_size", "8", "--num_generations", "4",
            "--max_completion_length", "6", "--max_steps", "40", "--logging_steps", "1", "--save_strategy", "no",
            "--gradient_checkpointing", "false", "--use_cpu", "true"]


@pytest.fixture(scope="module")
def never_interrupted(tmp_path_factory, tiny_model_dir):
    """The signal tests' run, never interrupted: its saved weights (one run for both signals)."""
    from safetensors.torch import load_file

    tmp_path = tmp_path_factory.mktemp("straight")
    straight = subprocess.run([*_signal_test_run(_write_data(tmp_path), tiny_model_dir), "--output_dir",
                               str(tmp_path / "straight")], capture_output=True, text=True, env=_env())
    assert straight.returncode == 0, straight.stderr[-2000:]
    return load_file(tmp_path / "straight" / "model.safetensors")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_at_the_step_with_a_checkpoint_and_one_line(tmp_path, tiny_model_dir, signum,
                                                                   never_interrupted):
    from safetensors.torch import load_file

    run = _signal_test_run(_write_data(tmp_path), tiny_model_dir)
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
    a, b = load_file(out / "model.safetensors"), never_interrupted
    # interrupted and resumed = never interrupted
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


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


# ------------------------------------------------------------------ launching on this machine's devices (launch.py)

CONFIGS = os.path.join(ROOT, "posttrain", "accelerate_configs")
ON_CPU = {"ACCELERATE_USE_CPU": "true"}


@pytest.fixture
def devices(monkeypatch):
    """devices(n): plan_devices finds n GPUs (0: none, for the reason given); no accelerate default config."""
    import accelerate.commands.config.config_args as config_args

    from posttrain import launch

    monkeypatch.setattr(config_args, "default_config_file", os.path.join(TESTS, "no-such-default-config.yaml"))

    def found(count: int, none_found: str = "no GPU found"):
        monkeypatch.setattr(launch, "_device_count", lambda: (count, "" if count else none_found))

    return found


def _launch(*argv: str) -> list[str]:
    from posttrain.launch import split_launch_args

    return split_launch_args(list(argv))[0]


def test_several_processes_without_a_gpu_run_on_the_cpu_and_say_so(devices):
    from posttrain.launch import plan_devices

    devices(0)
    multi_gpu = _launch("--accelerate_config", "multi_gpu", "--num_processes", "2")
    assert plan_devices(multi_gpu, use_cpu=False) == (multi_gpu, ON_CPU, "posttrain: no GPU found: running the 2 "
                                                      "processes on the CPU over gloo (add --cpu to say so and "
                                                      "silence this line).")
    assert plan_devices(multi_gpu, use_cpu=True) == (multi_gpu, ON_CPU, None)  # asked for: nothing to say
    assert "running the 8 processes" in plan_devices(_launch("--accelerate_config", "multi_gpu"), False)[2]
    # accelerate's --cpu starts one process whatever --num_processes says: torchrun's launcher runs them on the CPU
    assert plan_devices(["--num_processes", "2", "--cpu"], False) == (["--num_processes", "2", "--multi_gpu"], ON_CPU,
                                                                      None)
    assert plan_devices(["--num_processes", "1"], False) == (["--num_processes", "1"], {}, None)  # accelerate's own
    devices(0, "accelerate runs several processes on GPUs, not on MPS")
    assert plan_devices(multi_gpu, False)[2].startswith("posttrain: accelerate runs several processes on GPUs, not on "
                                                        "MPS: running the 2 processes on the CPU over gloo")
    devices(2)
    assert plan_devices(multi_gpu, False) == (multi_gpu, {}, None)  # a GPU each: as asked
    assert plan_devices(["--num_processes", "2", "--cpu"], False)[1:] == (ON_CPU, None)


def test_a_launch_asked_onto_the_cpu_starts_without_importing_torch():
    """The relaunching process only plans the launch: asked onto the CPU it counts no devices, so it never imports
    torch (about 2 s of every `posttrain grpo --num_processes 2 --use_cpu true` before accelerate's launcher starts)."""
    code = ("import sys; from posttrain.launch import plan_devices, split_launch_args; "
            "launch = split_launch_args(['--accelerate_config', 'multi_gpu', '--num_processes', '2'])[0]; "
            "plan_devices(launch, use_cpu=True); plan_devices(launch + ['--cpu'], use_cpu=False); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_a_launch_this_machine_cannot_run_stops_before_it_starts_in_one_sentence(devices):
    from posttrain.launch import plan_devices

    devices(0)
    assert all(name in os.listdir(CONFIGS) for name in ("fsdp1.yaml", "fsdp2.yaml", "zero1.yaml", "zero3.yaml"))
    for name, library in (("fsdp1", "FSDP"), ("fsdp2", "FSDP"), ("zero1", "DeepSpeed"), ("zero2", "DeepSpeed"),
                          ("zero3", "DeepSpeed")):
        with pytest.raises(ConfigError) as err:
            plan_devices(_launch("--accelerate_config", name, "--num_processes", "2"), False)
        assert str(err.value) == (f"accelerate_config {name} shards the model over GPUs with {library}, which "
                                  "accelerate does not do on the CPU, and this machine has none (no GPU found): run it "
                                  "on GPUs, or train on the CPU with --accelerate_config multi_gpu.")
    devices(8)
    with pytest.raises(ConfigError, match=r"zero3 shards .* and the CPU is asked for \(--cpu or use_cpu\): run it"):
        plan_devices(_launch("--accelerate_config", "zero3", "--num_processes", "2"), use_cpu=True)
    devices(2)
    with pytest.raises(ConfigError) as err:
        plan_devices(_launch("--accelerate_config", "multi_gpu"), False)  # the config's 8 processes on 2 GPUs
    assert str(err.value) == ("accelerate_config multi_gpu starts 8 processes on this machine, one per GPU, and it has "
                              "2: give --num_processes 2, or add --cpu to run them on the CPU.")
    four_on_two = _launch("--accelerate_config", "fsdp2", "--num_processes", "4", "--num_machines", "2")
    assert plan_devices(four_on_two, False) == (four_on_two, {}, None)  # 2 per machine


def test_the_devices_found(monkeypatch):
    from posttrain.launch import _device_count

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert _device_count() == (0, "no GPU found")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("mps"))
    assert _device_count() == (0, "accelerate runs several processes on GPUs, not on MPS")
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 4)
    assert _device_count() == (4, "")


def test_the_relaunch_runs_on_the_cpu_and_the_run_records_it(devices, monkeypatch, capsys):
    """`posttrain grpo --accelerate_config multi_gpu --num_processes 2` without a GPU: posttrain's launcher, told to
    use the CPU, and one line; a launched process takes the launcher's CPU as its use_cpu (written in its config)."""
    import types

    from posttrain import cli, launch

    devices(0)
    calls, launcher = [], types.SimpleNamespace(wait=lambda: 0)  # the launcher, which ends at once
    monkeypatch.setattr(launch.subprocess, "Popen", lambda cmd, env: calls.append((cmd, env)) or launcher)
    monkeypatch.delenv(launch.LAUNCHED, raising=False)
    argv = ["grpo", "--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--accelerate_config", "multi_gpu",
            "--num_processes", "2", "--max_steps", "3"]
    assert cli.main(argv) == 0
    (cmd, env), = calls
    assert cmd[1:3] == ["-m", "posttrain.launch"]
    assert cmd[cmd.index("posttrain.cli") - 1:] == ["-m", "posttrain.cli", "grpo", "--model_name_or_path", "m",
                                                    "--dataset_name", "d.jsonl", "--max_steps", "3"]
    assert env["ACCELERATE_USE_CPU"] == "true" and env[launch.LAUNCHED] == "1"
    assert capsys.readouterr().err.splitlines()[-1].startswith("posttrain: no GPU found: running the 2 processes")
    runs = []
    monkeypatch.setitem(cli.RUNS, "grpo", lambda script, lora, config: runs.append(config))
    monkeypatch.setenv(launch.LAUNCHED, "1")
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    assert cli.main(argv) == 0 and runs[0].use_cpu is True


def test_the_relaunching_process_waits_for_the_launcher_through_a_signal():
    """While `posttrain` waits for the launcher it relaunched, a SIGINT (a Ctrl-C, which the launcher gets too and
    passes on to its processes) does not end it early, and a SIGTERM sent to it alone is passed on to the launcher."""
    import threading

    from posttrain.launch import _wait_for

    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    for delay, signum in ((0.2, signal.SIGINT), (0.4, signal.SIGTERM)):
        threading.Timer(delay, os.kill, (os.getpid(), signum)).start()
    assert _wait_for(launcher) == -signal.SIGTERM  # the launcher got the SIGTERM; this process neither
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers  # its own back


def test_processes_on_one_machine_meet_on_a_free_port_unless_a_port_is_named(tmp_path):
    """torchrun's fixed 29500 would make a second run on the same machine fail: on one machine posttrain asks
    accelerate for a free port (--main_process_port 0); a port named by flag or config file, or several machines,
    keep what was given."""
    from posttrain.launch import accelerate_config_path, with_a_free_port

    shipped = ["--config_file", accelerate_config_path("multi_gpu"), "--num_processes", "2"]
    assert with_a_free_port(shipped) == [*shipped, "--main_process_port", "0"]
    assert with_a_free_port([*shipped, "--main_process_port", "2950"]) == [*shipped, "--main_process_port", "2950"]
    assert with_a_free_port([*shipped, "--num_machines", "2"]) == [*shipped, "--num_machines", "2"]
    named = tmp_path / "port.yaml"
    named.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\nmain_process_port: 2950\n")
    assert with_a_free_port(["--config_file", str(named)]) == ["--config_file", str(named)]


@pytest.mark.parametrize("exitcode, status, line", [
    (2, 2, None),  # the process printed its one sentence
    (1, 1, "posttrain: process 1 exited with status 1, and the launcher stopped the others."),
    (-9, 137, "posttrain: process 1 was killed by SIGKILL (out of memory?), and the launcher stopped the others."),
])
def test_a_failed_process_ends_the_launch_without_the_launchers_traceback(monkeypatch, capsys, exitcode, status, line):
    import accelerate.commands.launch as accelerate_launch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from posttrain.launch import run_accelerate

    def fails(args):
        assert args.module and args.training_script == "posttrain.cli" and args.training_script_args == ["grpo"]
        raise ChildFailedError("posttrain.cli", {1: ProcessFailure(local_rank=1, pid=4321, exitcode=exitcode,
                                                                   error_file="")})

    monkeypatch.setattr(accelerate_launch, "launch_command", fails)
    assert run_accelerate(["--num_processes", "2", "-m", "posttrain.cli", "grpo"]) == status
    assert capsys.readouterr().err.splitlines() == ([line] if line else [])


def test_processes_that_each_run_alone_stop_in_one_sentence(monkeypatch):
    """A launcher started 2 processes (WORLD_SIZE) but accelerate set up no process group: each would train alone on
    the same output_dir. Every process stops at construction; the main one says why."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from posttrain.training.distributed import reported_elsewhere
    from posttrain.training.sharding import check_launch

    for name in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as err:
        check_launch(SimpleNamespace(num_processes=1, distributed_type=DistributedType.NO))
    assert str(err.value) == (
        "This process is one of 2 that the launcher started (WORLD_SIZE), but accelerate set up a single process "
        "instead, as it does on a machine without a GPU unless told to use the CPU, so 2 separate runs would share "
        "output_dir: set use_cpu=True (--use_cpu true) to train the 2 processes together on the CPU over gloo, or run "
        "them on GPUs.")
    assert reported_elsewhere(err.value, is_main=False) and not reported_elsewhere(err.value, is_main=True)
    check_launch(SimpleNamespace(num_processes=2, distributed_type=DistributedType.MULTI_CPU))  # one group: runs


# ------------------------------------------------------------------ help

def _help(capsys, *argv) -> tuple[int, str]:
    """(exit status, stdout) of `posttrain <argv>` in this process."""
    from posttrain.cli import main

    try:
        code = main(list(argv))
    except SystemExit as stop:  # argparse's own --help
        code = stop.code
    return code, capsys.readouterr().out


def test_every_command_answers_help_with_help(capsys):
    from posttrain.cli import COMMANDS

    for command in COMMANDS:
        code, out = _help(capsys, command, "--help")
        assert code == 0 and out.startswith(f"usage: posttrain {command}"), (command, out[:300])
    code, out = _help(capsys, "env", "-h")
    assert code == 0 and "torch" not in out  # help, not the versions


def test_every_option_of_every_command_has_a_help_text():
    from posttrain.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for command, sub in commands.items():
        for action in sub._actions:
            text = (action.help or "").split(" (default: ")[0]
            assert text.strip() and text != argparse.SUPPRESS, (command, action.option_strings or action.dest)


def test_trainer_help_is_one_short_page_and_every_field_one_flag_away(capsys, monkeypatch):
    from posttrain.cli import TRAINERS
    from posttrain.cli_help import COMMON, LAUNCH_GROUP, field_classes, group_name
    from posttrain.configs import field_types
    from posttrain.launch import LAUNCH_FLAGS

    monkeypatch.setenv("COLUMNS", "80")
    for command, (script_cls, config_cls, _) in TRAINERS.items():
        fields = {name for cls in field_classes(script_cls, config_cls) for name in field_types(cls)} - set(
            config_cls.NOT_FLAGS)  # fields the trainer's TRL config lacks (RLOO's GRPO-only ones) are not flags
        code, page = _help(capsys, command, "--help")
        lines = page.splitlines()
        assert code == 0 and len(lines) <= 105, (command, len(lines))
        assert all(f"--{name} " in page for name in COMMON[command])
        assert lines[-1] == f"The rest: --help GROUP, --help FIELD, or --help-all (all {len(fields)} fields)."
        assert _help(capsys, command, "-h")[1] == page
        code, everything = _help(capsys, command, "--help-all")
        flags = set(re.findall(r"^  --(\w+)", everything, re.M))
        assert code == 0 and flags == fields | set(LAUNCH_FLAGS) | {"config", "quiet", "verbose", "accelerate_config"}
        grouped = set()
        for cls in field_classes(script_cls, config_cls):
            code, group = _help(capsys, command, "--help", group_name(cls))
            assert code == 0 and group_name(cls) in page  # the first page names it
            grouped |= set(re.findall(r"^  --(\w+)", group, re.M))
        assert grouped == fields
        assert set(re.findall(r"^  --(\w+)", _help(capsys, command, f"--help={LAUNCH_GROUP}")[1], re.M)) == set(
            LAUNCH_FLAGS) | {"accelerate_config"}
    code, beta = _help(capsys, "grpo", "--help", "beta")
    assert code == 0 and re.findall(r"^  --(\w+)", beta, re.M) == ["beta"] and "KL penalty" in beta
    code, beta = _help(capsys, "rloo", "--help", "beta")  # RLOO's own default and meaning, not GRPO's
    assert code == 0 and "(default: 0.05)" in beta and "subtracted from each completion's reward" in beta


def test_an_unknown_help_topic_is_one_sentence(capsys):
    from posttrain.cli import main

    assert main(["sft", "--help", "trainig"]) == 2
    assert capsys.readouterr().err.startswith("posttrain: error: `posttrain sft --help trainig` names no group or "
                                              "field. Did you mean training? Groups: script, lora, training,")
