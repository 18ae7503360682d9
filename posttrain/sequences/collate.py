"""Token rows -> the tensors of one forward pass.

Padded: each sequence its own row (a row that holds several, as packed rows do, is cut at their starts), right-padded
to the longest (rounded up to pad_to_multiple_of), with an attention mask. Padding-free: the micro-batch's rows end to
end as one row [1, T], no attention mask, position ids restarting at every sequence start, and the sequences'
Boundaries (TRL's cu_seq_lens / max_length / seq_idx) for the kernels that read them; padding (pad_to_multiple_of)
is one more sequence at the end, never trained on. Padding-free only for a model that keeps a packed row's sequences
apart (models/packed_layouts.py packs_one_row): the trainer decides, and collates padded otherwise.

Targets are shifted once, here: position t predicts token t + 1, which is a target when it is labelled and does not
start a sequence (so no target is predicted across a boundary).

Rows with model_inputs (posttrain/model_inputs.py) collate padded, their inputs batched for the forward
(SequenceBatch.model_inputs); the padding-free layout cannot carry them and is refused.
"""

from dataclasses import dataclass

import numpy as np
import torch

from posttrain.model_inputs import refuse
from posttrain.models.packed_layouts import Boundaries
from posttrain.sequences.rows import TokenRows


@dataclass
class SequenceBatch:
    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor | None  # [B, T], or None (padding-free)
    position_ids: torch.Tensor | None  # [1, T] padding-free, else None
    source_mask: torch.Tensor  # [B, T] bool: the next token is a target
    targets: torch.Tensor  # [M] target ids, row-major over source_mask
    tokens: int  # real (non-padding) tokens
    label_mask: torch.Tensor | None = None  # [B, T] bool: the token is trained on (TRL's labels != -100)
    boundaries: Boundaries | None = None  # padding-free: the row's sequences; padded: None
    model_inputs: dict | None = None  # {name: tensor} the rows' extra forward inputs, batched; None: text only

    @property
    def num_targets(self) -> int:
        return int(self.targets.numel())

    def to(self, device) -> "SequenceBatch":
        move = (lambda t: t.to(device, non_blocking=True) if t is not None else None)
        return SequenceBatch(move(self.input_ids), move(self.attention_mask), move(self.position_ids),
                             move(self.source_mask), move(self.targets), self.tokens, move(self.label_mask),
                             self.boundaries.to(device) if self.boundaries is not None else None,
                             None if self.model_inputs is None else {k: move(v) for k, v in self.model_inputs.items()})


def _round_up(n: int, multiple: int | None) -> int:
    return n if not multiple else -(-n // multiple) * multiple


def _source_mask(labels: np.ndarray, starts: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """[B, T] labels/starts/valid of the tokens -> [B, T] True where the next token is a target."""
    source = np.zeros_like(labels)
    source[:, :-1] = labels[:, 1:] & ~starts[:, 1:] & valid[:, 1:]
    return source


def collate(rows: TokenRows, pad_id: int, padding_free: bool, pad_to_multiple_of: int | None) -> SequenceBatch:
    """The forward-pass tensors of `rows` (a micro-batch's TokenRows). An empty micro-batch gives one padding token
    with no target, so a process with no rows left still runs a forward and backward in step with the others."""
    if len(rows) == 0 or len(rows.tokens) == 0:
        ids = torch.full((1, 1), pad_id, dtype=torch.long)
        empty = torch.zeros((1, 1), dtype=torch.bool)
        return SequenceBatch(ids, torch.ones_like(ids), None, empty, torch.zeros(0, dtype=torch.long), 0, empty)
    if padding_free:
        if rows.model_inputs is not None:
            refuse("padding_free")
        return _flat(rows, pad_id, pad_to_multiple_of)
    rows = rows.one_sequence_per_row()
    lengths = rows.lengths
    width = _round_up(int(lengths.max()), pad_to_multiple_of)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    labels = np.zeros((len(rows), width), dtype=bool)
    starts = np.zeros((len(rows), width), dtype=bool)
    valid = np.arange(width)[None, :] < lengths[:, None]
    ids[valid], labels[valid], starts[valid] = rows.tokens, rows.labels, rows.starts
    source = _source_mask(labels, starts, valid)
    targets = ids[:, 1:][source[:, :-1]]
    ids = torch.from_numpy(ids)
    inputs = None if rows.model_inputs is None else rows.model_inputs.batched(input_ids=ids)
    return SequenceBatch(ids, torch.from_numpy(valid.astype(np.int64)), None,
                         torch.from_numpy(source), torch.from_numpy(targets), int(lengths.sum()), torch.from_numpy(labels),
                         model_inputs=inputs)


def _flat(rows: TokenRows, pad_id: int, pad_to_multiple_of: int | None) -> SequenceBatch:
    total = len(rows.tokens)
    width = _round_up(total, pad_to_multiple_of)
    ids = np.full(width, pad_id, dtype=np.int64)
    labels = np.zeros(width, dtype=bool)
    starts = np.zeros(width, dtype=bool)
    ids[:total], labels[:total], starts[:total] = rows.tokens, rows.labels, rows.starts
    starts[rows.offsets[:-1]] = True  # a row's first token starts a sequence
    if width > total:
        starts[total] = True  # the padding is a sequence of its own
    # positions restart at 0 at each start: index minus the index of the latest start
    index = np.arange(width)
    positions = index - np.maximum.accumulate(np.where(starts, index, 0))
    source = _source_mask(labels[None], starts[None], np.ones((1, width), dtype=bool))
    targets = ids[1:][source[0, :-1]]
    return SequenceBatch(torch.from_numpy(ids[None]), None, torch.from_numpy(positions[None]),
                         torch.from_numpy(source), torch.from_numpy(targets), total, torch.from_numpy(labels[None]),
                         Boundaries.of_starts(starts))
