"""Vision-language models through accelerate's FSDP2 and DeepSpeed ZeRO-3 on 2 gloo processes (CPU), as a user
launches them (`accelerate launch --config_file <shipped config> posttrain grpo|sft ...`, through the test-only CPU
patch of tests/accelerate_on_cpu.py): a tiny LLaVA loaded by path (its processor with AutoProcessor) on a saved image
dataset. GRPO samples each process's image prompts with their pixels inside the sharded run's whole weights
(transformers' generate over the gathered model) and trains on them; SFT trains image rows. Against one process with
the same global batch (SGD, 2 steps): every step's loss equal, the final weights equal to float rounding."""

import json
import os
import subprocess
import sys

import pytest
import torch
from datasets import Dataset

from tests import vlm_data
from tests.test_sharded import _env, _launch, _runs_file, _weights

pytestmark = [pytest.mark.multiproc, pytest.mark.sharded]
TESTS = os.path.dirname(os.path.abspath(__file__))
COMMANDS = {"grpo": ["--reward_funcs", "multiproc_rewards.vowel_share", "--num_generations", "4",
                     "--max_completion_length", "6", "--beta", "0.04"],
            "sft": ["--train_sampling_strategy", "sequential"]}
METRICS = {"grpo": ["loss", "reward", "kl", "completions/mean_length"], "sft": ["loss", "num_tokens"]}


@pytest.fixture(scope="module")
def vision_workload(tmp_path_factory):
    from posttrain.testing import save_tiny_vision

    root = tmp_path_factory.mktemp("vlm-sharded")
    save_tiny_vision(str(root / "model"), seed=1)
    Dataset.from_list(vlm_data.prompt_only(8)).save_to_disk(str(root / "grpo"))
    Dataset.from_list(vlm_data.language_modeling(8)).save_to_disk(str(root / "sft"))
    return root


def _args(root, command: str, out, per_device: int) -> list[str]:
    return [command, "--model_name_or_path", str(root / "model"), "--dataset_name", str(root / command),
            *COMMANDS[command], "--per_device_train_batch_size", str(per_device), "--max_steps", "2",
            "--logging_steps", "1", "--save_strategy", "no", "--gradient_checkpointing", "false", "--optim", "sgd",
            "--learning_rate", "0.1", "--use_cpu", "true", "--plot_on_end", "false", "--report_to", "none",
            "--output_dir", str(out)]


@pytest.fixture(scope="module")
def one_process(vision_workload):
    root = vision_workload
    runs = [{"argv": _args(root, command, root / f"one-{command}", 8)} for command in COMMANDS]
    done = subprocess.run([sys.executable, os.path.join(TESTS, "run_commands.py"),
                           _runs_file(root / "one-runs.json", runs)], capture_output=True, text=True, env=_env(),
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return root


@pytest.mark.parametrize("config", ["fsdp2.yaml", "zero3-all"])
def test_sharded_vision_language_training_equals_one_process(config, vision_workload, one_process):
    if config.startswith("zero"):
        pytest.importorskip("deepspeed")
    root = vision_workload
    runs = [{"argv": _args(root, command, root / f"{config}-{command}", 4)} for command in COMMANDS]
    run = _launch(config, ["--runs", _runs_file(root / f"{config}-runs.json", runs)], directory=root)
    assert run.returncode == 0, run.stderr[-3000:]
    for command in COMMANDS:
        one, two = ([json.loads(line) for line in open(root / f"{which}-{command}" / "metrics.jsonl")]
                    for which in ("one", config))
        assert len(one) == len(two) == 2
        for a, b in zip(one, two):
            for key in METRICS[command]:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (command, key)
        reference, sharded = _weights(root / f"one-{command}"), _weights(root / f"{config}-{command}")
        assert sharded.keys() == reference.keys()
        initial = _weights(root / "model")
        assert max(float((reference[k] - initial[k]).abs().max()) for k in reference if k in initial) > 1e-4, command
        for name in reference:
            assert torch.allclose(sharded[name], reference[name], rtol=1e-5, atol=1e-6), (command, name)
