"""export_weights: merged LoRA weights with plain names, exact, not aliased, not disturbing training."""

import copy

import pytest
import torch

from posttrain.testing import tiny_model
from posttrain.weights import export_weights

pytestmark = pytest.mark.peft


def _lora_model(tokenizer, **lora_kwargs):
    from peft import LoraConfig, get_peft_model

    model = tiny_model(tokenizer, hidden=32, layers=2)
    kwargs = dict(r=4, lora_alpha=8, target_modules="all-linear", modules_to_save=["lm_head"], task_type="CAUSAL_LM")
    kwargs.update(lora_kwargs)
    peft_model = get_peft_model(model, LoraConfig(**kwargs))
    # adapters start as a no-op (B = 0): give them, and the saved lm_head copy, values that matter
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name or "modules_to_save" in name or "lora_magnitude" in name:
                p.add_(torch.randn_like(p) * 0.05)
    return peft_model


@pytest.mark.parametrize("variant", [{}, {"use_rslora": True}, {"use_dora": True}])
def test_export_equals_merge_and_unload_of_a_copy(tokenizer, variant):
    model = _lora_model(tokenizer, **variant)
    exported = dict(export_weights(model))
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(exported) == set(reference)
    assert not any("lora_" in k or "base_layer" in k or k.startswith("base_model") for k in exported)
    for key, value in reference.items():
        assert torch.equal(exported[key], value), key


def test_exported_tensors_survive_unmerge_and_optimizer_step(tokenizer):
    """The TRL regression: a merge, state_dict, unmerge sequence handed out tensors that changed under it."""
    model = _lora_model(tokenizer)
    exported = {k: v for k, v in export_weights(model)}
    snapshot = {k: v.clone() for k, v in exported.items()}
    model.merge_adapter()
    model.unmerge_adapter()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    ids = torch.tensor([[5, 6, 7, 8]])
    model(input_ids=ids).logits.sum().backward()
    optimizer.step()
    for key in snapshot:
        assert torch.equal(exported[key], snapshot[key]), key
    # the trained lm_head copy did move, so the check above is not vacuous
    assert not torch.equal(dict(export_weights(model))["lm_head.weight"], snapshot["lm_head.weight"])


def test_full_model_export_is_not_aliased_to_trainable_weights(tokenizer):
    model = tiny_model(tokenizer, hidden=32, layers=1)
    exported = dict(export_weights(model))
    before = {k: v.clone() for k, v in exported.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert all(torch.equal(exported[k], before[k]) for k in before)
    assert set(exported) == set(model.state_dict())


def test_training_forward_is_bit_identical_after_export(tokenizer):
    model = _lora_model(tokenizer)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    before = model(input_ids=ids).logits
    list(export_weights(model))
    after = model(input_ids=ids).logits
    assert torch.equal(before, after)
    assert not any(getattr(m, "merged", False) for m in model.modules())


def test_exported_names_load_strictly_into_the_base_architecture(tokenizer):
    from transformers import AutoModelForCausalLM

    model = _lora_model(tokenizer)
    merged = copy.deepcopy(model).merge_and_unload()
    # the trained lm_head copy no longer equals the embedding: the merged architecture is untied
    assert merged.config.tie_word_embeddings is False
    fresh = AutoModelForCausalLM.from_config(merged.config)
    fresh.load_state_dict(dict(export_weights(model)), strict=True)
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.allclose(fresh(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-6)


def test_embeddings_tied_check(tokenizer):
    from posttrain.weights import embeddings_still_tied

    model = _lora_model(tokenizer)
    assert not embeddings_still_tied(model.get_base_model(), dict(export_weights(model)))
    plain = tiny_model(tokenizer, hidden=32, layers=1)
    assert embeddings_still_tied(plain, dict(export_weights(plain)))
