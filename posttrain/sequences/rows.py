"""Token rows: tokenized sequences truncated or packed into the rows a micro-batch is made of, and the order rows are
trained in.

Storage is flat (numpy), so a dataset of millions of sequences costs a few bytes per token:

    tokens  int32 [N]   every row's token ids, row after row
    labels  bool  [N]   the token is trained on (predicted from the token before it)
    starts  bool  [N]   the token starts a sequence: positions restart at 0 there, attention never crosses it, and it
                        is never a target (nothing before it in its sequence predicts it)
    offsets int64 [R+1] row r is tokens[offsets[r]:offsets[r + 1]]

Unpacked, a row is one sequence (truncated to max_length). Packed, a row of at most max_length tokens holds several:
    bfd        best-fit decreasing; a sequence longer than max_length is truncated first
    bfd_split  best-fit decreasing; a longer sequence is split into pieces of at most max_length, each its own sequence
    wrapped    the sequences end to end, cut every max_length tokens; a cut starts a new sequence
A sequence (or piece) with no target left is dropped, and counted; so is what a cut removes (truncation_cut).

Rows may carry each row's extra forward inputs (`model_inputs`, posttrain/model_inputs.py: a vision-language model's
pixel values): selected, concatenated and truncated with their rows; packing and splitting them are refused.
"""

import bisect
import hashlib
from collections import deque
from dataclasses import dataclass

import numpy as np

from posttrain.model_inputs import ModelInputs, refuse


