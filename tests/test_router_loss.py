"""A mixture-of-experts model's router load-balancing loss, added as TRL 1.16 adds it: SFT's and DPO's step-1 loss and
aux_loss equal TRL's own trainers' on a tiny Qwen3-MoE; GRPO adds it over every row; the coefficient is resolved
from the config or the model, and refused for a model without routers."""

import pytest
import torch
from conftest import length_reward, tiny_config
from datasets import Dataset
from test_dpo_trainer import PAIRS as PREFERENCES
from test_sft_trainer import PAIRS, sft_config

from posttrain.configs import ConfigError, DPOConfig
from posttrain.dpo.trainer import DPOTrainer
from posttrain.grpo.trainer import GRPOTrainer
from posttrain.models.router import RouterLoss, router_coefficient
from posttrain.sft.trainer import SFTTrainer
from posttrain.testing import tiny_model, tiny_moe_model

COMMON = dict(use_cpu=True, report_to="none", max_steps=1, logging_steps=1, save_strategy="no",
              gradient_checkpointing=False, train_sampling_strategy="sequential", learning_rate=1e-2)


def _first(history: list[dict], key: str) -> float:
    return next(h[key] for h in history if key in h)


def test_the_coefficient_comes_from_the_config_or_the_model(tokenizer):
    moe = tiny_moe_model(tokenizer)
    assert router_coefficient(moe, None) == pytest.approx(0.001)  # Qwen3-MoE's config declares 0.001
    assert router_coefficient(moe, 0.25) == 0.25
    assert not RouterLoss(router_coefficient(moe, 0.0)).enabled
    dense = tiny_model(tokenizer, hidden=32, layers=1)
    assert router_coefficient(dense, None) == 0.0
    with pytest.raises(ConfigError, match="not a mixture-of-experts model.*remove router_aux_loss_coef"):
        router_coefficient(dense, 0.01)
    # a model with routers but no coefficient of its own (GLM-4-MoE, Nemotron-H): off unless asked for, as in TRL
    from transformers import PretrainedConfig

    routed = torch.nn.Linear(1, 1)
    routed.config = PretrainedConfig(output_router_logits=False)
    assert router_coefficient(routed, None) == 0.0 and router_coefficient(routed, 0.1) == 0.1


def test_generation_never_sees_router_logits(tokenizer):
    """output_router_logits is on only inside the collecting block, and the block's term is coef * share * aux."""
    moe = tiny_moe_model(tokenizer).train()
    router = RouterLoss(0.5)
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])
    mask = (ids != 0).long()
    with router.collecting(moe, 0.5) as term:
        out = moe(input_ids=ids, attention_mask=mask)
    assert moe.config.output_router_logits is False
    assert torch.allclose(term[0], 0.25 * out.aux_loss)
    assert router.metrics(lambda t: t) == {"aux_loss": pytest.approx(float(out.aux_loss.detach()))}


@pytest.mark.parametrize("coef", [None, 0.5])
def test_sft_loss_and_aux_loss_equal_trls(tokenizer, tmp_path, coef):
    """Two micro-batches per step (gradient accumulation), so the router loss's share of the step is tested too."""
    trl = pytest.importorskip("trl")
    options = dict(per_device_train_batch_size=8, gradient_accumulation_steps=2, router_aux_loss_coef=coef)
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), bf16=False, **COMMON, **options)
    theirs = trl.SFTTrainer(tiny_moe_model(tokenizer), args=args, train_dataset=Dataset.from_dict(PAIRS),
                            processing_class=tokenizer)
    theirs.train()
    ours = SFTTrainer(tiny_moe_model(tokenizer), args=sft_config(tmp_path, **COMMON, **options),
                      train_dataset=Dataset.from_dict(PAIRS), processing_class=tokenizer)
    ours.train()
    for key in ("aux_loss", "loss"):
        assert _first(ours.state.log_history, key) == pytest.approx(_first(theirs.state.log_history, key),
                                                                    rel=1e-5), key


def test_dpo_loss_and_aux_loss_equal_trls(tokenizer, tmp_path):
    trl = pytest.importorskip("trl")
    options = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, router_aux_loss_coef=0.5)
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), bf16=False, **COMMON, **options)
    theirs = trl.DPOTrainer(tiny_moe_model(tokenizer), args=args, ref_model=tiny_moe_model(tokenizer),
                            train_dataset=Dataset.from_dict(PREFERENCES), processing_class=tokenizer)
    theirs.train()
    ours = DPOTrainer(tiny_moe_model(tokenizer), args=DPOConfig(output_dir=str(tmp_path / "ours"), **COMMON,
                                                                **options),
                      train_dataset=Dataset.from_dict(PREFERENCES), processing_class=tokenizer)
    ours.train()
    for key in ("aux_loss", "loss"):
        assert _first(ours.state.log_history, key) == pytest.approx(_first(theirs.state.log_history, key),
                                                                    rel=1e-5), key


def test_grpo_adds_it_over_every_row(tokenizer, addition_dataset, tmp_path):
    """A constant reward leaves every advantage 0: the policy loss is 0 and its rows could be skipped, but the router
    loss covers them, so the loss is exactly coef * aux_loss and the routers (only they) move."""
    def constant(completions, **kwargs):
        return [1.0] * len(completions)

    coef = 0.5
    model = tiny_moe_model(tokenizer)
    gates = {n: p.detach().clone() for n, p in model.named_parameters() if "mlp.gate." in n}
    trainer = GRPOTrainer(model, constant, tiny_config(tmp_path, max_steps=1, router_aux_loss_coef=coef),
                          train_dataset=addition_dataset, processing_class=tokenizer)
    assert not trainer.skip_zero_advantage_rows and not trainer.packing and not trainer.share_prompts
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == coef  # TRL's attributes
    trainer.train()
    record = trainer.state.log_history[0]
    assert record["aux_loss"] > 0 and record["loss"] == pytest.approx(coef * record["aux_loss"], rel=1e-5)
    moved = {n for n, p in trainer.policy.named_parameters() if n in gates and not torch.equal(p, gates[n])}
    assert moved == set(gates)


def test_off_by_default_for_dense_models_and_at_zero(tokenizer, addition_dataset, tmp_path):
    trainer = GRPOTrainer(tiny_moe_model(tokenizer), length_reward,
                          tiny_config(tmp_path, max_steps=1, router_aux_loss_coef=0.0),
                          train_dataset=addition_dataset, processing_class=tokenizer)
    trainer.train()
    assert "aux_loss" not in trainer.state.log_history[0]
    with pytest.raises(ConfigError, match="not a mixture-of-experts model"):
        SFTTrainer(tiny_model(tokenizer, hidden=32, layers=1),
                   args=sft_config(tmp_path / "dense", router_aux_loss_coef=0.1),
                   train_dataset=Dataset.from_dict(PAIRS), processing_class=tokenizer)
