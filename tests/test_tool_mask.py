"""A multi-turn rollout's tool mask (Rollouts.tool_mask: False on the tokens a tool or environment put between the
model's turns) travels with its rows wherever they go (selection, padding, the checkpointed buffer, dynamic
sampling's kept rows), and takes those tokens out of the loss and the completion lengths. The loss over such a mask
equals TRL's: tests/test_trl_parity.py."""

import torch

from posttrain.generation import Rollouts
from posttrain.grpo.batch import TrainingBatch, buffer_from_tensors, buffer_tensors
from posttrain.grpo.completions import RewardLogs
from posttrain.grpo.dynamic_sampling import ScoredRound, assemble, kept_rows

PAD, EOS = 0, 1
# three rows: a model turn, a tool result (5 5), the model's next turn; a single-turn row; a cut row with a tool result
ROWS = [([7, 8], [3, 4, 5, 5, 6, EOS], [-0.1, -0.2, 0.0, 0.0, -0.3, -0.4]),
        ([9], [3, EOS], [-0.5, -0.6]),
        ([7, 9, 9], [4, 5, 6], [-0.7, 0.0, -0.8])]
TOOL_MASKS = [[True, True, False, False, True, True], None, [True, False, True]]


def _rollouts() -> Rollouts:
    return Rollouts.from_lists(ROWS, PAD, [EOS], "cpu", TOOL_MASKS)


def test_the_model_tokens_are_the_completion_less_the_tool_results():
    r = _rollouts()
    assert r.model_tokens.tolist() == [[True, True, False, False, True, True], [True, True] + [False] * 4,
                                       [True, False, True, False, False, False]]
    assert r.model_tokens.sum(1).tolist() == [4, 2, 2]  # the completion lengths TRL logs count these
    assert r.tool_mask[1].all() and r.tool_mask[2, 3:].all()  # a row without tools, and padding: True
    single = Rollouts.from_lists(ROWS, PAD, [EOS], "cpu")
    assert single.tool_mask is None and torch.equal(single.model_tokens, single.completion_mask)


def test_the_tool_mask_follows_selection_padding_and_the_checkpointed_buffer():
    r = _rollouts()
    picked = r.select(torch.tensor([2, 1]))  # widest completion among them: 3
    assert picked.tool_mask.tolist() == [[True, False, True], [True, True, True]]
    wide = picked.padded(4)
    assert wide.tool_mask.shape == (2, 4) and wide.tool_mask[:, 3].all()
    assert torch.equal(wide.model_tokens[:, :3], picked.model_tokens) and not wide.model_tokens[:, 3].any()
    batch = TrainingBatch(r, torch.tensor([1.0, -1.0, 0.5]), r.model_tokens)
    again = buffer_from_tensors(buffer_tensors([batch, TrainingBatch(
        Rollouts.from_lists(ROWS, PAD, [EOS], "cpu"), torch.zeros(3), r.completion_mask)]), "cpu")
    assert torch.equal(again[0].rollouts.tool_mask, r.tool_mask) and torch.equal(again[0].loss_mask, r.model_tokens)
    assert again[1].rollouts.tool_mask is None  # a single-turn batch stays one


def test_dynamic_sampling_keeps_each_kept_rows_tool_mask():
    r = _rollouts()
    scored = ScoredRound(rows=[{"prompt": "a"}] * 3, texts=["x"] * 3, rollouts=r,
                         rewards=torch.tensor([[1.0], [0.0], [0.5]]), logs=RewardLogs(), extra={}, skipped=None)
    rows = kept_rows(scored, torch.tensor([True, True, True]), 0, 1, lambda mine: mine)
    batch = assemble(rows[::-1], 3, 0, 1, RewardLogs(), None, PAD, [EOS], "cpu")
    assert batch.rollouts.tool_mask.tolist() == [[True, False, True, True, True, True],
                                                 [True, True, True, True, True, True],
                                                 [True, True, False, False, True, True]]
    assert torch.equal(batch.rollouts.model_tokens.sum(1), torch.tensor([2, 2, 4]))


def test_with_pad_equal_to_eos_the_masks_come_from_the_rows_lengths_not_their_ids():
    """TRL #4974: pad == eos. The completion, model-token and tool masks are the same as with a distinct pad id;
    only the padding's ids change."""
    apart = _rollouts()
    same = Rollouts.from_lists(ROWS, EOS, [EOS], "cpu", TOOL_MASKS)
    for name in ("completion_mask", "prompt_mask", "tool_mask", "model_tokens", "is_eos"):
        assert torch.equal(getattr(same, name), getattr(apart, name)), name
    assert (same.completion_ids[~same.completion_mask.bool()] == EOS).all()
