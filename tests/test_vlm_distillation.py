"""Distillation of a vision-language student from a vision-language teacher on prompts with images, as TRL 1.16's
DistillationTrainer takes them: the student samples with the prompts' pixels, and both models read them again for the
divergence. The loss, entropy and gradient equal TRL's _compute_loss on the same completions and the same multimodal
inputs (Qwen2.5-VL: flattened patches, image_grid_thw and mm_token_type_ids)."""

import functools
import inspect
import types

import pytest
import torch
from datasets import Dataset

from posttrain.testing import tiny_vision_processor
from tests import vlm_data


def _trainer(student, teacher, processor, tmp_path, **overrides):
    from posttrain import DistillationConfig, DistillationTrainer

    values = dict(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4,
                  max_completion_length=5, learning_rate=1e-2, logging_steps=1, save_strategy="no",
                  gradient_checkpointing=False, use_cpu=True, seed=0, report_to="none", beta=0.5)
    values.update(overrides)
    return DistillationTrainer(student, teacher, args=DistillationConfig(**values),
                               train_dataset=Dataset.from_list(vlm_data.prompt_only(4)), processing_class=processor)


def _trl_loss(trainer, batch):
    """TRL 1.16's DistillationTrainer._compute_loss on the batch and its multimodal inputs, with a stand-in for the
    trainer (the attributes the method reads)."""
    import trl

    student, teacher = trainer.policy, trainer.teacher_model
    stand_in = types.SimpleNamespace(_is_vlm=True, teacher_model=teacher, beta=trainer.args.beta,
                                     temperature=trainer.args.temperature,
                                     model_kwarg_keys=inspect.signature(student.forward).parameters.keys(),
                                     accelerator=types.SimpleNamespace(unwrap_model=lambda m: m, is_main_process=True),
                                     _forward_redirection=lambda wrapper, plain, fn, *a, **k: fn(*a, **k))
    stand_in._get_last_hidden_state = functools.partial(trl.DistillationTrainer._get_last_hidden_state, stand_in)
    r = batch.rollouts
    inputs = {"prompt_ids": r.prompt_ids, "prompt_mask": r.prompt_mask, "completion_ids": r.completion_ids,
              "completion_mask": r.completion_mask, **r.forward_inputs()}
    return trl.DistillationTrainer._compute_loss(stand_in, student, inputs, r.completion_mask.sum())


def test_loss_entropy_and_gradient_equal_trls_with_the_images(tmp_path):
    student, processor = tiny_vision_processor("qwen2_5_vl")
    teacher, _ = tiny_vision_processor("qwen2_5_vl", seed=3)
    trainer = _trainer(student, teacher, processor, tmp_path)
    batch = trainer.rollout.scored_batch(trainer.rounds, 1).batch
    assert batch.rollouts.model_inputs is not None
    params = [p for p in trainer.policy.parameters() if p.requires_grad]
    loss, entropy_sum, valid = _trl_loss(trainer, batch)
    theirs = torch.autograd.grad(loss, params, allow_unused=True)
    divergence, entropy = trainer.rollout.divergence(trainer.model, batch)
    ours_loss = divergence.sum() / batch.loss_mask.sum()
    ours = torch.autograd.grad(ours_loss, params, allow_unused=True)
    assert int(valid) == divergence.numel() == int(batch.loss_mask.sum())
    assert float(ours_loss) == pytest.approx(float(loss), rel=1e-5)
    assert float(entropy.sum()) == pytest.approx(float(entropy_sum), rel=1e-5)
    for a, b in zip(ours, theirs):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)
    trainer.train()
    assert trainer.state.global_step == 1


def test_a_text_teacher_for_prompts_with_images_is_refused(tmp_path, tokenizer):
    from posttrain.configs import ConfigError
    from posttrain.testing import tiny_model

    student, processor = tiny_vision_processor("qwen2_5_vl")
    teacher = tiny_model(processor.tokenizer, hidden=16, layers=1)
    with pytest.raises(ConfigError, match=r"^The prompts have images, and the teacher is a \w+, which cannot read"):
        _trainer(student, teacher, processor, tmp_path)
