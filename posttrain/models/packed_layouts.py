"""Packed rows: which layouts of several sequences a model keeps apart, decided once per model by a check, and the
sequence boundaries that some kernels read.

A packed row holds several sequences end to end, told apart by position ids restarting at 0, with no attention mask.
Whether each sequence then gets exactly what it would get alone depends on the model's layers and kernels:
    sdpa, eager, flex    transformers' masks find each row's sequences from its position ids: several rows work
    flash attention      reads position ids only when the batch is one row (else each row is one causal sequence);
                         given `cu_seq_lens_q/k` and `max_length_q/k` it keeps the sequences of the batch apart
    recurrent and        Gated DeltaNet (Qwen3.5, Qwen3-Next), Mamba-2 (Granite 4, Bamba, Nemotron-H), short
    convolutional layers convolutions (LFM2) carry state along the row; their kernels (flash-linear-attention,
                         mamba-ssm, causal-conv1d) restart it at `cu_seq_lens_q` / `seq_idx`, while transformers'
                         reference PyTorch versions ignore the boundaries or refuse them
So two layouts are checked, once per model, each against the same sequences run as a padded batch (right padding
with an attention mask: what every sequence gets alone):
    rows      several rows [B', W], position ids only (GRPO's rollouts in first-fit bins, models/packing.py)
    one_row   one row [1, T], position ids and TRL's boundary keywords (`Boundaries`, passed where the forward takes
              them: models/keywords.py) (GRPO's rollouts when rows fail; SFT, DPO and reward padding-free rows)
The check packs four sequences, two into each of two rows (and the same four into one row), so that a kernel that
reads boundaries from one row only fails it. A model that keeps neither layout apart runs padded rows (one sequence
each, an attention mask), said once in a warning naming the model class and why.
"""

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from posttrain.models import fast_paths
from posttrain.models.forwards import (agree_within_rounding, in_eval_mode, output_layer, sequence_kwargs,
                                       whole_in_model_forward)
from posttrain.models.keywords import missing_from_forward, unwrap
from posttrain.models.loading import CHECK_ERRORS, fallback_said, raised

logger = logging.getLogger("posttrain")

CHECK_LENGTHS = (3, 5, 4, 2)  # the check's sequences: the first two share a row, the last two the other
# what a model that keeps neither layout apart loses, and one that keeps several rows but not one row apart
PADDED_ROWS = "its packed and padding-free passes run padded rows, one sequence each"
PADDED_ONE_ROW = ("its padding-free rows (SFT packing and padding_free, DPO's and the reward trainer's padding_free) "
                  "run padded, one sequence each")


@dataclass
class Boundaries:
    """The sequences of one packed row [1, T], as TRL 1.16's padding-free collator passes them."""
    cu_seq_lens: torch.Tensor  # [S + 1] int32: 0, then where each sequence ends
    max_length: int  # the longest sequence
    seq_idx: torch.Tensor  # [1, T] int32: each token's sequence

    @classmethod
    def of_lengths(cls, lengths: Sequence[int], device=None) -> "Boundaries":
        """The boundaries of sequences of these lengths laid end to end (built on the CPU, then moved: no device
        synchronisation)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        seq_idx = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)[None]
        return cls(torch.from_numpy(cu), int(lengths.max()), torch.from_numpy(seq_idx)).to(device)

    @classmethod
    def of_starts(cls, starts: np.ndarray) -> "Boundaries":
        """The boundaries of a row whose [T] bool `starts` mark each sequence's first token (starts[0] True)."""
        first = np.flatnonzero(starts)
        return cls.of_lengths(np.diff(np.append(first, len(starts))))

    def to(self, device) -> "Boundaries":
        if device is None:
            return self
        return Boundaries(self.cu_seq_lens.to(device, non_blocking=True), self.max_length,
                          self.seq_idx.to(device, non_blocking=True))

    def keywords(self) -> dict:
        """The forward keywords, under TRL's names (models/keywords.py BOUNDARY_NAMES)."""
        return {"cu_seq_lens_q": self.cu_seq_lens, "cu_seq_lens_k": self.cu_seq_lens,
                "max_length_q": self.max_length, "max_length_k": self.max_length, "seq_idx": self.seq_idx}


@dataclass(frozen=True)
class Layouts:
    """The packed layouts a model keeps apart."""
    rows: bool  # several rows [B', W], position ids restarting at 0, no mask, no boundaries
    one_row: bool  # one row [1, T], position ids restarting at 0 and the Boundaries, no mask


PADDED_ONLY = Layouts(rows=False, one_row=False)


def packed_layouts(model) -> Layouts:
    """The layouts in which `model` gives every packed sequence what it gets alone; decided once per model object
    and cached (the check's forwards go through the model as given where its weights are gathered only there, so
    every process training it must reach the first call together, as at a step's first forward). A model whose
    fast paths are off (`fast_paths: false`) packs nothing."""
    return fast_paths.decided(model, "packed_layouts", lambda: _decide(model), off=PADDED_ONLY)


