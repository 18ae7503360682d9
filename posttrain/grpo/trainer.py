"""The GRPO trainer: its data (prompt rounds, generation, rewards) and its step, on the shared loop
(training/trainer.py).

    round      = next(prompt rounds)                    # B unique prompts, same on every process
    rollouts   = generator.generate(my share, G each,   # token ids, masks, sampler log-probs; a row's
                                    its rows' keys)       # completion depends on its key, not on the process
    rewards    = score(...) gathered over processes     # [B*G, F], NaN where a function returned None
    advantages = group_advantages(rewards, G, ...)      # [B*G], then this process's slice
    buffer    += batch.micro_batches(...) x num_iterations
    each optimizer step: gradient_accumulation_steps micro-batches, loss normalised over all of them

Generation happens whenever the buffer is empty, so how often we generate (steps_per_generation)
is independent of how many micro-batches make an optimizer step (gradient_accumulation_steps).
"""

import math

import torch

from posttrain.configs import ConfigError, GRPOConfig
from posttrain.data import DataError, PromptEncoder, PromptSource, check_eval_columns
from posttrain.generation import SamplingParams, make_generator
from posttrain.grpo.advantages import group_advantages
from posttrain.grpo.batch import TrainingBatch, buffer_from_tensors, buffer_tensors
from posttrain.grpo.completions import CompletionLog, RewardLogs
from posttrain.grpo.dynamic_sampling import ScoredRound, assemble, groups_to_keep, kept_rows, merge_logs, resolve_filter
from posttrain.grpo.entropy import EntropyControl
from posttrain.grpo.evaluation import evaluation_metrics
from posttrain.grpo.losses import LossInputs, LossParams, StepNormalizer, get_loss, micro_batch_loss
from posttrain.grpo.metrics import completion_metrics, loss_metrics, reward_metrics
from posttrain.grpo.sampler_correction import local_stats, reduce_stats, sampling_ratio, trainer_logps
from posttrain.models import token_logprobs
from posttrain.models.peft import reference_mode, refuse_prefix_tuning_for_sampling
from posttrain.models.preparation import make_reference, mix_reference
from posttrain.rewards import check_required_columns, resolve_reward_funcs, reward_inputs, score
from posttrain.training.checkpoint import model_fingerprint
from posttrain.training.distributed import guarded, mark_agreed
from posttrain.training.setup import take_quantization_config, trainer_config
from posttrain.training.trainer import Trainer
from posttrain.training.trainer import TrainingError  # noqa: F401 - part of this module's API
from posttrain.weights import export_weights


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
        callbacks: transformers TrainerCallbacks (instances or classes), see training/callbacks.py.
        optimizers: (optimizer, lr_scheduler); None entries are built from the config.
        quantization_config: a transformers quantization config (TRL's get_quantization_config) for a model loaded
            from a path or hub id.
        peft_config: a peft LoraConfig to train adapters instead of all weights (needs `posttrain[peft]`).
    """

    _title = "GRPO"
    # not the loss: on-policy GRPO's is about 0 by construction (its gradient is not), which reads as "not training"
    _shown_metrics = ("reward", "kl", "entropy", "completions/mean_length")
    _nonfinite_hint = "Lower the learning_rate or check the rewards."
    # fields whose change makes a checkpoint's optimizer state, buffer or data position mean something else
    _meaning_fields = ("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations",
                       "generation_batch_size", "steps_per_generation", "num_iterations", "max_completion_length",
                       "seed", "shuffle_dataset")

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None):
        args = trainer_config(GRPOConfig, args, model, "GRPO")
        take_quantization_config(model, args, quantization_config)
        super().__init__(args, callbacks, optimizers)
        with guarded(self.accelerator):  # a failure on one process stops them all before DDP's first collective
            model = self._setup(model, reward_funcs, train_dataset, eval_dataset, processing_class,
                                reward_processing_classes, peft_config)
        self._model_fingerprint = model_fingerprint(model)  # before any update: what checkpoints are checked against
        self._prepare(model, self._total_steps())
        rank, run_id = self.accelerator.process_index, self._run_id()
        with guarded(self.accelerator):  # a server one process cannot reach stops every process
            # one seed on every process: each row's key (its index in the round) tells the rows apart, so the
            # completions do not depend on the number of processes
            self.generator = make_generator(args, self.policy, self.tokenizer, seed=args.seed,
                                            process_index=rank, run_id=run_id,
                                            num_processes=self.accelerator.num_processes,
                                            local_process_index=self.accelerator.local_process_index)
        self.loss_fn = get_loss(args.loss_type)
        self.loss_params = LossParams.from_config(args)
        self.entropy_control = EntropyControl.from_config(args)
        # Old log-probs are needed only when an optimizer step can land between sampling and training.
        # So are they when an engine's samples are corrected towards the trainer's distribution (as in TRL).
        self.needs_old_logps = (args.num_iterations > 1 or args.steps_per_generation > args.gradient_accumulation_steps
                                or args.corrects_sampling)
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
        self.shuffle_rng = torch.Generator().manual_seed(self._data_seed)
        self.buffer: list[TrainingBatch] = []
        self._rounds = self.prompts.rounds()
        self.rounds_consumed = 0  # generation rounds drawn from the prompts: the data position, for resuming
        self._stream_epoch = 0.0
        self._pending_metrics: dict = {}
        self.completion_log = CompletionLog(args, self.accelerator, [f.name for f in self.reward_funcs])
        self._call("on_init_end")

    # ------------------------------------------------------------------ setup

    def _run_id(self) -> str:
        """A name for this run's weight versions on a generation server, the same on every process."""
        import uuid

        from accelerate.utils import broadcast_object_list

        name = [uuid.uuid4().hex[:12]]
        if self.accelerator.num_processes > 1:
            broadcast_object_list(name, from_process=0)
        return name[0]

    def _setup(self, model, reward_funcs, train_dataset, eval_dataset, processing_class, reward_processing_classes,
               peft_config):
        """Load the model and tokenizer, the reference, the rewards and the data; returns the prepared policy."""
        args = self.args
        if train_dataset is None:
            raise DataError("GRPOTrainer needs a train_dataset with a 'prompt' column.")
        refuse_prefix_tuning_for_sampling(peft_config, model)
        model, came_with_adapter = self._load_policy(model, processing_class, peft_config)
        self.ref_model, self.reference_adapter = make_reference(model, args, came_with_adapter)
        self.reward_funcs = resolve_reward_funcs(reward_funcs, args, self._trust_remote_code, reward_processing_classes)
        self.reward_weights = self._reward_weights()
        self._group_filter = resolve_filter(args.dynamic_sampling_filter)
        for f in self.reward_funcs:
            if f.model is not None:
                f.model.to(self.accelerator.device)

        self.encoder = PromptEncoder(self.tokenizer, args.chat_template_kwargs, args.max_prompt_length,
                                     getattr(model.config, "max_position_embeddings", None),
                                     args.max_completion_length)
        self.prompts = PromptSource(train_dataset, self.encoder, args.prompts_per_generation, args.shuffle_dataset,
                                    self._data_seed)
        self.train_dataset = train_dataset  # as given, as TRL keeps it (GRPO prepares prompts round by round)
        # TRL's remove_unused_columns=True drops every column but the prompt before the reward functions see them
        self.reward_columns = [] if args.remove_unused_columns else self.prompts.columns
        check_required_columns(self.reward_funcs, self.reward_columns)
        self.eval_dataset = eval_dataset
        check_eval_columns(eval_dataset, ["prompt", *self.reward_columns])
        return model

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

    def _next_round(self):
        prompt_round = next(self._rounds)
        self.rounds_consumed += 1
        self._stream_epoch = prompt_round.epoch
        return prompt_round

    def _generate_and_score(self) -> TrainingBatch:
        """The next generation batch: sampled and scored (with dynamic_sampling, from as many rounds as it takes to
        fill it with groups whose rewards differ), then its old and reference log-probs and its advantages."""
        args, G = self.args, self.args.num_generations
        scored = self._generate_round()
        sampling = {}
        if args.dynamic_sampling:
            scored, sampling = self._dynamically_sampled(scored)
        rollouts = scored.rollouts
        with guarded(self.accelerator):  # the log-prob passes can fail on one process only
            weights = sampling_stats = None
            if args.corrects_sampling:
                old_logps, weights, sampling_stats = self._sampling_correction(rollouts)
            else:
                old_logps = self._logps_no_grad(self.forward_policy, rollouts) if self.needs_old_logps else None
            ref_logps = self._reference_logps(rollouts)
        rewards = scored.rewards
        adv = group_advantages(rewards, self.reward_weights, G, args.scale_rewards, args.multi_objective_aggregation)
        n = len(scored.rows)
        local = slice(self.accelerator.process_index * n, (self.accelerator.process_index + 1) * n)

        loss_mask = rollouts.completion_mask
        if args.mask_truncated_completions:
            loss_mask = loss_mask & rollouts.is_eos.unsqueeze(1)
        batch = TrainingBatch(rollouts, adv.advantages[local].to(self.accelerator.device), loss_mask,
                              old_logps=old_logps, ref_logps=ref_logps, sampling_ratio=weights)
        self._pending_metrics = {**reward_metrics(rewards, adv, [f.name for f in self.reward_funcs]),
                                 **(reduce_stats(self.accelerator.gather(sampling_stats.to(self.accelerator.device))
                                                 .cpu()) if sampling_stats is not None else {}),
                                 **({"rewards/skipped_groups": scored.skipped} if scored.skipped is not None else {}),
                                 **completion_metrics(self.accelerator.gather(rollouts.completion_mask.sum(1)).cpu(),
                                                      self.accelerator.gather(rollouts.is_eos).cpu()),
                                 **scored.logs.reduced_metrics(self.accelerator), **sampling}
        if args.log_completions:
            self.completion_log.add(self.state.global_step + 1, [row["prompt"] for row in scored.rows], scored.texts,
                                    rewards, adv.advantages, scored.extra)
        return batch

    def _generate_round(self) -> ScoredRound:
        """The next round of prompts, G completions of each sampled (this process's share of the rows) and scored;
        every process's rewards gathered."""
        args, G = self.args, self.args.num_generations
        bad_rows = [] if args.on_bad_reward == "skip" else None
        logs = RewardLogs()
        with guarded(self.accelerator):  # reading data, generation and rewards can fail on one process only
            prompt_round = self._next_round()
            rows = self._local_share([row for row in prompt_round.rows for _ in range(G)])
            prompt_ids = self._local_share([ids for ids in prompt_round.prompt_ids for _ in range(G)])
            prompt_indices = self._local_share([i for i in prompt_round.indices for _ in range(G)])
            row_keys = self._local_share(list(range(len(prompt_round.prompt_ids) * G)))
            with self.sharding.whole_weights(self.model):  # sharded training: whole weights for the whole decode
                self.generator.sync_weights(export_weights(self.model))
                rollouts = self.generator.generate(prompt_ids, row_keys)
            prompts = [row["prompt"] for row in rows]
            completion_ids, texts, completions = reward_inputs(self.tokenizer, rollouts, isinstance(prompts[0], list))
            columns = {c: [row[c] for row in rows] for c in self.reward_columns}
            local_rewards = score(self.reward_funcs, prompts, completions, completion_ids, columns, self.state,
                                  self.state.global_step + 1, bad_rows, prompt_indices, logs.loggers(),
                                  args.reward_timeout)
        rewards = self.accelerator.gather(local_rewards.to(self.accelerator.device)).cpu()  # [B*G, F]
        skipped = self._skip_bad_groups(rewards, bad_rows, len(rows)) if bad_rows is not None else None
        extra = logs.gathered_extra(self.accelerator, len(rows)) if args.log_completions else {}
        return ScoredRound(rows, texts, rollouts, rewards, logs, extra, skipped)

    def _dynamically_sampled(self, scored: ScoredRound) -> tuple[ScoredRound, dict]:
        """DAPO's dynamic sampling (grpo/dynamic_sampling.py): rounds until the groups whose rewards differ fill the
        batch; the batch of the first of them (this process's share) and the sampling/* metrics."""
        from accelerate.utils import gather_object

        args, G, acc = self.args, self.args.num_generations, self.accelerator
        needed = scored.rewards.size(0)  # B*G rows, the batch's size
        rows, logs, filtered, rounds = [], RewardLogs(), 0, 0
        skipped = None if scored.skipped is None else 0
        while True:
            rounds += 1
            with guarded(acc):  # a user's filter can fail
                keep = groups_to_keep(scored.rewards, self.reward_weights, G, self._group_filter)
            filtered += int((~keep).sum())
            rows += kept_rows(scored, keep, acc.process_index * len(scored.rows), G, gather_object)
            merge_logs(logs, scored.logs)
            skipped = None if skipped is None else skipped + scored.skipped
            if len(rows) >= needed:
                break
            if rounds >= args.dynamic_sampling_max_rounds:
                raise mark_agreed(DataError(  # every process counts the same rows
                    f"dynamic_sampling: {rounds} generation rounds gave {len(rows) // G} of the {needed // G} prompt "
                    f"groups a batch needs whose rewards differ (dynamic_sampling_max_rounds="
                    f"{args.dynamic_sampling_max_rounds}): raise dynamic_sampling_max_rounds, use prompts that are "
                    "neither always solved nor never solved by the model, or set dynamic_sampling=False."))
            scored = self._generate_round()
        batch = assemble(rows, needed, acc.process_index, acc.num_processes, logs, skipped,
                         self.tokenizer.pad_token_id, self.generator.eos_ids, acc.device)
        return batch, {"sampling/groups_filtered": filtered, "sampling/generation_rounds": rounds}

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

    def _sampling_correction(self, rollouts):
        """With use_vllm: the old log-probs, the importance weight of every token for the engine's distribution
        differing from the trainer's, and this process's mismatch statistics (grpo/sampler_correction.py), the
        trainer's log-probs over the sampler's support coming from the same forward as the old ones."""
        args = self.args
        old_logps, support_logps = self._no_grad_per_micro_batch(
            rollouts, lambda r: trainer_logps(self.forward_policy, r, self.sampling_params, args.temperature,
                                              self.generator.eos_ids))
        mask = rollouts.completion_mask.bool()
        ratio = sampling_ratio(support_logps, rollouts.sampler_logprobs, mask, args.vllm_importance_sampling_mode,
                                  args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max)
        sequence_level = args.vllm_importance_sampling_mode.startswith("sequence_")
        return old_logps, ratio, local_stats(support_logps, rollouts.sampler_logprobs, mask, ratio, sequence_level)

    def _logps_no_grad(self, model, rollouts) -> torch.Tensor:
        return self._no_grad_per_micro_batch(rollouts, lambda r: token_logprobs(
            model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, self.args.temperature,
            packing=self.packing, share_prompts=self.share_prompts)[:1])[0]

    def _no_grad_per_micro_batch(self, rollouts, fn) -> tuple[torch.Tensor, ...]:
        """`fn` (rollouts -> tuple of [b, C'] tensors) over micro-batches of per_device_train_batch_size rows,
        padded as training pads them, without gradient; each result back at the rollouts' width [N, C]."""
        parts = []
        size, width = self.args.per_device_train_batch_size, rollouts.completion_ids.size(1)
        with torch.no_grad(), self.accelerator.autocast():
            for i in range(0, len(rollouts), size):
                r = rollouts.select(torch.arange(i, min(i + size, len(rollouts)))).padded(self.pad_to_multiple_of)
                # select() trimmed the columns (and padding may have widened them): back to the rollouts' width
                parts.append([torch.nn.functional.pad(x[:, :width], (0, width - min(x.size(1), width)))
                              for x in fn(r)])
        return tuple(torch.cat(column) for column in zip(*parts))

    def _reference_logps(self, rollouts) -> torch.Tensor | None:
        if self.args.beta == 0.0:
            return None
        if self.ref_model is not None:
            return self._logps_no_grad(self.ref_model, rollouts)
        with reference_mode(self.policy, self.reference_adapter):
            return self._logps_no_grad(self.forward_policy, rollouts)

    # ------------------------------------------------------------------ optimisation

    def _normalizer(self, micro: list[TrainingBatch]) -> StepNormalizer:
        tokens = sum(float(m.loss_mask.sum()) for m in micro)
        seen = sum(float(m.rollouts.prompt_mask.sum() + m.rollouts.completion_mask.sum()) for m in micro)
        totals = self.accelerator.reduce(torch.tensor([tokens, seen], device=self.accelerator.device),
                                         reduction="sum")
        self.state.total_flos += self._flops_per_token * float(totals[1])
        return StepNormalizer(sequences=sum(len(m) for m in micro), tokens=tokens,
                              tokens_per_process=float(totals[0]) / self.accelerator.num_processes)

    def _rows_with_gradient(self, mb: TrainingBatch) -> TrainingBatch:
        """Drop rows whose advantage is 0 (their gradient is exactly 0); keep at least one row, so every
        process still runs a backward and DDP's gradient synchronisation stays in step."""
        keep = (mb.advantages != 0).nonzero().squeeze(1).cpu()
        if len(keep) == len(mb):
            return mb
        return mb.select(keep if len(keep) else torch.zeros(1, dtype=torch.long))

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

    def _micro_step(self, mb: TrainingBatch, norm: StepNormalizer, bonus: float, share: float) -> dict:
        """Forward and backward of one micro-batch (`share`: its part of the step, for the router loss)."""
        all_tokens = mb.loss_mask.sum()
        # clip ratios count every token (or sequence, with a sequence-level ratio) of the micro-batch, skipped rows too
        sequence_level = self.args.importance_sampling_level == "sequence"
        clip_units = torch.tensor(float(len(mb)), device=all_tokens.device) if sequence_level else all_tokens
        if self.skip_zero_advantage_rows:
            mb = self._rows_with_gradient(mb)
        mb = mb.padded(self.pad_to_multiple_of)
        r = mb.rollouts
        with self.accelerator.autocast():
            with self._offloading(), self.router_loss.collecting(self.model, share) as router_term:
                logps, entropy = token_logprobs(self.model, r.prompt_ids, r.prompt_mask, r.completion_ids,
                                                r.completion_mask, self.args.temperature, with_entropy=True,
                                                loss_gradient=self._loss_gradient(mb, norm, bonus),
                                                entropy_grad=self.entropy_control.enabled, packing=self.packing,
                                                share_prompts=self.share_prompts)
            out = micro_batch_loss(self.loss_fn, self.loss_params, self._loss_inputs(mb, logps), entropy, norm,
                                   self.args.top_entropy_quantile, bonus)
            loss = out.loss + sum(router_term)  # TRL adds it last: coef * aux_loss / micro-batches of the step
            self._backward(loss)
        # clip counts are divided by every loss token of the micro-batch (skipped rows clip nothing);
        # the entropy is the mean over the tokens it was computed on
        stats = dict(out.stats, clip_units=clip_units) if "clip_units" in out.stats else out.stats
        return dict(stats, tokens=all_tokens, loss=loss.detach(), policy_loss=out.policy_loss.detach())

    def _optimizer_step(self) -> dict:
        args = self.args
        micro = [self._next_micro_batch() for _ in range(args.gradient_accumulation_steps)]
        norm = self._normalizer(micro)
        bonus = self.entropy_control.applied() if self.entropy_control.enabled else 0.0
        stats = self._accumulate(micro, lambda mb: self._micro_step(mb, norm, bonus, 1.0 / len(micro)))
        loss = float(self.accelerator.reduce(sum(s["loss"] for s in stats), reduction="mean"))
        grad_norm = self._apply_update(loss)
        metrics = loss_metrics(stats, self.accelerator, args.beta)
        metrics.update(loss=loss, grad_norm=grad_norm, learning_rate=self.lr_scheduler.get_last_lr()[0],
                       **self._router_metrics())
        if self.entropy_control.enabled:
            metrics.update(self._entropy_step(stats))
        if args.sync_ref_model and (self.state.global_step + 1) % args.ref_model_sync_steps == 0:
            self.sharding.at_rest(self.ref_model, self.model)
            mix_reference(self.ref_model, self.policy, args.ref_model_mixup_alpha)
        metrics.update(self._pending_metrics)
        self._pending_metrics = {}
        return metrics

    def _entropy_step(self, stats: list[dict]) -> dict:
        """Update the entropy coefficient from the step's entropy across processes; its metrics."""
        device = self.accelerator.device
        local = torch.stack([sum(s["bonus_entropy"] for s in stats).float(),
                             sum(s["bonus_tokens"] for s in stats).float()]).to(device)
        total = self.accelerator.reduce(local, reduction="sum")
        self.entropy_control.update(float(total[0]) / max(float(total[1]), 1.0))
        policy = float(self.accelerator.reduce(sum(s["policy_loss"] for s in stats), reduction="mean"))
        return {"policy_loss": policy, "entropy_coef": self.entropy_control.coef}

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
        for _ in range(-self.rounds_consumed % rounds):
            self._next_round()

    def _evaluation_metrics(self, dataset, prefix: str) -> dict:
        return evaluation_metrics(self, dataset, prefix)

    def log(self, logs: dict, start_time=None, to_file: bool = True) -> None:
        super().log(logs, start_time, to_file)
        if "loss" in logs:
            self.completion_log.show(self.state.global_step)
            if self.logger is not None:  # trainer.log called outside train() has no trackers
                self.completion_log.to_trackers(self.logger, self.state.global_step)

    def _checkpoint_meta(self) -> dict:
        return {"rounds_consumed": self.rounds_consumed, "entropy_control": self.entropy_control.state()}

    def _restore_position(self, state: dict) -> None:
        """Move the prompt stream to where the checkpoint left it (or to the start, with ignore_data_skip)."""
        self._rounds = self.prompts.rounds()
        self.rounds_consumed = state["rounds_consumed"]
        if not self.args.ignore_data_skip:
            for _ in range(self.rounds_consumed):
                next(self._rounds)
        if "entropy_control" in state:
            self.entropy_control.load(state["entropy_control"])

    def _checkpoint_tensors(self) -> dict:
        return buffer_tensors(self.buffer)

    def _load_checkpoint_tensors(self, tensors: dict, device) -> None:
        self.buffer = buffer_from_tensors(tensors, device)

    def _checkpoint_generators(self) -> dict:
        return {"sampler": self.generator.rng, "shuffle": self.shuffle_rng}

    def _checkpoint_models(self) -> dict:
        return {"ref_model": self.ref_model} if self.args.sync_ref_model else {}

    def close(self, failed: bool = False) -> None:
        """Release the generator and, in a multi-process run, the process group (call once, at the end)."""
        self.generator.close()
        super().close(failed)
