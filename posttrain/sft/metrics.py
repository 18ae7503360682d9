"""SFT's statistics, and its metrics with TRL's names."""

from dataclasses import dataclass

from posttrain.training.statistics import Statistics


@dataclass
class TokenStatistics(Statistics):
    """A micro-batch's sums over its target tokens: the loss terms, the entropy, the top-1 hits, and their count."""

    loss: float = 0.0
    entropy: float = 0.0
    correct: float = 0.0
    targets: float = 0.0

    def metrics(self, prefix: str = "") -> dict:
        """TRL's SFT metrics: loss, entropy and mean_token_accuracy, each the mean over the target tokens."""
        n = max(self.targets, 1.0)
        out = {"loss": self.loss / n, "entropy": self.entropy / n, "mean_token_accuracy": self.correct / n}
        return {prefix + k: v for k, v in out.items()}