def packs_one_row(model) -> bool:
    """Whether `model` keeps the sequences of one packed row [1, T] apart, given their Boundaries."""
    return packed_layouts(model).one_row


def _decide(model) -> Layouts:
    plain = unwrap(model)
    layer = output_layer(plain)
    # FSDP1 gathers the weights only around its root wrapper's forward, FSDP2 around its units' (the root a PEFT
    # model's, when it wraps one): the check goes through the model as given there
    runner = model if layer is not None and whole_in_model_forward(layer) else plain
    missing = missing_from_forward(plain, ("position_ids",))
    if missing:
        layouts, why = PADDED_ONLY, missing
    else:
        layouts, why = _check(runner, plain)
    if not layouts.one_row:
        fallback_said(plain, PADDED_ONE_ROW if layouts.rows else PADDED_ROWS, why)
    elif not layouts.rows:
        logger.info("%s: packed rollouts run as one row with their sequence boundaries, because %s.",
                    type(plain).__name__, why)
    return layouts


def _check(runner, plain) -> tuple[Layouts, str]:
    """(the layouts that agree with the padded batch, why the others do not) for the CHECK_LENGTHS sequences: padded
    [4, 5]; two rows [2, 8] (3 + 5, 4 + 2 and a 2-token tail); one row [1, 14] with its Boundaries. In the model's
    own precision (the check is about which tokens each position sees, not about an autocast around the call),
    within agree_within_rounding's tolerance."""
    device = next(plain.parameters()).device
    vocab = plain.get_input_embeddings().num_embeddings
    sequences = [(torch.arange(n, device=device) * 7919 + 101 * k + 3) % vocab for k, n in enumerate(CHECK_LENGTHS)]
    width = max(CHECK_LENGTHS)
    padded = torch.zeros((len(sequences), width), dtype=torch.long, device=device)
    mask = torch.zeros_like(padded)
    for i, ids in enumerate(sequences):
        padded[i, :len(ids)], mask[i, :len(ids)] = ids, 1
    with in_eval_mode(plain), torch.no_grad(), torch.autocast(device.type, enabled=False):
        try:
            apart = _hidden(runner, plain, padded, torch.arange(width, device=device).expand_as(padded), mask)
        except CHECK_ERRORS as err:
            return PADDED_ONLY, f"its one-time check raised {raised(err)} on a padded batch"
        alone = torch.cat([apart[i, :len(ids)] for i, ids in enumerate(sequences)])
        rows_differ = _differs(runner, plain, _two_rows(sequences), alone)
        one_row_differs = _differs(runner, plain, _one_row(sequences), alone)
    layouts = Layouts(rows=rows_differ is None, one_row=one_row_differs is None)
    if not layouts.one_row:
        return layouts, f"sequences packed in one row {one_row_differs}"
    return layouts, f"sequences packed in several rows {rows_differ}"


def _hidden(runner, plain, ids, positions, mask=None, boundaries=None) -> torch.Tensor:
    return runner(input_ids=ids, attention_mask=mask, output_hidden_states=True,
                  **sequence_kwargs(plain, positions, 1, boundaries)).hidden_states[-1].float()


def _two_rows(sequences: list) -> tuple:
    """(ids [2, 8], positions [2, 8], None, [2, 8] bool: the positions that belong to a sequence)."""
    rows = [torch.cat(sequences[:2]), torch.cat(sequences[2:])]
    width = max(len(r) for r in rows)
    ids = torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])
    pieces = [[len(s) for s in sequences[:2]], [len(s) for s in sequences[2:]]]
    positions = torch.stack([torch.cat([torch.arange(n) for n in p + ([width - sum(p)] if sum(p) < width else [])])
                             for p in pieces]).to(ids.device)
    real = torch.stack([torch.arange(width) < sum(p) for p in pieces]).to(ids.device)
    return ids, positions, None, real


def _one_row(sequences: list) -> tuple:
    """(ids [1, T], positions [1, T], Boundaries, [1, T] bool all True)."""
    ids = torch.cat(sequences)[None]
    positions = torch.cat([torch.arange(len(s)) for s in sequences])[None].to(ids.device)
    boundaries = Boundaries.of_lengths([len(s) for s in sequences], ids.device)
    return ids, positions, boundaries, torch.ones_like(ids, dtype=torch.bool)


def _differs(runner, plain, layout: tuple, alone: torch.Tensor) -> str | None:
    """None when the packed `layout`'s hidden states at its sequences' positions agree with `alone` [sum(n), H] (the
    padded batch's), else how they do not."""
    ids, positions, boundaries, real = layout
    try:
        together = _hidden(runner, plain, ids, positions, boundaries=boundaries)[real]
    except CHECK_ERRORS as err:
        return f"raise {raised(err)}"
    if agree_within_rounding(plain, together, alone):
        return None
    gap = float((together - alone).abs().max())
    return (f"do not get what they get alone (the one-time check's hidden states differ by up to {gap:.1e}: a "
            "recurrent or convolutional layer carries state across them, or its attention kernel does not read "
            "their boundaries)")
