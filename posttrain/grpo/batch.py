"""The unit the optimizer consumes: rollouts with their advantages and reference log-probs."""

from dataclasses import dataclass

import torch

from posttrain.generation import Rollouts


@dataclass(frozen=True)
class TrainingBatch:
    """N scored completions. C = completion width.

    Attributes:
        rollouts: the sampled completions.
        advantages: [N] float32.
        loss_mask: [N, C] bool, tokens that carry loss (completion mask, minus truncated completions when
            mask_truncated_completions is on).
        old_logps: [N, C] log-probs of the sampling policy, or None when every micro-step is on-policy.
        ref_logps: [N, C] reference-model log-probs, or None when beta = 0.
    """

    rollouts: Rollouts
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.rollouts)

    def select(self, index: torch.Tensor) -> "TrainingBatch":
        """Rows `index`, trimmed to the widest completion among them."""
        rollouts = self.rollouts.select(index)
        width = rollouts.completion_ids.size(1)

        def take(x):
            return None if x is None else x[index][:, :width]

        return TrainingBatch(rollouts, self.advantages[index], take(self.loss_mask), take(self.old_logps),
                             take(self.ref_logps))

    def micro_batches(self, size: int, generator: torch.Generator) -> list["TrainingBatch"]:
        """Shuffle the rows once and split them into micro-batches of `size`."""
        order = torch.randperm(len(self), generator=generator)
        return [self.select(order[i:i + size]) for i in range(0, len(self), size)]
