"""The micro-batches of each optimizer step from a dataset's training rows, and the data position a checkpoint keeps.

Map-style datasets are prepared once, up front, by the trainer; then each epoch is a permutation of the rows
(EpochPlan). Iterable datasets are read as a stream: each block of BLOCK rows is prepared as it arrives (packing bins
only within a block), and micro-batches are consecutive rows. Either way, the data position is a count (micro-batches,
or stream rows), so a resumed run continues with exactly the rows the interrupted one would have trained on next.

A stream's `preparation` is the trainer's: it has a `name`, `sequences(rows, first_index) -> rows`,
`rows(sequences) -> (training rows, dropped)` and `concatenate(parts)` (SFT's Preparation, DPO's PairPreparation).
"""

import logging

import numpy as np

from posttrain.data import DataError
from posttrain.sequences.rows import EpochPlan, TokenRows

logger = logging.getLogger("posttrain")
BLOCK = 1000  # dataset rows prepared (and, for a stream, packed) together


def block_rows(columns: dict) -> list[dict]:
    names = list(columns)
    return [dict(zip(names, values)) for values in zip(*(columns[n] for n in names))]


def first_row(dataset) -> dict:
    row = next(iter(dataset), None)
    if row is None:
        raise DataError("The training dataset is empty: it needs at least one row.")
    return row


def is_iterable(dataset) -> bool:
    import datasets

    return isinstance(dataset, datasets.IterableDataset)


def read_whole(dataset):
    """An IterableDataset read to its end into a map-style Dataset (evaluation takes every row once, in order, and
    may run many times); any other dataset as it is. A stream that never ends never finishes, as in transformers."""
    if not is_iterable(dataset):
        return dataset
    import datasets

    rows = list(dataset)
    if not rows:
        raise DataError("The IterableDataset given for evaluation has no rows.")
    return datasets.Dataset.from_list(rows)


