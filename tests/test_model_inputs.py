"""The model_inputs seam (posttrain/model_inputs.py): each row's extra forward inputs (a vision-language model's pixel
values) travel with the row through GRPO's Rollouts and buffer and through the token rows and their collation:
selected, padded, checkpointed, refused where a layout cannot carry them, and fed to the model's forward."""

import re

import numpy as np
import pytest
import torch

from posttrain.generation import Rollouts
from posttrain.grpo.batch import TrainingBatch, buffer_from_tensors, buffer_tensors
from posttrain.model_inputs import CANNOT_CARRY, ModelInputs, ModelInputsError
from posttrain.models.logprobs import fast_path_available, next_token_logprobs, token_logprobs
from posttrain.sequences.collate import collate
from posttrain.sequences.rows import TokenRows, drop_untrained, pack, prepare, split_long, truncate

IMAGE = 60  # the tiny LLaVA's image token: one image of 8x8 pixels, patches of 4 -> 4 image tokens


def _llava():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=8, patch_size=4),
        text_config=LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64),
        image_token_index=IMAGE, vision_feature_layer=-1, image_seq_length=4)
    return LlavaForConditionalGeneration(config).eval()


def _pixels(seed: int) -> torch.Tensor:
    return torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


def _rollouts() -> Rollouts:
    """Three rows whose prompts each hold one image (4 image tokens), left-padded; completions right-padded."""
    prompts = [[5, IMAGE, IMAGE, IMAGE, IMAGE, 7], [IMAGE, IMAGE, IMAGE, IMAGE, 9], [3, 4, IMAGE, IMAGE, IMAGE, IMAGE, 2]]
    completions = [[11, 12, 13], [14], [15, 16]]
    rows = [(p, c, [0.0] * len(c)) for p, c in zip(prompts, completions)]
    inputs = ModelInputs.from_rows([{"pixel_values": _pixels(i)} for i in range(3)])
    return Rollouts.from_lists(rows, pad_id=0, eos_ids=[1], device="cpu", model_inputs=inputs)


def _reference_logps(model, r: Rollouts) -> torch.Tensor:
    """[N, C] log-probs of the completions from the model's own forward with the rows' inputs."""
    ids = torch.cat([r.prompt_ids, r.completion_ids], 1)
    mask = torch.cat([r.prompt_mask, r.completion_mask], 1).long()
    logits = model(input_ids=ids, attention_mask=mask, **r.forward_inputs()).logits
    c = r.completion_ids.size(1)
    logps = logits[:, -c - 1:-1].float().log_softmax(-1)
    return logps.gather(-1, r.completion_ids.unsqueeze(-1)).squeeze(-1)


def test_rows_are_checked_selected_concatenated_and_batched_in_row_order():
    with pytest.raises(ModelInputsError, match="model_inputs of row 1: 'pixel_values' is list; each input is a tensor"):
        ModelInputs.from_rows([{"pixel_values": torch.zeros(1, 2)}, {"pixel_values": [1, 2]}])
    a, b, c = torch.full((2, 3), 1.0), torch.full((1, 3), 2.0), torch.full((3, 3), 3.0)
    inputs = ModelInputs.from_rows([{"pixel_values": a, "grid": torch.tensor([[1, 2, 1]])}, {}, {"pixel_values": b}])
    assert inputs.names == ["grid", "pixel_values"] and len(inputs) == 3
    assert torch.equal(inputs.batched()["pixel_values"], torch.cat([a, b]))  # the row without adds nothing
    picked = inputs[torch.tensor([2, 0])]
    assert torch.equal(picked.batched()["pixel_values"], torch.cat([b, a]))
    assert inputs.select(torch.tensor([False, True, True])).rows == (inputs.rows[1], inputs.rows[2])
    joined = ModelInputs.concatenate([None, ModelInputs.from_rows([{"pixel_values": c}])], [2, 1])
    assert joined.rows[:2] == ({}, {}) and torch.equal(joined.batched()["pixel_values"], c)
    assert ModelInputs.concatenate([None, None], [1, 1]) is None
    back = ModelInputs.from_tensors(inputs.tensors("m."), "m.", 3)
    assert [sorted(row) for row in back.rows] == [["grid", "pixel_values"], [], ["pixel_values"]]
    assert all(torch.equal(x[k], y[k]) for x, y in zip(inputs.rows, back.rows) for k in x)


