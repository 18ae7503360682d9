"""GRPO's round as one stage: a round of prompts in, a scored batch out, for training and evaluation alike.

    share   = rollout.share(round, G)              this process's rows of the round, G per prompt
    scored  = rollout.sample(round, G, step)       generated and scored here; every process's rewards gathered
    logps   = rollout.log_probs(rollouts)          old (or sampler-corrected) and reference log-probs, no gradient
    batch   = rollout.scored_batch(source, step)   the next training batch from a round source (grpo/round_source.py;
                                                   dynamic sampling takes more rounds)

The policy loss of a micro-batch is grpo/losses.py's `micro_batch_loss`; training (grpo/trainer.py) and evaluation
(grpo/evaluation.py) call it on what this stage produced. Nothing here reads the trainer.
"""

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from posttrain.agents.rollouts import AgentSample
from posttrain.data import DataError, PromptRound
from posttrain.generation import Rollouts
from posttrain.grpo.advantages import Advantages, group_advantages
from posttrain.grpo.batch import RowLayout, TrainingBatch
from posttrain.grpo.completions import LoggedRound, RewardLogs
from posttrain.grpo.dynamic_sampling import ScoredRound, assemble, groups_to_keep, kept_rows, merge_logs
from posttrain.grpo.metrics import completion_metrics, reward_metrics, tool_metrics
from posttrain.grpo.sampler_correction import local_stats, reduce_stats, sampling_ratio, trainer_logps
from posttrain.grpo.sampling import RoundSampler, RoundShare
from posttrain.models import token_logprobs
from posttrain.models.peft import reference_mode
from posttrain.rewards import score
from posttrain.training.distributed import guarded, mark_agreed


@dataclass(frozen=True)
class LocalRound:
    """A round sampled and scored on this process, before anything is gathered from the others.

    Attributes:
        prompt_round: the round of prompts (every process's).
        share: this process's rows of it.
        sampled: their completions and what the reward functions received (agents/rollouts.py AgentSample).
        rewards: [n, F] this process's rewards, NaN where a function returned None.
        bad_rows: this process's rows with a non-finite reward (on_bad_reward=skip), else None.
        logs: what the reward functions logged (log_metric, log_extra).
    """

    prompt_round: PromptRound
    share: RoundShare
    sampled: AgentSample
    rewards: torch.Tensor
    bad_rows: list | None
    logs: RewardLogs


@dataclass(frozen=True)
class LogProbs:
    """A batch's log-probs without gradient, each [N, C] or None.

    Attributes:
        old: the sampling policy's, when an update can land between sampling and training (or with a sampler
            correction), else None.
        ref: the reference model's, or None when beta = 0.
        sampling_ratio: each token's importance weight for the engine's distribution, with a sampler correction.
        sampling_stats: this process's sampler-mismatch sums (grpo/sampler_correction.py), with a sampler correction.
    """

    old: torch.Tensor | None = None
    ref: torch.Tensor | None = None
    sampling_ratio: torch.Tensor | None = None
    sampling_stats: torch.Tensor | None = None


@dataclass(frozen=True)
class ScoredBatch:
    """A training batch and what was learnt while making it.

    Attributes:
        batch: this process's rows, ready for the loss.
        scored: the round(s) it came from (rows, texts, gathered rewards, extra columns), for the completion log.
        advantages: every process's rows' advantages [B*G].
        metrics: the round's metrics (rewards, completions, sampler mismatch, dynamic sampling), with TRL's names.
    """

    batch: TrainingBatch
    scored: ScoredRound
    advantages: torch.Tensor
    metrics: dict

    def logged(self) -> LoggedRound:
        """What the completions log takes of it."""
        rows = self.scored
        return LoggedRound([row["prompt"] for row in rows.rows], rows.texts, rows.rewards, self.advantages, rows.extra,
                           rows.row_images())


@dataclass(frozen=True)
class Rewards:
    """The reward functions as the round applies them.

    Attributes:
        funcs: the RewardFunctions (posttrain/rewards).
        weights: [F] their weights.
        columns: the dataset columns they receive.
        group_filter: dynamic sampling's filter of a group's [G, F] rewards, or None for "rewards differ".
    """

    funcs: list
    weights: torch.Tensor
    columns: list[str]
    group_filter: Callable | None = None

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.funcs]


