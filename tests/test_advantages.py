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


def _watch(**config):
    from posttrain.configs import GRPOConfig
    from posttrain.generation import SamplingParams
    from posttrain.grpo.flat_rewards import FlatRewardWatch

    args = GRPOConfig(num_generations=2, per_device_train_batch_size=4, **config)
    return FlatRewardWatch(args, SamplingParams.from_config(args), ["a", "b"], [])


def _flat_batches(watch, rewards: torch.Tensor, n: int) -> list:
    """What `watch` says for n batches of `rewards` [4, 2] (groups of 2), with the metrics the round logs."""
    from posttrain.grpo.metrics import reward_metrics

    metrics = reward_metrics(rewards, group_advantages(rewards, torch.ones(2), 2, "group",
                                                       watch.args.multi_objective_aggregation), ["a", "b"])
    return [watch.observe(metrics, rewards) for _ in range(n)]


def test_flat_rewards_warn_once_after_flat_batches_in_a_row():
    """FLAT_BATCHES batches in a row whose groups all tie: one warning, on the last of them, never again; a batch
    whose rewards differ starts the count again."""
    from posttrain.grpo.flat_rewards import FLAT_BATCHES

    flat = torch.tensor([[1.0, 0.0], [1.0, 0.0], [2.0, 0.0], [2.0, 0.0]])  # 'a' alike within a prompt, 'b' constant
    differ = torch.tensor([[1.0, 0.0], [2.0, 0.0], [2.0, 0.0], [2.0, 0.0]])
    watch = _watch()
    said = _flat_batches(watch, flat, FLAT_BATCHES - 1) + _flat_batches(watch, differ, 1)
    said += _flat_batches(watch, flat, FLAT_BATCHES + 3)
    assert [i for i, text in enumerate(said) if text] == [2 * FLAT_BATCHES - 1]
    text = said[-4]
    assert "reward function 'a' scores every completion of a prompt alike" in text
    assert "reward function 'b' returned 0 for every completion" in text
    assert "num_generations=2 leaves few completions per prompt to differ" in text
    assert "the policy loss has no gradient" in text


def test_flat_rewards_are_no_warning_where_a_gradient_remains_or_the_batch_is_filtered():
    """normalize_then_sum: a flat total of functions that differ within a group still has advantages, no warning
    (functions flat one by one: warned); dynamic_sampling: its batch holds differing groups only, no warning."""
    from posttrain.grpo.flat_rewards import FLAT_BATCHES

    cancelling = torch.tensor([[1.0, -1.0], [2.0, -2.0], [1.0, -1.0], [3.0, -3.0]])
    flat = torch.tensor([[1.0, 0.0], [1.0, 0.0], [2.0, 0.0], [2.0, 0.0]])
    gdpo = dict(multi_objective_aggregation="normalize_then_sum")
    assert not any(_flat_batches(_watch(**gdpo), cancelling, FLAT_BATCHES + 1))
    assert any(_flat_batches(_watch(**gdpo), flat, FLAT_BATCHES))
    said = _flat_batches(_watch(), cancelling, FLAT_BATCHES)[-1]  # summed first: the functions cancel out
    assert "reward functions 'a', 'b' differ within a group, yet the weighted sum does not" in said
    assert not any(_flat_batches(_watch(dynamic_sampling=True), flat, FLAT_BATCHES + 1))
