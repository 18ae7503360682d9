"""The loop every trainer shares, on accelerate, with transformers' Trainer's public surface.

A trainer subclasses `Trainer` and provides its data and its step:

    _optimizer_step() -> dict         one optimizer step: its micro-batches through `_accumulate`, then
                                      `_apply_update(loss)`; returns the step's metrics
    _epoch() -> float                 progress in epochs after `state.global_step` steps
    _evaluation_metrics(dataset, prefix) -> dict    metrics over an eval dataset (the model is in eval mode)
    _restore_position(checkpoint_state)             move the data to where a checkpoint left it

The loop (`train`) runs steps until `max_steps` or a callback stops it; after each step the default flow
(training/callbacks.py) and the callbacks decide whether to log, evaluate and checkpoint; at the end it logs the
train summary (train_runtime, train_loss, ...), saves the model, and pushes to the Hub when asked.
"""

import atexit
import contextlib
import json
import logging
import math
import os
import shutil
import time

import torch

from posttrain.training.callbacks import CallbackHandler, Intervals, flow_after_epoch, flow_after_step
from posttrain.training.best_model import check_best_checkpoint, note_best_checkpoint, record_best
from posttrain.training.checkpoint import checkpoints, load_checkpoint, load_policy_weights, save_checkpoint
from posttrain.training.checkpoint import resolve as resolve_checkpoint
from posttrain.errors import UserError, storage_error
from posttrain.training.distributed import guarded, mark_agreed
from posttrain.training.interrupts import Interrupted, InterruptWatch
from posttrain.training.hub import push_folder, repo_id
from posttrain.training.logging import MetricsLogger
from posttrain.models import fast_paths
from posttrain.models.router import RouterLoss, router_coefficient
from posttrain.training.offloading import ActivationOffloader
from posttrain.training.optim import make_optimizer, make_scheduler
from posttrain.training.output_dir import OutputLock, check_writable, remove_stale_temporaries
from posttrain.training.saving import save_merged, save_policy_atomically
from posttrain.training.setup import make_accelerator, set_log_level, training_flops_per_token
from posttrain.training.sharding import Sharding, check_launch, check_supported

logger = logging.getLogger("posttrain")


class TrainingError(UserError, RuntimeError):
    """The run cannot go on (a non-finite loss or gradient); the message names the step and the metric."""


def _let_collectives_finish() -> None:
    """gloo's worker threads free a finished collective's tensors after the caller has moved on, and freeing a
    Python-owned tensor takes the GIL: at interpreter exit such a thread is killed inside a C++ destructor and the
    process aborts ("terminate called without an active exception", pytorch/pytorch#38228). A moment without the GIL
    lets them finish while the interpreter is alive. Registered to run at exit by every multi-process trainer, so
    that scripts which never call `close()` (as TRL's users do not) are covered too."""
    time.sleep(0.05)


# what transformers logs at logging steps only: a summary record does not repeat them
STEP_ONLY_KEYS = ("loss", "grad_norm", "learning_rate")


