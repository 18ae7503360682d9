"""Preference pairs as token rows: what DPO's and the reward model's data share."""

import hashlib
from dataclasses import dataclass

import numpy as np

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
