"""What get_train_dataloader() and get_eval_dataloader() return: transformers' DataLoader, as posttrain has one.

posttrain batches its data itself (sequences/batches.py; GRPO's PromptSource). The getters give what the trainer's
steps and evaluation take, for a user's inspection or loop of their own, each iteration from fresh readers over the
same prepared data (the run's own position does not move):

    SFT, DPO, KTO, the reward model   this process's collated micro-batches, the objects training_step receives, one
                                      epoch in training order; for evaluation, the eval dataset's in order
    GRPO, RLOO, distillation          lists of dataset rows: one generation batch's prompts, each repeated
                                      num_generations times (TRL's RepeatSampler order), one epoch; for evaluation,
                                      the eval dataset's prompts likewise (num_generations_eval)

A trainer's override of either getter is refused at construction (training/overrides.py): the loop reads its own
batchers, so an override would change nothing that trains.
"""

import itertools
from typing import Callable, Iterator


class MicroBatches:
    """An iterable over a trainer's batches, started afresh by each `iter()`; `len()` where it is known (not for a
    stream), and `dataset`, what they come from.

    Args:
        make: () -> an iterator over the batches.
        length: their number, or a function giving it, or None (unknown until read).
        dataset: the dataset they come from.
    """

    def __init__(self, make: Callable[[], Iterator], length=None, dataset=None):
        self._make, self._length, self.dataset = make, length, dataset

    def __iter__(self) -> Iterator:
        return iter(self._make())

    def __len__(self) -> int:
        length = self._length() if callable(self._length) else self._length
        if length is None:
            raise TypeError("These batches come from a stream (an IterableDataset), whose length is not known until "
                            "it is read: iterate over them instead.")
        return length


def prompt_batches(dataset, encoder, per_round: int, repeat: int, shuffle: bool = True, seed: int = 0,
                   training: bool = True) -> MicroBatches:
    """GRPO's rounds of `dataset` as TRL's dataloader yields them: per round, its `per_round` prompts' rows, each
    `repeat` times in a row. `training`: one epoch of the rounds training draws (`shuffle` with `seed`, whole rounds
    only); else every row once, in order (evaluation's rounds)."""
    from posttrain.data import PromptSource

    def rows() -> Iterator[list]:
        source = PromptSource(dataset, encoder, per_round, shuffle=shuffle, seed=seed, full_rounds=training)
        if not training:
            rounds = source.one_pass()
        elif source.rounds_per_epoch is not None:
            rounds = itertools.islice(source.rounds(), source.rounds_per_epoch)
        else:  # a stream: its rounds until it starts again
            rounds = itertools.takewhile(lambda r: r.epoch < 1, source.rounds())
        for prompt_round in rounds:
            yield [row for row in prompt_round.rows for _ in range(repeat)]

    def length() -> int | None:
        if not hasattr(dataset, "__len__"):
            return None
        return len(dataset) // per_round if training else -(-len(dataset) // per_round)

    return MicroBatches(rows, length, dataset)


def train_prompt_batches(dataset, encoder, args, seed: int) -> MicroBatches:
    """GRPO's (RLOO's, distillation's) training rounds of `dataset`, as prompt_batches gives them."""
    return prompt_batches(dataset, encoder, args.prompts_per_generation, args.num_generations, args.shuffle_dataset,
                          seed)


def eval_prompt_batches(dataset, encoder, args, processes: int) -> MicroBatches:
    """GRPO's evaluation rounds of `dataset` (grpo/evaluation.py's), as prompt_batches gives them."""
    generations = args.num_generations_eval or args.num_generations
    per_round = max(1, args.per_device_eval_batch_size * processes // generations)
    return prompt_batches(dataset, encoder, per_round, generations, training=False)
