import math

import torch

from posttrain.grpo.advantages import group_advantages, nanstd


def test_group_scaling_hand_worked():
    # group 1 rewards 1, 3 -> mean 2, unbiased std sqrt(2); group 2 rewards 5, 5 -> std 0.
    rewards = torch.tensor([[1.0], [3.0], [5.0], [5.0]])
    adv = group_advantages(rewards, torch.ones(1), group_size=2, scale="group")
    s = math.sqrt(2.0)
    expected = torch.tensor([-1 / (s + 1e-4), 1 / (s + 1e-4), 0.0, 0.0])
    assert torch.allclose(adv.advantages, expected, atol=1e-6)
    assert adv.group_std.tolist()[2:] == [0.0, 0.0]


def test_batch_and_none_scaling():
    rewards = torch.tensor([[1.0], [3.0], [5.0], [7.0]])
    # batch std of 1,3,5,7 (unbiased) = sqrt(20/3)
    batch = group_advantages(rewards, torch.ones(1), 2, scale="batch").advantages
    assert torch.allclose(batch, torch.tensor([-1.0, 1.0, -1.0, 1.0]) / (math.sqrt(20 / 3) + 1e-4), atol=1e-6)
    none = group_advantages(rewards, torch.ones(1), 2, scale="none").advantages
    assert none.tolist() == [-1.0, 1.0, -1.0, 1.0]


def test_weights_sum_and_none_rewards():
    nan = float("nan")
    # f1 is None on row 0; f2 weighted by 2. Row 3 has no applicable function at all.
    rewards = torch.tensor([[nan, 1.0], [2.0, 0.0], [1.0, 1.0], [nan, nan]])
    adv = group_advantages(rewards, torch.tensor([1.0, 2.0]), 2, scale="none")
    # totals: 2, 2, 3, NaN -> group 1 advantages 0, 0; group 2 has one valid value: mean 3, adv 0; row 3 -> 0
    assert adv.rewards[:3].tolist() == [2.0, 2.0, 3.0] and math.isnan(adv.rewards[3])
    assert adv.advantages.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_all_none_row_excluded_from_group_stats():
    nan = float("nan")
    rewards = torch.tensor([[1.0], [3.0], [nan]])
    adv = group_advantages(rewards, torch.ones(1), 3, scale="none")
    # the NaN row does not drag the mean down: mean of (1, 3) = 2
    assert adv.advantages.tolist() == [-1.0, 1.0, 0.0]


def test_normalize_then_sum_hand_worked():
    # f1 in group: (0, 2) -> normalised (-1/(sqrt2+eps), +1/(sqrt2+eps)); f2 constant -> 0 after normalising.
    rewards = torch.tensor([[0.0, 5.0], [2.0, 5.0]])
    adv = group_advantages(rewards, torch.ones(2), 2, aggregation="normalize_then_sum").advantages
    z = 1 / (math.sqrt(2) + 1e-4)
    summed = torch.tensor([-z, z])
    expected = (summed - summed.mean()) / (summed.std() + 1e-4)
    assert torch.allclose(adv, expected, atol=1e-5)


def test_nanstd_unbiased_and_nan_for_single_value():
    assert math.isclose(float(nanstd(torch.tensor([1.0, 3.0, float("nan")]))), math.sqrt(2), rel_tol=1e-6)
    assert math.isnan(float(nanstd(torch.tensor([1.0, float("nan")]))))
