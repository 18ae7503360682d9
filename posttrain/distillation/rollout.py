"""Distillation's round as one stage: a round of prompts in, the student's completions out, one per prompt, sampled
through every generation path GRPO has (grpo/sampling.py: in-process, `posttrain serve`, vLLM, tools); no reward, no
advantage, no log-prob pass. The loss of a micro-batch is the divergence at its loss tokens (models/teacher.py):

    loss = sum over the micro-batch's loss tokens of D(student || teacher) / (the step's loss tokens / processes)

so the step's update is that of the mean over all of its loss tokens on every process (TRL's normalisation), however
it is split into micro-batches and processes.
"""

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from posttrain.agents.rollouts import AgentSample
from posttrain.data import PromptRound, PromptSource
from posttrain.grpo.batch import TrainingBatch
from posttrain.grpo.completions import LoggedRound
from posttrain.grpo.metrics import completion_metrics, tool_metrics
from posttrain.grpo.sampling import RoundSampler, RoundShare
from posttrain.models.teacher import completion_divergence, teacher_pass
from posttrain.training.distributed import guarded
from posttrain.training.statistics import Statistics


@dataclass
class DivergenceStatistics(Statistics):
    """A micro-batch's sums (training/statistics.py): the divergence and the student's entropy over its loss tokens,
    and their count; `loss` and `entropy` are the means per loss token."""

    divergence: float = 0.0
    entropy: float = 0.0
    tokens: float = 0.0

    @classmethod
    def of(cls, divergence: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor) -> "DivergenceStatistics":
        """From [M] divergences and entropies at the loss tokens of `mask`."""
        return cls(divergence.detach().double().sum(), entropy.detach().double().sum(), mask.sum().double())

    def metrics(self, prefix: str = "") -> dict:
        tokens = max(float(self.tokens), 1.0)
        return {f"{prefix}loss": float(self.divergence) / tokens, f"{prefix}entropy": float(self.entropy) / tokens}


@dataclass(frozen=True)
class StudentRound:
    """A round's completions, one per prompt, on this process: what a round source gives distillation.

    Attributes:
        share: this process's rows of the round.
        sampled: their completions (agents/rollouts.py AgentSample).
    """

    share: RoundShare
    sampled: AgentSample


@dataclass(frozen=True)
class StudentBatch:
    """A generation batch of the student's completions: `batch` (this process's rows, every token of the model's
    carrying loss), the round they came from and its `metrics` (completions/*, tools/*, input_tokens)."""

    batch: TrainingBatch
    round: StudentRound
    metrics: dict

    def logged(self) -> LoggedRound:
        """What the completions log takes of it: prompts and completions, nothing scored."""
        sampled = self.round.sampled
        return LoggedRound([row["prompt"] for row in self.round.share.rows], sampled.texts)