@dataclass
class TokenRows:
    tokens: np.ndarray
    labels: np.ndarray
    starts: np.ndarray
    offsets: np.ndarray
    model_inputs: ModelInputs | None = None  # one entry per row, or None for text-only rows

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def target_counts(self) -> np.ndarray:
        """Targets per row: labelled tokens that do not start a sequence."""
        targets = (self.labels & ~self.starts).astype(np.int64)
        return _row_sums(targets, self.offsets)

    def one_sequence_per_row(self) -> "TokenRows":
        """These rows cut at every sequence start, so that each row holds one sequence (itself when they do)."""
        first = np.flatnonzero(self.starts)
        if np.isin(first, self.offsets[:-1]).all():  # no row holds a second sequence
            return self
        if self.model_inputs is not None:
            refuse("packing")
        edges = np.union1d(first, self.offsets).astype(np.int64)
        return TokenRows(self.tokens, self.labels, self.starts, edges)

    def row(self, r: int) -> slice:
        return slice(int(self.offsets[r]), int(self.offsets[r + 1]))

    def fingerprint(self) -> str:
        """SHA-256 of the rows (tokens, labels, boundaries): what a resumed run checks its data against."""
        h = hashlib.sha256()
        for array in (self.tokens, self.labels, self.starts, self.offsets):
            h.update(np.ascontiguousarray(array).tobytes())
        if self.model_inputs is not None:
            h.update(self.model_inputs.fingerprint_bytes())
        return h.hexdigest()[:16]

    @classmethod
    def from_sequences(cls, sequences: list[tuple[np.ndarray, np.ndarray]],
                       model_inputs: ModelInputs | None = None) -> "TokenRows":
        """One row per (ids, label mask) sequence; `model_inputs`, one entry per sequence, or None."""
        lengths = np.array([len(ids) for ids, _ in sequences], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens = np.concatenate([ids for ids, _ in sequences]) if sequences else np.zeros(0, np.int32)
        labels = np.concatenate([m for _, m in sequences]) if sequences else np.zeros(0, bool)
        starts = np.zeros(len(tokens), dtype=bool)
        starts[offsets[:-1][lengths > 0]] = True
        return cls(tokens.astype(np.int32), labels.astype(bool), starts, offsets, model_inputs)

    @classmethod
    def concatenate(cls, parts: list["TokenRows"]) -> "TokenRows":
        if not parts:
            return cls.from_sequences([])
        sizes = np.cumsum([0] + [len(p.tokens) for p in parts[:-1]])
        offsets = np.concatenate([[0]] + [p.offsets[1:] + s for p, s in zip(parts, sizes)])
        return cls(np.concatenate([p.tokens for p in parts]), np.concatenate([p.labels for p in parts]),
                   np.concatenate([p.starts for p in parts]), offsets.astype(np.int64),
                   ModelInputs.concatenate([p.model_inputs for p in parts], [len(p) for p in parts]))

    def select(self, rows: np.ndarray) -> "TokenRows":
        """The rows `rows`, in that order."""
        rows = np.asarray(rows, dtype=np.int64)
        lengths = self.lengths[rows]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        index = _gather_index(self.offsets[rows], lengths)
        inputs = None if self.model_inputs is None else self.model_inputs.select(rows.tolist())
        return TokenRows(self.tokens[index], self.labels[index], self.starts[index], offsets, inputs)


def _row_sums(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Sum of values over each row [offsets[r], offsets[r+1]); empty rows give 0."""
    cumulative = np.concatenate([[0], np.cumsum(values)])
    return cumulative[offsets[1:]] - cumulative[offsets[:-1]]


def _gather_index(sources: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Flat indices of the spans [sources[i], sources[i] + lengths[i]), one after the other."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    out_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return np.arange(total, dtype=np.int64) + np.repeat(sources - out_starts, lengths)


def truncate(rows: TokenRows, max_length: int | None, keep: str = "keep_start") -> TokenRows:
    """Every row cut to at most max_length tokens (its first ones, or with keep_end its last; a row cut at its start
    then begins there)."""
    if max_length is None or len(rows) == 0 or rows.lengths.max() <= max_length:
        return rows
    lengths = np.minimum(rows.lengths, max_length)
    sources = rows.offsets[:-1] if keep == "keep_start" else rows.offsets[1:] - lengths
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    index = _gather_index(sources, lengths)
    starts = rows.starts[index].copy()
    starts[offsets[:-1][lengths > 0]] = True
    return TokenRows(rows.tokens[index], rows.labels[index], starts, offsets, rows.model_inputs)


def split_long(rows: TokenRows, max_length: int) -> TokenRows:
    """Rows longer than max_length cut into pieces of max_length (the last one shorter), each its own sequence."""
    if len(rows) == 0 or rows.lengths.max() <= max_length:
        return rows
    if rows.model_inputs is not None:
        refuse("split")
    lengths = rows.lengths
    pieces = -(-lengths // max_length)
    piece_row = np.repeat(np.arange(len(rows)), pieces)
    first_piece = np.concatenate([[0], np.cumsum(pieces)[:-1]])
    within = np.arange(int(pieces.sum())) - np.repeat(first_piece, pieces)
    piece_lengths = np.minimum(max_length, lengths[piece_row] - within * max_length)
    offsets = np.concatenate([rows.offsets[:-1][piece_row] + within * max_length,
                              [rows.offsets[-1]]]).astype(np.int64)
    # the pieces tile the rows in order, so the flat arrays stay as they are
    starts = rows.starts.copy()
    starts[offsets[:-1][piece_lengths > 0]] = True
    return TokenRows(rows.tokens, rows.labels, starts, offsets)


def drop_untrained(rows: TokenRows) -> tuple[TokenRows, int]:
    """Rows without a target removed; (the rest, how many were removed)."""
    keep = np.nonzero(rows.target_counts > 0)[0]
    if len(keep) == len(rows):
        return rows, 0
    return rows.select(keep), len(rows) - len(keep)


def best_fit_bins(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Best-fit decreasing: items, longest first, each into the open bin it fills best (a new one if none fits).
    Returns the bins in the order they were opened, each a list of item indices. Every length must be <= capacity."""
    order = np.argsort(-lengths, kind="stable")
    spaces: list[int] = []  # distinct free spaces that some open bin has, sorted
    bins_with_space: dict[int, deque] = {}  # free space -> bins that have it, oldest first
    bins: list[list[int]] = []
    for item in order:
        length = int(lengths[item])
        at = bisect.bisect_left(spaces, length)
        if at < len(spaces):
            space = spaces[at]
            b = bins_with_space[space].popleft()
            if not bins_with_space[space]:
                del bins_with_space[space]
                spaces.pop(at)
        else:
            space, b = capacity, len(bins)
            bins.append([])
        bins[b].append(int(item))
        left = space - length
        if left > 0:
            if left not in bins_with_space:
                bins_with_space[left] = deque()
                bisect.insort(spaces, left)
            bins_with_space[left].append(b)
    return bins


def pack(rows: TokenRows, max_length: int, strategy: str) -> TokenRows:
    """Rows packed into rows of at most max_length tokens (see the module docstring)."""
    if len(rows) == 0:
        return rows
    if rows.model_inputs is not None:
        refuse("packing")
    if strategy == "wrapped":
        return _wrap(rows, max_length)
    bins = best_fit_bins(rows.lengths, max_length)
    packed = rows.select(np.array([i for b in bins for i in b], dtype=np.int64))
    sizes = np.array([len(b) for b in bins])
    bin_edges = np.concatenate([[0], np.cumsum(sizes)])
    return TokenRows(packed.tokens, packed.labels, packed.starts, packed.offsets[bin_edges])


def _wrap(rows: TokenRows, max_length: int) -> TokenRows:
    total = len(rows.tokens)
    offsets = np.concatenate([np.arange(0, total, max_length), [total]]).astype(np.int64)
    starts = rows.starts.copy()
    starts[offsets[:-1]] = True
    return TokenRows(rows.tokens, rows.labels, starts, offsets)


def truncates(packing: bool, strategy: str) -> bool:
    """Whether preparation cuts what lies beyond max_length off a longer sequence (unpacked rows, and bfd packing),
    rather than keeping it (bfd_split splits it into pieces, wrapped continues it in the next row)."""
    return not packing or strategy == "bfd"


def truncation_cut(lengths: np.ndarray, max_length: int | None) -> tuple[int, int]:
    """(how many sequences of `lengths` [N] are longer than max_length, how many tokens cutting them to it removes)."""
    if max_length is None:
        return 0, 0
    over = lengths[lengths > max_length] - max_length
    return len(over), int(over.sum())


def prepare(rows: TokenRows, max_length: int | None, truncation_mode: str, packing: bool,
            strategy: str) -> tuple[TokenRows, int]:
    """Sequences (one per row) -> training rows: truncated, or packed. Returns (rows, how many were dropped for having
    no target: sequences, or with bfd_split the pieces of split sequences, or with wrapped packed rows whose
    sequences' targets all fell in a neighbouring row)."""
    if truncates(packing, strategy):
        rows, dropped = drop_untrained(truncate(rows, max_length, truncation_mode))
        return (pack(rows, max_length, strategy), dropped) if packing else (rows, dropped)
    if strategy == "bfd_split":
        rows, dropped = drop_untrained(split_long(rows, max_length))
        return pack(rows, max_length, strategy), dropped
    rows, dropped = drop_untrained(rows)
    packed, empty = drop_untrained(pack(rows, max_length, strategy))
    return packed, dropped + empty


class EpochPlan:
    """Which rows each process trains on, micro-batch by micro-batch, epoch after epoch.

    An epoch's order is a permutation of the rows (train_sampling_strategy): random (seeded by seed and epoch),
    sequential, or group_by_length. Consecutive micro_batch_size * num_processes rows form a global micro-batch;
    process p takes its p-th share. An optimizer step takes gradient_accumulation_steps micro-batches, never crossing
    an epoch's end (the last step of an epoch may take fewer, as in transformers).
    """

    def __init__(self, lengths: np.ndarray, micro_batch_size: int, *, num_processes: int, accumulation: int,
                 strategy: str = "random", seed: int = 0, drop_last: bool = False):
        self.lengths = lengths
        self.size = micro_batch_size
        self.processes = num_processes
        self.accumulation = accumulation
        self.strategy = strategy
        self.seed = seed
        per_global = micro_batch_size * num_processes
        n = len(lengths)
        self.micro_batches = n // per_global if drop_last else -(-n // per_global)
        self.steps = -(-self.micro_batches // accumulation)

    def order(self, epoch: int) -> np.ndarray:
        n = len(self.lengths)
        if self.strategy == "sequential":
            return np.arange(n)
        order = np.random.default_rng([self.seed, epoch]).permutation(n)
        if self.strategy == "group_by_length":
            mega = self.size * self.processes * 50
            groups = [order[i:i + mega] for i in range(0, n, mega)]
            order = np.concatenate([g[np.argsort(-self.lengths[g], kind="stable")] for g in groups])
        return order

    def step_micro_batches(self, step_in_epoch: int) -> range:
        """Indices (within the epoch) of the micro-batches of one optimizer step."""
        first = step_in_epoch * self.accumulation
        return range(first, min(first + self.accumulation, self.micro_batches))

    def share(self, order: np.ndarray, micro_batch: int, rank: int) -> np.ndarray:
        """The rows process `rank` trains on in micro-batch `micro_batch` of an epoch with this order (possibly
        fewer than micro_batch_size at the end of an epoch, or none)."""
        per_global = self.size * self.processes
        rows = order[micro_batch * per_global:(micro_batch + 1) * per_global]
        if len(rows) == per_global:
            return rows[rank * self.size:(rank + 1) * self.size]
        return np.array_split(rows, self.processes)[rank]
