"""The parts of one optimizer step that every trainer's `_optimizer_step` uses (a mixin of training/trainer.py's
Trainer, on its `args`, `accelerator`, `sharding`, `model`, `policy`, `optimizer`, `lr_scheduler` and `state`):

    stats = self._accumulate(micro_batches, micro_loss, num_items_in_batch)
                                    each micro-batch through `training_step` -> `compute_loss` (the override points),
                                    which runs `micro_loss(batch)` -> (its share of the step's loss, its statistics),
                                    then `_backward`; gradients synchronised on the last one only
    grad_norm = self._apply_update(loss)                   clip, check finite, step optimizer and schedule
"""

import contextlib
import math

import torch

from posttrain.errors import UserError
from posttrain.models.tied_embedding import tied_rows
from posttrain.training.checkpoint import checkpoints, save_checkpoint
from posttrain.training.distributed import mark_agreed
from posttrain.training.update import Update

# fp16 steps a dynamic loss scaler may skip in a row before the run stops: each halves the scale, so 24 take 2^16,
# a GradScaler's first scale, down to 1/256 (gradients that overflow there overflow at any scale)
MAX_SCALER_SKIPS = 24


class TrainingError(UserError, RuntimeError):
    """The run cannot go on (a non-finite loss or gradient); the message names the step and the metric."""


@contextlib.contextmanager
def _unused_parameters_said(step: int, looking: bool = False):
    """DDP's error for trainable parameters that got no gradient in the step before, as one sentence; `looking`:
    DDP was already looking for unused parameters (find_unused_parameters), so the sentence does not suggest it."""
    try:
        yield
    except RuntimeError as err:
        if "Expected to have finished reduction in the prior iteration" not in str(err):
            raise
        if looking:
            raise TrainingError(
                f"Step {step}: some trainable parameters got no gradient in the step before although DDP looks for "
                "unused ones: a tensor of the model's output that the loss never reads reaches them (a vision "
                "tower's last layer, say), so DDP counts them as used; freeze those parameters.") from err
        raise TrainingError(
            f"Step {step}: some trainable parameters got no gradient in the step before (a vision tower a text batch "
            "never reaches, experts no token was routed to, a layer the loss does not use), and DDP waits for every "
            "one: set ddp_find_unused_parameters=True, or freeze those parameters.") from err


