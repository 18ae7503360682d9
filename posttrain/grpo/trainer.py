"""The GRPO trainer: its signal (rewards) and its objective (the policy loss) on the online trainers' data
(grpo/online.py: prompt rounds sampled from the policy, the buffer, the round source).

    round      = rounds.next_round(step)                # B unique prompts, same on every process, G completions
                                                        # each; a row's completion depends on its key, not on the
                                                        # process (grpo/rollout.py)
    rewards    = score(...) gathered over processes     # [B*G, F], NaN where a function returned None
    advantages = group_advantages(rewards, G, ...)      # [B*G], then this process's slice
    buffer    += batch.micro_batches(...) x num_iterations
    each optimizer step: gradient_accumulation_steps micro-batches, loss normalised over all of them

Generation happens whenever the buffer is empty, so how often we generate (steps_per_generation) is independent of
how many micro-batches make an optimizer step (gradient_accumulation_steps).
"""

import functools
import logging
from dataclasses import replace

import torch

from posttrain.agents.rollouts import Agents
from posttrain.configs import ConfigError, GRPOConfig
from posttrain.grpo.batch import TrainingBatch
from posttrain.grpo.dynamic_sampling import resolve_filter
from posttrain.grpo.entropy import EntropyControl
from posttrain.grpo.evaluation import evaluation_metrics
from posttrain.grpo.flat_rewards import FlatRewardWatch
from posttrain.grpo.losses import (SEQUENCE_LEVELS, LossInputs, LossParams, MicroBatchLoss, StepNormalizer, get_loss,
                                  micro_batch_loss)
from posttrain.grpo.metrics import loss_metrics
from posttrain.grpo.online import OnlineTrainer
from posttrain.grpo.rollout import Rewards, Rollout, RoundModels
from posttrain.models.preparation import make_reference, mix_reference
from posttrain.rewards import RewardFunction, check_required_columns, resolve_reward_funcs, reward_weights
from posttrain.rewards.resolving import NO_REWARD
from posttrain.training.checkpoint import CheckpointExtras
from posttrain.training.trainer import TrainingError  # noqa: F401 - TrainingError: this module's API too

logger = logging.getLogger("posttrain")


