"""SFT on a vision-language model with images, as TRL 1.16 takes them: each row's images go through the processor with
its conversation, the pixels ride with the row (model_inputs) into the forward; the per-token log-probs and the loss of
one batch equal those of TRL's own collator (DataCollatorForVisionLanguageModeling) through the same tiny model, for
LLaVA (pixel_values per image), Gemma 3 (pooled image tokens, token_type_ids' bidirectional image attention),
Qwen2.5-VL and Qwen3.5 (flattened patches, image_grid_thw, mm_token_type_ids' rotary positions; Qwen3.5's Gated
DeltaNet layers); TRL's refusals are one sentence each."""

import copy

import pytest
import torch
from datasets import Dataset

from posttrain.testing import VISION_PROCESSORS, tiny_vision_processor
from tests import vlm_data

FAMILIES = ("llava", "qwen2_5_vl")
# what each family's rows carry into the forward: pixels per image (LLaVA, Gemma 3) or flattened patches with their
# grid (Qwen-VL), and the per-token types derived from the ids
CARRIED = {"llava": {"pixel_values"}, "gemma3": {"pixel_values", "token_type_ids"},
           "qwen2_5_vl": {"pixel_values", "image_grid_thw", "mm_token_type_ids"},
           "qwen3_5": {"pixel_values", "image_grid_thw", "mm_token_type_ids"}}


@pytest.fixture(scope="module")
def vlms():
    return {family: tiny_vision_processor(family) for family in VISION_PROCESSORS}


def _trainer(model, processor, rows, tmp_path, **overrides):
    from posttrain import SFTConfig, SFTTrainer

    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=len(rows), max_steps=1, report_to="none",
                  use_cpu=True, save_strategy="no", learning_rate=1e-2, logging_steps=1)
    values.update(overrides)
    return SFTTrainer(model, args=SFTConfig(**values), train_dataset=Dataset.from_list(rows),
                      processing_class=processor)


def _trl_token_logps(model, batch) -> list[torch.Tensor]:
    """Each row's target log-probs [T_i] as TRL's loss sees them: the model's logits at each labelled token."""
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    labels = batch["labels"][:, 1:]
    logps = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return [logps[i][labels[i] != -100] for i in range(len(labels))]


def _ours_token_logps(trainer, batch) -> list[torch.Tensor]:
    from posttrain.models.logprobs import next_token_logprobs

    with torch.no_grad():
        logps, *_ = next_token_logprobs(trainer.model, batch.input_ids, batch.attention_mask, batch.position_ids,
                                        batch.source_mask, batch.targets, model_inputs=batch.model_inputs)
    counts = batch.source_mask.sum(1).tolist()
    return list(torch.split(logps, counts))


def _row_order(ours, theirs) -> list[int]:
    """For each of our batch's rows, the TRL batch row with the same tokens."""
    def tokens(ids, mask):
        return [tuple(i[m.bool()].tolist()) for i, m in zip(ids, mask)]
    theirs_rows = tokens(theirs["input_ids"], theirs["attention_mask"])
    return [theirs_rows.index(row) for row in tokens(ours.input_ids, ours.attention_mask)]


@pytest.mark.parametrize("family, data", [(family, "language_modeling") for family in VISION_PROCESSORS] +
                         [(family, "prompt_completion") for family in FAMILIES])
