"""The reward model's statistics, and its metrics with TRL's names."""

from dataclasses import dataclass

from posttrain.training.statistics import Statistics, max_field, min_field


@dataclass
class RewardStatistics(Statistics):
    """A micro-batch's sums: the loss summed over its pairs, the pairs, those ranked right (r_c > r_r), the margins
    r_c - r_r, the rewards' sum and count; and the smallest and largest reward."""

    loss: float = 0.0
    pairs: float = 0.0
    correct_pairs: float = 0.0
    margin: float = 0.0
    reward_sum: float = 0.0
    rewards: float = 0.0
    min_reward: float = min_field()
    max_reward: float = max_field()

    def metrics(self, prefix: str = "") -> dict:
        """TRL's reward metrics: loss (the mean over the pairs), accuracy, margin, min_reward, mean_reward,
        max_reward."""
        pairs = max(self.pairs, 1.0)
        out = {"loss": self.loss / pairs, "accuracy": self.correct_pairs / pairs, "margin": self.margin / pairs,
               "min_reward": self.min_reward, "mean_reward": self.reward_sum / max(self.rewards, 1.0),
               "max_reward": self.max_reward}
        return {prefix + k: v for k, v in out.items()}