class StepMixin:
    """transformers' training_step and the update, shared by every trainer."""

    _update = None  # how gradients become an update (training/update.py): the dense one unless a trainer sets its own
    _returned_losses = ()  # the step's micro-batch losses as compute_loss returned them (_logged_loss)

    def _accumulate(self, micro_batches: list, micro_loss, num_items_in_batch=None, passes: list | None = None) -> list:
        """Run a step's micro-batches through `training_step`, whose `compute_loss` runs `micro_loss(micro_batch)` ->
        (the micro-batch's share of the step's loss, its statistics), gradients synchronised across processes only
        on the last one; `on_substep_end` between them. `num_items_in_batch`: what the step's loss is normalised over,
        across processes (passed on as transformers passes it). `passes`: per micro-batch, the parts of whole rows it
        runs as, each its own forward and backward (a trainer that splits long micro-batches: grpo/batch.py
        in_passes); None: each micro-batch in one pass. Returns the passes' statistics."""
        results, self._returned_losses = [], []
        self._run_micro_loss = micro_loss
        runs = passes if passes is not None else [[mb] for mb in micro_batches]
        for i, parts in enumerate(runs):
            for j, part in enumerate(parts):
                last = i == len(runs) - 1 and j == len(parts) - 1
                results.append(self._one_pass(part, num_items_in_batch, sync=last))
            if i < len(runs) - 1:
                self._call("on_substep_end")
        return results

    def _one_pass(self, batch, num_items_in_batch, sync: bool):
        """One forward and backward through `training_step`; gradients synchronised across processes when `sync`.
        Returns its statistics."""
        looking = bool(self.args.ddp_find_unused_parameters)
        routed = not self.sharding.reads_gradients_in_backward()  # a tied embedding's rows: models/tied_embedding.py
        with self.sharding.accumulating(self.model, sync), _unused_parameters_said(self.state.global_step + 1, looking), \
                tied_rows(self.policy, routed):
            self._micro_result = self._backpropagated = None
            self.training_step(self.model, batch, num_items_in_batch)
            self._returned_losses.append(self._backpropagated)
            if self._micro_result is None:
                method = "compute_loss" if self._backpropagated is not None else "training_step"
                raise UserError(f"{type(self).__name__}.{method} returned without calling super().{method}(...), "
                                "so the micro-batch was not trained as posttrain trains it (its statistics are "
                                "its loss's): call it in the override, and change what it returns.")
            return self._micro_result

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        """The forward and backward of one micro-batch: transformers' override point, called once per micro-batch.

        Args:
            model: the model being trained (self.model).
            inputs: the trainer's micro-batch: GRPO a TrainingBatch (rollouts, advantages, log-probs), SFT a
                SequenceBatch (input_ids, attention_mask or position_ids, targets), DPO a PairBatch.
            num_items_in_batch: what the step's loss is normalised over, across processes, as transformers passes
                it (SFT: target tokens; DPO and the reward model: pairs; KTO: examples; GRPO, RLOO and distillation:
                loss tokens, whatever loss_type then divides by).
        Returns:
            The loss it backpropagated, detached: the micro-batch's share of the step's loss. An override calls
            `super().training_step(model, inputs, num_items_in_batch)` to train (and may act before and after).
        """
        loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        self._backward(loss)
        return self._backpropagated

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        """The micro-batch's loss, to be backpropagated: transformers' override point (training_step calls it).

        The loss is the micro-batch's share of the step's loss: its terms divided by what the whole step's loss is
        normalised over (`num_items_in_batch`), so the micro-batches' losses add up to the step's (averaged over
        processes). An override calls `super().compute_loss(model, inputs, return_outputs, num_items_in_batch)` and
        may change what it returns (add a term, scale it): that is what is backpropagated, and the logged `loss` is
        then the sum of what it returned. With `return_outputs`: (loss, the micro-batch's statistics, as the
        trainer logs them).
        """
        loss, self._micro_result = self._run_micro_loss(inputs)
        return (loss, self._micro_result) if return_outputs else loss

    def _own_step_methods(self) -> bool:
        """Whether training_step and compute_loss are posttrain's own: only then may a micro-batch run as several
        passes (an override sees each micro-batch whole, as in TRL)."""
        return type(self).training_step is StepMixin.training_step and type(self).compute_loss is StepMixin.compute_loss

    def _logged_loss(self, metrics: dict) -> dict:
        """The step's metrics, with `loss` the sum of what an overridden compute_loss returned (averaged over
        processes), as transformers logs it; as they are without an override."""
        if type(self).compute_loss is StepMixin.compute_loss or not self._returned_losses:
            return metrics
        total = torch.stack([loss.float() for loss in self._returned_losses]).sum().to(self.accelerator.device)
        return {**metrics, "loss": float(self.accelerator.reduce(total, reduction="mean"))}

    def get_train_dataloader(self):
        """transformers' train DataLoader, as posttrain has it: what the steps take, one epoch (training/loaders.py)."""
        return self._train_loader()

    def get_eval_dataloader(self, eval_dataset=None):
        """transformers' eval DataLoader, as posttrain has it: what evaluation takes of `eval_dataset` (default: the
        trainer's; a name picks one of a dict of them), as training/loaders.py says."""
        if eval_dataset is None or isinstance(eval_dataset, str):
            named, given = eval_dataset, self.eval_dataset
            if given is None:
                raise UserError(f"{type(self).__name__} has no eval_dataset: pass one to get_eval_dataloader.")
            if isinstance(given, dict) and named not in given:
                raise UserError(f"eval_dataset is a dict of datasets ({', '.join(map(str, given))}): pass the name "
                                "of one to get_eval_dataloader.")
            eval_dataset = given[named] if isinstance(given, dict) else given
        return self._eval_loader(eval_dataset)

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
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise UserError(f"{type(self).__name__}.compute_loss returned {type(loss).__name__}"
                            f"{'' if not isinstance(loss, torch.Tensor) else ' without a gradient'}, where the "
                            "micro-batch's loss is a tensor connected to the model's parameters: return super()'s "
                            "loss, or a term added to it.")
        self._backpropagated = loss.detach()  # what training_step returns
        self.sharding.backward(self.model, loss)

    def _apply_update(self, loss: float) -> float:
        """Clip the accumulated gradients, check that the step's `loss` (the same on every process) and gradient norm
        are finite, step the optimizer and the schedule. Returns the gradient norm before clipping.

        Under DeepSpeed the engine's step clips and measures the norm itself, and skips an update whose norm is not
        finite: the norm is checked right after it, with the same outcome (no update applied, the run stops).

        Under a dynamic loss scaler (fp16) a non-finite gradient norm is an overflow: the scaler skips the update and
        lowers its scale, the schedule does not advance, and the run goes on (transformers' behaviour); only
        MAX_SCALER_SKIPS skips in a row stop it."""
        max_norm = self.args.max_grad_norm if self.args.max_grad_norm is not None else 0.0
        if self._update is None:
            self._update = Update(self.sharding)
        grad_norm = self._update.clip(self.model, self.optimizer, max_norm)
        scaled = self._update.scales_loss(self.model)
        self._check_finite(loss, None if scaled else grad_norm)
        self._call("on_pre_optimizer_step")
        stepped_norm = self._update.step(self.model, self.optimizer)
        if grad_norm is None:
            grad_norm = stepped_norm
            self._check_finite(loss, None if scaled else grad_norm)
        if scaled and self._update.step_skipped(self.model, self.optimizer):
            self._scaler_skipped(grad_norm)
            self.optimizer.zero_grad(set_to_none=True)
            return grad_norm
        self._scaler_skips = 0
        self._check_weights_finite()
        self._call("on_optimizer_step")
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _scaler_skipped(self, grad_norm: float | None) -> None:
        """Count a step the loss scaler skipped; stop with one sentence after MAX_SCALER_SKIPS in a row (gradients that
        are not finite at any scale)."""
        self._scaler_skips = getattr(self, "_scaler_skips", 0) + 1
        if self._scaler_skips >= MAX_SCALER_SKIPS:
            raise mark_agreed(TrainingError(  # the scaler's verdict is the same on every process
                f"Step {self.state.global_step + 1}: the fp16 loss scaler skipped the last {self._scaler_skips} updates "
                f"in a row for non-finite gradients (grad_norm {grad_norm}), so they are not finite at any scale; no "
                "update was applied. Lower the learning_rate, check the data, or train in bf16."))

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
        name = self._update.nonfinite_weight(self.policy)
        if name is None:
            return
        newest = checkpoints(self.args.output_dir)
        where = f"the newest checkpoint is {newest[-1][1]}" if newest else "there is no checkpoint"
        raise mark_agreed(TrainingError(  # every process sees it (all_finite agrees across shards)
            f"Step {self.state.global_step + 1}: the update made weights non-finite (first: {name}), so they are not "
            f"saved; {where}. Lower the learning_rate (or max_grad_norm)."))

