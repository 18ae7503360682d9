"""Distillation of a vision-language student from a vision-language teacher on prompts with images, as TRL 1.16's
DistillationTrainer takes them: the student samples with the prompts' pixels, and both models read them again for the
divergence. The loss, entropy and gradient equal TRL's _compute_loss on the same completions and the same multimodal
inputs, on the four tiny families (LLaVA, whose vision tower's last layer gets no gradient, as in TRL; Gemma 3;
Qwen2.5-VL and Qwen3.5: flattened patches, image_grid_thw and mm_token_type_ids)."""

import pytest
from datasets import Dataset
from test_distillation import assert_loss_entropy_and_gradient_equal_trls

from posttrain.testing import VISION_PROCESSORS, tiny_vision_processor
from tests import vlm_data


def _trainer(student, teacher, processor, tmp_path, **overrides):
    from posttrain import DistillationConfig, DistillationTrainer

    values = dict(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4,
                  max_completion_length=5, learning_rate=1e-2, logging_steps=1, save_strategy="no",
                  gradient_checkpointing=False, use_cpu=True, seed=0, report_to="none", beta=0.5)
    values.update(overrides)
    return DistillationTrainer(student, teacher, args=DistillationConfig(**values),
                               train_dataset=Dataset.from_list(vlm_data.prompt_only(4)), processing_class=processor)


@pytest.mark.parametrize("family", VISION_PROCESSORS)
def test_loss_entropy_and_gradient_equal_trls_with_the_images(family, tmp_path):
    student, processor = tiny_vision_processor(family)
    teacher, _ = tiny_vision_processor(family, seed=3)
    trainer = _trainer(student, teacher, processor, tmp_path)
    batch = trainer.rollout.scored_batch(trainer.rounds, 1).batch
    assert batch.rollouts.model_inputs is not None
    assert_loss_entropy_and_gradient_equal_trls(trainer, batch)  # TRL's _compute_loss given the rows' pixels
    trainer.train()
    assert trainer.state.global_step == 1


def test_a_text_teacher_for_prompts_with_images_is_refused(tmp_path, tokenizer):
    from posttrain.configs import ConfigError
    from posttrain.testing import tiny_model

    student, processor = tiny_vision_processor("qwen2_5_vl")
    teacher = tiny_model(processor.tokenizer, hidden=16, layers=1)
    with pytest.raises(ConfigError, match=r"^The prompts have images, and the teacher is a \w+, which cannot read"):
        _trainer(student, teacher, processor, tmp_path)
