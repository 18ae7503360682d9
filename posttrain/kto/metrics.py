"""KTO's statistics, and its metrics with TRL's names."""

from dataclasses import dataclass

from posttrain.training.statistics import SidedStatistics, local_field


@dataclass
class KTOStatistics(SidedStatistics):
    """A micro-batch's sums: the loss summed over its examples, the desirable (chosen) and undesirable (rejected)
    examples' counts, rewards and sequence log-probs, their targets' logits and counts, the entropy; and its KL
    reference point z0 (the same on every process: summed over micro-batches only, for their mean)."""

    loss: float = 0.0
    chosen: float = 0.0
    rejected: float = 0.0
    kl: float = local_field()
    kl_points: float = local_field()

    def metrics(self, prefix: str = "") -> dict:
        """TRL's KTO metrics (loss, kl, rewards/*, logps/*, logits/*, entropy): the loss the mean over the examples,
        kl the mean of the micro-batches' points. As in TRL, the chosen (rejected) ones are left out when no example
        was desirable (undesirable), and the margin unless there were both."""
        out = {"loss": self.loss / max(self.chosen + self.rejected, 1.0),
               "kl": self.kl / self.kl_points if self.kl_points else 0.0}
        targets = self.chosen_tokens + self.rejected_tokens
        out["entropy"] = self.entropy / targets if targets > 0 else 0.0
        for side in ("chosen", "rejected"):
            if getattr(self, f"{side}_tokens") > 0:
                out[f"logits/{side}"] = getattr(self, f"{side}_logits") / getattr(self, f"{side}_tokens")
            if getattr(self, side) > 0:
                out[f"rewards/{side}"] = getattr(self, f"{side}_reward") / getattr(self, side)
                out[f"logps/{side}"] = getattr(self, f"{side}_logps") / getattr(self, side)
        if self.chosen > 0 and self.rejected > 0:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return {prefix + k: v for k, v in out.items()}
