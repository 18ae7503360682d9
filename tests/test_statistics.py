"""training/statistics.py: micro-batch statistics add up, reduce across processes as their fields say, and make the
trainers' metrics from the sums (whatever the split into micro-batches)."""

import dataclasses
import types

import torch

from posttrain.dpo.metrics import PairStatistics
from posttrain.kto.metrics import KTOStatistics
from posttrain.reward.metrics import RewardStatistics
from posttrain.training.statistics import Statistics, StepCounts, local_field, max_field, min_field

ONE_PROCESS = types.SimpleNamespace(num_processes=1, device=torch.device("cpu"))


@dataclasses.dataclass
class Example(Statistics):
    loss: float = 0.0
    count: float = 0.0
    low: float = min_field()
    high: float = max_field()
    point: float = local_field()

    def metrics(self, prefix=""):
        return {f"{prefix}loss": self.loss / max(self.count, 1.0), f"{prefix}low": self.low}


def test_statistics_add_up_field_by_field_tensors_and_numbers_alike():
    parts = [Example(loss=torch.tensor(3.0), count=2.0, low=torch.tensor(-1.0), high=torch.tensor(2.0), point=0.5),
             Example(loss=1.0, count=torch.tensor(2), low=0.5, high=7.0, point=0.5)]
    total = Example.total(parts).reduced(ONE_PROCESS)
    assert total == Example(loss=4.0, count=4.0, low=-1.0, high=7.0, point=1.0)
    assert all(type(getattr(total, f.name)) is float for f in dataclasses.fields(total))
    assert total.metrics("eval_") == {"eval_loss": 1.0, "eval_low": -1.0}
    assert Example.total([]) == Example.empty() == Example(0.0, 0.0, float("inf"), float("-inf"), 0.0)
    assert StepCounts.total([StepCounts(items=2, tokens=10), StepCounts(items=1, tokens=5)]) == StepCounts(3, 15)


def test_the_trainers_metrics_are_means_of_the_sums_whatever_the_split():
    whole = PairStatistics(pair_loss=3.0, sft_loss=8.0, pairs=4.0, chosen_reward=2.0, rejected_reward=-2.0,
                           correct_pairs=3.0, chosen_tokens=16.0, rejected_tokens=4.0, entropy=10.0, correct_tokens=4.0)
    halves = [dataclasses.replace(whole, **{f.name: getattr(whole, f.name) / 2 for f in dataclasses.fields(whole)})] * 2
    assert PairStatistics.total(halves).metrics() == whole.metrics()
    m = whole.metrics()
    assert (m["loss"], m["rewards/margins"], m["rewards/accuracies"], m["entropy"]) == (3 / 4 + 8 / 16, 1.0, 0.75, 0.5)
    kto = KTOStatistics.total([KTOStatistics(loss=2.0, chosen=2.0, kl=0.25, kl_points=1.0),
                               KTOStatistics(loss=1.0, chosen=1.0, kl=0.75, kl_points=1.0)]).reduced(ONE_PROCESS)
    assert kto.metrics()["loss"] == 1.0 and kto.metrics()["kl"] == 0.5 and "rewards/margins" not in kto.metrics()
    reward = RewardStatistics.total([RewardStatistics(loss=1.0, pairs=1.0, reward_sum=1.0, rewards=2.0,
                                                      min_reward=-1.0, max_reward=2.0),
                                     RewardStatistics(pairs=1.0, min_reward=-3.0, max_reward=0.0)])
    assert reward.metrics()["min_reward"] == -3.0 and reward.metrics()["max_reward"] == 2.0
    assert reward.metrics()["loss"] == 0.5 and RewardStatistics.empty().metrics()["min_reward"] == float("inf")
