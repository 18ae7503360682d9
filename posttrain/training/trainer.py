"""The loop every trainer shares, on accelerate, with transformers' Trainer's public surface.

A trainer subclasses `Trainer` and provides its data and its step:

    _optimizer_step() -> dict         one optimizer step: its micro-batches through `_accumulate`, then
                                      `_apply_update(loss)`; returns the step's metrics
    _epoch() -> float                 progress in epochs after `state.global_step` steps
    _evaluation_metrics(dataset, prefix) -> dict    metrics over an eval dataset (the model is in eval mode)
    _checkpoint_extras() -> CheckpointExtras        what its checkpoints hold besides the policy and optimizer
    _restore_position(state, tensors)               take them back: the data position, this process's tensors
    _start_sources() / _stop_sources()              open a running data source where the position stands, and
                                                    close it when training ends (grpo/round_source.py); optional

The loop (`train`) runs steps until `max_steps` or a callback stops it; after each step the default flow
(training/callbacks.py) and the callbacks decide whether to log, evaluate and checkpoint; at the end it logs the
train summary (train_runtime, train_loss, ...), saves the model, and pushes to the Hub when asked.

The rest of transformers' surface comes from three mixins on the same fields: the step's parts and training_step
(training/step.py), evaluate() and eval_dataset (training/evaluation.py), and logging, saving and the Hub
(training/outputs.py).
"""

import contextlib
import logging
import math
import os
import time

import torch

from posttrain.data import vocabulary_rows
from posttrain.models import fast_paths
from posttrain.models.router import RouterLoss, router_coefficient
from posttrain.timeouts import InterruptedWaiting
from posttrain.training.best_model import check_best_checkpoint, note_best_checkpoint, record_best
from posttrain.training.callbacks import CallbackHandler, Intervals, flow_after_epoch, flow_after_step
from posttrain.training.checkpoint import (CheckpointExtras, RunState, checkpoints, load_checkpoint,
                                          load_policy_weights, run_identity, save_checkpoint)
from posttrain.training.checkpoint import resolve as resolve_checkpoint
from posttrain.training.distributed import AGREED, guarded, let_collectives_finish_at_exit, mark_agreed
from posttrain.training.evaluation import EvaluationMixin
from posttrain.training.interrupts import Interrupted, InterruptWatch, interrupted_waiting
from posttrain.training.logging import MetricsLogger, hide_deepspeed_cpu_notice
from posttrain.training.offloading import ActivationOffloader
from posttrain.training.optim import check_optimizers, make_optimizer, make_scheduler
from posttrain.training.output_dir import OutputLock, check_writable, remove_stale_temporaries
from posttrain.training.outputs import OutputsMixin
from posttrain.training.overrides import refuse_uncalled_overrides
from posttrain.training.setup import (allow_unused_parameters, make_accelerator, prepare_host_memory, set_log_level,
                                     training_flops_per_token)
from posttrain.training.sharding import check_launch, check_supported, sharding_of
from posttrain.training.threads import IntraOpThreads
from posttrain.training.step import StepMixin, TrainingError  # noqa: F401 - TrainingError: part of this module's API

logger = logging.getLogger("posttrain")


