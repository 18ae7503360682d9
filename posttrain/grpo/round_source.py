"""Where a rollout trainer's rounds come from: one protocol, two sources.

    SampledNow    the round is drawn and sampled when the step asks for it (synchronous GRPO, distillation)
    AheadRounds   a rollout worker samples the next rounds while the trainer steps (async_generation,
                  grpo/async_rollout.py)

The trainer (grpo/trainer.py) opens its source when training starts, where the restored position stands, asks it for
rounds, tells it of each step and of evaluation, saves what it holds in checkpoints and closes it when training
ends; it never asks which source it holds. `open_round_source` is the one place the choice is made.
"""

import contextlib
from typing import Callable, ContextManager, Protocol

import torch

from posttrain.grpo.async_rollout import queue_from_tensors, start_ahead
from posttrain.training.distributed import guarded


class RoundSource(Protocol):
    """What a rollout trainer asks of the rounds it trains on."""

    def next_round(self, step: int, extra: bool = False):
        """The next round, sampled, scored and gathered on every process (grpo/dynamic_sampling.py ScoredRound), for
        optimizer step `step` (1-based, as reward functions are told); `extra`: a dynamic-sampling round beyond the
        batch's first."""

    def metrics(self) -> dict:
        """The source's own metrics since the last call (async/*), or {}."""

    def after_step(self, steps_taken: int) -> None:
        """An optimizer step was taken (the weights may be pushed to the engine)."""

    def evaluating(self, steps_taken: int) -> ContextManager:
        """A context in which evaluation samples with the current weights."""

    def skip_rest_of_epoch(self, rounds_per_epoch: int) -> None:
        """Drop the rounds left in the current epoch (a callback's should_epoch_stop)."""

    def snapshot(self, sampler: torch.Generator) -> tuple[dict, dict, torch.Generator]:
        """(meta, tensors, the sampler's state as of them) for a checkpoint."""

    def close(self):
        """Stop; returns what a source opened later resumes from (None when there is nothing to resume)."""


class SampledNow:
    """Rounds drawn from the prompt stream and sampled when the step asks for them.

    Args:
        accelerator: the run's.
        draw: () -> the prompt stream's next round.
        sample: (prompt round, step) -> the round sampled, scored and gathered on every process.
        on_taken: told of each round drawn (the trainer's data position).
        taken: () -> the rounds drawn so far (that position).
    """

    def __init__(self, accelerator, *, draw: Callable, sample: Callable, on_taken: Callable, taken: Callable):
        self.accelerator, self._draw, self._sample, self._on_taken = accelerator, draw, sample, on_taken
        self._taken = taken

    def next_round(self, step: int, extra: bool = False):
        with guarded(self.accelerator):  # reading the data can fail on one process only
            prompt_round = self._draw()
        self._on_taken(prompt_round)
        return self._sample(prompt_round, step)

    def metrics(self) -> dict:
        return {}

    def after_step(self, steps_taken: int) -> None:
        pass  # the weights are pushed when the next round samples

    def evaluating(self, steps_taken: int) -> ContextManager:
        return contextlib.nullcontext()

    def skip_rest_of_epoch(self, rounds_per_epoch: int) -> None:
        for _ in range(-self._taken() % rounds_per_epoch):
            self._on_taken(self._draw())

    def snapshot(self, sampler: torch.Generator) -> tuple[dict, dict, torch.Generator]:
        return {}, {}, sampler

    def close(self):
        return None


def resume_point(state: dict, tensors: dict):
    """What a checkpoint's source left to resume from (its meta, as trainer_state.json holds it, and `tensors`), or
    None: a rollout worker's next round and the rounds it had sampled ahead."""
    return (state["async"], queue_from_tensors(tensors)) if "async" in state else None


def open_round_source(args, accelerator, *, on_demand: Callable[[], RoundSource], rollout, rounds, taken: int,
                      on_taken: Callable, resumed, steps_taken: int) -> RoundSource:
    """The source a run's configuration asks for, opened where the run stands.

    Args:
        on_demand: () -> the trainer's SampledNow (without async_generation).
        rollout: the round stage, whose worker-side half the rollout worker runs (async_generation).
        rounds: the prompt stream, at the rounds `taken` (trained on or dropped); on_taken: told of each round taken.
        resumed: what a closed source or a checkpoint left to resume from (`resume_point`), or None.
        steps_taken: the optimizer steps taken (the version of the weights a rollout worker starts from).
    """
    if args.async_generation:
        return start_ahead(args, accelerator, rollout, rounds, taken, on_taken, resumed, steps_taken)
    return on_demand()
