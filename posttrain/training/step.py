"""The parts of one optimizer step that every trainer's `_optimizer_step` uses (a mixin of training/trainer.py's
Trainer, on its `args`, `accelerator`, `sharding`, `model`, `policy`, `optimizer`, `lr_scheduler` and `state`):

    stats = self._accumulate(micro_batches, micro_step)    each micro-batch through `training_step` (the override
                                                            point), gradients synchronised on the last one only
    self._backward(loss)                                   inside micro_step: the micro-batch's share of the loss
    grad_norm = self._apply_update(loss)                   clip, check finite, step optimizer and schedule
"""

import contextlib
import math

import torch

from posttrain.errors import UserError
from posttrain.training.checkpoint import checkpoints, save_checkpoint
from posttrain.training.distributed import mark_agreed


class TrainingError(UserError, RuntimeError):
    """The run cannot go on (a non-finite loss or gradient); the message names the step and the metric."""


@contextlib.contextmanager
def _unused_parameters_said(step: int):
    """DDP's error for trainable parameters that got no gradient in the step before, as one sentence."""
    try:
        yield
    except RuntimeError as err:
        if "Expected to have finished reduction in the prior iteration" not in str(err):
            raise
        raise TrainingError(
            f"Step {step}: some trainable parameters got no gradient in the step before (a vision tower a text batch "
            "never reaches, experts no token was routed to, a layer the loss does not use), and DDP waits for every "
            "one: set ddp_find_unused_parameters=True, or freeze those parameters.") from err


