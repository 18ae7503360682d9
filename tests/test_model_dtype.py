"""A model given by name loads in float32 unless model_init_kwargs says otherwise, as TRL's create_model_from_path
does, for every trainer and for DPO's reference given by name; `dtype` / `torch_dtype` / "auto" mean what they mean
there. The checkpoint here is bfloat16, as most hub checkpoints are."""

import pytest
import torch
from conftest import length_reward, tiny_config
from datasets import Dataset

from posttrain import DPOConfig, DPOTrainer, GRPOTrainer, SFTConfig, SFTTrainer
from posttrain.testing import tiny_model

COMMON = dict(max_steps=1, per_device_train_batch_size=4, logging_steps=1, save_strategy="no",
              gradient_checkpointing=False, use_cpu=True, report_to="none")


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("bf16")
    tiny_model(tokenizer, hidden=32, layers=1).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _dtypes(model) -> set:
    return {p.dtype for p in model.parameters()}


@pytest.mark.parametrize("init,expected", [
    (None, torch.float32), ({"dtype": "float32"}, torch.float32), ({"dtype": "auto"}, torch.bfloat16),
    ({"dtype": "bfloat16"}, torch.bfloat16), ({"dtype": torch.bfloat16}, torch.bfloat16),
    ({"torch_dtype": "bfloat16"}, torch.bfloat16)])
def test_sft_loads_a_named_model_in_trls_dtype(bf16_dir, tmp_path, init, expected):
    trainer = SFTTrainer(bf16_dir, args=SFTConfig(output_dir=str(tmp_path / "out"), model_init_kwargs=init, **COMMON),
                         train_dataset=Dataset.from_dict({"text": ["ab ab 1", "ab 2"]}))
    assert _dtypes(trainer.policy) == {expected}
    if init is None or "dtype" in init:  # TRL's own loader on the same kwargs (it reads `dtype` only)
        from trl.trainer.utils import create_model_from_path

        assert _dtypes(create_model_from_path(bf16_dir, **dict(init or {}))) == {expected}


def test_sft_with_a_default_config_moves_every_parameter_of_a_bf16_checkpoint(bf16_dir, tmp_path):
    """The issue's case: in bfloat16, AdamW's small updates round away and some parameters never move."""
    from safetensors.torch import load_file

    before = load_file(f"{bf16_dir}/model.safetensors")
    args = SFTConfig(output_dir=str(tmp_path / "out"), **{**COMMON, "max_steps": 9, "learning_rate": 1e-5})
    trainer = SFTTrainer(bf16_dir, args=args, train_dataset=Dataset.from_dict({"text": ["ab ab 1", "ab 2"] * 8}))
    trainer.train()
    after = {name: p.detach() for name, p in trainer.policy.named_parameters()}
    unmoved = [name for name, value in after.items() if torch.equal(value, before[name].float())]
    assert unmoved == [] and len(after) == len(before)


def test_grpo_loads_its_policy_and_reference_in_float32(bf16_dir, tmp_path, addition_dataset):
    trainer = GRPOTrainer(bf16_dir, length_reward, tiny_config(tmp_path, beta=0.04), train_dataset=addition_dataset)
    assert _dtypes(trainer.policy) == {torch.float32} and _dtypes(trainer.ref_model) == {torch.float32}


@pytest.mark.parametrize("ref_init,expected", [(None, torch.float32), ({"dtype": "auto"}, torch.bfloat16)])
def test_dpo_loads_policy_and_named_reference_in_float32_unless_told(bf16_dir, tmp_path, ref_init, expected):
    pairs = Dataset.from_dict({"prompt": ["1+1=", "2+2="], "chosen": ["2", "4"], "rejected": ["3", "5"]})
    args = DPOConfig(output_dir=str(tmp_path / "out"), ref_model_init_kwargs=ref_init, **COMMON)
    trainer = DPOTrainer(bf16_dir, ref_model=bf16_dir, args=args, train_dataset=pairs)
    assert _dtypes(trainer.policy) == {torch.float32} and _dtypes(trainer.ref_model) == {expected}


@pytest.mark.parametrize("init,expected", [(None, torch.bfloat16), ({"dtype": "float32"}, torch.float32),
                                           ({"torch_dtype": "float32"}, torch.float32)])
def test_reward_models_by_name_load_with_model_init_kwargs_dtype_as_in_trl(tmp_path, tokenizer, init, expected):
    """TRL loads a reward model given by name with model_init_kwargs and no float32 default: its checkpoint's dtype
    unless they say otherwise."""
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    from posttrain import GRPOConfig
    from posttrain.rewards import resolve_reward_funcs

    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    AutoModelForSequenceClassification.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    funcs = resolve_reward_funcs([str(tmp_path / "rm")], GRPOConfig(output_dir=str(tmp_path), model_init_kwargs=init))
    assert _dtypes(funcs[0].model) == {expected}
