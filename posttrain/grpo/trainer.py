"""The GRPO trainer: one loop on accelerate that composes the stages.

    round      = next(prompt rounds)                    # B unique prompts, same on every process
    rollouts   = generator.generate(my share, G each)   # token ids, masks, sampler log-probs
    rewards    = score(...) gathered over processes     # [B*G, F], NaN where a function returned None
    advantages = group_advantages(rewards, G, ...)      # [B*G], then this process's slice
    buffer    += batch.micro_batches(...) x num_iterations
    each optimizer step: gradient_accumulation_steps micro-batches, loss normalised over all of them

Generation happens whenever the buffer is empty, so how often we generate (steps_per_generation)
is independent of how many micro-batches make an optimizer step (gradient_accumulation_steps).
"""

import contextlib
import copy
import math
import os
import time
from dataclasses import dataclass, field

import torch

from posttrain.configs import ConfigError, GRPOConfig
from posttrain.data import DataError, PromptEncoder, PromptSource
from posttrain.errors import UserError
from posttrain.generation import make_generator
from posttrain.grpo.advantages import group_advantages
from posttrain.grpo.evaluation import evaluate_rewards
from posttrain.grpo.batch import TrainingBatch
from posttrain.grpo.losses import LossInputs, LossParams, StepNormalizer, get_loss
from posttrain.grpo.metrics import completion_metrics, loss_metrics, reward_metrics
from posttrain.models import load_causal_lm, load_tokenizer, token_logprobs
from posttrain.models.peft import add_reference_adapter, apply_peft, is_peft_model, reference_mode
from posttrain.rewards import check_required_columns, resolve_reward_funcs, reward_inputs, score
from posttrain.training.checkpoint import load_checkpoint, save_checkpoint
from posttrain.training.checkpoint import resolve as resolve_checkpoint
from posttrain.training.logging import MetricsLogger
from posttrain.training.optim import make_optimizer, make_scheduler
from posttrain.training.saving import append_completions, save_merged, save_policy
from posttrain.weights import export_weights


class TrainingError(UserError, RuntimeError):
    """The run cannot go on (a non-finite loss or gradient); the message names the step and the metric."""


@dataclass
class TrainerState:
    """What reward functions and callbacks see of the run (the attributes TRL users read)."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    num_train_epochs: float = 0.0
    log_history: list = field(default_factory=list)


@dataclass
class TrainerControl:
    """Callbacks may set `should_training_stop` to end the run after the current step."""

    should_training_stop: bool = False


def _accelerator(cpu: bool, mixed_precision: str):
    """An Accelerator; in a process that already made one with another precision (a notebook, a test run),
    its process-wide state is reset first. The distributed state (process group) is kept."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    if AcceleratorState._shared_state and AcceleratorState().mixed_precision != mixed_precision:
        AcceleratorState._reset_state(reset_partial_state=False)
    return Accelerator(cpu=cpu, mixed_precision=mixed_precision)


