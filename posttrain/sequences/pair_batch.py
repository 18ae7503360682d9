"""A micro-batch of pairs -> the tensors of one forward pass, and where each target belongs.

The pairs' 2P sequences (chosen 2i, rejected 2i + 1) are collated as SFT collates rows (sequences/collate.py): padded, one
sequence per row with an attention mask, or padding-free, all of them end to end in one row with position ids that
restart per sequence. Either way the targets come out sequence after sequence, so each target's sequence and its
position within that sequence's completion follow from the per-sequence counts:

    target_seq  [M]   sequence of each target (0 .. 2P-1)
    target_pos  [M]   1-based position of the target within its completion (LD-DPO's shared length counts these)
    targets     [2P]  targets per sequence (completion tokens after the first position: TRL's shifted mask)
    completion  [2P]  completion tokens per sequence (TRL's unshifted completion mask: ipo, sigmoid_norm)

Padded, where each pair's prompt is long enough for running it once to pay (`min_shared` positions saved), the batch
also carries the pairs laid out with their common prefix once (sequences/prefixes.py, until="targets"): the same
targets in the same order, which models/logprobs.py `next_token_logprobs` runs as a row per pair or as two forwards.
"""

from dataclasses import dataclass

import numpy as np
import torch

from posttrain.sequences.pairs import PairRows
from posttrain.sequences.collate import SequenceBatch, collate
from posttrain.sequences.prefixes import PrefixBatch, prefix_batch


@dataclass
class PairBatch:
    sequences: SequenceBatch
    target_seq: torch.Tensor  # [M] long
    target_pos: torch.Tensor  # [M] long
    targets: torch.Tensor  # [2P] long
    completion: torch.Tensor  # [2P] long
    ref: torch.Tensor | None  # [P, 2] float32 precomputed reference log-probs (chosen, rejected)
    prefixes: PrefixBatch | None = None  # the same pairs with each common prefix once, where that pays

    @property
    def pairs(self) -> int:
        return self.targets.numel() // 2

    def to(self, device) -> "PairBatch":
        move = (lambda t: t.to(device, non_blocking=True) if t is not None else None)
        return PairBatch(self.sequences.to(device), move(self.target_seq), move(self.target_pos), move(self.targets),
                         move(self.completion), move(self.ref), move(self.prefixes))


def collate_pairs(pairs: PairRows, pad_id: int, padding_free: bool, pad_to_multiple_of: int | None,
                  min_shared: int | None = None) -> PairBatch:
    """The forward-pass tensors of a micro-batch of pairs (none: one padding token, no target, no pair); with
    `min_shared` (padded rows only) also its shared-prefix layout, where that saves at least that many positions."""
    rows = pairs.rows
    sequences = collate(rows, pad_id, padding_free, pad_to_multiple_of)
    prefixes = prefix_batch(rows, pad_id, sequences.input_ids.size(1), min_shared, until="targets") \
        if min_shared is not None and not padding_free else None
    counts = rows.target_counts.astype(np.int64)  # [2P]
    completion = np.add.reduceat(rows.labels.astype(np.int64), rows.offsets[:-1]) if len(rows.tokens) else counts
    target_seq = np.repeat(np.arange(len(counts)), counts)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]) if len(counts) else counts
    target_pos = np.arange(len(target_seq)) - np.repeat(first, counts) + 1
    ref = torch.from_numpy(pairs.ref).float() if pairs.ref is not None else None
    return PairBatch(sequences, torch.from_numpy(target_seq), torch.from_numpy(target_pos), torch.from_numpy(counts),
                     torch.from_numpy(completion.astype(np.int64)), ref, prefixes)