class DistillationRound:
    """The student's completions of a round (through `sampler`), and their divergence from the teacher.

    Args:
        args: the DistillationConfig.
        accelerator: the run's.
        sampler: samples the completions (grpo/sampling.py).
        model: the student as prepared; teacher: the frozen teacher (sharded as the student).
    """

    def __init__(self, args, *, accelerator, sampler: RoundSampler, model, teacher):
        self.args, self.accelerator, self.sampler = args, accelerator, sampler
        self.model, self.teacher = model, teacher

    def sampled(self, prompt_round: PromptRound, pad_prompts: bool = False) -> StudentRound:
        """This process's share of the round, its completions sampled, one per prompt."""
        share = self.sampler.share(prompt_round, 1, pad_prompts)
        with guarded(self.accelerator):  # generation and tools can fail on one process only
            return StudentRound(share, self.sampler.generate(share))

    def training_round(self, prompt_round: PromptRound, step: int) -> StudentRound:
        """A round as training samples it (a round source's `sample`; the step does not change it)."""
        return self.sampled(prompt_round)

    def round_metrics(self, rollouts, keep: torch.Tensor | None = None) -> tuple[dict, torch.Tensor]:
        """(completions/* over every process's completions, [rows of every process, 2] prompt and model tokens)."""
        acc = self.accelerator
        lengths = acc.gather(torch.stack([rollouts.prompt_mask.sum(1), rollouts.model_tokens.sum(1)], 1)).cpu()
        is_eos = acc.gather(rollouts.is_eos).cpu()
        if keep is not None:
            lengths, is_eos = lengths[keep], is_eos[keep]
        return completion_metrics(lengths[:, 1], is_eos), lengths

    def scored_batch(self, source, step: int) -> StudentBatch:
        """The next generation batch from a round source (grpo/round_source.py): the round's prompts, one completion
        each, every token of the model's carrying loss."""
        student = source.next_round(step)
        sampled = student.sampled
        rollouts = sampled.rollouts
        tool_counts = sampled.counts if self.sampler.calls_tools else None
        completions, lengths = self.round_metrics(rollouts)
        metrics = {"input_tokens": float(lengths.sum()), **completions, **tool_metrics(tool_counts, self.accelerator),
                   **source.metrics()}
        return StudentBatch(TrainingBatch(rollouts, None, rollouts.model_tokens), student, metrics)

    def divergence(self, model, batch: TrainingBatch, mask: torch.Tensor | None = None,
                   grad_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """([M] divergence from the teacher with `model`'s gradient, [M] the student's entropy) at the batch's loss
        tokens (or `mask`'s); `grad_scale`: the gradient the loss gives each position's divergence."""
        r, args = batch.rollouts, self.args
        mask = batch.loss_mask if mask is None else mask
        pixels = r.forward_inputs() or None  # both models take the rows' images (vision-language teacher and student)
        with self.accelerator.autocast():
            hidden, head = teacher_pass(self.teacher, r.prompt_ids, r.prompt_mask, r.completion_ids,
                                        r.completion_mask, mask, pixels)
            return completion_divergence(model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, mask,
                                         hidden, head, args.beta, args.temperature, grad_scale, pixels)


def evaluation_metrics(rollout: DistillationRound, encoder, dataset, prefix: str = "eval",
                       on_batch: Callable[[], None] = lambda: None) -> dict:
    """`prefix`_loss (the mean divergence over every eval completion token), _entropy, _completions/*, and
    _runtime, _samples_per_second, _steps_per_second: one completion per eval prompt, per_device_eval_batch_size
    prompts per process at a time (the last batch's prompts repeated to fill every process's share, the repeats left
    out)."""
    from transformers.trainer_utils import speed_metrics

    args, acc = rollout.args, rollout.accelerator
    per_round = max(1, args.per_device_eval_batch_size * acc.num_processes)
    source = PromptSource(dataset, encoder, per_round, shuffle=False, seed=args.seed, full_rounds=False)
    start, batches, samples, sums, lengths = time.time(), 0, 0, DivergenceStatistics(), {}
    for prompt_round in source.one_pass():
        student = rollout.sampled(prompt_round, pad_prompts=True)
        rollouts = student.sampled.rollouts
        real = torch.tensor(student.share.real, device=acc.device).unsqueeze(1)
        mask = rollouts.model_tokens & real
        with torch.no_grad():
            div, entropy = rollout.divergence(rollout.model, TrainingBatch(rollouts, None, mask), mask)
        sums = sums + DivergenceStatistics.of(div, entropy, mask).reduced(acc)
        keep = torch.arange(len(prompt_round.rows))
        for key, value in rollout.round_metrics(rollouts, keep)[0].items():
            if value is not None and not math.isnan(value):
                lengths.setdefault(key, []).append(value)
        batches += 1
        samples += len(prompt_round.rows)
        on_batch()
    out = {**sums.metrics(f"{prefix}_"), **{f"{prefix}_{k}": sum(v) / len(v) for k, v in sorted(lengths.items())}}
    out.update(speed_metrics(prefix, start, num_samples=samples, num_steps=batches))
    return out