@dataclass(frozen=True)
class RoundModels:
    """The models a round runs: `model` as prepared (its weights go to the generator), `policy` unwrapped,
    `forward_policy` for forwards without gradient; a separate reference `ref_model`, or None (then the policy with its
    adapters off, `reference_adapter`)."""

    model: Any
    policy: Any
    forward_policy: Any
    ref_model: Any
    reference_adapter: str | None


class Rollout:
    """Turns rounds of prompts into scored batches.

    Args:
        args: the GRPOConfig.
        accelerator, sharding: the run's (training/).
        models: the policy as prepared, unwrapped and for forwards without gradient, and the reference.
        sampler: samples the rounds' completions (grpo/sampling.py: the generator, the tokenizer, the agents).
        rewards: the reward functions, weights and columns.
        trainer_state: transformers' TrainerState, which reward functions receive.
        layout: how the log-prob forwards lay rows out.
        sampling_params: the generator's, for the sampler correction's support.
        needs_old_logps: whether old log-probs are kept.
    """

    def __init__(self, args, *, accelerator, sharding, models: RoundModels, sampler: RoundSampler, rewards: Rewards,
                 trainer_state: Any, layout: RowLayout, sampling_params, needs_old_logps: bool):
        self.args, self.accelerator, self.sharding = args, accelerator, sharding
        self.model, self.policy, self.forward_policy = models.model, models.policy, models.forward_policy
        self.ref_model, self.reference_adapter = models.ref_model, models.reference_adapter
        self.sampler, self.rewards, self.trainer_state = sampler, rewards, trainer_state
        self.packing, self.share_prompts = layout.packing, layout.share_prompts
        self.pad_to_multiple_of, self.row_passes = layout.pad_to_multiple_of, layout.passes
        self.sampling_params, self.needs_old_logps = sampling_params, needs_old_logps

    # ------------------------------------------------------------------ sampling and scoring

    def sample(self, prompt_round: PromptRound, G: int, step: int, skip_bad: bool = False,
               gather_extra: bool = False, pad_prompts: bool = False) -> tuple[ScoredRound, RoundShare]:
        """G completions of each prompt of the round (this process's share), scored; every process's rewards gathered
        [rows of every process, F].

        Args:
            step: the step the reward functions are told.
            skip_bad: a non-finite reward blanks its group (on_bad_reward=skip) instead of stopping the run.
            gather_extra: gather the reward functions' log_extra columns (for the completion log).
            pad_prompts: see `share`.
        """
        with guarded(self.accelerator):  # generation, tools and reward functions can fail on one process only
            local = self.sample_local(prompt_round, G, step, skip_bad, pad_prompts)
        return self.gathered(local, G, gather_extra), local.share

    def sample_local(self, prompt_round: PromptRound, G: int, step: int, skip_bad: bool = False,
                     pad_prompts: bool = False, engine=None) -> LocalRound:
        """`sample`'s part on this process alone, with no collective (the rollout worker of async_generation runs it
        on its own thread): this process's share generated and scored. `engine`: a context the generation runs in
        (the worker's hold on the engine; the weights are then pushed by the trainer, not here)."""
        bad_rows = [] if skip_bad else None
        logs = RewardLogs()
        share = self.sampler.share(prompt_round, G, pad_prompts)
        if engine is None:
            sampled = self.sampler.generate(share)
        else:
            with engine():
                sampled = self.sampler.generate_with_held_weights(share)
        columns = {c: [row[c] for row in share.rows] for c in self.rewards.columns}
        columns.update(sampled.columns)  # environments, rollout_func's extra columns (which take precedence)
        completion_ids = sampled.rollouts.completion_lists()
        local = score(self.rewards.funcs, sampled.prompts, sampled.completions, completion_ids, columns,
                      self.trainer_state, step, bad_rows, share.indices, logs.loggers(), self.args.reward_timeout)
        return LocalRound(prompt_round, share, sampled, local, bad_rows, logs)

    def training_round(self, prompt_round: PromptRound, step: int) -> ScoredRound:
        """A round sampled and scored as training samples it (num_generations each, on_bad_reward, log_completions'
        extra columns): what a round source (grpo/round_source.py) gives the step."""
        args = self.args
        scored, _ = self.sample(prompt_round, args.num_generations, step, skip_bad=args.on_bad_reward == "skip",
                                gather_extra=args.log_completions)
        return scored

    def gathered(self, local: LocalRound, G: int, gather_extra: bool = False) -> ScoredRound:
        """A round sampled on every process (`sample_local`), its rewards gathered [rows of every process, F], a
        group with a non-finite reward blanked (on_bad_reward=skip), its log_extra columns gathered (gather_extra)."""
        acc, sampled = self.accelerator, local.sampled
        rewards = acc.gather(local.rewards.to(acc.device)).cpu()  # [rows of every process, F]
        skipped = self._skip_bad_groups(rewards, local.bad_rows, G) if local.bad_rows is not None else None
        extra = local.logs.gathered_extra(acc, len(local.share.rows)) if gather_extra else {}
        tool_counts = sampled.counts if self.sampler.calls_tools else None
        return ScoredRound(local.share.rows, sampled.texts, sampled.rollouts, rewards, local.logs, extra, skipped,
                           tool_counts, sampled.images)

    def _skip_bad_groups(self, rewards: torch.Tensor, bad_rows: list, G: int) -> int:
        """Blank (NaN) every reward of a group holding a NaN/inf one, so the group gets advantage 0. In place.

        Args:
            rewards: [B*G, F] gathered rewards.
            bad_rows: local indices of completions with a non-finite reward.
        Returns:
            The number of groups skipped, across processes.
        """
        acc = self.accelerator
        bad = torch.zeros(rewards.size(0) // acc.num_processes, dtype=torch.bool, device=acc.device)
        bad[bad_rows] = True
        bad_groups = acc.gather(bad).cpu().view(-1, G).any(1)  # [B]
        rewards[bad_groups.repeat_interleave(G)] = float("nan")
        return int(bad_groups.sum())

    # whether the KL to the reference is a reward penalty (in `advantages`) rather than a term of the loss
    kl_in_reward = False

    def advantages(self, rewards: torch.Tensor, G: int, logps: LogProbs, loss_mask: torch.Tensor
                   ) -> tuple[Advantages, dict]:
        """Group-relative advantages of the gathered [B*G, F] rewards (grpo/advantages.py), and metrics of their
        own (none here). `logps` and `loss_mask` [n, C] are this process's rows', for an advantage that reads them
        (RLOO's KL penalty, rloo/rollout.py)."""
        args = self.args
        return group_advantages(rewards, self.rewards.weights, G, args.scale_rewards,
                                args.multi_objective_aggregation), {}

    # ------------------------------------------------------------------ log-probs without gradient

    def policy_logps(self, model, rollouts: Rollouts, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`model`'s [N, C] log-probs of the completions (and entropies, with_entropy=True), laid out as training
        lays them out; keyword arguments go to models.token_logprobs."""
        r = rollouts
        return token_logprobs(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                              self.args.temperature, packing=self.packing, share_prompts=self.share_prompts,
                              model_inputs=r.forward_inputs(), **kwargs)

    def log_probs(self, rollouts: Rollouts, old: bool = True) -> LogProbs:
        """The old (when kept, and `old`), sampler-corrected and reference log-probs of this process's rollouts."""
        args = self.args
        with guarded(self.accelerator):  # the log-prob passes can fail on one process only
            if old and args.corrects_sampling:
                corrected = self._sampling_correction(rollouts)
                return replace(corrected, ref=self._reference_logps(rollouts))
            old_logps = self._no_grad(self.forward_policy, rollouts) if old and self.needs_old_logps else None
            return LogProbs(old=old_logps, ref=self._reference_logps(rollouts))

    def _reference_logps(self, rollouts: Rollouts) -> torch.Tensor | None:
        if self.args.beta == 0.0:
            return None
        if self.ref_model is not None:
            return self._no_grad(self.ref_model, rollouts)
        with reference_mode(self.policy, self.reference_adapter):
            return self._no_grad(self.forward_policy, rollouts)

    def _sampling_correction(self, rollouts: Rollouts) -> LogProbs:
        """With use_vllm: the old log-probs, the importance weight of every token for the engine's distribution
        differing from the trainer's, and this process's mismatch statistics (grpo/sampler_correction.py), the
        trainer's log-probs over the sampler's support coming from the same forward as the old ones."""
        args = self.args
        old_logps, support_logps = self._per_micro_batch(
            rollouts, lambda r: trainer_logps(self.forward_policy, r, self.sampling_params, args.temperature,
                                              self.sampler.generator.eos_ids))
        mask = rollouts.model_tokens.bool()  # a tool result's tokens were not sampled: no ratio, no statistics
        ratio = sampling_ratio(support_logps, rollouts.sampler_logprobs, mask, args.vllm_importance_sampling_mode,
                               args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max)
        sequence_level = args.vllm_importance_sampling_mode.startswith("sequence_")
        stats = local_stats(support_logps, rollouts.sampler_logprobs, mask, ratio, sequence_level)
        return LogProbs(old=old_logps, sampling_ratio=ratio, sampling_stats=stats)

    def _no_grad(self, model, rollouts: Rollouts) -> torch.Tensor:
        return self._per_micro_batch(rollouts, lambda r: self.policy_logps(model, r)[:1])[0]

    def _per_micro_batch(self, rollouts: Rollouts, fn) -> tuple[torch.Tensor, ...]:
        """`fn` (rollouts -> tuple of [b, C'] tensors) over micro-batches of per_device_train_batch_size rows,
        padded as training pads them, without gradient; each result back at the rollouts' width [N, C]."""
        parts, width = [], rollouts.completion_ids.size(1)
        passes = self._passes_without_gradient(rollouts)
        with torch.no_grad(), self.accelerator.autocast():
            for rows in passes:
                r = rollouts.select(rows).padded(self.pad_to_multiple_of)
                # select() trimmed the columns (and padding may have widened them): back to the rollouts' width
                parts.append([torch.nn.functional.pad(x[:, :width], (0, width - min(x.size(1), width)))
                              for x in fn(r)])
        back = torch.cat(passes).argsort()  # the passes' rows back in the rollouts' order
        return tuple(torch.cat(column)[back.to(column[0].device)] for column in zip(*parts))

    def _passes_without_gradient(self, rollouts: Rollouts) -> list[torch.Tensor]:
        """The row indices of each forward: micro-batches of per_device_train_batch_size rows, each in the passes the
        training's rule gives it (layout.passes), where a micro-batch's activations would set the step's peak; as
        many on every process where each forward is a collective (FSDP, ZeRO-3)."""
        size = self.args.per_device_train_batch_size
        micro = [torch.arange(i, min(i + size, len(rollouts))) for i in range(0, len(rollouts), size)]
        if self.row_passes is None:
            return micro
        batches = [TrainingBatch(r, None, r.completion_mask) for r in (rollouts.select(rows) for rows in micro)]
        counts = torch.tensor([self.row_passes(b) for b in batches], device=self.accelerator.device)
        if self.sharding.shards_parameters and self.accelerator.num_processes > 1:
            counts = self.accelerator.gather(counts).view(-1, len(micro)).amax(0)
        passes = []
        for rows, batch, count in zip(micro, batches, counts.tolist()):
            passes += [rows[part] for part in batch.pass_rows(count)] if count > 1 else [rows]
        return passes

    # ------------------------------------------------------------------ the training batch

    def scored_batch(self, source, step: int) -> ScoredBatch:
        """The next generation batch: sampled and scored (with dynamic_sampling, from as many rounds as it takes to
        fill it with groups whose rewards differ), then its log-probs and its advantages.

        Args:
            source: where the rounds come from (grpo/round_source.py RoundSource).
            step: the optimizer step the batch is for (what reward functions are told).
        """
        args, G, acc = self.args, self.args.num_generations, self.accelerator
        scored, sampling = source.next_round(step), {}
        if args.dynamic_sampling:
            scored, sampling = self._dynamically_sampled(scored, source, step)
        rollouts = scored.rollouts
        logps = self.log_probs(rollouts)
        loss_mask = rollouts.model_tokens  # a multi-turn rollout's tool results carry no loss (TRL's tool_mask)
        if args.mask_truncated_completions:
            loss_mask = loss_mask & rollouts.is_eos.unsqueeze(1)
        adv, adv_metrics = self.advantages(scored.rewards, G, logps, loss_mask)
        n = len(scored.rows)
        local = slice(acc.process_index * n, (acc.process_index + 1) * n)
        batch = TrainingBatch(rollouts, adv.advantages[local].to(acc.device), loss_mask, old_logps=logps.old,
                              ref_logps=logps.ref, sampling_ratio=logps.sampling_ratio)
        # what the generation batch fed the model, every process's: its prompts and the model's completion tokens
        # (TRL adds it to state.num_input_tokens_seen, which it logs as num_tokens): [rows of every process, 2], each
        # row's prompt and model tokens, in one gather with the completion lengths
        lengths = acc.gather(torch.stack([rollouts.prompt_mask.sum(1), rollouts.model_tokens.sum(1)], 1)).cpu()
        metrics = {"input_tokens": float(lengths.sum()),
                   **reward_metrics(scored.rewards, adv, self.rewards.names),
                   **(reduce_stats(acc.gather(logps.sampling_stats.to(acc.device)).cpu())
                      if logps.sampling_stats is not None else {}),
                   **({"rewards/skipped_groups": scored.skipped} if scored.skipped is not None else {}),
                   **completion_metrics(lengths[:, 1], acc.gather(rollouts.is_eos).cpu()),  # the model's tokens
                   **scored.logs.reduced_metrics(acc), **sampling, **adv_metrics,
                   **tool_metrics(scored.tool_counts, acc), **source.metrics()}
        return ScoredBatch(batch, scored, adv.advantages, metrics)

    def _dynamically_sampled(self, scored: ScoredRound, source, step: int) -> tuple[ScoredRound, dict]:
        """DAPO's dynamic sampling (grpo/dynamic_sampling.py): rounds until the groups whose rewards differ fill the
        batch; the batch of the first of them (this process's share) and the sampling/* metrics."""
        from accelerate.utils import gather_object

        args, G, acc = self.args, self.args.num_generations, self.accelerator
        needed = scored.rewards.size(0)  # B*G rows, the batch's size
        rows, logs, filtered, rounds = [], RewardLogs(), 0, 0
        skipped = None if scored.skipped is None else 0
        tool_counts = None if scored.tool_counts is None else torch.zeros_like(scored.tool_counts)
        while True:
            rounds += 1
            with guarded(acc):  # a user's filter can fail
                keep = groups_to_keep(scored.rewards, self.rewards.weights, G, self.rewards.group_filter)
            filtered += int((~keep).sum())
            rows += kept_rows(scored, keep, acc.process_index * len(scored.rows), G, gather_object)
            merge_logs(logs, scored.logs)
            skipped = None if skipped is None else skipped + scored.skipped
            tool_counts = None if tool_counts is None else tool_counts + scored.tool_counts
            if len(rows) >= needed:
                break
            if rounds >= args.dynamic_sampling_max_rounds:
                raise mark_agreed(DataError(  # every process counts the same rows
                    f"dynamic_sampling: {rounds} generation rounds gave {len(rows) // G} of the {needed // G} prompt "
                    f"groups a batch needs whose rewards differ (dynamic_sampling_max_rounds="
                    f"{args.dynamic_sampling_max_rounds}): raise dynamic_sampling_max_rounds, use prompts that are "
                    "neither always solved nor never solved by the model, or set dynamic_sampling=False."))
            scored = source.next_round(step, extra=True)
        batch = assemble(rows, needed, acc.process_index, acc.num_processes, logs, skipped,
                         self.sampler.tokenizer.pad_token_id, self.sampler.generator.eos_ids, acc.device, tool_counts)
        return batch, {"sampling/groups_filtered": filtered, "sampling/generation_rounds": rounds}