class MapBatches:
    """Micro-batches of a map-style dataset's rows: EpochPlan order, position = (epoch, micro-batch in epoch)."""

    def __init__(self, rows: TokenRows, plan: EpochPlan, rank: int):
        self.rows = rows
        self.plan = plan
        self.rank = rank
        self.epoch, self.micro = 0, 0
        self._order = plan.order(0)
        self._before = None  # predecessor_positions of the plan, on first use (the same every epoch)

    @property
    def steps_per_epoch(self) -> int:
        return self.plan.steps

    def next_step(self) -> list[TokenRows]:
        """This process's rows of each micro-batch of the next optimizer step."""
        if self.micro >= self.plan.micro_batches:
            self._start_epoch(self.epoch + 1)
        step = self.plan.step_micro_batches(self.micro // self.plan.accumulation)
        shares = [self.rows.select(self.plan.share(self._order, m, self.rank)) for m in step]
        self.micro = step.stop
        self._step = step
        return shares

    def step_predecessors(self) -> list:
        """For each share of the last next_step(), the rows of the example before each of its examples in the whole
        step's order (every process's micro-batches, in turn; the step's first is preceded by its last): KTO's KL
        pairs, the same however the step is split."""
        if self._before is None:
            self._before = predecessor_positions(self.plan, len(self._order))
        positions = np.arange(len(self._order))
        return [self.rows.select(self._order[self._before[self.plan.share(positions, m, self.rank)]])
                for m in self._step]

    def _start_epoch(self, epoch: int) -> None:
        self.epoch, self.micro = epoch, 0
        self._order = self.plan.order(epoch)

    def skip_rest_of_epoch(self) -> None:
        self.micro = self.plan.micro_batches

    def epoch_progress(self) -> float:
        return self.epoch + self.micro / self.plan.micro_batches

    def position(self) -> dict:
        return {"epoch": self.epoch, "micro_batch": self.micro}

    def restore(self, position: dict) -> None:
        self._start_epoch(position["epoch"])
        self.micro = position["micro_batch"]


def predecessor_positions(plan: EpochPlan, n: int) -> np.ndarray:
    """[n] for each position of an epoch's order, the position before it within its optimizer step (the step's first
    takes its last); a step of one example (an epoch's last, alone) takes the example before it in the epoch, not
    itself; positions no step trains (dropped with drop_last) are their own."""
    per_global = plan.size * plan.processes
    before = np.arange(n)
    for step in range(plan.steps):
        micro = plan.step_micro_batches(step)
        first, end = micro.start * per_global, min(micro.stop * per_global, n)
        before[first:end] = first + (np.arange(first, end) - first - 1) % (end - first)
        if end - first == 1 and n > 1:
            before[first] = first - 1 if first > 0 else n - 1
    return before


class StreamBatches:
    """Micro-batches of an iterable dataset, read in order, epoch after epoch: position = stream rows consumed."""

    def __init__(self, dataset, preparation, *, micro_batch_size: int, num_processes: int,
                 accumulation: int, rank: int):
        self.dataset = dataset
        self.preparation = preparation
        self.size, self.processes, self.accumulation, self.rank = micro_batch_size, num_processes, accumulation, rank
        self.epoch = 0
        self._step_rows, self._step_shares, self._previous_rows = [], [], []
        self._reset(0)

    def _reset(self, epoch: int) -> None:
        self.epoch = epoch
        self._blocks = self._prepared_blocks()
        self._pending: TokenRows | None = None
        self._taken_in_epoch = 0

    def _prepared_blocks(self):
        block, index = [], 0
        for row in self.dataset:
            block.append(row)
            if len(block) == BLOCK:
                yield self._prepare(block, index)
                index += len(block)
                block = []
        if block:
            yield self._prepare(block, index)
        if index == 0 and not block:
            raise DataError(f"{self.preparation.name} is empty: it needs at least one row.")

    def _prepare(self, block: list[dict], index: int) -> TokenRows:
        rows, dropped = self.preparation.rows(self.preparation.sequences(block, index))
        if dropped and self.rank == 0:  # every process prepares the same blocks: said once
            logger.warning("%s: %d rows at %d-%d had no trained token within max_length and were dropped.",
                           self.preparation.name, dropped, index, index + len(block) - 1)
        return rows

    def _take(self, n: int) -> TokenRows:
        """The next n training rows of this epoch (fewer at its end)."""
        parts, have = [], 0
        while have < n:
            if self._pending is None or len(self._pending) == 0:
                self._pending = next(self._blocks, None)
                if self._pending is None:
                    break
                continue
            part = self._pending.select(np.arange(min(n - have, len(self._pending))))
            self._pending = self._pending.select(np.arange(len(part), len(self._pending)))
            parts.append(part)
            have += len(part)
        self._taken_in_epoch += have
        return self.preparation.concatenate(parts)

    def next_step(self) -> list[TokenRows]:
        per_global = self.size * self.processes
        self._previous_rows = self._step_rows  # a lone example's KL pair (step_predecessors)
        shares, self._step_rows, self._step_shares = [], [], []
        for _ in range(self.accumulation):
            rows = self._take(per_global)
            if len(rows) == 0:
                if shares:
                    break  # the epoch ended within this step: it takes fewer micro-batches
                if self._taken_in_epoch == 0:
                    raise DataError(f"{self.preparation.name} has no row left to train on after preparation.")
                self._reset(self.epoch + 1)
                rows = self._take(per_global)
            if len(rows) == per_global:
                mine = np.arange(self.rank * self.size, (self.rank + 1) * self.size)
            else:
                mine = np.array_split(np.arange(len(rows)), self.processes)[self.rank]
            shares.append(rows.select(mine))
            self._step_shares.append(mine + sum(len(r) for r in self._step_rows))
            self._step_rows.append(rows)
            if len(rows) < per_global:
                break  # the epoch's last micro-batch
        return shares

    def step_predecessors(self) -> list:
        """As MapBatches.step_predecessors: the rows before each of this process's examples in the step's order (a
        step of one example takes the previous step's last)."""
        rows = self.preparation.concatenate(self._step_rows)
        if len(rows) == 1 and self._previous_rows:
            previous = self.preparation.concatenate(self._previous_rows)
            return [previous.select(np.full(len(mine), len(previous) - 1)) for mine in self._step_shares]
        return [rows.select((mine - 1) % len(rows)) for mine in self._step_shares]

    def skip_rest_of_epoch(self) -> None:
        self._reset(self.epoch + 1)

    def epoch_progress(self) -> float:
        return float(self.epoch)

    def position(self) -> dict:
        return {"epoch": self.epoch, "stream_rows": self._taken_in_epoch}

    def restore(self, position: dict) -> None:
        self._reset(position["epoch"])
        self._take(position["stream_rows"])


def eval_batches(rows: TokenRows, micro_batch_size: int, num_processes: int, rank: int):
    """This process's share of each eval micro-batch, every row once, in order."""
    plan = EpochPlan(rows.lengths, micro_batch_size, num_processes=num_processes, accumulation=1, strategy="sequential")
    order = plan.order(0)
    for m in range(plan.micro_batches):
        yield rows.select(plan.share(order, m, rank))
