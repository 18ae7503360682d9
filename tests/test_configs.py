import glob
import os

import pytest

from posttrain.cli import parse_grpo
from posttrain.configs import ConfigError, GRPOConfig, load_yaml

ROOT = os.path.dirname(os.path.dirname(__file__))


def test_trl_defaults_and_derived_batches():
    cfg = GRPOConfig()
    assert (cfg.loss_type, cfg.beta, cfg.num_generations, cfg.epsilon, cfg.epsilon_high) == ("dapo", 0.0, 8, 0.2, 0.2)
    assert (cfg.learning_rate, cfg.max_completion_length, cfg.scale_rewards) == (1e-6, 512, "group")
    cfg = GRPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=4, num_generations=8)
    assert cfg.steps_per_generation == 4 and cfg.generation_batch_size == 16 and cfg.prompts_per_generation == 2
    cfg = GRPOConfig(per_device_train_batch_size=4, generation_batch_size=32, num_generations=8)
    assert cfg.steps_per_generation == 8
    assert GRPOConfig(scale_rewards=False).scale_rewards == "none"


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_generations=1), "num_generations >= 2"),
    (dict(per_device_train_batch_size=6, num_generations=4), "not a multiple of num_generations=4"),
    (dict(per_device_train_batch_size=4, generation_batch_size=10), "multiple of per_device_train_batch_size"),
    (dict(steps_per_generation=2, generation_batch_size=24), "both set, and they disagree"),  # agreeing: one setting
    (dict(loss_type="ppo"), "loss_type='ppo' is not one of: grpo, bnpo, dr_grpo, dapo, cispo"),
    (dict(max_completion_length=0), "max_completion_length=0 must be a positive integer"),
    (dict(scale_rewards="std"), "scale_rewards='std'"),
    (dict(delta=1.1), "delta=1.1 must be greater than 1 \\+ epsilon_high"),
    (dict(temperature=0), "temperature=0 must be > 0"),
    (dict(report_to="tensorbord"), "report_to='tensorbord' is not one of: none, all, wandb, trackio, tensorboard"),
])
def test_impossible_configs_fail_with_one_sentence(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        GRPOConfig(**kwargs)


def test_yaml_and_flag_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model_name_or_path: m\nlearning_rate: 1.0e-5\nnum_generations: 4\nreward_funcs: [accuracy]\n"
                    "per_device_train_batch_size: 8\n")
    script, lora, cfg = parse_grpo(["--config", str(path), "--learning_rate", "3e-4", "--beta", "0.1",
                                    "--reward_funcs", "accuracy", "think_format", "--use_peft", "--lora_r", "8",
                                    "--generation_kwargs", '{"min_new_tokens": 2}'])
    assert cfg.learning_rate == 3e-4 and cfg.beta == 0.1 and cfg.num_generations == 4
    assert script.reward_funcs == ["accuracy", "think_format"] and script.model_name_or_path == "m"
    assert lora.use_peft is True and lora.lora_r == 8 and cfg.generation_kwargs == {"min_new_tokens": 2}


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "examples", "*.yaml"))))
def test_every_example_config_loads(path):
    """Each example parses as the command its name starts with (grpo_*.yaml, sft_*.yaml, dpo_*.yaml)."""
    from posttrain.cli import parse_dpo, parse_sft

    assert load_yaml(path)
    for prefix, parse, name in (("sft_", parse_sft, "SFTConfig"), ("dpo_", parse_dpo, "DPOConfig")):
        if os.path.basename(path).startswith(prefix):
            script, lora, cfg = parse(["--config", path])
            assert script.model_name_or_path and script.dataset_name and type(cfg).__name__ == name
            return
    script, lora, cfg = parse_grpo(["--config", path])
    assert script.model_name_or_path and script.dataset_name and script.reward_funcs


def test_docs_config_reference_is_current():
    from posttrain.configs import config_reference

    with open(os.path.join(ROOT, "docs", "config.md")) as f:
        assert f.read() == config_reference(), "regenerate with: python -m posttrain.configs > docs/config.md"


def test_a_tilde_in_output_dir_is_the_home_directory():
    assert GRPOConfig(output_dir="~/runs/a").output_dir == os.path.expanduser("~/runs/a")
    _, _, cfg = parse_grpo(["--output_dir", "~/runs/b"])
    assert cfg.output_dir == os.path.expanduser("~/runs/b")


def group_filter_for_the_round_trip(rewards):
    """A module-level group filter (dynamic_sampling_filter given as a function)."""
    return rewards.std() > 0


@pytest.mark.parametrize("make", ["grpo", "sft", "dpo"])
def test_every_kind_of_value_a_config_takes_is_written_and_read_back(tmp_path, make):
    """A torch dtype (as TRL's model_init_kwargs take it), a Path, transformers' enums, a function, tuples and sets
    become plain YAML and JSON that construct the same config again."""
    import json
    import pathlib

    import torch
    import yaml
    from transformers.trainer_utils import IntervalStrategy, SchedulerType

    from posttrain import DPOConfig, SFTConfig

    cls = {"grpo": GRPOConfig, "sft": SFTConfig, "dpo": DPOConfig}[make]
    values = dict(output_dir=pathlib.Path(tmp_path) / "out", save_strategy=IntervalStrategy.STEPS,
                  lr_scheduler_type=SchedulerType.COSINE, report_to=("none",),
                  model_init_kwargs={"dtype": torch.bfloat16, "attn_implementation": "sdpa", "nested": [torch.float16]})
    if make == "grpo":
        values.update(dynamic_sampling=True, dynamic_sampling_filter=group_filter_for_the_round_trip)
    written = cls(**values).to_dict()
    text = yaml.safe_dump(written, sort_keys=False)
    assert json.loads(json.dumps(written)) == written
    again = cls(**yaml.safe_load(text))
    assert again.to_dict() == written
    assert written["model_init_kwargs"] == {"dtype": "bfloat16", "attn_implementation": "sdpa", "nested": ["float16"]}
    assert (written["output_dir"], written["save_strategy"], written["lr_scheduler_type"]) == (
        str(tmp_path / "out"), "steps", "cosine")
    if make == "grpo":
        assert written["dynamic_sampling_filter"] == "test_configs.group_filter_for_the_round_trip"


def test_a_run_with_a_torch_dtype_in_model_init_kwargs_saves_its_config(tmp_path, tiny_model_dir):
    """The final save wrote posttrain_config.yaml with yaml.safe_dump, which cannot represent torch.bfloat16."""
    import torch
    import yaml
    from datasets import Dataset

    from posttrain import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=2, use_cpu=True,
                     report_to="none", gradient_checkpointing=False, model_init_kwargs={"dtype": torch.bfloat16})
    SFTTrainer(str(tiny_model_dir), args=args, train_dataset=Dataset.from_dict({"text": ["ab 1", "ab ab 2"]})).train()
    with open(tmp_path / "out" / "posttrain_config.yaml") as f:
        assert yaml.safe_load(f)["model_init_kwargs"]["dtype"] == "bfloat16"