def test_rollouts_carry_them_through_select_padding_the_buffer_and_a_checkpoint():
    r = _rollouts()
    picked = r.select(torch.tensor([2, 0]))
    assert torch.equal(picked.forward_inputs()["pixel_values"], torch.cat([_pixels(2), _pixels(0)]))
    assert r.padded(8).model_inputs is r.model_inputs
    batch = TrainingBatch(r, torch.tensor([1.0, -1.0, 0.5]), r.model_tokens)
    parts = batch.micro_batches(2, torch.Generator().manual_seed(3))
    seen = torch.cat([p.rollouts.forward_inputs()["pixel_values"] for p in parts])
    order = torch.randperm(3, generator=torch.Generator().manual_seed(3))
    assert torch.equal(seen, torch.cat([_pixels(int(i)) for i in order]))
    nonzero = TrainingBatch(r, torch.tensor([0.0, -1.0, 0.5]), r.model_tokens).rows_with_gradient()
    assert torch.equal(nonzero.rollouts.forward_inputs()["pixel_values"], torch.cat([_pixels(1), _pixels(2)]))
    restored = buffer_from_tensors(buffer_tensors(parts), "cpu")
    for before, after in zip(parts, restored, strict=True):
        assert torch.equal(before.rollouts.forward_inputs()["pixel_values"],
                           after.rollouts.forward_inputs()["pixel_values"])
        assert torch.equal(before.advantages, after.advantages)


def test_grpo_log_probs_feed_them_to_the_models_forward_and_follow_the_rows():
    """token_logprobs with the rows' pixel values equals the model's own forward on them, on any selection of rows
    (packing and prompt sharing asked for and not taken); without them the model reads its image tokens as text."""
    model, r = _llava(), _rollouts()
    with torch.no_grad():
        logps, _ = token_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                                  model_inputs=r.forward_inputs(), packing=True, share_prompts=True)
        expected = _reference_logps(model, r)
        mask = r.completion_mask
        assert torch.allclose(logps[mask], expected[mask], atol=1e-5)
        picked = r.select(torch.tensor([2, 0]))
        again, _ = token_logprobs(model, picked.prompt_ids, picked.prompt_mask, picked.completion_ids,
                                  picked.completion_mask, model_inputs=picked.forward_inputs())
        rows = expected[[2, 0]][:, :picked.completion_ids.size(1)]
        assert torch.allclose(again[picked.completion_mask], rows[picked.completion_mask], atol=1e-5)
        plain, _ = token_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
        assert not torch.allclose(plain[mask], expected[mask], atol=1e-3)  # the pixels change what the model says


def _token_rows() -> TokenRows:
    sequences = [(np.array([5, IMAGE, IMAGE, IMAGE, IMAGE, 7, 8, 9], np.int32), np.array([0] * 6 + [1] * 2, bool)),
                 (np.array([IMAGE, IMAGE, IMAGE, IMAGE, 3, 4], np.int32), np.array([0] * 4 + [1] * 2, bool)),
                 (np.array([6, IMAGE, IMAGE, IMAGE, IMAGE], np.int32), np.zeros(5, bool))]  # no target: dropped
    inputs = ModelInputs.from_rows([{"pixel_values": _pixels(i)} for i in range(3)])
    return TokenRows.from_sequences(sequences, inputs)


def test_token_rows_carry_them_and_refuse_packing_splitting_and_padding_free():
    rows = _token_rows()
    kept, dropped = drop_untrained(rows)
    assert dropped == 1 and torch.equal(kept.model_inputs.batched()["pixel_values"], torch.cat([_pixels(0),
                                                                                                 _pixels(1)]))
    assert truncate(rows, 7).model_inputs is rows.model_inputs
    joined = TokenRows.concatenate([rows.select(np.array([1])), TokenRows.from_sequences([(np.array([1, 2]),
                                                                                          np.array([0, 1], bool))])])
    assert joined.model_inputs.rows[1] == {} and len(joined.model_inputs) == 2
    assert rows.fingerprint() != TokenRows(rows.tokens, rows.labels, rows.starts, rows.offsets,
                                           ModelInputs.from_rows([{"pixel_values": _pixels(i + 5)}
                                                                  for i in range(3)])).fingerprint()
    for layout, call in (("packing", lambda: pack(kept, 16, "bfd")),
                         ("packing", lambda: prepare(rows, 16, "keep_start", True, "wrapped")),
                         ("split", lambda: split_long(kept, 4)),
                         ("padding_free", lambda: collate(kept, 0, True, None))):
        with pytest.raises(ModelInputsError, match=re.escape(CANNOT_CARRY[layout])):
            call()
    batch = collate(kept.select(np.array([1, 0])), 0, False, 8)
    assert torch.equal(batch.model_inputs["pixel_values"], torch.cat([_pixels(1), _pixels(0)]))


