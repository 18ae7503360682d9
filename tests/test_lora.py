"""GRPO with LoRA: shared reference, gradient checkpointing, saving, and a separate generator that follows."""

import copy
import os

import pytest
import torch
from conftest import capture_gradients, tiny_config

from posttrain.generation import SamplingParams
from posttrain.generation.transformers_backend import TransformersGenerator
from posttrain.grpo.trainer import GRPOTrainer
from posttrain.models.logprobs import token_logprobs
from posttrain.testing import tiny_model

pytestmark = pytest.mark.peft


def _lora_config(**kw):
    from peft import LoraConfig

    values = dict(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    values.update(kw)
    return LoraConfig(**values)


def five_reward(completions, **kw):
    """The fraction of digits in the completion: varies from the first step, and a LoRA can raise it."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def test_lora_reference_is_the_policy_with_adapters_disabled(tokenizer, addition_dataset, tmp_path):
    trainer = GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), five_reward,
                          tiny_config(tmp_path, beta=0.1, max_steps=3), train_dataset=addition_dataset,
                          processing_class=tokenizer, peft_config=_lora_config())
    assert trainer.ref_model is None  # no second copy of the weights
    trainer.train()
    records = [r for r in trainer.state.log_history if "loss" in r]  # the training steps (not the summary)
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-7)  # adapters start as a no-op
    assert records[-1]["kl"] > 0  # the adapters moved the policy away from the base
    assert os.path.exists(tmp_path / "out" / "adapter_model.safetensors")
    assert not os.path.exists(tmp_path / "out" / "model.safetensors")


def test_pretrained_adapter_is_the_reference_not_the_bare_base(tokenizer, addition_dataset, tmp_path):
    from peft import get_peft_model

    peft_model = get_peft_model(tiny_model(tokenizer, hidden=32, layers=1), _lora_config())
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # a "pre-trained" adapter far from the base
    trainer = GRPOTrainer(peft_model, five_reward, tiny_config(tmp_path, beta=0.1, max_steps=1, learning_rate=0.0),
                          train_dataset=addition_dataset, processing_class=tokenizer)
    trainer.train()
    # policy == frozen copy of its own adapter at step 1 (lr 0): KL to the reference is 0, not the base's KL
    assert trainer.state.log_history[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert all(p.requires_grad == ("lora_" in n and "reference" not in n) for n, p in peft_model.named_parameters())


def test_gradient_checkpointing_with_lora_gives_the_same_gradients(tokenizer, addition_dataset, tmp_path):
    grads = []
    for checkpointing in (False, True):
        trainer = GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=2), five_reward,
                              tiny_config(tmp_path / str(checkpointing), max_steps=1,
                                          gradient_checkpointing=checkpointing), train_dataset=addition_dataset,
                              processing_class=tokenizer, peft_config=_lora_config())
        steps = capture_gradients(trainer)
        trainer.train()
        grads.append(steps[0])
    assert grads[0] and set(grads[0]) == set(grads[1])
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-7), name


@pytest.mark.parametrize("modules_to_save", [None, ["lm_head"]])
def test_save_merged_loads_as_a_plain_model(tokenizer, addition_dataset, tmp_path, modules_to_save):
    from transformers import AutoModelForCausalLM

    trainer = GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), five_reward,
                          tiny_config(tmp_path, max_steps=2, save_merged=True, learning_rate=1e-2),
                          train_dataset=addition_dataset, processing_class=tokenizer,
                          peft_config=_lora_config(modules_to_save=modules_to_save))
    trainer.train()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "merged")
    ids = torch.tensor([[5, 6, 7, 8]])
    reference = copy.deepcopy(trainer.policy).merge_and_unload()
    assert torch.allclose(merged(input_ids=ids).logits, reference(input_ids=ids).logits, atol=1e-5)


def test_separate_generator_follows_the_lora_policy(tokenizer, addition_dataset, tmp_path):
    """A generator with its own copy of the model (the shape of vLLM and server modes) samples the trained weights."""
    base = tiny_model(tokenizer, hidden=32, layers=1)
    engine_model = copy.deepcopy(base)
    trainer = GRPOTrainer(base, five_reward, tiny_config(tmp_path, max_steps=6, learning_rate=3e-2),
                          train_dataset=addition_dataset, processing_class=tokenizer, peft_config=_lora_config())
    trainer.generator = TransformersGenerator(engine_model, tokenizer,
                                              SamplingParams.from_config(trainer.args), shares_policy=False)
    trainer.train()
    trainer.generator.sync_weights(__import__("posttrain.weights", fromlist=["x"]).export_weights(trainer.model))
    prompt = torch.tensor([tokenizer("1+2=", add_special_tokens=False).input_ids])
    completion = torch.tensor([tokenizer("55", add_special_tokens=False).input_ids])
    masks = (torch.ones_like(prompt, dtype=torch.bool), torch.ones_like(completion, dtype=torch.bool))
    with torch.no_grad():
        policy, _ = token_logprobs(trainer.policy, prompt, masks[0], completion, masks[1])
        engine, _ = token_logprobs(engine_model, prompt, masks[0], completion, masks[1])
        untrained, _ = token_logprobs(tiny_model(tokenizer, hidden=32, layers=1), prompt, masks[0], completion,
                                      masks[1])
    assert torch.allclose(engine, policy, atol=1e-5)
    assert not torch.allclose(engine, untrained, atol=1e-3)  # the policy did move
    rewards = [r["reward"] for r in trainer.state.log_history if "reward" in r]
    assert max(rewards[3:]) > rewards[0]  # the generator sampled the improving policy


@pytest.mark.parametrize("kind", ["PromptTuningConfig", "PromptEncoderConfig"])
def test_adapters_that_add_virtual_tokens_are_refused_at_construction(tokenizer, addition_dataset, tmp_path, kind):
    """Their virtual tokens precede every input, which the target masks do not count: step 1 used to crash."""
    import peft

    from posttrain.configs import ConfigError

    config = getattr(peft, kind)(task_type="CAUSAL_LM", num_virtual_tokens=4, **(
        {"encoder_hidden_size": 16} if kind == "PromptEncoderConfig" else {}))
    with pytest.raises(ConfigError, match=rf"^peft_config is a {kind}, which adds trained virtual tokens to every "
                                          r"input, .*: use LoRA \(LoraConfig, --use_peft\), another adapter, or prefix "
                                          r"tuning \(PrefixTuningConfig\)\.$"):
        GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), five_reward, tiny_config(tmp_path),
                    train_dataset=addition_dataset, processing_class=tokenizer, peft_config=config)
    # the same adapter on a model that arrives wrapped (peft.get_peft_model): refused the same way, not at step 1
    wrapped = peft.get_peft_model(tiny_model(tokenizer, hidden=32, layers=1), config)
    with pytest.raises(ConfigError, match=rf"^The model is a PeftModel whose active adapter is a {kind}, which adds "
                                          r"trained virtual tokens to every input"):
        GRPOTrainer(wrapped, five_reward, tiny_config(tmp_path), train_dataset=addition_dataset,
                    processing_class=tokenizer)


def _moe(tokenizer):
    """A tiny Qwen3-MoE (transformers 5 fuses its experts' linear layers into one module's parameters)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))