def test_a_batch_s_log_probs_and_loss_equal_trls_collator_through_the_same_model(vlms, family, data, tmp_path):
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    model, processor = vlms[family]
    rows = getattr(vlm_data, data)(4)
    trainer = _trainer(model, processor, rows, tmp_path)
    ours = next(iter(trainer.get_train_dataloader()))
    assert set(ours.model_inputs) == CARRIED[family]
    collator = DataCollatorForVisionLanguageModeling(processor, completion_only_loss=data == "prompt_completion")
    theirs = collator(copy.deepcopy(rows))
    order = _row_order(ours, theirs)
    assert sorted(order) == [0, 1, 2, 3]
    trl_logps = _trl_token_logps(model, theirs)
    our_logps = _ours_token_logps(trainer, ours)
    for mine, j in zip(our_logps, order):
        torch.testing.assert_close(mine, trl_logps[j], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        trl_loss = model(**theirs).loss
        terms, _, _ = trainer._forward(ours, None)
    torch.testing.assert_close(terms.mean(), trl_loss, atol=1e-5, rtol=1e-5)


def test_training_moves_the_language_model_and_the_projector_on_images(vlms, tmp_path):
    model, processor = tiny_vision_processor("qwen2_5_vl", seed=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = _trainer(model, processor, vlm_data.language_modeling(4), tmp_path, max_steps=2,
                       per_device_train_batch_size=2)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    moved = {n for n, p in trainer.policy.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert any("visual" in n for n in moved) and any("language_model" in n for n in moved)


def test_text_only_rows_train_beside_image_rows(vlms, tmp_path):
    model, processor = vlms["qwen2_5_vl"]
    rows = vlm_data.language_modeling(4)
    rows[1]["images"] = []  # TRL's test_train_vlm_text_only_data: a row without images in a vision dataset
    trainer = _trainer(model, processor, rows, tmp_path)
    batch = next(iter(trainer.get_train_dataloader()))
    assert int(batch.model_inputs["image_grid_thw"].shape[0]) == sum(len(r["images"]) for r in rows)
    trainer.train()
    assert trainer.state.global_step == 1


@pytest.mark.parametrize("option, said", [
    (dict(packing=True), "packing=True is not supported with images"),
    (dict(padding_free=True), "padding_free=True is not supported with images"),
    (dict(max_length=64, truncation_mode="keep_end"), "truncation_mode='keep_end' is not supported with images"),
])
def test_options_that_cannot_carry_images_are_refused_as_trl_refuses_them(vlms, tmp_path, option, said):
    from posttrain.configs import ConfigError

    model, processor = vlms["qwen2_5_vl"]
    with pytest.raises(ConfigError, match=f"^{said}"):
        _trainer(model, processor, vlm_data.language_modeling(2), tmp_path, **option)


def test_a_vision_dataset_with_a_text_model_is_refused(tokenizer, tmp_path):
    from posttrain.configs import ConfigError
    from posttrain.testing import tiny_model

    with pytest.raises(ConfigError, match=r"^SFT's train_dataset has images .* but the processing class is a "):
        _trainer(tiny_model(tokenizer), tokenizer, vlm_data.language_modeling(2), tmp_path)


def test_max_length_that_cuts_an_image_s_tokens_is_one_sentence(vlms, tmp_path):
    from posttrain.data import DataError

    model, processor = vlms["qwen2_5_vl"]
    with pytest.raises(DataError, match=r"^Row 0 of train_dataset has image tokens beyond max_length=20 "):
        _trainer(model, processor, vlm_data.language_modeling(2), tmp_path, max_length=20)


def test_images_and_their_placeholders_must_agree(vlms, tmp_path):
    from posttrain.data import DataError

    model, processor = vlms["qwen2_5_vl"]
    rows = vlm_data.language_modeling(2)
    for row, blocks in zip(rows, (2, 1)):  # the content as parts with image blocks, the first row's one too many
        row["messages"] = [{"role": "user", "content": [{"type": "image", "text": None}] * blocks +
                            [{"type": "text", "text": "Which?"}]}, {"role": "assistant", "content": [
                                {"type": "text", "text": "This."}]}]
    with pytest.raises(DataError, match=r"^Row 0 of train_dataset has 1 image\(s\) and 2 place\(s\) for one"):
        _trainer(model, processor, rows, tmp_path)


@pytest.mark.multiproc
def test_a_prepared_dataset_holds_no_pixels_until_a_batch_takes_its_rows(vlms, tmp_path):
    """As TRL's collators process each batch's images, a prepared map-style dataset keeps each row's ids and where
    its images are (RowPixels), never a whole dataset's pixels; a batch makes its rows' pixels from the dataset."""
    from posttrain.sequences.images import RowPixels

    model, processor = vlms["qwen2_5_vl"]
    trainer = _trainer(model, processor, vlm_data.language_modeling(4), tmp_path)
    held = trainer.batches.rows.model_inputs.rows
    assert len(held) == 4 and all(isinstance(row, RowPixels) for row in held)
    assert not any(isinstance(value, torch.Tensor) for row in held for value in vars(row).values())
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch.model_inputs["pixel_values"].shape[0] == 16 * 5  # 5 images of 16x16 in patches of 4: 16 each


def test_evaluation_on_image_rows_gives_trls_eval_loss(vlms, tmp_path):
    """An eval_dataset with images: evaluate() reads each row's pixels as training does, and its eval_loss equals
    TRL's SFTTrainer.evaluate() on the same model and rows (its collator processing the images; one batch, so both are
    the batch's mean over its completion tokens)."""
    import copy

    from trl import SFTConfig as TRLConfig
    from trl import SFTTrainer as TRLTrainer

    from posttrain import SFTConfig, SFTTrainer

    model, processor = vlms["qwen2_5_vl"]
    rows = vlm_data.language_modeling(4)
    ours = SFTTrainer(copy.deepcopy(model), processing_class=processor, train_dataset=Dataset.from_list(rows),
                      eval_dataset=Dataset.from_list(rows),
                      args=SFTConfig(output_dir=str(tmp_path / "ours"), per_device_eval_batch_size=4,
                                     report_to="none", use_cpu=True))
    theirs = TRLTrainer(copy.deepcopy(model), processing_class=processor, train_dataset=Dataset.from_list(rows),
                        eval_dataset=Dataset.from_list(rows),
                        args=TRLConfig(output_dir=str(tmp_path / "trl"), per_device_eval_batch_size=4,
                                       report_to="none", use_cpu=True, bf16=False))
    assert ours.evaluate()["eval_loss"] == pytest.approx(theirs.evaluate()["eval_loss"], rel=1e-5)