class Trainer:
    """The shared loop. Subclasses set `self.model` (via `_prepare`), `self.processing_class` and `self.policy`.

    Args:
        args: the trainer's config.
        callbacks: TrainerCallback instances or classes (training/callbacks.py).
        optimizers: (optimizer, lr_scheduler), either None to build it from the config, as in transformers.
        optimizer_cls_and_kwargs: (optimizer class, keyword arguments) to build the optimizer with, instead of optim
            and optim_args (transformers' argument).
    """

    def __init__(self, args, callbacks=None, optimizers=(None, None), optimizer_cls_and_kwargs=None):
        from transformers import TrainerControl, TrainerState
        from transformers.trainer_utils import enable_full_determinism, set_seed

        self.args = args
        self.accelerator = make_accelerator(args, self._mixed_precision())
        if self.accelerator.num_processes > 1:  # once per process, however many trainers it builds
            atexit.unregister(_let_collectives_finish)
            atexit.register(_let_collectives_finish)
        check_launch(self.accelerator)  # FSDP or DeepSpeed asked for and not set up: one sentence, before any work
        check_supported(self.accelerator)
        self.sharding = Sharding.of(self.accelerator)
        enable_full_determinism(args.seed) if args.full_determinism else set_seed(args.seed)
        if args.tf32 is not None and torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
        set_log_level(args, self.accelerator.is_main_process)
        self.state = TrainerState(is_local_process_zero=self.accelerator.is_local_main_process,
                                  is_world_process_zero=self.accelerator.is_main_process)
        self.control = TrainerControl()
        self.model = self.policy = self.forward_policy = self.optimizer = self.lr_scheduler = None
        self.processing_class = None
        self.callback_handler = CallbackHandler(callbacks, self)
        self._optimizers = optimizers
        self._optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        self.logger = None
        self.eval_dataset = None
        self.router_loss = RouterLoss(0.0)  # a mixture-of-experts model's load-balancing loss, set with the policy
        self.compute_metrics = self.preprocess_logits_for_metrics = None  # SFT's and DPO's (training/prediction.py)
        with guarded(self.accelerator):  # before anything slow: a path that cannot be written stops at once
            if self.accelerator.is_main_process:
                check_writable(args.output_dir)

    # ------------------------------------------------------------------ setup

    def _mixed_precision(self) -> str:
        bf16 = self.args.bf16
        if bf16 is None:
            bf16 = not self.args.use_cpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return "bf16" if bf16 else "fp16" if self.args.fp16 else "no"

    def _prepare(self, model, total_steps: int) -> None:
        """Build (or take) the optimizer and schedule for a run of `total_steps` steps, and prepare them."""
        optimizer, scheduler = self._optimizers
        if optimizer is None:
            optimizer = make_optimizer(model, self.args, self._optimizer_cls_and_kwargs)
        scheduler = scheduler if scheduler is not None else make_scheduler(optimizer, self.args, total_steps)
        self._flops_per_token = training_flops_per_token(model)  # before sharding: whole parameters
        self.model, self.optimizer, self.lr_scheduler = self.sharding.prepare(model, optimizer, scheduler, self.args)
        self.policy = self.accelerator.unwrap_model(self.model)
        self.forward_policy = self.sharding.forward_module(self.model, self.policy)  # for forwards without gradient
        if getattr(self, "ref_model", None) is not None:  # a separate reference: sharded as the policy is
            self.ref_model = self.sharding.prepare_frozen(self.ref_model)
            if not self.args.fast_paths:
                fast_paths.turn_off(self.ref_model)
        self._offloader = None
        if getattr(self.args, "activation_offloading", False):
            if self.accelerator.device.type == "cpu":
                logger.warning("activation_offloading=True changes nothing on a CPU: the activations saved for the "
                               "backward are in host memory already.")
            else:
                self._offloader = ActivationOffloader(self.policy)
        self.intervals = Intervals(self.args, total_steps)
        state = self.state
        state.max_steps, state.num_train_epochs = total_steps, self.args.num_train_epochs
        state.logging_steps, state.eval_steps, state.save_steps = (self.intervals.logging, self.intervals.eval,
                                                                   self.intervals.save)
        state.train_batch_size = self.args.per_device_train_batch_size

    def _offloading(self):
        """The block to run a training forward in: activation_offloading's offloader, or nothing."""
        return self._offloader if self._offloader is not None else contextlib.nullcontext()

    def _load_policy(self, model, processing_class, peft_config, adapt=None):
        """Load the model (a path, a hub id or a model) and its tokenizer, and prepare it for training (adapters,
        dropout, checkpointing: models/preparation.py). Sets `processing_class` and `tokenizer`. `adapt(model,
        peft_config)` runs between the two (SFT's chat_template_path resizes the embeddings there, before adapters
        wrap them).

        Returns:
            (the prepared policy on this process's device, whether the model came with a peft adapter).
        """
        from posttrain.configs import ConfigError
        from posttrain.models import load_causal_lm, load_tokenizer
        from posttrain.models.loading import with_trl_default_dtype
        from posttrain.models.peft import is_peft_model
        from posttrain.models.preparation import prepare_policy

        args = self.args
        if isinstance(model, str) and os.path.isdir(os.path.expanduser(model)) and os.path.realpath(
                os.path.expanduser(model)) == os.path.realpath(args.output_dir):
            raise ConfigError(f"output_dir {args.output_dir!r} is the model's own directory: the final save would "
                              "overwrite the model being trained; choose another output_dir.")
        model = load_causal_lm(model, with_trl_default_dtype(
            {"trust_remote_code": self._trust_remote_code, **(args.model_init_kwargs or {})}))
        self.processing_class = (processing_class if processing_class is not None
                                 else load_tokenizer(model.config._name_or_path, self._trust_remote_code))
        self.tokenizer = load_tokenizer(self.processing_class)
        came_with_adapter = is_peft_model(model)
        if not args.fast_paths:
            fast_paths.turn_off(model)
        if adapt is not None:
            adapt(model, peft_config)
        self.router_loss = RouterLoss(router_coefficient(model, args.router_aux_loss_coef))
        return prepare_policy(model, args, peft_config, self.accelerator.device), came_with_adapter

    @property
    def _trust_remote_code(self) -> bool:
        args = self.args
        return args.trust_remote_code or bool((args.model_init_kwargs or {}).get("trust_remote_code"))

    @property
    def _data_seed(self) -> int:
        return self.args.data_seed if self.args.data_seed is not None else self.args.seed

    def _padding_multiple(self) -> int | None:
        """pad_to_multiple_of as a number (or None): "auto" pads to 128 on Neuron, which compiles once per shape, and
        nowhere else, where padding does not pay."""
        multiple = self.args.pad_to_multiple_of
        if multiple == "auto":
            return 128 if self.accelerator.device.type == "neuron" else None
        return multiple

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the run (max_steps, or derived from num_train_epochs)."""
        return self.state.max_steps

    @property
    def scheduler(self):
        """The learning-rate schedule (transformers calls it `lr_scheduler`)."""
        return self.lr_scheduler

    @scheduler.setter
    def scheduler(self, value):
        self.lr_scheduler = value

    # ------------------------------------------------------------------ callbacks

    def add_callback(self, callback) -> None:
        """Add a TrainerCallback (an instance or a class)."""
        self.callback_handler.add(callback)

    def pop_callback(self, callback):
        """Remove a callback (an instance, or the first of a class) and return it."""
        return self.callback_handler.pop(callback)

    def remove_callback(self, callback) -> None:
        self.callback_handler.pop(callback)

    def _call(self, event: str, **kwargs):
        """Run a callback event; a callback that raises on one process stops every process."""
        if self.accelerator.num_processes == 1:
            return self.callback_handler.call(event, **kwargs)
        with guarded(self.accelerator):
            return self.callback_handler.call(event, **kwargs)

    # ------------------------------------------------------------------ the loop

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        """Run `max_steps` optimizer steps (or `num_train_epochs`), then save the final model.

        Args:
            resume_from_checkpoint: a checkpoint directory, or True for the newest in output_dir; default
                `args.resume_from_checkpoint`.
        Returns:
            transformers' TrainOutput(global_step, training_loss, metrics).
        """
        if trial is not None:
            from posttrain.configs import ConfigError

            raise ConfigError("train(trial=...) is for transformers' hyper-parameter search, which posttrain does not "
                              "run: train one config per run.")
        args = self.args
        lock = OutputLock(args.output_dir)
        with guarded(self.accelerator):  # one run per output_dir; saves a killed run left half-done are removed
            if self.accelerator.is_main_process:
                lock.__enter__()
                remove_stale_temporaries(args.output_dir)
        try:
            return self._train(resume_from_checkpoint)
        finally:
            lock.__exit__()

    def _train(self, resume_from_checkpoint):
        """train() within the output_dir lock."""
        from transformers.trainer_utils import TrainOutput

        args = self.args
        path = resolve_checkpoint(resume_from_checkpoint if resume_from_checkpoint is not None
                                  else args.resume_from_checkpoint, args.output_dir)
        if path is not None:
            self._resume(path)
        check_best_checkpoint(self.state)
        self.logger = MetricsLogger(args, self.state.max_steps, enabled=self.accelerator.is_main_process,
                                    run_config=args.to_dict(), append=path is not None,
                                    start_step=self.state.global_step, title=self._title,
                                    cumulative=self._cumulative_metrics, shown=self._shown_metrics)
        start_time, start_step, self._loss_sum = time.time(), self.state.global_step, 0.0
        self._call("on_train_begin")
        self._epoch_open = False
        try:
            with InterruptWatch(self.accelerator) as interrupts:
                if args.eval_on_start and self.state.global_step == 0:
                    self._evaluate_during_training()
                while self.state.global_step < self.state.max_steps and not self.control.should_training_stop:
                    self._one_step()
                    signum = interrupts.received()
                    if signum:
                        self._stop_on_signal(signum)
            if self._epoch_open:
                self._end_epoch()
            metrics = self._train_summary(start_time, self.state.global_step - start_step)
        finally:
            self.logger.close()
        if args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            self._load_best_model()
        self.save_model(args.output_dir)
        self._on_main(self._write_plots)
        if getattr(args, "save_merged", False):
            self.save_merged(os.path.join(args.output_dir, "merged"))
        self._call("on_train_end")
        if args.push_to_hub:
            self.push_to_hub(commit_message="End of training")
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    def _load_best_model(self) -> None:
        """load_best_model_at_end: the best checkpoint's weights into the policy (the final save writes them); with
        save_total_limit=1 only that checkpoint stays, as in transformers."""
        state = self.state
        logger.info(f"Loading best model from {state.best_model_checkpoint} (score: {state.best_metric}).")
        load_policy_weights(self, state.best_model_checkpoint)
        if self.args.save_total_limit == 1:
            self._on_main(self._remove_checkpoints_but, state.best_model_checkpoint)

    def _remove_checkpoints_but(self, kept: str) -> None:
        for _, path in checkpoints(self.args.output_dir):
            if path != kept:
                shutil.rmtree(path, ignore_errors=True)

    def _write_plots(self) -> None:
        """output_dir/plots.png from metrics.jsonl and output_dir/report.html (posttrain/report.py), as plot_on_end
        says (None: when matplotlib is installed)."""
        import importlib.util

        from posttrain.plotting import PlotError, plot_runs
        from posttrain.report import write_report

        if self.args.plot_on_end is False or (self.args.plot_on_end is None and
                                              importlib.util.find_spec("matplotlib") is None):
            return
        try:
            plot_runs([self.args.output_dir], os.path.join(self.args.output_dir, "plots.png"))
        except PlotError as err:  # nothing logged (logging_strategy=no): the run itself is fine
            logger.warning("No plots.png: %s", err)
        write_report(self.args.output_dir)  # without logged steps, it says so in place of the curves

    _title = "train"
    _shown_metrics: tuple = ("loss",)  # on the terminal; the first with its moving average (training/logging.py)
    _cumulative_metrics: tuple = ()  # metrics that are running totals (logged as their latest value)

    def _one_step(self) -> None:
        state, control = self.state, self.control
        if not self._epoch_open:
            self._epoch_open, self._epoch_index = True, math.floor(state.epoch)
            self._call("on_epoch_begin")
        self._call("on_step_begin")
        start = time.perf_counter()
        metrics = self._optimizer_step()
        state.global_step += 1
        state.epoch = self._epoch()
        metrics["step_time"] = time.perf_counter() - start
        self._loss_sum += metrics.get("loss", 0.0)
        self.logger.add(metrics)
        self.logger.advance()
        steps = self.args.torch_empty_cache_steps
        if steps and state.global_step % steps == 0 and torch.cuda.is_available():
            torch.cuda.empty_cache()
        flow_after_step(self.args, state, control, self.intervals)
        self._call("on_step_end")
        self._act_on_control()
        if control.should_epoch_stop:
            self._skip_rest_of_epoch()
            state.epoch = self._epoch()
        if control.should_epoch_stop or math.floor(state.epoch) > self._epoch_index:
            self._end_epoch()

    # ------------------------------------------------------------------ one optimizer step, for subclasses

    def _accumulate(self, micro_batches: list, micro_step) -> list:
        """Run a step's micro-batches through `training_step`, which runs `micro_step(micro_batch)`, gradients
        synchronised across processes only on the last one; `on_substep_end` between them. Returns the micro-steps'
        results."""
        from posttrain.errors import UserError

        results = []
        self._run_micro_step = micro_step
        for i, mb in enumerate(micro_batches):
            sync = i == len(micro_batches) - 1
            with self.sharding.accumulating(self.model, sync):
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
        from posttrain.errors import UserError

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
        grad_norm = self.sharding.clip_gradients(self.model, max_norm)
        self._check_finite(loss, grad_norm)
        self._call("on_pre_optimizer_step")
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
                path = save_checkpoint(self, self.args.output_dir, prefix="emergency-checkpoint")
                raise mark_agreed(TrainingError(  # every process sees the same reduced values, and raises together
                    f"Step {step}: {name} is {value}; the update was not applied and the last good state is saved in "
                    f"{path}. {self._nonfinite_hint}"))

    def _check_weights_finite(self) -> None:
        """Stop when an update (finite loss and gradient, but e.g. a huge learning rate) made weights non-finite:
        such weights are never saved as a good state."""
        finite, name = self.sharding.all_finite(self.policy)
        if finite:
            return
        newest = checkpoints(self.args.output_dir)
        where = f"the newest checkpoint is {newest[-1][1]}" if newest else "there is no checkpoint"
        raise mark_agreed(TrainingError(  # every process sees it (all_finite agrees across shards)
            f"Step {self.state.global_step + 1}: the update made weights non-finite (first: {name}), so they are not "
            f"saved; {where}. Lower the learning_rate (or max_grad_norm)."))

    def _stop_on_signal(self, signum: int) -> None:
        """SIGINT / SIGTERM arrived during the step just finished: log its window, checkpoint it, and stop."""
        import signal

        record = self.logger.flush()
        if record:
            self.log(record)
        newest = checkpoints(self.args.output_dir)
        path = newest[-1][1] if newest else None
        if self.args.save_on_interrupt and not (newest and newest[-1][0] == self.state.global_step):
            path = save_checkpoint(self, self.args.output_dir, self.args.save_total_limit)
        where = (f"the newest checkpoint is {path}: resume with resume_from_checkpoint=true" if path
                 else "there is no checkpoint to resume from (save_on_interrupt is off)")
        raise mark_agreed(Interrupted(f"Interrupted ({signal.Signals(signum).name}) at step {self.state.global_step} "
                                      f"of {self.state.max_steps}; {where}.", signum))

    def _end_epoch(self) -> None:
        self._epoch_open = False
        self._call("on_epoch_end")
        flow_after_epoch(self.args, self.state, self.control)
        self._act_on_control()

    def _act_on_control(self) -> None:
        """Log, evaluate and checkpoint as the flow and the callbacks asked, in transformers' order."""
        control = self.control
        if control.should_log:
            control.should_log = False
            record = self.logger.flush()
            if record:
                self.log(record)
        if control.should_evaluate:
            control.should_evaluate = False
            new_best = record_best(self.args, self.state, self._evaluate_during_training())
            if self.args.save_strategy == "best":
                control.should_save = new_best
        if control.should_save:
            control.should_save = False
            self._save_checkpoint()

    def _skip_rest_of_epoch(self) -> None:
        """A callback set should_epoch_stop: the rest of this epoch's data is not trained on. Subclasses that can
        skip data override this."""

    def _train_summary(self, start_time: float, steps: int) -> dict:
        """transformers' end-of-training record, logged to log_history, trackers and callbacks, and written to
        output_dir/train_results.json."""
        from transformers.trainer_utils import speed_metrics

        args = self.args
        per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * self.accelerator.num_processes
        metrics = speed_metrics("train", start_time, num_samples=steps * per_step, num_steps=steps)
        metrics.update(total_flos=float(self.state.total_flos), train_loss=self._loss_sum / max(steps, 1))
        self.log(metrics, to_file=False)
        # TRL merges its metrics into every record it logs, this one too, and its users read them from
        # state.log_history[-1]: there the summary carries the last logging window's (not transformers' own per-step
        # keys, which it leaves to train_loss); trackers already have them at their step
        summary = self.state.log_history[-1]
        carried = {k: v for k, v in self.logger.last_window.items() if k not in STEP_ONLY_KEYS and k not in summary}
        self.state.log_history[-1] = {**summary, **carried}
        self.save_metrics("train", metrics)
        return metrics

    def _resume(self, path: str) -> None:
        state = load_checkpoint(self, path)
        self.state.global_step, self.state.epoch = state["global_step"], state["epoch"]
        self.state.log_history = state["log_history"]
        for key in ("best_metric", "best_global_step", "best_model_checkpoint"):
            setattr(self.state, key, state.get(key))
        self.state.total_flos = state.get("total_flos", 0.0)
        self._restore_position(state)

    def _save_checkpoint(self) -> None:
        note_best_checkpoint(self.args, self.state)
        save_checkpoint(self, self.args.output_dir, self.args.save_total_limit)
        self._call("on_save")
        if self.args.push_to_hub and self.args.hub_strategy == "every_save":
            self.push_to_hub(commit_message=f"Training in progress, step {self.state.global_step}")

    # ------------------------------------------------------------------ what checkpoints hold (training/checkpoint.py)

    def _checkpoint_meta(self) -> dict:
        return {}

    def _checkpoint_tensors(self) -> dict:
        return {}

    def _load_checkpoint_tensors(self, tensors: dict, device) -> None:
        pass

    def _checkpoint_generators(self) -> dict:
        return {}

    def _checkpoint_models(self) -> dict:
        return {}

    # ------------------------------------------------------------------ logging and evaluation

    def log(self, logs: dict, start_time=None, to_file: bool = True) -> None:
        """Record `logs` at the current step: log_history, metrics.jsonl, trackers, and the on_log callbacks.

        Args:
            to_file: also append to metrics.jsonl (the end-of-training summary goes to train_results.json instead).
        """
        record = {"step": self.state.global_step, "epoch": round(self.state.epoch, 4), **logs}
        self.state.log_history.append(record)
        self._on_main(self._emit, record, to_file, writing=None)  # trackers' network errors are not disk writes
        self._call("on_log", logs=record)

    def _emit(self, record: dict, to_file: bool) -> None:
        if self.logger is not None:
            self.logger.emit(record, to_file=to_file)
        elif to_file:
            path = os.path.join(self.args.output_dir, "metrics.jsonl")
            try:
                os.makedirs(self.args.output_dir, exist_ok=True)
                with open(path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as err:
                raise storage_error(err, "write", path) from err

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        """Metrics over an eval dataset (default: the trainer's), logged and passed to on_evaluate.

        Args:
            eval_dataset: a dataset, or a dict of them (each evaluated with the prefix eval_<name>).
        """
        dataset = eval_dataset if eval_dataset is not None else self._eval_source
        if dataset is None:
            from posttrain.configs import ConfigError

            raise ConfigError("evaluate() needs an eval_dataset: pass it to the trainer or to evaluate().")
        if isinstance(dataset, dict):
            metrics = {}
            for name, part in dataset.items():
                metrics.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        was_training = self.model.training
        self.model.eval()
        try:
            metrics = self._evaluation_metrics(dataset, metric_key_prefix)
        finally:
            self.model.train(was_training)
        self.log(metrics)
        self._call("on_evaluate", metrics=metrics)
        return metrics

    @property
    def eval_dataset(self):
        """The eval dataset (or dict of them) as TRL shows it after preparation (SFT: input_ids and labels; DPO:
        prompt_ids, chosen_ids, rejected_ids; GRPO: the rows as given). Set it to evaluate on other rows."""
        source = self._eval_source
        if source is None:
            return None
        if isinstance(source, dict):
            return {name: self._prepared_view(part) for name, part in source.items()}
        return self._prepared_view(source)

    @eval_dataset.setter
    def eval_dataset(self, dataset) -> None:
        self._eval_source = dataset

    def _prepared_view(self, dataset):
        """A dataset as the trainer prepares it, for users to read (the trainer trains on its own rows)."""
        return dataset

    def _evaluate_during_training(self) -> None:
        if self._eval_source is None:
            from posttrain.configs import ConfigError

            raise ConfigError(f"eval_strategy={self.args.eval_strategy!r} (or eval_on_start) needs an eval_dataset: "
                              "pass one to the trainer, or set eval_strategy='no'.")
        return self.evaluate()

    # ------------------------------------------------------------------ saving and the Hub

    def _on_main(self, fn, *args, writing: str | None = "output_dir"):
        """`fn(*args)` on the main process; every process waits for it and learns whether it failed (a failed disk
        write under `writing`, default output_dir, as one sentence; None for work that is not a write)."""
        path = self.args.output_dir if writing == "output_dir" else writing
        with guarded(self.accelerator, writing=path):
            if self.accelerator.is_main_process:
                fn(*args)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the model (or adapter), tokenizer and config to `output_dir` (default args.output_dir)."""
        whole = self.sharding.full_state_dict(self.model)  # sharded: gathered by every process, written by the main
        self._on_main(save_policy_atomically, self.policy, self.processing_class, self.args.to_dict(),
                      output_dir or self.args.output_dir, whole)

    def save_merged(self, output_dir: str) -> None:
        """Save full weights that load with plain `AutoModelForCausalLM.from_pretrained` (LoRA merged)."""
        with self.sharding.whole_weights(self.model):  # every process: the export reads whole weights
            self._on_main(save_merged, self.policy, self.processing_class, output_dir)

    def save_state(self) -> None:
        """Write the TrainerState to output_dir/trainer_state.json, as transformers does."""
        self._on_main(self._write_state_json)

    def _write_state_json(self) -> None:
        os.makedirs(self.args.output_dir, exist_ok=True)
        self.state.save_to_json(os.path.join(self.args.output_dir, "trainer_state.json"))

    def log_metrics(self, split: str, metrics: dict) -> None:
        """Print `metrics` of `split` (train, eval, ...) as transformers' Trainer does, on the main process."""
        if not self.accelerator.is_main_process:
            return
        print(f"***** {split} metrics *****")
        width = max((len(k) for k in metrics), default=0)
        for key in sorted(metrics):
            value = metrics[key]
            print(f"  {key:<{width}} = {value:>9.4g}" if isinstance(value, float) else f"  {key:<{width}} = {value}")

    def save_metrics(self, split: str, metrics: dict, combined: bool = True) -> None:
        """Write `metrics` to output_dir/<split>_results.json (and merge them into all_results.json)."""
        self._on_main(self._write_metrics, split, metrics, combined)

    def _write_metrics(self, split: str, metrics: dict, combined: bool) -> None:
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(os.path.join(self.args.output_dir, f"{split}_results.json"), "w") as f:
            json.dump(metrics, f, indent=4, sort_keys=True)
        if combined:
            path = os.path.join(self.args.output_dir, "all_results.json")
            merged = json.load(open(path)) if os.path.exists(path) else {}
            merged.update(metrics)
            with open(path, "w") as f:
                json.dump(merged, f, indent=4, sort_keys=True)

    def push_to_hub(self, commit_message: str = "End of training", blocking: bool = True, token: str | None = None,
                    revision: str | None = None, **kwargs) -> str | None:
        """Save the model to output_dir and upload output_dir to the Hub (args.hub_model_id, else its name).

        It needs network access and a token (`hf auth login`, HF_TOKEN or hub_token); without them it stops with one
        sentence saying so. Uploads are synchronous. Returns the commit URL on the main process.
        """
        self.save_model(self.args.output_dir)
        self._call("on_push_begin")
        url = None
        with guarded(self.accelerator):  # the main process pushes; every process learns whether it failed
            if self.accelerator.is_main_process:
                url = push_folder(self.args, self.args.output_dir, commit_message, token=token, revision=revision)
        return url

    @property
    def hub_model_id(self) -> str:
        """The Hub repository push_to_hub uploads to: args.hub_model_id, else output_dir's name (under the token's
        user), as transformers' Trainer names it."""
        return repo_id(self.args)

    def is_world_process_zero(self) -> bool:
        return self.accelerator.is_main_process

    def is_local_process_zero(self) -> bool:
        return self.accelerator.is_local_main_process

    def end(self) -> None:
        """transformers' (5.18) name for the end of a run, which TRL's scripts call: the same as close()."""
        self.close()

    def close(self, failed: bool = False) -> None:
        """Release the process group in a multi-process run (call once, at the end).

        Args:
            failed: the run stopped on an error. Then no process waits for the others (one that died never
                arrives); each releases its own part and exits.
        """
        if not failed:
            self.accelerator.wait_for_everyone()
        self.accelerator.end_training()  # destroys the process group: gloo aborts at exit otherwise
