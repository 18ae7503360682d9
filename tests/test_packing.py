"""Padding-free log-prob passes (models/packing.py): the packed rows' layout, and log-probs, entropies and gradients
equal to the padded batch's on the model's own forward, the chunked output layer's, and inside the output layer's
forward (ZeRO-3's way)."""

import pytest
import torch
from transformers import Qwen2ForCausalLM

from packing_cases import random_rollouts
from posttrain.models import logprobs, packing
from posttrain.models.logprobs import token_logprobs
from posttrain.models.packed_layouts import PADDED_ONLY, PADDED_ROWS, packed_layouts
from posttrain.models.packing import first_fit_decreasing, pack_rollouts
from posttrain.testing import tiny_model


def test_first_fit_decreasing_places_the_longest_first_into_the_first_bin_with_room():
    bins = first_fit_decreasing([2, 7, 4, 3, 1], 7)
    assert bins == [[1], [2, 3], [0, 4]]


def test_packed_rows_layout():
    """Sequences of 1+1, 3+4 and 2+2 tokens: 7 is the width; the 4-token one and the 2-token one share a row."""
    p_ids = torch.tensor([[0, 0, 11], [21, 22, 23], [0, 31, 32]])
    p_mask = (p_ids > 0).long()
    c_ids = torch.tensor([[12, 0, 0, 0], [24, 25, 26, 27], [33, 34, 0, 0]])
    c_mask = (c_ids > 0).long()
    packed = pack_rollouts(p_ids, p_mask, c_ids, c_mask)
    assert packed.input_ids.tolist() == [[21, 22, 23, 24, 25, 26, 27], [31, 32, 33, 34, 11, 12, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 0, 1, 0]]
    assert packed.source_mask.long().tolist() == [[0, 0, 1, 1, 1, 1, 0], [0, 1, 1, 0, 1, 0, 0]]
    assert packed.targets.tolist() == [24, 25, 26, 27, 33, 34, 12]
    assert packed.positions.tolist() == [4, 5, 6, 7, 8, 9, 0]  # flat indices into the [3, 4] completions


def test_what_is_not_packed():
    vocab = 50
    full = random_rollouts([3, 3, 3], [4, 4, 4], 3, 4, vocab)  # every row full: nothing to remove
    assert pack_rollouts(*full) is None
    p_ids, p_mask, c_ids, c_mask = random_rollouts([3, 1, 2], [4, 1, 2], 3, 4, vocab)
    assert pack_rollouts(p_ids, p_mask, c_ids, c_mask) is not None
    holed = c_mask.clone()
    holed[0, 1] = 0  # a completion mask with a hole: not one run of real tokens
    assert pack_rollouts(p_ids, p_mask, c_ids, holed) is None
    right_padded = torch.flip(p_mask, [1])  # a right-padded prompt
    assert pack_rollouts(p_ids, right_padded, c_ids, c_mask) is None


def _mark_in_forward(model):
    """Mark the output layer's weight as DeepSpeed marks a partitioned one, so the chunked log-probs run as its
    forward (models/logprobs.py `_computing_in`)."""
    model.get_output_embeddings().weight.ds_tensor = torch.empty(0)