def test_sequence_log_probs_feed_them_to_the_models_forward():
    """next_token_logprobs (SFT's, DPO's) with the collated rows' pixel values equals the model's own forward, through
    the chunked output layer."""
    model = _llava()
    assert fast_path_available(model)  # the chunked output layer, after the model's forward with the inputs
    kept, _ = drop_untrained(_token_rows())
    batch = collate(kept, 0, False, None)
    with torch.no_grad():
        logps, _, _ = next_token_logprobs(model, batch.input_ids, batch.attention_mask, None, batch.source_mask,
                                          batch.targets, model_inputs=batch.model_inputs)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       pixel_values=batch.model_inputs["pixel_values"]).logits
    expected = logits[batch.source_mask].float().log_softmax(-1).gather(-1, batch.targets[:, None]).squeeze(-1)
    assert logps.shape == (4,) and torch.allclose(logps, expected, atol=1e-5)


def test_dynamic_sampling_keeps_each_rows_inputs_with_it():
    from posttrain.grpo.completions import RewardLogs
    from posttrain.grpo.dynamic_sampling import ScoredRound, assemble, kept_rows

    r = _rollouts()
    scored = ScoredRound(rows=[{"prompt": "p"}] * 3, texts=["a", "b", "c"], rollouts=r,
                         rewards=torch.tensor([[0.0], [1.0], [2.0]]), logs=RewardLogs())
    keep = torch.tensor([False, True, True])  # G = 1: rows 1 and 2 kept
    rows = kept_rows(scored, keep, 0, 1, lambda mine: mine)
    batch = assemble(rows, 2, 0, 1, RewardLogs(), None, 0, [1], "cpu")
    assert torch.equal(batch.rollouts.forward_inputs()["pixel_values"], torch.cat([_pixels(1), _pixels(2)]))


def test_a_multimodal_rotary_models_rows_keep_their_images_and_positions():
    """Qwen2.5-VL (multimodal rotary positions, its inputs pixel_values [patches, 96] and image_grid_thw [images, 3]
    concatenated over the rows): token_logprobs with the rows' inputs equals the model's own forward, which derives
    the positions from the image grid, on the rows in any order."""
    from posttrain.testing import tiny_tokenizer, tiny_vision_language

    tokenizer = tiny_tokenizer()
    model = tiny_vision_language("qwen2_5_vl", tokenizer).eval()
    start, image = model.config.vision_start_token_id, model.config.image_token_id
    grid = torch.tensor([[1, 2, 2]])  # one 8x8 image: 2x2 patches of 4, merged 2x2 -> one image token
    prompts = [[5, start, image, 7, 8], [start, image, 9], [3, 4, start, image, 2, 6]]
    rows = [(p, [11 + i, 12, 13][:3 - i], [0.0] * (3 - i)) for i, p in enumerate(prompts)]
    pixels = [torch.randn(4, 96, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    inputs = ModelInputs.from_rows([{"pixel_values": p, "image_grid_thw": grid} for p in pixels])
    r = Rollouts.from_lists(rows, pad_id=tokenizer.pad_token_id, eos_ids=[1], device="cpu", model_inputs=inputs)
    assert fast_path_available(model)  # the chunked output layer, after the model's forward with the inputs
    with torch.no_grad():
        expected = _reference_logps(model, r)
        for order in ([0, 1, 2], [2, 0]):
            picked = r.select(torch.tensor(order))
            logps, _ = token_logprobs(model, picked.prompt_ids, picked.prompt_mask, picked.completion_ids,
                                      picked.completion_mask, model_inputs=picked.forward_inputs())
            want = expected[order][:, :picked.completion_ids.size(1)]
            assert torch.allclose(logps[picked.completion_mask], want[picked.completion_mask], atol=1e-5)
    # the gradient, the output layer's predicted in the forward (loss_gradient), equals the model's own
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.randn(r.completion_ids.shape, generator=torch.Generator().manual_seed(5)) * r.completion_mask
    ours, _ = token_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                             model_inputs=r.forward_inputs(), loss_gradient=lambda logps: weights)
    theirs = torch.autograd.grad((_reference_logps(model, r) * weights).sum(), params, allow_unused=True)
    mine = torch.autograd.grad((ours * weights).sum(), params, allow_unused=True)
    for a, b in zip(mine, theirs):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, atol=1e-5))