@pytest.mark.parametrize("targets, unmatched", [
    (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], []),
    (["q_proj", "v_proj", "gate_prj"], ["gate_prj"]),
], ids=["moe-experts", "a-typo"])
def test_lora_targets_adapt_what_trls_do_and_those_matching_nothing_are_said(tokenizer, tmp_path, caplog, targets,
                                                                           unmatched):
    """On Qwen3-MoE the usual target list's gate_proj, up_proj and down_proj name no module (the experts are fused):
    peft adapts the experts' fused parameters for them, as under TRL, and posttrain adapts what TRL's SFTTrainer
    adapts. An entry peft adapts nothing for (a typo beside names that match) trains the others, as in TRL, with a
    warning naming it."""
    from datasets import Dataset
    from trl import SFTConfig as TRLConfig
    from trl import SFTTrainer as TRLTrainer

    from posttrain import SFTConfig, SFTTrainer

    data = Dataset.from_dict({"text": ["1+1=2", "2+2=4"]})
    common = dict(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to="none",
                  use_cpu=True, save_strategy="no")
    theirs = TRLTrainer(_moe(tokenizer), args=TRLConfig(**common), train_dataset=data, processing_class=tokenizer,
                        peft_config=_lora_config(target_modules=targets))
    with caplog.at_level("WARNING", logger="posttrain"):
        ours = SFTTrainer(_moe(tokenizer), args=SFTConfig(**common), train_dataset=data, processing_class=tokenizer,
                          peft_config=_lora_config(target_modules=targets))
    said = [r.getMessage() for r in caplog.records if "match no module" in r.getMessage()]
    assert said == ([f"LoRA target modules {unmatched} match no module of the model (its linear layers: k_proj, "
                     "lm_head, o_proj, q_proj, v_proj). peft adapts the others, as in TRL; name only modules of this "
                     "model to silence this."] if unmatched else [])
    trained = sorted(n for n, p in ours.policy.named_parameters() if p.requires_grad)
    assert trained == sorted(n for n, p in theirs.model.named_parameters() if p.requires_grad)
    assert any("experts" in n for n in trained) == (not unmatched)
    ours.train()
    assert ours.state.global_step == 1