class GRPOTrainer:
    """Group Relative Policy Optimization, with TRL's GRPOTrainer signature.

    Args:
        model: a causal LM, or the path / hub id of one.
        reward_funcs: a reward function, a built-in name, a dotted import path, a reward model (or its path),
            or a list of these.
        args: the GRPOConfig.
        train_dataset: a `datasets.Dataset` or `IterableDataset` with a `prompt` column.
        eval_dataset: prompts for `evaluate()`.
        processing_class: the tokenizer; loaded from the model's path when None.
        peft_config: a peft LoraConfig to train adapters instead of all weights (needs `posttrain[peft]`).
        callbacks: objects with any of on_train_begin / on_step_end / on_log / on_save / on_train_end, called as
            transformers' TrainerCallback methods are: (args, state, control, **kwargs).
    """

    def __init__(self, model, reward_funcs, args: GRPOConfig | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, peft_config=None, callbacks=None):
        from accelerate.utils import set_seed

        self.args = args = args or GRPOConfig()
        if train_dataset is None:
            raise DataError("GRPOTrainer needs a train_dataset with a 'prompt' column.")
        self.accelerator = _accelerator(args.use_cpu, self._mixed_precision())
        set_seed(args.seed)
        self.callbacks = list(callbacks or [])
        self.state, self.control = TrainerState(), TrainerControl()

        trust_remote_code = bool((args.model_init_kwargs or {}).get("trust_remote_code", False))
        model = load_causal_lm(model, args.model_init_kwargs)
        self.tokenizer = load_tokenizer(processing_class or model.config._name_or_path, trust_remote_code)
        came_with_adapter = is_peft_model(model)
        model = self._prepare_model(model, peft_config)
        self.ref_model, self.reference_adapter = self._reference(model, came_with_adapter)
        self.reward_funcs = resolve_reward_funcs(reward_funcs, args, trust_remote_code)
        self.reward_weights = self._reward_weights()
        for f in self.reward_funcs:
            if f.model is not None:
                f.model.to(self.accelerator.device)

        encoder = PromptEncoder(self.tokenizer, args.chat_template_kwargs, args.max_prompt_length,
                                getattr(model.config, "max_position_embeddings", None), args.max_completion_length)
        self.prompts = PromptSource(train_dataset, encoder, args.prompts_per_generation, args.shuffle_dataset, args.seed)
        check_required_columns(self.reward_funcs, self.prompts.columns)
        self.eval_dataset = eval_dataset
        self.encoder = encoder

        self.total_steps = self._total_steps()
        self.state.max_steps, self.state.num_train_epochs = self.total_steps, args.num_train_epochs
        optimizer = make_optimizer(model, args)
        scheduler = make_scheduler(optimizer, args, self.total_steps)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        self.policy = self.accelerator.unwrap_model(self.model)
        self.generator = make_generator(args, self.policy, self.tokenizer, seed=args.seed + self.accelerator.process_index)
        self.loss_fn = get_loss(args.loss_type)
        self.loss_params = LossParams(args.epsilon, args.epsilon_high, args.delta, args.beta,
                                      args.importance_sampling_level, args.max_completion_length)
        # Old log-probs are needed only when an optimizer step can land between sampling and training.
        self.needs_old_logps = args.num_iterations > 1 or args.steps_per_generation > args.gradient_accumulation_steps
        # A row with advantage 0 has zero gradient unless a KL term or an entropy quantile (which looks at
        # every row) involves it: such rows skip the forward and backward.
        self.skip_zero_advantage_rows = args.beta == 0.0 and args.top_entropy_quantile >= 1.0
        self.shuffle_rng = torch.Generator().manual_seed(args.seed)
        self.buffer: list[TrainingBatch] = []
        self._rounds = self.prompts.rounds()
        self.rounds_consumed = 0  # generation rounds drawn from the prompts: the data position, for resuming
        self._pending_metrics: dict = {}

    # ------------------------------------------------------------------ setup

    def _mixed_precision(self) -> str:
        bf16 = self.args.bf16
        if bf16 is None:
            bf16 = (not self.args.use_cpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported())
        return "bf16" if bf16 else "no"

    def _prepare_model(self, model, peft_config):
        args = self.args
        if peft_config is not None:
            model = apply_peft(model, peft_config)
        if args.disable_dropout:
            for module in model.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
        if args.gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs or {"use_reentrant": False})
            if hasattr(model, "enable_input_require_grads"):
                model.enable_input_require_grads()
        model.config.use_cache = False
        return model.to(self.accelerator.device).train()

    def _reference(self, model, came_with_adapter: bool):
        """(reference model, reference adapter name) when beta > 0.

        Full fine-tuning: a frozen copy of the initial policy. LoRA: no copy; the policy with adapters
        disabled, or with a frozen copy of the adapter it came with (see models/peft.py).
        """
        if self.args.beta == 0.0:
            return None, None
        if is_peft_model(model):
            return None, (add_reference_adapter(model) if came_with_adapter else None)
        return copy.deepcopy(model).eval().requires_grad_(False), None

    def _reward_weights(self) -> torch.Tensor:
        weights = self.args.reward_weights
        if weights is None:
            return torch.ones(len(self.reward_funcs))
        if len(weights) != len(self.reward_funcs):
            raise ConfigError(f"reward_weights has {len(weights)} entries for {len(self.reward_funcs)} reward "
                             "functions: give one weight per function.")
        return torch.tensor([float(w) for w in weights])

    def _total_steps(self) -> int:
        args = self.args
        if args.max_steps > 0:
            return args.max_steps
        rounds = self.prompts.rounds_per_epoch
        if rounds is None:
            raise ConfigError("With an IterableDataset the length of training is unknown: set max_steps.")
        micro = rounds * args.num_train_epochs * args.steps_per_generation * args.num_iterations
        return max(1, math.ceil(micro / args.gradient_accumulation_steps))

    # ------------------------------------------------------------------ generation and scoring

    def _next_micro_batch(self) -> TrainingBatch:
        if not self.buffer:
            batch = self._generate_and_score()
            micro = batch.micro_batches(self.args.per_device_train_batch_size, self.shuffle_rng)
            self.buffer = micro * self.args.num_iterations
        return self.buffer.pop(0)

    def _local_share(self, items: list) -> list:
        n = len(items) // self.accelerator.num_processes
        start = self.accelerator.process_index * n
        return items[start:start + n]

    def _generate_and_score(self) -> TrainingBatch:
        args, G = self.args, self.args.num_generations
        prompt_round = next(self._rounds)
        self.rounds_consumed += 1
        self.state.epoch = prompt_round.epoch
        rows = self._local_share([row for row in prompt_round.rows for _ in range(G)])
        prompt_ids = self._local_share([ids for ids in prompt_round.prompt_ids for _ in range(G)])
        prompt_indices = self._local_share([i for i in prompt_round.indices for _ in range(G)])
        self.generator.sync_weights(export_weights(self.model))
        rollouts = self.generator.generate(prompt_ids)

        prompts = [row["prompt"] for row in rows]
        completion_ids, texts, completions = reward_inputs(self.tokenizer, rollouts, isinstance(prompts[0], list))
        columns = {c: [row[c] for row in rows] for c in self.prompts.columns}
        bad_rows = [] if args.on_bad_reward == "skip" else None
        local_rewards = score(self.reward_funcs, prompts, completions, completion_ids, columns, self.state,
                              self.state.global_step + 1, bad_rows, prompt_indices)
        rewards = self.accelerator.gather(local_rewards.to(self.accelerator.device)).cpu()  # [B*G, F]
        skipped = self._skip_bad_groups(rewards, bad_rows, len(rows)) if bad_rows is not None else 0
        adv = group_advantages(rewards, self.reward_weights, G, args.scale_rewards, args.multi_objective_aggregation)
        local = slice(self.accelerator.process_index * len(rows), (self.accelerator.process_index + 1) * len(rows))

        loss_mask = rollouts.completion_mask
        if args.mask_truncated_completions:
            loss_mask = loss_mask & rollouts.is_eos.unsqueeze(1)
        batch = TrainingBatch(rollouts, adv.advantages[local].to(self.accelerator.device), loss_mask,
                              old_logps=self._logps_no_grad(self.policy, rollouts) if self.needs_old_logps else None,
                              ref_logps=self._reference_logps(rollouts))
        self._pending_metrics = {**reward_metrics(rewards, adv, [f.name for f in self.reward_funcs]),
                                 **({"rewards/skipped_groups": skipped} if bad_rows is not None else {}),
                                 **completion_metrics(self.accelerator.gather(rollouts.completion_mask.sum(1)).cpu(),
                                                      self.accelerator.gather(rollouts.is_eos).cpu())}
        if args.log_completions and self.accelerator.is_main_process:
            append_completions(os.path.join(args.output_dir, "completions.jsonl"), self.state.global_step + 1,
                               prompts, texts, local_rewards)
        return batch

    def _skip_bad_groups(self, rewards: torch.Tensor, bad_rows: list, n_local: int) -> int:
        """Blank (NaN) every reward of a group holding a NaN/inf one, so the group gets advantage 0. In place.

        Args:
            rewards: [B*G, F] gathered rewards.
            bad_rows: local indices of completions with a non-finite reward.
        Returns:
            The number of groups skipped, across processes.
        """
        bad = torch.zeros(n_local, dtype=torch.bool, device=self.accelerator.device)
        bad[bad_rows] = True
        bad_groups = self.accelerator.gather(bad).cpu().view(-1, self.args.num_generations).any(1)  # [B]
        rewards[bad_groups.repeat_interleave(self.args.num_generations)] = float("nan")
        return int(bad_groups.sum())

    def _logps_no_grad(self, model, rollouts) -> torch.Tensor:
        logps = []
        size = self.args.per_device_train_batch_size
        with torch.no_grad(), self.accelerator.autocast():
            for i in range(0, len(rollouts), size):
                r = rollouts.select(torch.arange(i, min(i + size, len(rollouts))))
                lp, _ = token_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                                       self.args.temperature)
                # select() trimmed the columns; pad back to the rollouts' width
                logps.append(torch.nn.functional.pad(lp, (0, rollouts.completion_ids.size(1) - lp.size(1))))
        return torch.cat(logps)

    def _reference_logps(self, rollouts) -> torch.Tensor | None:
        if self.args.beta == 0.0:
            return None
        if self.ref_model is not None:
            return self._logps_no_grad(self.ref_model, rollouts)
        with reference_mode(self.policy, self.reference_adapter):
            return self._logps_no_grad(self.policy, rollouts)

    # ------------------------------------------------------------------ optimisation

    def _normalizer(self, micro: list[TrainingBatch]) -> StepNormalizer:
        tokens = sum(float(m.loss_mask.sum()) for m in micro)
        total = self.accelerator.reduce(torch.tensor(tokens, device=self.accelerator.device), reduction="sum")
        return StepNormalizer(sequences=sum(len(m) for m in micro), tokens=tokens,
                              tokens_per_process=float(total) / self.accelerator.num_processes)

    def _entropy_mask(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        q = self.args.top_entropy_quantile
        if q >= 1.0:
            return None
        values = entropy[mask].float()
        if values.numel() == 0:
            return mask
        threshold = torch.quantile(values, 1.0 - q)
        return (entropy >= threshold) & mask

    def _rows_with_gradient(self, mb: TrainingBatch) -> TrainingBatch:
        """Drop rows whose advantage is 0 (their gradient is exactly 0); keep at least one row, so every
        process still runs a backward and DDP's gradient synchronisation stays in step."""
        keep = (mb.advantages != 0).nonzero().squeeze(1).cpu()
        if len(keep) == len(mb):
            return mb
        return mb.select(keep if len(keep) else torch.zeros(1, dtype=torch.long))

    def _loss(self, mb: TrainingBatch, logps: torch.Tensor, norm: StepNormalizer, entropy_mask=None):
        """The configured loss of micro-batch `mb` given the policy's [b, C] log-probs."""
        inputs = LossInputs(logps=logps, old_logps=mb.old_logps, ref_logps=mb.ref_logps, advantages=mb.advantages,
                            mask=mb.loss_mask, entropy_mask=entropy_mask)
        return self.loss_fn(inputs, self.loss_params, norm)

    def _loss_gradient(self, mb: TrainingBatch, norm: StepNormalizer):
        """[b, C] log-probs -> d loss / d log-probs, when each token's loss term depends on its own log-prob only.

        It lets the output layer's gradient be computed during the forward (models/chunked.py). Not so with an
        entropy quantile (it looks at every token) or a sequence-level ratio to stored old log-probs.
        """
        if self.args.top_entropy_quantile < 1.0 or (
                mb.old_logps is not None and self.args.importance_sampling_level == "sequence"):
            return None

        def gradient(logps: torch.Tensor) -> torch.Tensor:
            x = logps.detach().requires_grad_()
            with torch.enable_grad():
                return torch.autograd.grad(self._loss(mb, x, norm).loss, x)[0]

        return gradient

    def _micro_step(self, mb: TrainingBatch, norm: StepNormalizer, sync: bool) -> dict:
        all_tokens = mb.loss_mask.sum()
        if self.skip_zero_advantage_rows:
            mb = self._rows_with_gradient(mb)
        r = mb.rollouts
        sync_ctx = contextlib.nullcontext() if sync else self.accelerator.no_sync(self.model)
        with sync_ctx, self.accelerator.autocast():
            logps, entropy = token_logprobs(self.model, r.prompt_ids, r.prompt_mask, r.completion_ids,
                                            r.completion_mask, self.args.temperature, with_entropy=True,
                                            loss_gradient=self._loss_gradient(mb, norm))
            out = self._loss(mb, logps, norm, self._entropy_mask(entropy, mb.loss_mask))
            self.accelerator.backward(out.loss)
        # clip counts are divided by every loss token of the micro-batch (skipped rows clip nothing);
        # the entropy is the mean over the tokens it was computed on
        return dict(out.stats, tokens=all_tokens, loss=out.loss.detach(), entropy=(entropy * mb.loss_mask).sum(),
                    entropy_tokens=mb.loss_mask.sum())

    def _optimizer_step(self) -> dict:
        micro = [self._next_micro_batch() for _ in range(self.args.gradient_accumulation_steps)]
        norm = self._normalizer(micro)
        stats = [self._micro_step(mb, norm, sync=(i == len(micro) - 1)) for i, mb in enumerate(micro)]
        grad_norm = self._clip_gradients()
        step = self.state.global_step + 1
        loss = float(self.accelerator.reduce(sum(s["loss"] for s in stats), reduction="mean"))
        for name, value in (("loss", loss), ("grad_norm", grad_norm)):
            if not math.isfinite(value):
                self.optimizer.zero_grad(set_to_none=True)
                path = save_checkpoint(self, self.args.output_dir, prefix="emergency-checkpoint")
                raise TrainingError(f"Step {step}: {name} is {value}; the update was not applied and the last good "
                                    f"state is saved in {path}. Lower the learning_rate or check the rewards.")
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = loss_metrics(stats, self.accelerator, self.args.beta)
        metrics.update(loss=loss, grad_norm=grad_norm, learning_rate=self.scheduler.get_last_lr()[0])
        return metrics

    def _clip_gradients(self) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.args.max_grad_norm if self.args.max_grad_norm > 0 else float("inf")
        return float(self.accelerator.clip_grad_norm_(params, max_norm))

    # ------------------------------------------------------------------ the loop

    def _resume(self, path: str) -> None:
        """Restore everything a checkpoint holds and move the prompt stream to where it was."""
        state = load_checkpoint(self, path)
        self.state.global_step, self.state.epoch = state["global_step"], state["epoch"]
        self.state.log_history = state["log_history"]
        self._rounds = self.prompts.rounds()
        for _ in range(state["rounds_consumed"]):
            next(self._rounds)
        self.rounds_consumed = state["rounds_consumed"]

    def train(self, resume_from_checkpoint=None) -> TrainerState:
        """Run `max_steps` optimizer steps (or `num_train_epochs`), then save the final model.

        Args:
            resume_from_checkpoint: a checkpoint directory, or True for the newest in output_dir; default
                `args.resume_from_checkpoint`.
        """
        args = self.args
        path = resolve_checkpoint(resume_from_checkpoint if resume_from_checkpoint is not None
                                  else args.resume_from_checkpoint, args.output_dir)
        if path is not None:
            self._resume(path)
        logger = MetricsLogger(args.output_dir, self.total_steps, args.logging_steps, args.report_to,
                               enabled=self.accelerator.is_main_process, run_config=args.to_dict(),
                               append=path is not None, start_step=self.state.global_step)
        self._callback("on_train_begin")
        try:
            while self.state.global_step < self.total_steps and not self.control.should_training_stop:
                start = time.perf_counter()
                metrics = self._optimizer_step()
                self.state.global_step += 1
                metrics.update(self._pending_metrics, step_time=time.perf_counter() - start)
                self._pending_metrics = {}
                logger.add(metrics)
                record = logger.step_done(self.state.global_step, self.state.epoch)
                self._callback("on_step_end")
                if record is not None:
                    self.state.log_history.append(record)
                    self._callback("on_log", logs=record)
                if args.save_strategy == "steps" and self.state.global_step % args.save_steps == 0:
                    save_checkpoint(self, args.output_dir, args.save_total_limit)
                    self._callback("on_save")
        finally:
            logger.close()
        self.save_model(args.output_dir)
        if args.save_merged:
            self.save_merged(os.path.join(args.output_dir, "merged"))
        self._callback("on_train_end")
        self.logger = logger
        return self.state

    def close(self) -> None:
        """Release the generator and, in a multi-process run, the process group (call once, at the end)."""
        self.generator.close()
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()  # destroys the process group: gloo aborts at exit otherwise

    def _callback(self, event: str, **kwargs):
        for cb in self.callbacks:
            method = getattr(cb, event, None)
            if method is not None:
                method(self.args, self.state, self.control, **kwargs)

    def save_model(self, output_dir: str) -> None:
        """Save the model (or adapter), tokenizer and config to `output_dir`, from the main process."""
        self._on_main(save_policy, self.policy, self.tokenizer, self.args.to_dict(), output_dir)

    def save_merged(self, output_dir: str) -> None:
        """Save full weights that load with plain `AutoModelForCausalLM.from_pretrained` (LoRA merged)."""
        self._on_main(save_merged, self.policy, self.tokenizer, output_dir)

    def _on_main(self, fn, *args):
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            fn(*args)
        self.accelerator.wait_for_everyone()

    def evaluate(self, eval_dataset=None) -> dict:
        """Sample G completions for every prompt of the eval dataset and return reward means (eval_*)."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset (pass it to GRPOTrainer or to evaluate).")
        return evaluate_rewards(self, dataset)
