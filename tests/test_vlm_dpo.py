"""DPO on a vision-language model with preference pairs that have images, as TRL 1.16 takes them: each pair's images in
its prompt, processed with it, both of its sequences carrying the prompt's pixels. The pairs' sequence log-probs and
the loss equal those of TRL's own DataCollatorForVisionPreference batch through the same tiny model (LLaVA,
Qwen2.5-VL), and so does the loss TRL's DPOTrainer computes on that batch against a reference of other weights."""

import copy

import pytest
import torch

from posttrain.testing import VISION_PROCESSORS, tiny_vision_processor
from tests import vlm_data

FAMILIES = VISION_PROCESSORS


def _trainer(model, ref_model, processor, rows, tmp_path, **overrides):
    return vlm_data.reference_trainer("DPO", model, ref_model, processor, rows, tmp_path, **overrides)


def _sequence_logps(model, batch, pixels: dict) -> torch.Tensor:
    """[2P] summed completion log-probs of a TRL vision preference batch (chosen rows first)."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **pixels).logits
    targets = batch["input_ids"][:, 1:]
    logps = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, targets[..., None])[..., 0]
    return (logps * batch["completion_mask"][:, 1:]).sum(1)


@pytest.mark.parametrize("family", FAMILIES)
def test_pair_log_probs_and_loss_equal_trls_vision_preference_batch(family, tmp_path):
    from trl.trainer.dpo_trainer import DataCollatorForVisionPreference

    from posttrain.models.logprobs import next_token_logprobs

    model, processor = tiny_vision_processor(family)
    ref_model, _ = tiny_vision_processor(family, seed=1)
    rows = vlm_data.preference(4)
    trainer = _trainer(model, ref_model, processor, rows, tmp_path)
    ours = next(iter(trainer.get_train_dataloader()))
    assert ours.sequences.model_inputs is not None
    theirs = DataCollatorForVisionPreference(processor)(copy.deepcopy(rows))
    pixels = {k: v for k, v in theirs.items() if k not in ("input_ids", "attention_mask", "completion_mask")}
    trl_logps = _sequence_logps(model, theirs, pixels).view(2, -1)  # [chosen, rejected] x P
    with torch.no_grad():
        loss, _, _, _ = trainer._micro_loss(ours, grad=False)
        logps, _, _ = next_token_logprobs(trainer._no_grad_model, *trainer._inputs(ours),
                                          model_inputs=ours.sequences.model_inputs)
        mine = trainer._sequence_logps(logps, ours).view(-1, 2)  # [P, (chosen, rejected)]
    # the same pairs (our batch is shuffled): each pair's (chosen, rejected) log-probs
    torch.testing.assert_close(torch.tensor(sorted(mine.tolist())), torch.tensor(sorted(trl_logps.T.tolist())),
                               atol=1e-5, rtol=1e-5)
    trl_loss = vlm_data.trl_loss("DPO", model, ref_model, processor, rows, theirs, tmp_path / "trl")
    torch.testing.assert_close(loss / 4, trl_loss, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("precompute", [False, True], ids=["reference-each-step", "precompute_ref_log_probs"])
def test_a_run_with_image_pairs_and_a_text_pair_trains(tmp_path, precompute):
    """TRL refuses precompute_ref_log_probs with images; posttrain's precomputed pass carries the pixels as every
    other forward does, and trains as the reference computed each step does."""
    model, processor = tiny_vision_processor("qwen2_5_vl")
    rows = vlm_data.preference(4)
    rows[2]["images"] = []  # a text-only pair among image pairs
    trainer = _trainer(model, None, processor, rows, tmp_path, max_steps=2, per_device_train_batch_size=2,
                       precompute_ref_log_probs=precompute)
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == 2 and all(torch.isfinite(torch.tensor(e["loss"])) for e in logged)
    assert logged[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # the policy starts as its reference


def test_padding_free_with_images_is_refused(tmp_path):
    from posttrain.configs import ConfigError

    model, processor = tiny_vision_processor("qwen2_5_vl")
    with pytest.raises(ConfigError, match=r"^padding_free=True is not supported with images \(train_dataset has"):
        _trainer(model, None, processor, vlm_data.preference(2), tmp_path, padding_free=True)