@pytest.mark.parametrize("in_forward", [False, True])
def test_packed_logprobs_entropy_and_gradients_equal_the_padded_batch(tokenizer, monkeypatch, in_forward):
    """Natural lengths (completions of 1 to 16 tokens, prompts of 2 to 6): the packed forward runs over fewer
    positions and gives the padded batch's log-probs, entropies and gradients, through the loss-gradient predictor
    of the chunked output layer too."""
    prompt_lengths = [2, 6, 3, 5, 4, 2, 6, 3]
    completion_lengths = [16, 1, 5, 9, 16, 2, 3, 7]
    batch = random_rollouts(prompt_lengths, completion_lengths, 6, 16, len(tokenizer), seed=3)
    weights = torch.randn(batch[2].shape, generator=torch.Generator().manual_seed(1)) * batch[3]
    results, widths = [], []
    for packed in (False, True):
        model = tiny_model(tokenizer, seed=2, hidden=32, layers=2)
        if in_forward:
            _mark_in_forward(model)
        if not packed:
            monkeypatch.setattr(logprobs, "pack_rollouts", lambda *a, **k: None)
        else:
            monkeypatch.setattr(logprobs, "pack_rollouts", packing.pack_rollouts)
        # both checks before the hook below, which sees the log-prob pass only
        assert logprobs.fast_path_available(model) and packed_layouts(model).rows
        model.get_input_embeddings().register_forward_hook(lambda m, args, out: widths.append(tuple(args[0].shape)))
        logps, entropy = token_logprobs(model, *batch, temperature=0.7, with_entropy=True,
                                        loss_gradient=lambda lp: weights)
        (logps * weights).sum().backward()
        results.append((logps.detach(), entropy, {n: p.grad for n, p in model.named_parameters()}))
    (padded_logps, padded_entropy, padded_grads), (packed_logps, packed_entropy, packed_grads) = results
    assert widths[0] == (8, 22)  # padded: 8 rows of 6 + 16
    assert widths[1] == (5, 20)  # packed: 90 real tokens in rows of the longest sequence (4 + 16)
    mask = batch[3].bool()
    assert torch.allclose(packed_logps[mask], padded_logps[mask], atol=1e-5)
    assert torch.equal(packed_logps[~mask], torch.zeros_like(packed_logps[~mask]))
    assert torch.allclose(packed_entropy[mask], padded_entropy[mask], atol=1e-5)
    for name, grad in padded_grads.items():
        assert torch.allclose(packed_grads[name], grad, atol=1e-5), name


class NoPackingLM(Qwen2ForCausalLM):
    """Builds its own all-ones attention mask when given none: sequences packed in a row would see each other."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=None, logits_to_keep=0,
                **kwargs):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)


def test_a_model_that_would_mix_packed_sequences_keeps_the_padded_batch(tokenizer):
    model = tiny_model(tokenizer, model_class=NoPackingLM, seed=2, hidden=32, layers=2)
    logprobs.fast_path_available(model)
    assert packed_layouts(model) == PADDED_ONLY
    batch = random_rollouts([2, 6, 3], [16, 1, 5], 6, 16, len(tokenizer))
    assert pack_rollouts(*batch) is not None  # it would pack, were the model able to
    widths = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: widths.append(tuple(args[0].shape)))
    logps, _ = token_logprobs(model, *batch)
    assert widths == [(3, 22)]
    ids = torch.cat([batch[0], batch[2]], 1)
    mask = torch.cat([batch[1], batch[3]], 1)
    logits = Qwen2ForCausalLM.forward(model, input_ids=ids, attention_mask=mask,
                                      position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, 5:-1]
    reference = logits.log_softmax(-1).gather(-1, batch[2][..., None]).squeeze(-1)
    real = batch[3].bool()
    assert torch.allclose(logps[real], reference[real], atol=1e-5)


def test_a_model_whose_packing_check_raises_keeps_the_padded_batch_and_says_why(tokenizer, caplog):
    class MaskRequired(Qwen2ForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, logits_to_keep=0, **kwargs):
            if attention_mask is None:
                raise RuntimeError("this model needs an attention mask\nsecond line")
            return super().forward(input_ids, attention_mask, position_ids, logits_to_keep=logits_to_keep, **kwargs)

    model = tiny_model(tokenizer, model_class=MaskRequired, seed=2, hidden=32, layers=2)
    with caplog.at_level("WARNING", logger="posttrain"):
        assert logprobs.fast_path_available(model)
        assert packed_layouts(model) == packed_layouts(model) == PADDED_ONLY
    assert [r.getMessage() for r in caplog.records] == [
        f"MaskRequired: {PADDED_ROWS}, because sequences packed in one row raise RuntimeError: this model needs an "
        "attention mask."]


@pytest.mark.parametrize("case", ["bfloat16 weights", "float32 under bf16 autocast"])
def test_the_packing_check_passes_in_16_bit_and_under_autocast(tokenizer, case):
    """The check runs in the model's own precision (not an autocast around the training call), with a tolerance
    for a 16-bit model's rounding: mixed-precision and bf16 runs pack too."""
    model = tiny_model(tokenizer, seed=2, hidden=32, layers=2)
    if case == "bfloat16 weights":
        model = model.to(torch.bfloat16)
        assert packed_layouts(model).rows
    else:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert packed_layouts(model).rows
