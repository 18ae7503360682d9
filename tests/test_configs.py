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
    (dict(steps_per_generation=2, generation_batch_size=16), "both set"),
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
