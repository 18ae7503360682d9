"""The GRPO trainer: its data (prompt rounds, generation, rewards) and its step, on the shared loop
(training/trainer.py).

    round      = next(prompt rounds)                    # B unique prompts, same on every process
    rollouts   = generator.generate(my share, G each,   # token ids, masks, sampler log-probs; a row's
                                    its rows' keys)       # completion depends on its key, not on the process
    rewards    = score(...) gathered over processes     # [B*G, F], NaN where a function returned None
    advantages = group_advantages(rewards, G, ...)      # [B*G], then this process's slice
    buffer    += batch.micro_batches(...) x num_iterations
    each optimizer step: gradient_accumulation_steps micro-batches, loss normalised over all of them

Generation happens whenever the buffer is empty, so how often we generate (steps_per_generation) is independent of
how many micro-batches make an optimizer step (gradient_accumulation_steps).
"""

import contextlib
import functools
import logging
import math
from dataclasses import replace

import torch

from posttrain.agents.chat_templates import tool_chat_template
from posttrain.agents.rollouts import Agents
from posttrain.configs import ConfigError, GRPOConfig
from posttrain.data import PromptEncoder, PromptSource, check_eval_columns, prompt_dataset_columns
from posttrain.generation import SamplingParams, make_generator
from posttrain.grpo.agent_setup import agent_dataset, agent_rollouts
from posttrain.grpo.async_rollout import queue_from_tensors, start_ahead
from posttrain.grpo.batch import TrainingBatch, buffer_from_tensors, buffer_tensors
from posttrain.grpo.completions import CompletionLog
from posttrain.grpo.dynamic_sampling import resolve_filter
from posttrain.grpo.entropy import EntropyControl
from posttrain.grpo.evaluation import evaluation_metrics
from posttrain.grpo.flat_rewards import FlatRewardWatch
from posttrain.grpo.losses import (SEQUENCE_LEVELS, LossInputs, LossParams, MicroBatchLoss, StepNormalizer, get_loss,
                                  micro_batch_loss)
from posttrain.grpo.metrics import loss_metrics, with_tokens_seen
from posttrain.grpo.rollout import Rewards, Rollout, RoundModels, RowLayout
from posttrain.models.peft import refuse_prefix_tuning_for_sampling
from posttrain.models.preparation import make_reference, mix_reference
from posttrain.rewards import RewardFunction, check_required_columns, resolve_reward_funcs, reward_weights
from posttrain.rewards.resolving import NO_REWARD
from posttrain.training.checkpoint import CheckpointExtras, model_fingerprint
from posttrain.training.distributed import guarded, run_name
from posttrain.training.loaders import eval_prompt_batches, train_prompt_batches
from posttrain.training.setup import run_length_unknown, take_quantization_config, trainer_config
from posttrain.training.trainer import Trainer, TrainingError  # noqa: F401 - TrainingError: this module's API too

logger = logging.getLogger("posttrain")


