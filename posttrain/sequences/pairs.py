"""Preference pairs as token rows, and the pairs that cannot teach: what DPO's and the reward model's data share (and
the next pair trainer's).

A pair whose chosen and rejected sequences give the model the same tokens to predict (the same answer twice, both
empty, as given or once truncated) teaches nothing: every model gives both the same log-prob or score, so the
preference is empty (DPO's sigmoid loss and the reward model's are log 2 with no gradient). Such pairs are dropped and
counted (DroppedPairs), one warning a dataset (same_answers_warning), the same on every process; a dataset left with
none is one sentence naming every cause (nothing_left)."""

import hashlib
from dataclasses import dataclass

import numpy as np

from posttrain.data import DataError
from posttrain.sequences.rows import TokenRows


@dataclass
class PairRows:
    """Token pairs: `rows` has 2 rows per pair (chosen 2i, rejected 2i + 1); `index` [P] the dataset row of each
    pair; `ref` [P, 2] float64 reference log-probs (chosen, rejected) once precomputed (DPO), else None; `margin` [P]
    float64 each pair's margin column (the reward model's), else None."""

    rows: TokenRows
    index: np.ndarray
    ref: np.ndarray | None = None
    margin: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.index)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of each pair (chosen + rejected sequence)."""
        return self.rows.lengths.reshape(-1, 2).sum(1)

    def select(self, pairs) -> "PairRows":
        pairs = np.asarray(pairs, dtype=np.int64)
        rows = np.stack([2 * pairs, 2 * pairs + 1], 1).reshape(-1)
        return PairRows(self.rows.select(rows), self.index[pairs], None if self.ref is None else self.ref[pairs],
                        None if self.margin is None else self.margin[pairs])

    @classmethod
    def concatenate(cls, parts: list["PairRows"]) -> "PairRows":
        if not parts:
            return cls(TokenRows.from_sequences([]), np.zeros(0, np.int64))

        def joined(values):
            return None if any(v is None for v in values) else np.concatenate(values)

        return cls(TokenRows.concatenate([p.rows for p in parts]), np.concatenate([p.index for p in parts]),
                   joined([p.ref for p in parts]), joined([p.margin for p in parts]))

    def fingerprint(self) -> str:
        h = hashlib.sha256(self.rows.fingerprint().encode())
        h.update(np.ascontiguousarray(self.index).tobytes())
        if self.margin is not None:
            h.update(np.ascontiguousarray(self.margin).tobytes())
        return h.hexdigest()[:16]


@dataclass
class DroppedPairs:
    """Pairs left out because they cannot teach, by cause (counts)."""

    prompt_fills: int = 0  # keep_start: the prompt alone fills max_length, no completion token is left (DPO)
    identical: int = 0  # chosen and rejected give the same tokens to predict, as given
    identical_truncated: int = 0  # ... only once truncated to max_length
    too_long: int = 0  # a chosen or rejected sequence longer than max_length (the reward model's, as TRL filters)

    def __add__(self, other: "DroppedPairs") -> "DroppedPairs":
        return DroppedPairs(self.prompt_fills + other.prompt_fills, self.identical + other.identical,
                            self.identical_truncated + other.identical_truncated, self.too_long + other.too_long)

    @property
    def same_answers(self) -> int:
        return self.identical + self.identical_truncated


def _predicted(rows: TokenRows, targets: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray]:
    """Row r's tokens and target mask up to its last target: all that its log-prob depends on (causal attention)."""
    span = rows.row(r)
    mask = targets[span]
    n = int(np.flatnonzero(mask)[-1]) + 1 if mask.any() else 0
    return rows.tokens[span][:n], mask[:n]


def same_answers(rows: TokenRows) -> np.ndarray:
    """[P] bool: pair p's chosen (row 2p) and rejected (row 2p + 1) give the model the same tokens to predict after
    the same tokens, so every model gives both the same log-prob (two sequences without a target included)."""
    targets = rows.labels & ~rows.starts
    same = np.zeros(len(rows) // 2, dtype=bool)
    for p in range(len(same)):
        (chosen, chosen_mask), (rejected, rejected_mask) = (_predicted(rows, targets, r) for r in (2 * p, 2 * p + 1))
        same[p] = np.array_equal(chosen_mask, rejected_mask) and np.array_equal(chosen, rejected)
    return same


def same_answers_warning(name: str, dropped: DroppedPairs, of: str, max_length: int | None,
                         same: str = "log-prob") -> str:
    """The one warning about pairs dropped for giving the same answer twice (`of`: "of 16 pairs", "at rows 0-999";
    `same`: what every model gives both, a log-prob or a score)."""
    truncated = f"once truncated to max_length={max_length}"
    how = ("" if not dropped.identical_truncated else f" ({truncated})" if not dropped.identical else
           f" ({dropped.identical} as given, {dropped.identical_truncated} only {truncated})")
    fix = (" (raise max_length for those that differ beyond it)" if dropped.identical_truncated else "")
    return (f"{name}: dropped {dropped.same_answers} pairs {of} whose chosen and rejected are the same tokens{how}, "
            f"which teach nothing (every model gives both the same {same}); remove them from the dataset{fix}.")


def nothing_left(name: str, dropped: DroppedPairs, pairs: int, max_length: int | None) -> DataError:
    """The one sentence for a dataset of `pairs` pairs none of which can teach, by the causes `dropped` counts."""
    if not dropped.same_answers and dropped.prompt_fills == pairs:
        return DataError(f"{name} has no pair left: every prompt alone fills max_length={max_length}, leaving no "
                         "completion token; raise max_length or shorten the prompts.")
    if not dropped.same_answers and dropped.too_long == pairs:
        return DataError(f"{name} has no pair left: every one of its {pairs} pairs has a chosen or rejected sequence "
                         f"longer than max_length={max_length}; raise max_length (or set it to None).")
    causes = [f"{n} {what}" for n, what in (
        (dropped.prompt_fills, f"prompts alone fill max_length={max_length}"),
        (dropped.too_long, f"have a chosen or rejected sequence longer than max_length={max_length}"),
        (dropped.identical, "have the same chosen and rejected tokens"),
        (dropped.identical_truncated, f"have the same chosen and rejected tokens once truncated to max_length="
                                      f"{max_length}")) if n]
    return DataError(f"{name} has no pair left that can teach: of its {pairs} pairs, {' and '.join(causes)}; give "
                     "pairs whose chosen and rejected answers differ within max_length.")
