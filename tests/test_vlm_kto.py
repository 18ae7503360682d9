"""KTO on a vision-language model with unpaired examples that have images, as TRL 1.16 takes them: each example's
images in its prompt, processed with it; its row and its KL row (its prompt with another example's completion) carry
the prompt's pixels. The examples' completion log-probs equal those of TRL's own DataCollatorForVisionUnpairedPreference
batch through the same tiny model (LLaVA, Qwen2.5-VL), and the loss TRL's KTOTrainer._compute_loss gives on it."""

import copy

import pytest
import torch

from posttrain.testing import VISION_PROCESSORS, tiny_vision_processor
from tests import vlm_data

FAMILIES = VISION_PROCESSORS


def _trainer(model, ref_model, processor, rows, tmp_path, **overrides):
    return vlm_data.reference_trainer("KTO", model, ref_model, processor, rows, tmp_path, **overrides)


@pytest.mark.parametrize("family", FAMILIES)
def test_example_log_probs_and_loss_equal_trls_vision_batch(family, tmp_path):
    from trl.trainer.kto_trainer import DataCollatorForVisionUnpairedPreference

    from posttrain.models.logprobs import next_token_logprobs

    model, processor = tiny_vision_processor(family)
    ref_model, _ = tiny_vision_processor(family, seed=1)
    rows = vlm_data.unpaired_preference(4)
    trainer = _trainer(model, ref_model, processor, rows, tmp_path, loss_type="apo_zero_unpaired")
    ours = next(iter(trainer.get_train_dataloader()))
    assert ours.examples.model_inputs is not None
    theirs = DataCollatorForVisionUnpairedPreference(processor, calculate_kl=False)(copy.deepcopy(rows))
    pixels = {k: v for k, v in theirs.items() if k not in ("input_ids", "attention_mask", "completion_mask",
                                                           "label")}
    with torch.no_grad():
        logits = model(input_ids=theirs["input_ids"], attention_mask=theirs["attention_mask"], **pixels).logits
        targets = theirs["input_ids"][:, 1:]
        trl_logps = (torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, targets[..., None])[..., 0]
                     * theirs["completion_mask"][:, 1:]).sum(1)
        s = ours.examples
        logps, _, _ = next_token_logprobs(trainer._no_grad_model, s.input_ids, s.attention_mask, s.position_ids,
                                          s.source_mask, s.targets, model_inputs=s.model_inputs)
        mine = torch.zeros(ours.size).index_add(0, ours.target_seq, logps)
        ours.ref = torch.stack([trainer._reference_logps(ours)[0], torch.zeros(ours.size)], 1)
        loss, _, _ = trainer._micro_loss(ours, torch.zeros(()), grad=False)
    # the same examples (our batch is shuffled)
    torch.testing.assert_close(mine.sort().values, trl_logps.sort().values, atol=1e-5, rtol=1e-5)
    trl_loss = vlm_data.trl_loss("KTO", model, ref_model, processor, rows, theirs, tmp_path / "trl",
                                 loss_type="apo_zero_unpaired")
    torch.testing.assert_close(loss / ours.size, trl_loss, atol=1e-5, rtol=1e-5)


def test_a_run_with_image_examples_and_their_kl_rows_trains(tmp_path):
    model, processor = tiny_vision_processor("qwen2_5_vl")
    rows = vlm_data.unpaired_preference(4)
    rows[1]["images"] = []  # a text-only example among image examples
    trainer = _trainer(model, None, processor, rows, tmp_path, max_steps=2, per_device_train_batch_size=2)
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch.kl is not None and batch.kl.model_inputs is not None  # the KL rows carry their prompts' pixels
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == 2 and all(torch.isfinite(torch.tensor(e["loss"])) for e in logged)


def test_a_paired_vision_dataset_is_refused_as_trl_refuses_to_unpair_it(tmp_path):
    from posttrain.data import DataError

    model, processor = tiny_vision_processor("qwen2_5_vl")
    with pytest.raises(DataError, match=r"^train_dataset has images and is paired data: images go with "):
        _trainer(model, None, processor, vlm_data.preference(2), tmp_path)