def test_prefix_tuning_is_refused_for_grpo_whose_decode_would_drop_the_prefix(tokenizer, addition_dataset, tmp_path):
    from peft import PrefixTuningConfig, get_peft_model

    from posttrain.configs import ConfigError

    config = PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    refused = r"^Prefix tuning \(PrefixTuningConfig\) trains SFT and DPO here, not GRPO: .*use LoRA"
    with pytest.raises(ConfigError, match=refused):  # given as peft_config
        GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), five_reward, tiny_config(tmp_path),
                    train_dataset=addition_dataset, processing_class=tokenizer, peft_config=config)
    with pytest.raises(ConfigError, match=refused):  # or a model that comes with a prefix
        GRPOTrainer(get_peft_model(tiny_model(tokenizer, hidden=32, layers=1), config), five_reward,
                    tiny_config(tmp_path), train_dataset=addition_dataset, processing_class=tokenizer)


@pytest.mark.parametrize("trainer_kind", ["sft", "dpo"])
def test_prefix_tuning_trains_its_prefix_only(tokenizer, tmp_path, trainer_kind):
    """Prefix tuning's virtual tokens live in the attention's keys and values: the prefix moves, the base does not."""
    from datasets import Dataset
    from peft import PrefixTuningConfig

    from posttrain import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    config = PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    model = tiny_model(tokenizer, hidden=32, layers=1)
    base = {name: p.detach().clone() for name, p in model.named_parameters()}
    common = dict(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2,
                  save_strategy="no", gradient_checkpointing=False, use_cpu=True, report_to="none")
    if trainer_kind == "sft":
        trainer = SFTTrainer(model, args=SFTConfig(**common), processing_class=tokenizer, peft_config=config,
                             train_dataset=Dataset.from_dict({"text": ["ab ab 1", "ab 2", "a 3", "b 4"]}))
    else:
        pairs = Dataset.from_dict({"prompt": ["1+1=", "2+2=", "3+3=", "1+2="], "chosen": ["2", "4", "6", "3"],
                                   "rejected": ["3", "5", "7", "4"]})
        trainer = DPOTrainer(model, args=DPOConfig(**common), processing_class=tokenizer, peft_config=config,
                             train_dataset=pairs)
    prefix = {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if p.requires_grad}
    assert prefix and all("prompt_encoder" in n for n in prefix)
    trainer.train()
    after = dict(trainer.policy.named_parameters())
    assert any(not torch.equal(after[n], p) for n, p in prefix.items())
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)
