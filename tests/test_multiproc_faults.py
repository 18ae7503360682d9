"""A failure on one of two processes stops both, within seconds, with the original message printed once.

Each test launches two gloo processes with accelerate (tests/multiproc_faults.py injects the fault on one of
them) under a timeout: before the failure was shared, the survivor waited in a collective for the failed process,
and both hung.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
FAULTS = {
    "reward": "Reward function 'faulty_reward' raised ValueError at step 2",
    "generation": "RuntimeError: CUDA out of memory (simulated) while generating",
    "data": "row 17 of the prompt stream could not be read",
    "saving": "checkpoint-1.tmp: the disk is full. Free some space",
    "nonfinite": "Step 2: loss is nan; the update was not applied",
}


def _run_with_fault(fault: str, launch: list[str], tmp_path, model_dir: str, timeout: int,
                    launcher: str = "accelerate.commands.launch", args: tuple = (), conversational: bool = False,
                    **env):
    """`accelerate launch <launch> multiproc_faults.py FAULT` of a 4-step GRPO run on 16 prompts (`launcher`: the
    module that launches, accelerate's or posttrain.launch; `args`: flag, value pairs that replace or add to the
    run's)."""
    data = tmp_path / "prompts.jsonl"
    prompts = [f"{a}+{b}=" for a in range(4) for b in range(4)]
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": p}] if conversational else p}) + "\n"
                            for p in prompts))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]),
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", **env)
    run = ["--model_name_or_path", model_dir, "--dataset_name", str(data),
           "--reward_funcs", "multiproc_faults.faulty_reward", "--per_device_train_batch_size", "4",
           "--num_generations", "4", "--max_completion_length", "6", "--max_steps", "4", "--logging_steps", "1",
           "--gradient_checkpointing", "false", "--use_cpu", "true", "--save_strategy", "steps", "--save_steps", "1",
           "--output_dir", str(tmp_path / "out")]
    for flag, value in zip(args[::2], args[1::2]):
        if flag in run:
            run[run.index(flag) + 1] = value
        else:
            run += [flag, value]
    cmd = [sys.executable, "-m", launcher, "--main_process_port", "0", *launch,
           os.path.join(TESTS, "multiproc_faults.py"), fault, str(tmp_path), "--", *run]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.multiproc
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_failure_on_one_process_stops_both(fault, tmp_path, tiny_model_dir):
    launch = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no"]
    out = _run_with_fault(fault, launch, tmp_path, tiny_model_dir, timeout=240)
    ended = time.time()
    assert out.returncode != 0
    fault_time = float((tmp_path / "fault_time").read_text())
    print(f"{fault}: both processes stopped {ended - fault_time:.1f} s after the fault")
    assert ended - fault_time < 30, ended - fault_time  # stopped within seconds, not at a collective's timeout
    lines = [line for line in out.stderr.splitlines() if line.startswith("posttrain: error:")]
    assert len(lines) == 1 and FAULTS[fault] in lines[0], out.stderr[-3000:]  # the original message, once


AGENT_FAULTS = {
    "reset": "Counter.reset raised RuntimeError: rank 1 cannot reach its environment on row",
    "tool": "Tool 'tally' (tally) returned a list holding 0, which is not a content block",
}


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    """A tiny model whose tokenizer has TRL's Qwen2.5 chat template (tools and their results rendered), with room
    for the tools' schemas in the prompt."""
    import trl

    from posttrain.testing import save_tiny, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    return save_tiny(str(tmp_path_factory.mktemp("tools")), tokenizer, hidden=32, layers=1, max_positions=2048)


@pytest.mark.multiproc
@pytest.mark.parametrize("fault", list(AGENT_FAULTS))
def test_an_environment_or_tool_failure_on_one_process_stops_both(fault, tmp_path, tool_model_dir):
    """Tools run where the rollout lives: rank 1's environment reset raising, or its tool's result failing outside
    the model's turn, stops both processes within seconds, with the one sentence printed once."""
    pytest.importorskip("trl")
    launch = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no"]
    out = _run_with_fault(fault, launch, tmp_path, tool_model_dir, timeout=240, conversational=True,
                          args=("--max_completion_length", "200", "--generation_kwargs", '{"max_new_tokens": 4}'))
    ended = time.time()
    assert out.returncode != 0 and (tmp_path / "fault_time").exists(), out.stderr[-3000:]
    assert ended - float((tmp_path / "fault_time").read_text()) < 30
    lines = [line for line in out.stderr.splitlines() if line.startswith("posttrain: error:")]
    assert len(lines) == 1 and AGENT_FAULTS[fault] in lines[0], out.stderr[-3000:]


@pytest.mark.multiproc
def test_a_signal_while_both_processes_wait_on_a_reward_function_stops_both(tmp_path, tiny_model_dir):
    """Both processes wait at step 2 on a reward function that never returns; SIGINT reaches the launcher (as a
    Ctrl-C does), which passes it on: each process stops at once, together, with one sentence printed once, and the
    launcher exits 130 without a traceback."""
    launch = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
              "--dynamo_backend", "no"]
    out = _run_with_fault("interrupt", launch, tmp_path, tiny_model_dir, timeout=240, launcher="posttrain.launch")
    ended = time.time()
    fault_time = float((tmp_path / "fault_time").read_text())
    print(f"interrupt: both processes stopped {ended - fault_time:.1f} s after the signal")
    assert ended - fault_time < 20, ended - fault_time  # not the launcher's SIGKILL, 30 s on
    assert [(tmp_path / f"exit_{rank}").read_text() for rank in (0, 1)] == ["130", "130"]
    lines = [line for line in out.stderr.splitlines() if line.startswith("posttrain:")]
    assert lines == [f"posttrain: Interrupted (SIGINT) at step 1 of 4 while waiting on reward function "
                     f"'faulty_reward'; the newest checkpoint is {tmp_path}/out/checkpoint-1: resume with "
                     "resume_from_checkpoint=true."], out.stderr[-3000:]
    assert out.returncode == 130 and "Traceback" not in out.stderr, out.stderr[-3000:]


@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", ["multi_gpu", "zero2", "zero3"])
def test_a_nonfinite_gradient_stops_every_strategy_before_its_update(strategy, tmp_path, tiny_model_dir):
    """Rank 1's gradient turns NaN at step 2, its loss finite. Under DDP the loop measures the norm before the step;
    under DeepSpeed the engine's step measures it and skips the update. Either way both processes stop with one
    sentence, and the emergency checkpoint holds the weights of step 1, bit for bit: the update was not applied."""
    from safetensors.torch import load_file

    if strategy.startswith("zero"):
        pytest.importorskip("deepspeed")
    configs = os.path.join(os.path.dirname(TESTS), "posttrain", "accelerate_configs")
    launch = ["--config_file", os.path.join(configs, f"{strategy}.yaml"), "--num_processes", "2",
              "--mixed_precision", "no"]
    out = _run_with_fault("nonfinite_grad", launch, tmp_path, tiny_model_dir, timeout=300, PT_ACCELERATE_ON_CPU="1")
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.startswith("posttrain: error:")]
    assert len(lines) == 1 and re.search(r"Step 2: grad_norm is (nan|inf); the update was not applied and the last "
                                         r"good state is saved in .*emergency-checkpoint-1", lines[0]), out.stderr[-3000:]
    good, emergency = (load_file(tmp_path / "out" / name / "model.safetensors")
                       for name in ("checkpoint-1", "emergency-checkpoint-1"))
    assert all(torch.equal(good[k], emergency[k]) for k in good)
