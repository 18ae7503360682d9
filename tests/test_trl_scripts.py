"""TRL 1.16's own scripts (trl/scripts/sft.py, dpo.py, grpo.py), read from the installed TRL at test time and run
with only `trl` changed to `posttrain` in their import lines, from a YAML config and flags, on a tiny local model and
local data; and posttrain's configs under transformers' HfArgumentParser, which TrlParser is."""

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

trl = pytest.importorskip("trl")

ROWS = {"sft": lambda a, b: {"prompt": f"{a}+{b}=", "completion": str(a + b)},
        "dpo": lambda a, b: {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)},
        "grpo": lambda a, b: {"prompt": f"{a}+{b}=", "solution": str(a + b)}}
CONFIG = {"sft": {}, "dpo": {},
          "grpo": {"reward_funcs": ["think_format_reward", "my_rewards.length"], "num_generations": 4,
                   "max_completion_length": 8}}
FLAG = {"sft": ("--learning_rate", "0.0003", "learning_rate", 0.0003), "dpo": ("--beta", "0.2", "beta", 0.2),
        "grpo": ("--beta", "0.04", "beta", 0.04)}


def _ported(name: str, into) -> str:
    """TRL's script with `from trl` / `from trl.rewards` read as `from posttrain` / `from posttrain.rewards`."""
    text = open(os.path.join(os.path.dirname(trl.__file__), "scripts", f"{name}.py")).read()
    ported = re.sub(r"^(\s*)from trl(\.rewards)? import", lambda m: f"{m.group(1)}from posttrain{m.group(2) or ''} import",
                    text, flags=re.M)
    assert ported.count("from posttrain") == text.count("from trl") > 0 and "import trl" not in ported
    path = into / f"{name}.py"
    path.write_text(ported)
    return str(path)


@pytest.mark.parametrize("name", ["sft", "dpo", "grpo"])
def test_trls_script_runs_with_posttrain_from_yaml_and_flags(tmp_path, tiny_model_dir, name):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(ROWS[name](a, b)) + "\n" for a in range(4) for b in range(4)))
    (tmp_path / "my_rewards.py").write_text("def length(completions, **kwargs):\n"
                                            "    return [len(c) / 10 for c in completions]\n")
    config = {"model_name_or_path": str(tiny_model_dir), "dataset_name": str(data), "max_steps": 3,
              "per_device_train_batch_size": 4, "use_cpu": True, "report_to": "none", "save_strategy": "no",
              "not_a_field": 1, "env": {"POSTTRAIN_FROM_YAML": "yes"}, **CONFIG[name]}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    flag, value, field, expected = FLAG[name]
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, _ported(name, tmp_path), "--config", "run.yaml", "--output_dir",
                             str(out), "--max_steps", "2", flag, value], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Training completed." in result.stdout and f"Model saved to {out}." in result.stdout
    # TRL drops an unknown key without a word; `env:` is not one (it set the environment)
    assert "Ignored from the config file: --not_a_field (no argument of this script takes them)." in result.stderr
    saved = yaml.safe_load((out / "posttrain_config.yaml").read_text())
    assert saved[field] == expected and saved["max_steps"] == 2  # flags over the YAML file
    assert saved["model_init_kwargs"]["dtype"] == "float32"  # the script's ModelConfig default, as TRL's
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 2
    assert (out / "model.safetensors").exists()


def test_posttrain_configs_parse_with_hf_argument_parser():
    """Flags as transformers' HfArgumentParser (and so TrlParser) passes them: mappings as JSON strings, numbers in
    lists, several dataclasses at once."""
    from transformers import HfArgumentParser

    from posttrain import DatasetMixtureConfig, DPOConfig, GRPOConfig, ModelConfig, ScriptArguments, SFTConfig

    for config_class in (GRPOConfig, SFTConfig, DPOConfig):
        HfArgumentParser((ScriptArguments, config_class, ModelConfig, DatasetMixtureConfig))
    script, config, model = HfArgumentParser((ScriptArguments, GRPOConfig, ModelConfig)).parse_args_into_dataclasses(
        ["--dataset_name", "d", "--output_dir", "o", "--model_init_kwargs", '{"dtype": "bfloat16"}',
         "--reward_weights", "1.0", "0.5", "--use_peft", "--lora_target_modules", "q_proj", "v_proj"])
    assert script.dataset_name == "d" and config.output_dir == "o"
    assert config.model_init_kwargs == {"dtype": "bfloat16"} and config.reward_weights == [1.0, 0.5]
    assert model.use_peft and model.lora_target_modules == ["q_proj", "v_proj"] and model.dtype == "float32"
    dpo, = HfArgumentParser(DPOConfig).parse_args_into_dataclasses(["--loss_type", "sigmoid", "sft",
                                                                    "--loss_weights", "1", "0.2"])
    assert dpo.loss_type == ["sigmoid", "sft"] and dpo.loss_weights == [1.0, 0.2]


def test_a_mapping_given_as_a_string_that_is_not_json_is_refused():
    from posttrain import GRPOConfig
    from posttrain.configs import ConfigError

    with pytest.raises(ConfigError, match=r"^model_init_kwargs='dtype=bf16' is not a mapping: give a dict, or a JSON "):
        GRPOConfig(model_init_kwargs="dtype=bf16")


def test_get_dataset_and_the_peft_and_quantization_configs(tmp_path):
    from posttrain import DatasetMixtureConfig, ModelConfig, get_dataset, get_peft_config, get_quantization_config

    for part in ("a", "b"):
        (tmp_path / f"{part}.jsonl").write_text("".join(json.dumps({"text": f"{part}{i}"}) + "\n" for i in range(10)))
    mixture = DatasetMixtureConfig(datasets=[{"path": "json", "data_files": str(tmp_path / "a.jsonl"), "fraction": 1},
                                             {"path": "json", "data_files": str(tmp_path / "b.jsonl"), "fraction": 1}],
                                   test_split_size=0.2)
    splits = get_dataset(mixture)
    assert sorted(splits) == ["test", "train"] and len(splits["train"]) + len(splits["test"]) == 20
    assert get_peft_config(ModelConfig()) is None and get_quantization_config(ModelConfig()) is None
    assert get_quantization_config(ModelConfig(load_in_8bit=True)).load_in_8bit
    if pytest.importorskip("importlib.util").find_spec("peft") is not None:
        lora = get_peft_config(ModelConfig(use_peft=True, lora_r=4, lora_target_modules=["all-linear"]))
        assert (lora.r, lora.target_modules, lora.bias, lora.task_type) == (4, "all-linear", "none", "CAUSAL_LM")


@pytest.mark.parametrize("entries,message", [
    ([{"path": "json", "fraction": 1}, {"path": "json"}], r"^fraction is set on some datasets entries and not others"),
    ([{"path": "json", "splt": "train"}], r"^datasets entry 0 has 'splt': its keys are .* Did you mean split\?"),
    (["json"], r"^datasets entry 0 \('json'\) needs a path")])
def test_a_mixture_that_cannot_load_is_refused_in_one_sentence(entries, message):
    from posttrain import DatasetMixtureConfig
    from posttrain.configs import ConfigError

    with pytest.raises(ConfigError, match=message):
        DatasetMixtureConfig(datasets=entries)
