"""Distillation's round as one stage, on GRPO's (grpo/rollout.py): a round of prompts in, the student's completions
out, one per prompt, through every generation path GRPO has (in-process, `posttrain serve`, vLLM, tools); no reward,
no advantage, no log-prob pass. The loss of a micro-batch is the divergence at its loss tokens (models/teacher.py):

    loss = sum over the micro-batch's loss tokens of D(student || teacher) / (the step's loss tokens / processes)

so the step's update is that of the mean over all of its loss tokens on every process (TRL's normalisation), however
it is split into micro-batches and processes.
"""

import math
import time
from typing import Callable

import torch

from posttrain.data import PromptRound, PromptSource
from posttrain.grpo.batch import TrainingBatch
from posttrain.grpo.completions import RewardLogs
from posttrain.grpo.dynamic_sampling import ScoredRound
from posttrain.grpo.metrics import completion_metrics, tool_metrics
from posttrain.grpo.rollout import Rollout, ScoredBatch
from posttrain.models.teacher import completion_divergence, teacher_pass
from posttrain.training.distributed import guarded


class DistillationRollout(Rollout):
    """GRPO's Rollout with one completion per prompt and the teacher as its frozen model (`ref_model`)."""

    def _sampled(self, prompt_round: PromptRound, pad_prompts: bool = False):
        """(this process's share of the round, its completions sampled, one per prompt)."""
        share = self.share(prompt_round, 1, pad_prompts)
        with guarded(self.accelerator):  # generation and tools can fail on one process only
            return share, self._synced_generate(share)

    def _round_metrics(self, rollouts, keep: torch.Tensor | None = None) -> tuple[dict, torch.Tensor]:
        """(completions/* over every process's completions, [rows of every process, 2] prompt and model tokens)."""
        acc = self.accelerator
        lengths = acc.gather(torch.stack([rollouts.prompt_mask.sum(1), rollouts.model_tokens.sum(1)], 1)).cpu()
        is_eos = acc.gather(rollouts.is_eos).cpu()
        if keep is not None:
            lengths, is_eos = lengths[keep], is_eos[keep]
        return completion_metrics(lengths[:, 1], is_eos), lengths

    def scored_batch(self, draw_round: Callable[[], PromptRound], step: int) -> ScoredBatch:
        """The next generation batch: the round's prompts, one completion each (the `scored` part for the completion
        log, with no reward)."""
        acc = self.accelerator
        with guarded(acc):  # reading the data can fail on one process only
            prompt_round = draw_round()
        share, sampled = self._sampled(prompt_round)
        rollouts = sampled.rollouts
        n = len(share.rows)
        zeros = torch.zeros(n * acc.num_processes)
        batch = TrainingBatch(rollouts, zeros[:n].to(acc.device), rollouts.model_tokens)
        tool_counts = sampled.counts if self.agents is not None and self.agents.agents.calls_tools else None
        scored = ScoredRound(share.rows, sampled.texts, rollouts, torch.zeros(n * acc.num_processes, 0),
                             RewardLogs(), {}, None, tool_counts)
        completions, lengths = self._round_metrics(rollouts)
        metrics = {"input_tokens": float(lengths.sum()), **completions, **tool_metrics(tool_counts, acc)}
        return ScoredBatch(batch, scored, zeros, metrics)

    def divergence(self, model, batch: TrainingBatch, mask: torch.Tensor | None = None,
                   grad_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """([M] divergence from the teacher with `model`'s gradient, [M] the student's entropy) at the batch's loss
        tokens (or `mask`'s); `grad_scale`: the gradient the loss gives each position's divergence."""
        r, args = batch.rollouts, self.args
        mask = batch.loss_mask if mask is None else mask
        with self.accelerator.autocast():
            hidden, head = teacher_pass(self.ref_model, r.prompt_ids, r.prompt_mask, r.completion_ids,
                                        r.completion_mask, mask)
            return completion_divergence(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, mask,
                                         hidden, head, args.beta, args.temperature, grad_scale)


def evaluation_metrics(rollout: DistillationRollout, encoder, dataset, prefix: str = "eval",
                       on_batch: Callable[[], None] = lambda: None) -> dict:
    """`prefix`_loss (the mean divergence over every eval completion token), _entropy, _completions/*, and
    _runtime, _samples_per_second, _steps_per_second: one completion per eval prompt, per_device_eval_batch_size
    prompts per process at a time (the last batch's prompts repeated to fill every process's share, the repeats left
    out)."""
    from transformers.trainer_utils import speed_metrics

    args, acc = rollout.args, rollout.accelerator
    per_round = max(1, args.per_device_eval_batch_size * acc.num_processes)
    source = PromptSource(dataset, encoder, per_round, shuffle=False, seed=args.seed, full_rounds=False)
    start, batches, samples, sums, lengths = time.time(), 0, 0, torch.zeros(3, dtype=torch.float64), {}
    for prompt_round in source.one_pass():
        share, sampled = rollout._sampled(prompt_round, pad_prompts=True)
        rollouts = sampled.rollouts
        real = torch.tensor(share.real, device=acc.device).unsqueeze(1)
        mask = rollouts.model_tokens & real
        with torch.no_grad():
            div, entropy = rollout.divergence(rollout.model, TrainingBatch(rollouts, torch.zeros(len(share.rows)),
                                                                           mask), mask)
        local = torch.stack([div.double().sum(), entropy.double().sum(),
                             torch.tensor(float(mask.sum()), dtype=torch.float64, device=div.device)])
        sums += acc.reduce(local, reduction="sum").cpu()
        keep = torch.arange(len(prompt_round.rows))
        for key, value in rollout._round_metrics(rollouts, keep)[0].items():
            if value is not None and not math.isnan(value):
                lengths.setdefault(key, []).append(value)
        batches += 1
        samples += len(prompt_round.rows)
        on_batch()
    tokens = max(float(sums[2]), 1.0)
    out = {f"{prefix}_loss": float(sums[0]) / tokens, f"{prefix}_entropy": float(sums[1]) / tokens,
           **{f"{prefix}_{k}": sum(v) / len(v) for k, v in sorted(lengths.items())}}
    out.update(speed_metrics(prefix, start, num_samples=samples, num_steps=batches))
    return out
