"""The entropy bonus's coefficient: constant, or adapted each optimizer step (Skywork-OR1), as TRL's GRPOTrainer does.

The loss becomes `loss - coef * H`, H the step's mean per-token entropy (grpo/losses.py `entropy_bonus`). With
`use_adaptive_entropy`, after each step `coef` moves by `entropy_coef_delta` towards more exploration while the step's
entropy is at or below `entropy_target` (up) and away otherwise (down), within [entropy_coef_min, entropy_coef_max];
the bonus applies in a step only when the previous step's entropy was at or below the target.
"""

import math
from dataclasses import dataclass


@dataclass
class EntropyControl:
    """The coefficient and what it was last measured against (saved in checkpoints)."""

    coef: float
    adaptive: bool
    coef_min: float
    coef_max: float
    delta: float
    target: float
    last_entropy: float = math.inf

    @classmethod
    def from_config(cls, args) -> "EntropyControl":
        return cls(args.entropy_coef, args.use_adaptive_entropy, args.entropy_coef_min, args.entropy_coef_max,
                   args.entropy_coef_delta, args.entropy_target)

    @property
    def enabled(self) -> bool:
        """Whether the bonus is part of the run (its entropy then needs a gradient)."""
        return self.coef != 0.0 or self.adaptive

    def applied(self) -> float:
        """The coefficient of this step's bonus."""
        if self.adaptive and self.last_entropy > self.target:
            return 0.0
        return self.coef

    def update(self, step_entropy: float) -> None:
        """After an optimizer step whose mean per-token entropy (across processes) was `step_entropy`."""
        if self.adaptive:
            if step_entropy <= self.target:
                self.coef = min(self.coef + self.delta, self.coef_max)
            else:
                self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_entropy = step_entropy

    def state(self) -> dict:
        return {"coef": self.coef, "last_entropy": None if math.isinf(self.last_entropy) else self.last_entropy}

    def load(self, state: dict) -> None:
        self.coef = state["coef"]
        self.last_entropy = math.inf if state["last_entropy"] is None else state["last_entropy"]

    def after_step(self, results: list, accelerator) -> dict:
        """Update the coefficient from an optimizer step's entropy across processes (`results`: its micro-batches'
        grpo/losses.py MicroBatchLoss); its metrics: the policy loss alone and the coefficient."""
        import torch

        local = torch.stack([sum(r.stats.bonus_entropy for r in results).float(),
                             sum(r.stats.bonus_tokens for r in results).float()]).to(accelerator.device)
        total = accelerator.reduce(local, reduction="sum")
        self.update(float(total[0]) / max(float(total[1]), 1.0))
        policy = float(accelerator.reduce(sum(r.policy_loss for r in results), reduction="mean"))
        return {"policy_loss": policy, "entropy_coef": self.coef}