class StepMixin:
    """transformers' training_step and the update, shared by every trainer."""

    _sparse_rows = None  # a trainer's row-wise embedding update (training/sparse_rows.py), set after _prepare

    def _accumulate(self, micro_batches: list, micro_step) -> list:
        """Run a step's micro-batches through `training_step`, which runs `micro_step(micro_batch)`, gradients
        synchronised across processes only on the last one; `on_substep_end` between them. Returns the micro-steps'
        results."""
        results = []
        self._run_micro_step = micro_step
        for i, mb in enumerate(micro_batches):
            sync = i == len(micro_batches) - 1
            with self.sharding.accumulating(self.model, sync), _unused_parameters_said(self.state.global_step + 1):
                self._micro_result = None
                self.training_step(self.model, mb)
                if self._micro_result is None:
                    raise UserError(f"{type(self).__name__}.training_step returned without calling "
                                    "super().training_step(model, inputs), so the micro-batch was not trained: call it "
                                    "in the override.")
                results.append(self._micro_result)
            if not sync:
                self._call("on_substep_end")
        return results

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """The forward and backward of one micro-batch: transformers' override point, called once per micro-batch.

        Args:
            model: the model being trained (self.model).
            inputs: the trainer's micro-batch: GRPO a TrainingBatch (rollouts, advantages, log-probs), SFT a
                SequenceBatch (input_ids, attention_mask or position_ids, targets), DPO a PairBatch.
            num_items_in_batch: accepted for transformers' signature; the loss is normalised over the whole step
                (its tokens, sequences or pairs across processes) whatever is passed.
        Returns:
            The loss it backpropagated, detached: the micro-batch's share of the step's loss. An override calls
            `super().training_step(model, inputs, num_items_in_batch)` to train (and may act before and after).
        """
        self._micro_result = self._run_micro_step(inputs)
        return self._backpropagated

    def get_train_dataloader(self):
        raise self._no_dataloader("get_train_dataloader")

    def get_eval_dataloader(self, eval_dataset=None):
        raise self._no_dataloader("get_eval_dataloader")

    def _no_dataloader(self, name: str) -> Exception:
        return UserError(f"{type(self).__name__}.{name}() is transformers' DataLoader, which posttrain does not have: it "
                         "batches the prepared rows itself (read them in trainer.train_dataset and trainer.eval_dataset), "
                         "and training_step(model, inputs) is the override point that sees each micro-batch.")

    @property
    def router_aux_loss_coef(self) -> float:
        """The router load-balancing loss's coefficient in use (TRL's attribute): 0 when off."""
        return self.router_loss.coef

    @property
    def aux_loss_enabled(self) -> bool:
        """Whether a mixture-of-experts router loss is added (TRL's attribute)."""
        return self.router_loss.enabled

    def _router_metrics(self) -> dict:
        """The step's router load-balancing loss, {"aux_loss": mean over micro-batches and processes}, or {} when a
        mixture-of-experts model's router loss is off (or the model has none); the same on every process."""
        device = self.accelerator.device
        return self.router_loss.metrics(lambda t: self.accelerator.reduce(t.to(device), reduction="mean"))

    def _backward(self, loss: torch.Tensor) -> None:
        """Backpropagate one micro-batch's loss (normalised for the whole step) through the run's sharding."""
        self._backpropagated = loss.detach()  # what training_step returns
        self.sharding.backward(self.model, loss)

    def _apply_update(self, loss: float) -> float:
        """Clip the accumulated gradients, check that the step's `loss` (the same on every process) and gradient norm
        are finite, step the optimizer and the schedule. Returns the gradient norm before clipping.

        Under DeepSpeed the engine's step clips and measures the norm itself, and skips an update whose norm is not
        finite: the norm is checked right after it, with the same outcome (no update applied, the run stops)."""
        max_norm = self.args.max_grad_norm if self.args.max_grad_norm is not None else 0.0
        rows = self._sparse_rows
        if rows is not None and not rows.serves(self.optimizer):  # an optimizer put in after construction
            rows.release()
            self._sparse_rows = rows = None
        if rows is not None:  # the input embedding's sparse gradient, updated row by row (training/sparse_rows.py)
            grad_norm = rows.clip([p for p in self.model.parameters() if p.requires_grad], max_norm)
        else:
            grad_norm = self.sharding.clip_gradients(self.model, max_norm)
        self._check_finite(loss, grad_norm)
        self._call("on_pre_optimizer_step")
        if rows is not None:
            stepped_norm = rows.step(lambda: self.sharding.optimizer_step(self.model, self.optimizer))
        else:
            stepped_norm = self.sharding.optimizer_step(self.model, self.optimizer)
        if grad_norm is None:
            grad_norm = stepped_norm
            self._check_finite(loss, grad_norm)
        self._check_weights_finite()
        self._call("on_optimizer_step")
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    _nonfinite_hint = "Lower the learning_rate or check the data."

    def _check_finite(self, loss: float, grad_norm: float | None) -> None:
        """Stop before the update when the loss or gradient norm (None: not known yet) is not finite, keeping the last
        good state (the weights are finite: every update was checked)."""
        step = self.state.global_step + 1
        for name, value in (("loss", loss), ("grad_norm", grad_norm)):
            if value is not None and not math.isfinite(value):
                self.optimizer.zero_grad(set_to_none=True)
                path = save_checkpoint(self._run_state(), self.sharding, self.args.output_dir,
                                       prefix="emergency-checkpoint")
                raise mark_agreed(TrainingError(  # every process sees the same reduced values, and raises together
                    f"Step {step}: {name} is {value}; the update was not applied and the last good state is saved in "
                    f"{path}. {self._nonfinite_hint}"))

    def _check_weights_finite(self) -> None:
        """Stop when an update (finite loss and gradient, but e.g. a huge learning rate) made weights non-finite:
        such weights are never saved as a good state."""
        rows = self._sparse_rows  # the input embedding's updated rows were checked as they were written
        finite, name = self.sharding.all_finite(self.policy, skip=rows.weight if rows is not None else None)
        if finite and rows is not None and not rows.finite:
            finite, name = False, next(n for n, p in self.policy.named_parameters() if p is rows.weight)
        if finite:
            return
        newest = checkpoints(self.args.output_dir)
        where = f"the newest checkpoint is {newest[-1][1]}" if newest else "there is no checkpoint"
        raise mark_agreed(TrainingError(  # every process sees it (all_finite agrees across shards)
            f"Step {self.state.global_step + 1}: the update made weights non-finite (first: {name}), so they are not "
            f"saved; {where}. Lower the learning_rate (or max_grad_norm)."))

