"""How a step's accumulated gradients become an update: clipped, stepped and checked. The loop
(training/step.py `_apply_update`) asks its trainer's `Update` and never branches on what kind it is.

    Update(sharding)    the dense update every trainer makes: the sharding strategy's clipping and optimizer step,
                        every trainable weight checked for finiteness afterwards

A trainer whose optimizer does something of its own (the reward model's row-wise input embedding:
reward/sparse_rows.py) sets another object with the same methods.
"""


class Update:
    """The dense update, through the run's sharding strategy (training/sharding)."""

    def __init__(self, sharding):
        self.sharding = sharding

    def clip(self, model, optimizer, max_norm: float) -> float | None:
        """Clip every gradient to a total norm of `max_norm` (<= 0: none); the norm before clipping, or None where
        the optimizer's step measures it (DeepSpeed)."""
        return self.sharding.clip_gradients(model, max_norm)

    def step(self, model, optimizer) -> float | None:
        """Step the optimizer; the gradient norm where the step measured it, else None."""
        return self.sharding.optimizer_step(model, optimizer)

    def scales_loss(self, model) -> bool:
        """Whether a dynamic loss scaler owns the step (fp16): an overflow is its to skip."""
        return self.sharding.scales_loss(model)

    def step_skipped(self, model, optimizer) -> bool:
        """Whether the loss scaler skipped the last step (its gradients overflowed)."""
        return self.sharding.step_skipped(model, optimizer)

    def nonfinite_weight(self, policy) -> str | None:
        """The name of the first trainable weight the update made non-finite (on any process), or None."""
        finite, name = self.sharding.all_finite(policy)
        return None if finite else name