class GRPOTrainer(OnlineTrainer):
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
        self._reward_funcs_given = (reward_funcs, reward_processing_classes)  # resolved before the policy loads
        super().__init__(model, args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers,
                         quantization_config=quantization_config, peft_config=peft_config,
                         agents=Agents(list(tools or []), environment_factory, rollout_func, response_template))

    # ------------------------------------------------------------------ the signal: rewards (grpo/online.py's hooks)

    def _before_model(self, agents: Agents) -> None:
        reward_funcs, reward_processing_classes = self._reward_funcs_given
        self._reward_funcs_given = None
        self._user_funcs = self._user_reward_funcs(reward_funcs, reward_processing_classes,
                                                   agents.environment_factory is not None)

    def _frozen_model(self, model, came_with_adapter: bool) -> tuple:
        """(a separate frozen model the round reads, sharded as the policy; or None, and the reference adapter or
        None): GRPO's KL reference (models/preparation.py), none at beta 0."""
        return make_reference(model, self.args, came_with_adapter)

    def _after_agents(self, agents: Agents) -> None:
        """The reward functions: the given ones, then each environment's get_reward; their weights and columns."""
        args, user_funcs = self.args, self._user_funcs
        sources = self.agents.reward_sources() if self.agents is not None else []
        if agents.environment_factory is not None and not user_funcs and not sources:
            raise ConfigError(NO_REWARD + ", or environments whose class defines get_reward.")
        self.reward_weights = reward_weights(args.reward_weights, len(user_funcs), len(sources))
        # an environment's get_reward is a reward of weight 1 named after its class, after the given ones (TRL's)
        self.reward_funcs = user_funcs + [RewardFunction(name=name, fn=fn) for name, fn in sources]
        del self._user_funcs
        self._group_filter = resolve_filter(args.dynamic_sampling_filter)
        for f in self.reward_funcs:
            if f.model is not None:
                f.model.to(self.accelerator.device)
        # TRL's GRPO remove_unused_columns=True drops every column but the prompt before the reward functions see them
        self.reward_columns = [] if args.drops_reward_columns else self.prompts.columns
        check_required_columns(self.reward_funcs, self.reward_columns,
                               self.agents.column_names if self.agents is not None else (),
                               more_columns=agents.rollout_func is not None)

    def _eval_columns(self) -> list[str]:
        return self.reward_columns

    def _reward_names(self) -> list[str]:
        return [f.name for f in self.reward_funcs]

    def _set_objective(self, args) -> None:
        """The loss, the entropy control, whether old log-probs are kept, and which rows skip the forward."""
        self.loss_fn, self.loss_params = self._objective(args)
        self.entropy_control = EntropyControl.from_config(args)
        self.needs_old_logps = self._needs_old_logps(args)
        # A row with advantage 0 has zero gradient unless the loss needs it (Loss.needs_zero_advantage_rows), an
        # entropy quantile or bonus (which look at every row) or a mixture-of-experts router loss involves it: such
        # rows skip the forward and backward.
        self.skip_zero_advantage_rows = (not self.loss_fn.needs_zero_advantage_rows(self.loss_params)
                                         and args.top_entropy_quantile >= 1.0 and not self.entropy_control.enabled
                                         and not self.router_loss.enabled)
        self.flat_rewards = FlatRewardWatch(args, self.sampling_params, self._reward_names(),
                                            self._gradients_besides_rewards())

    def _round_stage(self, sampler, layout):
        """GRPO's round (grpo/rollout.py): sampling, scoring, log-probs, advantages (RLOO's differ)."""
        rewards = Rewards(self.reward_funcs, self.reward_weights, self.reward_columns, self._group_filter)
        return self._rollout_class(
            self.args, accelerator=self.accelerator, sharding=self.sharding, models=RoundModels(
                self.model, self.policy, self.forward_policy, self.ref_model, self.reference_adapter),
            sampler=sampler, rewards=rewards, trainer_state=self.state, layout=layout,
            sampling_params=self.sampling_params, needs_old_logps=self.needs_old_logps)

    def _objective(self, args) -> tuple:
        """The loss (grpo/losses.py) and its parameters: loss_type's."""
        return get_loss(args.loss_type), LossParams.from_config(args)

    def _needs_old_logps(self, args) -> bool:
        """Old log-probs: when a step can land between sampling and training, or the engine's samples are corrected."""
        return (args.num_iterations > 1 or args.steps_per_generation > args.gradient_accumulation_steps
                or args.corrects_sampling)

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

    # ------------------------------------------------------------------ the step

    def _batch_made(self, scored) -> None:
        """The completion log, and a warning once when the rewards have stopped telling completions apart
        (grpo/flat_rewards.py)."""
        super()._batch_made(scored)
        warning = self.flat_rewards.observe(scored.metrics, scored.scored.rewards)
        if warning and self.accelerator.is_main_process:
            logger.warning(warning)

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

    def _loss_sees_whole_micro_batch(self) -> bool:
        """An entropy quantile picks its tokens among the whole micro-batch's (besides the router loss)."""
        return self.args.top_entropy_quantile < 1.0 or super()._loss_sees_whole_micro_batch()

    def _optimizer_step(self) -> dict:
        args = self.args
        micro, round_metrics = self._step_micro_batches()
        norm, seen_tokens = self._step_counts(micro)
        self.state.total_flos += self._flops_per_token * seen_tokens
        bonus = self.entropy_control.applied() if self.entropy_control.enabled else 0.0
        results = self._accumulate(micro, lambda mb: self._step_loss(mb, norm, bonus, 1.0 / len(micro)),
                                   norm.tokens_per_process * self.accelerator.num_processes, self._passes(micro))
        loss = float(self.accelerator.reduce(sum(r.loss for r in results), reduction="mean"))
        grad_norm = self._apply_update(loss)
        metrics = loss_metrics([r.stats for r in results], self.accelerator)
        metrics.update(loss=loss, grad_norm=grad_norm, learning_rate=self.lr_scheduler.get_last_lr()[0],
                       **self._router_metrics())
        if self.entropy_control.enabled:
            metrics.update(self.entropy_control.after_step(results, self.accelerator))
        self.rounds.after_step(self.state.global_step + 1)  # a rollout worker's engine takes the weights
        if args.sync_ref_model and (self.state.global_step + 1) % args.ref_model_sync_steps == 0:
            self.sharding.at_rest(self.ref_model, self.model)
            mix_reference(self.ref_model, self.policy, args.ref_model_mixup_alpha)
        metrics.update(round_metrics)
        return metrics

    # ------------------------------------------------------------------ the loop's hooks (training/trainer.py)

    def _evaluation_metrics(self, dataset, prefix: str) -> dict:
        bonus = self.entropy_control.applied() if self.entropy_control.enabled else 0.0
        with self.rounds.evaluating(self.state.global_step):
            metrics = evaluation_metrics(self.rollout, self._policy_loss(bonus), self.encoder, dataset,
                                         self.state.global_step, prefix, lambda: self._call("on_prediction_step"))
        # as TRL: the training's running total (evaluation feeds the model tokens it does not count)
        return {**metrics, f"{prefix}_num_tokens": float(self.state.num_input_tokens_seen)}

    def _checkpoint_extras(self) -> CheckpointExtras:
        """The online data's (grpo/online.py), the entropy controller and a synced reference."""
        extras = super()._checkpoint_extras()
        extras.meta["entropy_control"] = self.entropy_control.state()
        if self.args.sync_ref_model:
            extras.models["ref_model"] = self.ref_model
        return extras

    def _restore_position(self, state: dict, tensors: dict) -> None:
        super()._restore_position(state, tensors)
        if "entropy_control" in state:
            self.entropy_control.load(state["entropy_control"])
