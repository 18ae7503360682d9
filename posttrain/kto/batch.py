"""A micro-batch of unpaired examples -> the tensors of its forward passes, and where each target belongs.

    examples      N examples, each prompt + completion cut to max_length (keep_start, as TRL's collator cuts them)
    kl            with the KL reference point: each example's prompt with its partner's completion (the example before it
                  in the optimizer step's order: sequences/batches.py step_predecessors), cut to max_length the same
                  way; else None
    target_seq    [M] example of each target (0 .. N-1); kl_target_seq the same for the KL rows
    desirable     [N] bool
    ref           [N, 2] float32 precomputed reference log-probs (completion, KL pair), else None

Both are collated as SFT collates rows (sequences/collate.py), right-padded with an attention mask. A target is a
completion token after the sequence's first (TRL's shifted completion mask).
"""

from dataclasses import dataclass, replace

import numpy as np
import torch

from posttrain.kto.data import UnpairedRows, kl_rows
from posttrain.sequences.collate import SequenceBatch, collate
from posttrain.sequences.rows import TokenRows, truncate


@dataclass
class KTOBatch:
    examples: SequenceBatch
    target_seq: torch.Tensor  # [M] long
    desirable: torch.Tensor  # [N] bool
    kl: SequenceBatch | None
    kl_target_seq: torch.Tensor | None  # [M_kl] long
    ref: torch.Tensor | None  # [N, 2] float32

    @property
    def size(self) -> int:
        return int(self.desirable.numel())

    def to(self, device) -> "KTOBatch":
        move = (lambda t: t.to(device, non_blocking=True) if t is not None else None)
        return KTOBatch(self.examples.to(device), move(self.target_seq), move(self.desirable),
                        None if self.kl is None else self.kl.to(device), move(self.kl_target_seq), move(self.ref))


def _target_seq(rows: TokenRows) -> torch.Tensor:
    counts = rows.target_counts.astype(np.int64)
    return torch.from_numpy(np.repeat(np.arange(len(counts)), counts))


def collate_examples(examples: UnpairedRows, pad_id: int, max_length: int | None, pad_to_multiple_of: int | None,
                     partners: UnpairedRows | None = None) -> KTOBatch:
    """The forward-pass tensors of a micro-batch of examples (none: one padding token, no target), with the KL rows
    of each example's prompt and its partner's completion when `partners` are given."""
    if examples.rows.model_inputs is not None:  # an example's pixels made once, for its row and its KL row
        examples = replace(examples, rows=replace(examples.rows, model_inputs=examples.rows.model_inputs.resolved()))
    rows = truncate(examples.rows, max_length)
    sequences = collate(rows, pad_id, False, pad_to_multiple_of)
    kl, kl_seq = None, None
    if partners is not None:
        mismatched = truncate(kl_rows(examples, partners), max_length)
        kl, kl_seq = collate(mismatched, pad_id, False, pad_to_multiple_of), _target_seq(mismatched)
    ref = torch.from_numpy(examples.ref).float() if examples.ref is not None else None
    return KTOBatch(sequences, _target_seq(rows), torch.from_numpy(examples.desirable.astype(bool)), kl, kl_seq, ref)