class GRPOTrainer(Trainer):
    """Group Relative Policy Optimization, with TRL's GRPOTrainer signature.

    Args:
        model: a causal LM, or the path / hub id of one.
        reward_funcs: a reward function, a built-in name, a dotted import path, a reward model (or its path),
            or a list of these.
        args: the GRPOConfig (default: TRL's defaults, output_dir `<model name>-GRPO`).
        train_dataset: a `datasets.Dataset` or `IterableDataset` with a `prompt` column.
        eval_dataset: prompts for evaluation (a dataset, or a dict of them).
        processing_class: the tokenizer (or a processor holding one); loaded from the model's path when None.
        reward_processing_classes: tokenizers of reward models (one, or one per reward function; None entries load
            the reward model's own).
        callbacks: transformers TrainerCallbacks (instances or classes); optimizers: (optimizer, lr_scheduler).
        quantization_config: a transformers quantization config for a model loaded from a path or hub id.
        peft_config: a peft LoraConfig to train adapters instead of all weights (needs `posttrain[peft]`).
        tools: functions (sync or async, with type hints and a Google-style docstring) the model may call; their
            schemas are rendered into the prompts and each rollout runs the calls it makes (docs/tools.md).
        rollout_func: (prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs", ["env_mask"], ...extra}:
            generation done by the function instead (TRL's experimental API; extra keys reach the reward functions).
        environment_factory: a class (or function) making an environment, or {name: factory} routed by the rows'
            `environment` column: one instance per rollout, reset with its row, its public methods tools, its
            get_reward a reward (TRL's experimental API).
        response_template: posttrain's override of how the model's tool calls are read, for a chat template it does
            not recognise: a transformers response_template dict, or a function (turn text, prefix text) ->
            assistant message (default: the tokenizer's response_template, else the family its template writes).
    """

    _title = "GRPO"
    _config_class = GRPOConfig
    _rollout_class = Rollout  # the round: sampling, scoring, log-probs, advantages (RLOO's differ)
    # not the loss: on-policy GRPO's is about 0 by construction (its gradient is not), which reads as "not training"
    _shown_metrics = ("reward", "kl", "entropy", "completions/mean_length")
    _cumulative_metrics = ("num_tokens",)  # a running total, as TRL logs it
    _nonfinite_hint = "Lower the learning_rate or check the rewards."
    # fields whose change makes a checkpoint's optimizer state, buffer or data position mean something else
    _meaning_fields = ("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations",
                       "generation_batch_size", "steps_per_generation", "num_iterations", "max_completion_length",
                       "seed", "shuffle_dataset")

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None, tools=None, rollout_func=None,
                 environment_factory=None, response_template=None):
        args = trainer_config(self._config_class, args, model, self._title)
        agents = Agents(list(tools or []), environment_factory, rollout_func, response_template)
        take_quantization_config(model, args, quantization_config)
        super().__init__(args, callbacks, optimizers)
        with guarded(self.accelerator):  # a failure on one process stops them all before DDP's first collective
            model = self._setup(model, reward_funcs, train_dataset, eval_dataset, processing_class,
                                reward_processing_classes, peft_config, agents)
        self._model_fingerprint = model_fingerprint(model)  # before any update: what checkpoints are checked against
        self._prepare(model, self._total_steps())
        rank, run_id = self.accelerator.process_index, run_name(self.accelerator)
        with guarded(self.accelerator):  # a server one process cannot reach stops every process; one seed on every
            # process: each row's key (its index in the round) tells the rows apart, whatever the number of processes
            generator = make_generator(args, self.policy, self.tokenizer, seed=args.seed, process_index=rank,
                                       run_id=run_id, num_processes=self.accelerator.num_processes,
                                       local_process_index=self.accelerator.local_process_index)
        self.loss_fn, self.loss_params = self._objective(args)
        self.entropy_control = EntropyControl.from_config(args)
        self.needs_old_logps = self._needs_old_logps(args)
        self.sampling_params = SamplingParams.from_config(args)
        # A row with advantage 0 has zero gradient unless the loss needs it (Loss.needs_zero_advantage_rows), an
        # entropy quantile or bonus (which look at every row) or a mixture-of-experts router loss involves it: such
        # rows skip the forward and backward.
        self.skip_zero_advantage_rows = (not self.loss_fn.needs_zero_advantage_rows(self.loss_params)
                                         and args.top_entropy_quantile >= 1.0 and not self.entropy_control.enabled
                                         and not self.router_loss.enabled)
        self.pad_to_multiple_of = self._padding_multiple()
        # padded widths are fixed for a reason: keep them; a router loss counts each real token of the padded rows
        # once, under their attention mask, as in TRL (packed rows and shared prompts would count others)
        self.packing = self.pad_to_multiple_of is None and not self.router_loss.enabled
        # each distinct prompt once (two forwards before a backward) where every process holds the whole weights: one
        # process, DDP (not with a static graph, recorded for one forward) or DeepSpeed ZeRO-1/2; not FSDP or ZeRO-3
        self.share_prompts = self.packing and not self.sharding.shards_parameters and not args.ddp_static_graph
        rewards = Rewards(self.reward_funcs, self.reward_weights, self.reward_columns, self._group_filter)
        self.rollout = self._rollout_class(
            args, accelerator=self.accelerator, sharding=self.sharding, models=RoundModels(
                self.model, self.policy, self.forward_policy, self.ref_model, self.reference_adapter),
            generator=generator, tokenizer=self.tokenizer, rewards=rewards, trainer_state=self.state,
            layout=RowLayout(self.packing, self.share_prompts, self.pad_to_multiple_of),
            sampling_params=self.sampling_params, needs_old_logps=self.needs_old_logps, agents=self.agents)
        self.shuffle_rng = torch.Generator().manual_seed(self._data_seed)
        self.buffer: list[TrainingBatch] = []
        self._rounds = self.prompts.rounds()
        self.rounds_consumed = 0  # generation rounds drawn from the prompts: the data position, for resuming
        self._resumed_queue = None  # async_generation: (meta, rounds) a checkpoint's worker had sampled ahead
        self._stream_epoch = 0.0
        self.completion_log = CompletionLog(args, self.accelerator, [f.name for f in self.reward_funcs])
        self.flat_rewards = FlatRewardWatch(args, self.sampling_params, [f.name for f in self.reward_funcs],
                                            self._gradients_besides_rewards())
        self._call("on_init_end")

    def _objective(self, args) -> tuple:
        """The loss (grpo/losses.py) and its parameters: loss_type's."""
        return get_loss(args.loss_type), LossParams.from_config(args)

    def _needs_old_logps(self, args) -> bool:
        """Old log-probs: when a step can land between sampling and training, or the engine's samples are corrected."""
        return (args.num_iterations > 1 or args.steps_per_generation > args.gradient_accumulation_steps
                or args.corrects_sampling)

    @property
    def generator(self):
        """The generation backend (posttrain/generation) the round samples with."""
        return self.rollout.generator

    @generator.setter
    def generator(self, value) -> None:
        self.rollout.generator = value

    # ------------------------------------------------------------------ setup

    def _setup(self, model, reward_funcs, train_dataset, eval_dataset, processing_class, reward_processing_classes,
               peft_config, agents: Agents):
        """Load the model and tokenizer, the reference, the agents, the rewards and the data; returns the prepared
        policy."""
        args = self.args
        train_dataset, placeholder_prompts = agent_dataset(train_dataset, agents, args)
        refuse_prefix_tuning_for_sampling(peft_config, model)
        # the data's prompts and the given reward functions before the model loads: a dataset with no prompt, a misnamed
        # reward or a missing package stops the run at once
        if train_dataset is not None:
            prompt_dataset_columns(train_dataset)
        user_funcs = self._user_reward_funcs(reward_funcs, reward_processing_classes,
                                             agents.environment_factory is not None)
        model, came_with_adapter = self._load_policy(model, processing_class, peft_config)
        self.ref_model, self.reference_adapter = self._reference(model, came_with_adapter)
        context = getattr(model.config, "max_position_embeddings", None)
        # tool results are rendered with a prefix-preserving template: the tokenizer's, or TRL's training version
        chat_template = tool_chat_template(self.tokenizer, args.chat_template_kwargs) if agents.calls_tools else None
        self.encoder = PromptEncoder.for_run(self.tokenizer, args, context, chat_template, self._vocab_rows)
        self.agents = agent_rollouts(agents, args, self.encoder, chat_template, context, placeholder_prompts,
                                     trainer=self)
        sources = self.agents.reward_sources() if self.agents is not None else []
        if agents.environment_factory is not None and not user_funcs and not sources:
            raise ConfigError(NO_REWARD + ", or environments whose class defines get_reward.")
        self.reward_weights = reward_weights(self.args.reward_weights, len(user_funcs), len(sources))
        # an environment's get_reward is a reward of weight 1 named after its class, after the given ones (TRL's)
        self.reward_funcs = user_funcs + [RewardFunction(name=name, fn=fn) for name, fn in sources]
        self._group_filter = resolve_filter(args.dynamic_sampling_filter)
        for f in self.reward_funcs:
            if f.model is not None:
                f.model.to(self.accelerator.device)

        self.prompts = PromptSource(train_dataset, self.encoder, args.prompts_per_generation,
                                    shuffle=args.shuffle_dataset, seed=self._data_seed)
        self.train_dataset = train_dataset  # as given, as TRL keeps it (GRPO prepares prompts round by round)
        # TRL's GRPO remove_unused_columns=True drops every column but the prompt before the reward functions see them
        self.reward_columns = [] if args.drops_reward_columns else self.prompts.columns
        check_required_columns(self.reward_funcs, self.reward_columns,
                               self.agents.column_names if self.agents is not None else (),
                               more_columns=agents.rollout_func is not None)
        self.eval_dataset = eval_dataset
        check_eval_columns(eval_dataset, ["prompt", *self.reward_columns])
        return model

    def _reference(self, model, came_with_adapter: bool) -> tuple:
        """(a separate frozen model the round reads, sharded as the policy; or None, and the reference adapter or
        None): GRPO's KL reference (models/preparation.py), none at beta 0."""
        return make_reference(model, self.args, came_with_adapter)

    def _user_reward_funcs(self, reward_funcs, reward_processing_classes, environments: bool) -> list:
        """The reward functions the user gave, resolved (posttrain/rewards); one is needed unless there are
        environments, whose get_reward methods bring theirs (reward_funcs None or [], as TRL takes them)."""
        if environments and not reward_funcs:
            return []
        return resolve_reward_funcs(reward_funcs, self.args, self._trust_remote_code, reward_processing_classes)

    def _gradients_besides_rewards(self) -> list[str]:
        """What trains the model when every advantage is 0 (grpo/flat_rewards.py names it)."""
        beta = self.loss_params.beta  # the loss's KL term (RLOO's is in its reward)
        kl = [f"the KL term (beta={beta:g}), which only pulls the model back towards the reference"] if beta else []
        return kl + (
            ["the entropy bonus, which only changes the model's entropy"] if self.entropy_control.enabled else []) + (
            ["the router's load-balancing loss, which only balances the experts"] if self.router_loss.enabled else [])

    def _total_steps(self) -> int:
        args = self.args
        if args.max_steps > 0:
            return args.max_steps
        rounds = self.prompts.rounds_per_epoch
        if rounds is None:
            raise run_length_unknown()
        micro = rounds * args.num_train_epochs * args.steps_per_generation * args.num_iterations
        return max(1, math.ceil(micro / args.gradient_accumulation_steps))

    # ------------------------------------------------------------------ generation and scoring

    def _step_micro_batches(self) -> tuple[list[TrainingBatch], dict]:
        """The step's gradient_accumulation_steps micro-batches from the buffer, a new generation batch made (its
        micro-batches, num_iterations times over) whenever it is empty; the metrics of the newest batch made ({} when
        none was)."""
        micro, round_metrics = [], {}
        if self.args.async_generation and self.rollout.ahead is None:  # the rollout worker, where the run stands
            resumed, self._resumed_queue = self._resumed_queue, None
            self.rollout.ahead = start_ahead(self.args, self.accelerator, self.rollout, self._rounds,
                                             self.rounds_consumed, self._round_taken, resumed, self.state.global_step)
        for _ in range(self.args.gradient_accumulation_steps):
            if not self.buffer:
                scored = self.rollout.scored_batch(self._next_round, self.state.global_step + 1)
                self.completion_log.add_batch(self.state.global_step + 1, scored)
                self._watch_rewards(scored)
                parts = scored.batch.micro_batches(self.args.per_device_train_batch_size, self.shuffle_rng)
                self.buffer, round_metrics = parts * self.args.num_iterations, with_tokens_seen(scored.metrics, self.state)
            micro.append(self.buffer.pop(0))
        return micro, round_metrics

    def _watch_rewards(self, scored) -> None:
        """Warn once when the rewards have stopped telling completions apart (grpo/flat_rewards.py)."""
        warning = self.flat_rewards.observe(scored.metrics, scored.scored.rewards)
        if warning and self.accelerator.is_main_process:
            logger.warning(warning)

    def _next_round(self):
        prompt_round = next(self._rounds)
        self._round_taken(prompt_round)
        return prompt_round

    def _round_taken(self, prompt_round) -> None:
        self.rounds_consumed += 1
        self._stream_epoch = prompt_round.epoch

    # ------------------------------------------------------------------ optimisation

    def _step_counts(self, micro: list[TrainingBatch]) -> tuple[StepNormalizer, float]:
        """What the step's loss is normalised by, and the tokens every process's forwards see (prompts and
        completions, for total_flos)."""
        tokens = sum(float(m.loss_mask.sum()) for m in micro)
        seen = sum(float(m.rollouts.prompt_mask.sum() + m.rollouts.completion_mask.sum()) for m in micro)
        totals = self.accelerator.reduce(torch.tensor([tokens, seen], device=self.accelerator.device),
                                         reduction="sum")
        norm = StepNormalizer(sequences=sum(len(m) for m in micro), tokens=tokens,
                              tokens_per_process=float(totals[0]) / self.accelerator.num_processes)
        return norm, float(totals[1])

    def _policy_loss(self, bonus: float):
        """A micro-batch's loss (grpo/losses.py micro_batch_loss): (inputs, entropy, norm) -> MicroBatchLoss."""
        return functools.partial(micro_batch_loss, self.loss_fn, self.loss_params,
                                 top_entropy_quantile=self.args.top_entropy_quantile, bonus=bonus)

    @staticmethod
    def _loss_inputs(mb: TrainingBatch, logps: torch.Tensor) -> LossInputs:
        """Micro-batch `mb` as the loss takes it, given the policy's [b, C] log-probs."""
        return LossInputs(logps=logps, old_logps=mb.old_logps, ref_logps=mb.ref_logps, advantages=mb.advantages,
                          mask=mb.loss_mask, sampling_ratio=mb.sampling_ratio)

    def _loss_gradient(self, mb: TrainingBatch, norm: StepNormalizer, bonus: float = 0.0):
        """[b, C] log-probs -> d loss / d log-probs, when each token's loss term depends on its own log-prob only.

        It lets the output layer's gradient be computed in the forward (models/chunked.py). Not so with an entropy
        quantile (it looks at every token) or bonus (its gradient is recomputed anyway), or a loss that is not
        token-local here (Loss.token_local).
        """
        token_local = self.loss_fn.token_local(self.loss_params, off_policy=mb.old_logps is not None)
        if self.args.top_entropy_quantile < 1.0 or bonus != 0.0 or not token_local:
            return None

        def gradient(logps: torch.Tensor) -> torch.Tensor:
            x = logps.detach().requires_grad_()
            with torch.enable_grad():
                return torch.autograd.grad(self.loss_fn(self._loss_inputs(mb, x), self.loss_params, norm).loss, x)[0]

        return gradient

    def _step_loss(self, mb: TrainingBatch, norm: StepNormalizer, bonus: float,
                   share: float) -> tuple[torch.Tensor, MicroBatchLoss]:
        """One micro-batch's forward (`share`: its part of the step, for the router loss): (its share of the step's
        loss, with the router term; that loss, the objective's, and its sums, detached)."""
        all_tokens = mb.loss_mask.sum()
        # clip ratios count every token (or sequence, with a sequence-level ratio) of the micro-batch, skipped rows too
        sequence_level = self.loss_params.importance_sampling_level in SEQUENCE_LEVELS
        clip_units = torch.tensor(float(len(mb)), device=all_tokens.device) if sequence_level else all_tokens
        if self.skip_zero_advantage_rows:
            mb = mb.rows_with_gradient()
        mb = mb.padded(self.pad_to_multiple_of)
        with self.accelerator.autocast():
            with self._offloading(), self.router_loss.collecting(self.model, share) as router_term:
                logps, entropy = self.rollout.policy_logps(self.model, mb.rollouts, with_entropy=True,
                                                           loss_gradient=self._loss_gradient(mb, norm, bonus),
                                                           entropy_grad=self.entropy_control.enabled)
            out = self._policy_loss(bonus)(self._loss_inputs(mb, logps), entropy, norm)
            loss = out.loss + sum(router_term)  # TRL adds it last: coef * aux_loss / micro-batches of the step
        # clip counts are divided by every loss token of the micro-batch (skipped rows clip nothing);
        # the entropy is the mean over the tokens it was computed on
        units = clip_units if out.stats.clip_units is not None else None
        return loss, MicroBatchLoss(loss.detach(), out.policy_loss.detach(),
                                    replace(out.stats, clip_units=units, tokens=all_tokens))

    def _optimizer_step(self) -> dict:
        args = self.args
        micro, round_metrics = self._step_micro_batches()
        norm, seen_tokens = self._step_counts(micro)
        self.state.total_flos += self._flops_per_token * seen_tokens
        bonus = self.entropy_control.applied() if self.entropy_control.enabled else 0.0
        results = self._accumulate(micro, lambda mb: self._step_loss(mb, norm, bonus, 1.0 / len(micro)),
                                   norm.tokens_per_process * self.accelerator.num_processes)
        loss = float(self.accelerator.reduce(sum(r.loss for r in results), reduction="mean"))
        grad_norm = self._apply_update(loss)
        metrics = loss_metrics([r.stats for r in results], self.accelerator)
        metrics.update(loss=loss, grad_norm=grad_norm, learning_rate=self.lr_scheduler.get_last_lr()[0],
                       **self._router_metrics())
        if self.entropy_control.enabled:
            metrics.update(self.entropy_control.after_step(results, self.accelerator))
        if self.rollout.ahead is not None:
            self.rollout.ahead.after_step(self.state.global_step + 1)  # every weight_sync_steps, the weights pushed
        if args.sync_ref_model and (self.state.global_step + 1) % args.ref_model_sync_steps == 0:
            self.sharding.at_rest(self.ref_model, self.model)
            mix_reference(self.ref_model, self.policy, args.ref_model_mixup_alpha)
        metrics.update(round_metrics)
        return metrics

    # ------------------------------------------------------------------ the loop's hooks (training/trainer.py)

    def _epoch(self) -> float:
        """Epochs of data trained on: micro-batches consumed over micro-batches per epoch (the stream's epoch for an
        iterable dataset)."""
        rounds = self.prompts.rounds_per_epoch
        if rounds is None:
            return self._stream_epoch
        per_round = self.args.steps_per_generation * self.args.num_iterations
        return (self.rounds_consumed * per_round - len(self.buffer)) / (rounds * per_round)

    def _skip_rest_of_epoch(self) -> None:
        rounds = self.prompts.rounds_per_epoch
        if rounds is None:
            return
        self.buffer = []
        if self.rollout.ahead is not None:
            return self.rollout.ahead.skip_rest_of_epoch(rounds)
        for _ in range(-self.rounds_consumed % rounds):
            self._next_round()

    def _train_loader(self):
        return train_prompt_batches(self.train_dataset, self.encoder, self.args, self._data_seed)

    def _eval_loader(self, dataset):
        return eval_prompt_batches(dataset, self.encoder, self.args, self.accelerator.num_processes)

    def _evaluation_metrics(self, dataset, prefix: str) -> dict:
        bonus = self.entropy_control.applied() if self.entropy_control.enabled else 0.0
        ahead = self.rollout.ahead
        with ahead.evaluating(self.state.global_step) if ahead is not None else contextlib.nullcontext():
            metrics = evaluation_metrics(self.rollout, self._policy_loss(bonus), self.encoder, dataset,
                                         self.state.global_step, prefix, lambda: self._call("on_prediction_step"))
        # as TRL: the training's running total (evaluation feeds the model tokens it does not count)
        return {**metrics, f"{prefix}_num_tokens": float(self.state.num_input_tokens_seen)}

    def log(self, logs: dict, start_time=None) -> None:
        super().log(logs, start_time)
        if "loss" in logs:
            self.completion_log.show(self.state.global_step, self.logger)  # above the progress line
            if self.logger is not None:  # trainer.log called outside train() has no trackers
                self.completion_log.to_trackers(self.logger, self.state.global_step)

    def _checkpoint_extras(self) -> CheckpointExtras:
        """The prompt stream's position, the entropy controller, the buffered micro-batches, the sampler's and
        shuffler's generators, and a synced reference."""
        meta = {"rounds_consumed": self.rounds_consumed, "entropy_control": self.entropy_control.state()}
        tensors, sampler = buffer_tensors(self.buffer), self.generator.rng
        if self.rollout.ahead is not None:  # the worker's queue, and its sampler's state as of that queue
            meta["async"], queued, sampler = self.rollout.ahead.snapshot(sampler)
            tensors.update(queued)
        return CheckpointExtras(meta=meta, tensors=tensors, generators={"sampler": sampler, "shuffle": self.shuffle_rng},
                                models={"ref_model": self.ref_model} if self.args.sync_ref_model else {})

    def _restore_position(self, state: dict, tensors: dict) -> None:
        """Move the prompt stream to where the checkpoint left it (or to the start, with ignore_data_skip), and take
        back the buffered micro-batches."""
        self._rounds = self.prompts.rounds()
        self.rounds_consumed = state["rounds_consumed"]
        if not self.args.ignore_data_skip:
            for _ in range(self.rounds_consumed):
                next(self._rounds)
        if "entropy_control" in state:
            self.entropy_control.load(state["entropy_control"])
        self.buffer = buffer_from_tensors({k: v for k, v in tensors.items() if k != "async_queue"},
                                          self.accelerator.device)
        if "async" in state:
            self._resumed_queue = (state["async"], queue_from_tensors(tensors))

    def _train(self, resume_from_checkpoint):
        try:
            return super()._train(resume_from_checkpoint)
        finally:  # async_generation: the worker stopped, its sampled rounds kept for a later train()
            if self.rollout.ahead is not None:
                self._resumed_queue, self.rollout.ahead = self.rollout.ahead.close(), None

    def close(self, failed: bool = False) -> None:
        """Release the generator, the tools' event loop and, in a multi-process run, the process group (call once, at
        the end)."""
        self.generator.close()
        if getattr(self, "agents", None) is not None:
            self.agents.close()
        super().close(failed)