class Trainer(StepMixin, EvaluationMixin, OutputsMixin):
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

        refuse_uncalled_overrides(type(self))  # a subclass's override that would never run: before any work
        check_optimizers(optimizers, optimizer_cls_and_kwargs)
        hide_deepspeed_cpu_notice()  # accelerate imports DeepSpeed when installed, which warns on a CPU-only machine
        self.args = args
        self.accelerator = make_accelerator(args, self._mixed_precision())
        self._threads = IntraOpThreads(self.accelerator.device.type, args.fast_paths)  # training/threads.py
        if self.accelerator.num_processes > 1:
            let_collectives_finish_at_exit()
        check_launch(self.accelerator)  # FSDP or DeepSpeed asked for and not set up: one sentence, before any work
        check_supported(self.accelerator)
        self.sharding = sharding_of(self.accelerator)
        enable_full_determinism(args.seed) if args.full_determinism else set_seed(args.seed)
        if args.tf32 is not None and torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32
        set_log_level(args, self.accelerator.is_main_process)
        self.state = TrainerState(is_local_process_zero=self.accelerator.is_local_main_process,
                                  is_world_process_zero=self.accelerator.is_main_process)
        self.control = TrainerControl()
        self.model = self.policy = self.forward_policy = self.optimizer = self.lr_scheduler = None
        self.processing_class = None
        self.ref_model = None  # a separate reference model, which a subclass sets before `_prepare`
        self._model_fingerprint = None  # the policy's, before training: set by the subclass (checkpoint.py)
        self.callback_handler = CallbackHandler(callbacks, self)
        self._optimizers, self._optimizer_cls_and_kwargs = optimizers, optimizer_cls_and_kwargs
        self.router_loss = RouterLoss(0.0)  # a mixture-of-experts model's load-balancing loss, set with the policy
        self.logger = self.eval_dataset = self.compute_metrics = self.preprocess_logits_for_metrics = None
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
        prepare_host_memory(self.accelerator, self.args, model, optimizer)  # training/heap.py
        self.model, self.optimizer, self.lr_scheduler = self.sharding.prepare(model, optimizer, scheduler, self.args)
        self.policy = self.accelerator.unwrap_model(self.model)
        self.forward_policy = self.sharding.forward_module(self.model, self.policy)  # for forwards without gradient
        if self.ref_model is not None:  # a separate reference: sharded as the policy is
            self.ref_model = self.sharding.prepare_frozen(self.ref_model)
            if not self.args.fast_paths:
                fast_paths.turn_off(self.ref_model)
        self._offloader = None
        if self.args.activation_offloading:
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

    def _load_policy(self, model, processing_class, peft_config, adapt=None, load=None):
        """Load the model (a path, a hub id or a model) and its tokenizer, and prepare it for training (adapters,
        dropout, checkpointing: models/preparation.py). Sets `processing_class`, `tokenizer` and `_vocab_rows`.
        `adapt(model, peft_config)` runs between the two (SFT's chat_template_path resizes the embeddings there, before
        adapters wrap them). `load(model, init_kwargs)` loads a path (default: a causal LM; the reward model's is a
        sequence classifier). Returns (the prepared policy on this process's device, whether it came with a peft
        adapter)."""
        from posttrain.configs import ConfigError
        from posttrain.models.loading import load_causal_lm, load_tokenizer, with_trl_default_dtype
        from posttrain.models.peft import is_peft_model
        from posttrain.models.preparation import prepare_policy

        args = self.args
        if isinstance(model, str) and os.path.isdir(os.path.expanduser(model)) and os.path.realpath(
                os.path.expanduser(model)) == os.path.realpath(args.output_dir):
            raise ConfigError(f"output_dir {args.output_dir!r} is the model's own directory: the final save would "
                              "overwrite the model being trained; choose another output_dir.")
        model = (load or load_causal_lm)(model, with_trl_default_dtype(
            {"trust_remote_code": self._trust_remote_code, **(args.model_init_kwargs or {})}))
        self.processing_class = (processing_class if processing_class is not None
                                 else load_tokenizer(model.config._name_or_path, self._trust_remote_code))
        self.tokenizer = load_tokenizer(self.processing_class)
        came_with_adapter = is_peft_model(model)
        allow_unused_parameters(args, self.accelerator, model)
        if not args.fast_paths:
            fast_paths.turn_off(model)
        if adapt is not None:
            adapt(model, peft_config)
        self._vocab_rows = vocabulary_rows(model)  # the token ids it reads: the data's are checked as they tokenize
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
        self._start_sources()
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
        except InterruptedWaiting as stop:  # a signal while the step waited on user code (training/interrupts.py)
            self._stop_while_waiting(stop)
        finally:
            self._stop_sources()
            self._threads.restore()
            self.logger.close()
        if args.load_best_model_at_end and self.state.best_model_checkpoint is not None:
            self._load_best_model()
        self._save_final_model()
        self._on_main(self._write_plots)
        if args.save_merged:
            self.save_merged(os.path.join(args.output_dir, "merged"))
        self._call("on_train_end")
        if args.push_to_hub:
            self.push_to_hub(commit_message="End of training")
        self._print_outputs()  # where the model, metrics, plots and report are
        return TrainOutput(self.state.global_step, metrics["train_loss"], metrics)

    def _load_best_model(self) -> None:
        """load_best_model_at_end: the best checkpoint's weights into the policy (the final save writes them); with
        save_total_limit=1 only that checkpoint stays, as in transformers."""
        state = self.state
        logger.info(f"Loading best model from {state.best_model_checkpoint} (score: {state.best_metric}).")
        load_policy_weights(self._run_state(), self.sharding, state.best_model_checkpoint)
        if self.args.save_total_limit == 1:
            self._on_main(self._remove_checkpoints_but, state.best_model_checkpoint)

    _title = "train"
    _shown_metrics: tuple = ("loss",)  # on the terminal; the first with its moving average (training/logging.py)
    _cumulative_metrics: tuple = ()  # metrics that are running totals (logged as their latest value)

    def _one_step(self) -> None:
        state, control = self.state, self.control
        if not self._epoch_open:
            self._epoch_open, self._epoch_index = True, math.floor(state.epoch)
            self._call("on_epoch_begin")
        self._threads.adjust()  # as many intra-op threads as the machine's other work leaves cores
        self._call("on_step_begin")
        start = time.perf_counter()
        metrics = self._logged_loss(self._optimizer_step())
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

    def _stop_on_signal(self, signum: int) -> None:
        """SIGINT / SIGTERM arrived during the step just finished: log its window, checkpoint it, and stop."""
        import signal

        record = self.logger.flush()
        if record:
            self.log(record)
        newest = checkpoints(self.args.output_dir)
        path = newest[-1][1] if newest else None
        if self.args.save_on_interrupt and not (newest and newest[-1][0] == self.state.global_step):
            path = save_checkpoint(self._run_state(), self.sharding, self.args.output_dir, self.args.save_total_limit)
        where = (f"the newest checkpoint is {path}: resume with resume_from_checkpoint=true" if path
                 else "there is no checkpoint to resume from (save_on_interrupt is off)")
        raise mark_agreed(Interrupted(f"Interrupted ({signal.Signals(signum).name}) at step {self.state.global_step} "
                                      f"of {self.state.max_steps}; {where}.", signum))

    def _stop_while_waiting(self, stop: InterruptedWaiting) -> None:
        """SIGINT / SIGTERM arrived while the step waited on user code that may never return: the step under way is
        dropped (nothing of it can be saved), the steps done are logged, and the newest checkpoint is named."""
        record = self.logger.flush()
        # logging is a collective: only when every process stops here (agreed in a guarded block) or there is one
        if record and (self.accelerator.num_processes == 1 or getattr(stop, AGREED, False)):
            self.log(record)
        newest = checkpoints(self.args.output_dir)
        raise mark_agreed(interrupted_waiting(stop, self.state.global_step, self.state.max_steps,
                                              newest[-1][1] if newest else None)) from None

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
        """should_epoch_stop: the rest of this epoch's data is not trained on (where a subclass can skip it)."""

    def _resume(self, path: str) -> None:
        restored = load_checkpoint(self._run_state(), self.sharding, path)
        state = restored.state
        self.state.global_step, self.state.epoch = state["global_step"], state["epoch"]
        self.state.log_history = state["log_history"]
        for key in ("best_metric", "best_global_step", "best_model_checkpoint"):
            setattr(self.state, key, state.get(key))
        self.state.total_flos = state.get("total_flos", 0.0)
        self.state.num_input_tokens_seen = state.get("num_input_tokens_seen", 0)
        self._restore_position(state, restored.tensors)

    def _save_checkpoint(self) -> None:
        note_best_checkpoint(self.args, self.state)
        save_checkpoint(self._run_state(), self.sharding, self.args.output_dir, self.args.save_total_limit)
        self._call("on_save")
        if self.args.push_to_hub and self.args.hub_strategy == "every_save":
            self.push_to_hub(commit_message=f"Training in progress, step {self.state.global_step}")

    # ------------------------------------------------------------------ what checkpoints hold (training/checkpoint.py)

    _meaning_fields: tuple = ()  # config fields whose change makes a checkpoint's state mean something else

    def _run_state(self) -> RunState:
        """The run's state as checkpoints save and restore it."""
        identity = run_identity(self.args, self._meaning_fields, self._model_fingerprint, self.policy)
        return RunState(self.accelerator, self.model, self.policy, self.processing_class, self.optimizer,
                        self.lr_scheduler, self.state, self.args, identity, self._checkpoint_extras())

    def _start_sources(self) -> None:
        """Training starts, where the restored position stands (a rollout worker opens here)."""

    def _stop_sources(self) -> None:
        """Training ends or fails: what `_start_sources` opened is closed."""

    def _checkpoint_extras(self) -> CheckpointExtras:
        """What this trainer's checkpoints hold besides the policy, optimizer, schedule and TrainerState."""
        return CheckpointExtras()

    def _restore_position(self, state: dict, tensors: dict) -> None:
        """Take back what `_checkpoint_extras` saved: `state` is trainer_state.json (its meta among it), `tensors`
        this process's tensors."""

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
