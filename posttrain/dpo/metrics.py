"""DPO's statistics, and its metrics with TRL's names."""

from dataclasses import dataclass

from posttrain.training.statistics import SidedStatistics


@dataclass
class PairStatistics(SidedStatistics):
    """A micro-batch's sums: the preference loss summed over its pairs, the sft term summed over its chosen targets,
    the implicit rewards (beta * policy-reference log-ratio), the sequence log-probs, the targets' logits, entropy and
    top-1 hits."""

    pair_loss: float = 0.0
    sft_loss: float = 0.0
    pairs: float = 0.0
    correct_pairs: float = 0.0
    correct_tokens: float = 0.0

    def metrics(self, prefix: str = "") -> dict:
        """TRL's DPO metrics (loss, rewards/*, logps/*, logits/*, entropy, mean_token_accuracy): the loss the mean
        over the pairs (and, for the sft term, over the chosen targets)."""
        pairs = max(self.pairs, 1.0)
        targets = max(self.chosen_tokens + self.rejected_tokens, 1.0)
        out = {"loss": self.pair_loss / pairs + self.sft_loss / max(self.chosen_tokens, 1.0),
               "rewards/chosen": self.chosen_reward / pairs, "rewards/rejected": self.rejected_reward / pairs,
               "rewards/accuracies": self.correct_pairs / pairs,
               "rewards/margins": (self.chosen_reward - self.rejected_reward) / pairs,
               "logps/chosen": self.chosen_logps / pairs, "logps/rejected": self.rejected_logps / pairs,
               "logits/chosen": self.chosen_logits / max(self.chosen_tokens, 1.0),
               "logits/rejected": self.rejected_logits / max(self.rejected_tokens, 1.0),
               "entropy": self.entropy / targets,
               "mean_token_accuracy": self.correct_tokens / max(self.chosen_tokens, 1.0)}
        return {prefix + k: v for k, v in out.items()}
