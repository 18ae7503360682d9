"""Preference pairs laid out with each pair's common prefix once: the forward runs the prefix and both continuations
as one row with a mask that keeps the continuations apart (models/prefix_rows.py), or the prefix with a cache and both
continuations against it (the reward model: models/scores.py `prefix_row_scores`, `prefix_shared_scores`; DPO and
ORPO's log-probs: models/logprobs.py `next_token_logprobs` with `prefixes`).

A pair's chosen and rejected sequences usually begin with the same prompt. Under causal attention the prompt's keys,
values and hidden states are the same in both sequences, so the body can run it once: P * Lp + 2P * C positions
instead of the padded batch's 2P * T.

A pair's shared prefix is the longest common prefix of its two sequences, cut so that what each sequence is read at
lies after it (`until`):
    "score"    its score position (its last token that is not padding, where the reward is read): each continuation
               then holds its own, found by the model's pooling over the continuation's ids as it would be over the
               whole sequence's;
    "targets"  its targets (labelled tokens; a sequence without one keeps its last token): the prefix's last position
               predicts the first continuation token, each continuation position the token after it, so every target
               is predicted from the continuations' forward or the prefix's last position (suffix_targets marks them).
A micro-batch is laid out so only when every pair shares at least one token (a prefix row of padding
alone would attend to nothing) and when it removes at least MIN_SAVING of the padded batch's positions and at least
`min_saved` positions (what pays for the second forward). Where every pair's prefix cut to the shortest of them runs
fewer positions, the prefixes are cut so: rows of one length need no padding, and so no mask, in their forward
(as where all prompts have one length and some pairs' answers also begin alike).

    prefix_ids   [P, Lp]  long  each pair's shared prefix, left-padded with pad_id (it ends at its last column)
    prefix_mask  [P, Lp]  long  1 at the prefix's tokens
    suffix_ids   [2P, C]  long  the rest of each sequence (chosen 2i, rejected 2i + 1), right-padded with pad_id
    suffix_mask  [2P, C]  long  1 at the continuation's tokens
    suffix_targets [2P, C] bool  the continuation's token is a target (until="targets"; None for "score")
    in_rows      whether the layout runs as a row per pair (models/prefix_rows.py: set where the model is chosen, by
                 models/logprobs.py prefix_layout), else as the prefixes' forward and the continuations' against it
"""

from dataclasses import dataclass

import numpy as np
import torch

from posttrain.models.packing import MIN_SAVING
from posttrain.models.prefix_rows import pair_source
from posttrain.models.scores import score_positions
from posttrain.sequences.rows import TokenRows


@dataclass
class PrefixBatch:
    prefix_ids: torch.Tensor
    prefix_mask: torch.Tensor
    suffix_ids: torch.Tensor
    suffix_mask: torch.Tensor
    suffix_targets: torch.Tensor | None = None
    in_rows: bool = False

    @property
    def pairs(self) -> int:
        return self.prefix_ids.size(0)

    @property
    def source(self) -> torch.Tensor:
        """[2P] the prefix each continuation follows: i for chosen 2i and rejected 2i + 1."""
        return pair_source(self.pairs, self.prefix_ids.device)

    @property
    def row_width(self) -> int:
        """The width of a row holding a pair's prefix and both its continuations (models/prefix_rows.py)."""
        return self.prefix_ids.size(1) + 2 * self.suffix_ids.size(1)

    def to(self, device, non_blocking: bool = True) -> "PrefixBatch":
        def move(t):
            return t.to(device, non_blocking=non_blocking) if t is not None else None

        return PrefixBatch(*(move(t) for t in (self.prefix_ids, self.prefix_mask, self.suffix_ids, self.suffix_mask,
                                               self.suffix_targets)), in_rows=self.in_rows)


def _reach(rows: TokenRows, pad_id: int, until: str) -> np.ndarray:
    """[2P] the longest prefix of each sequence that leaves what it is read at after it (the module's `until`)."""
    offsets = rows.offsets
    if until == "score":
        return score_positions(rows.tokens, offsets, pad_id) - offsets[:-1]
    targets = rows.labels & ~rows.starts
    index = np.where(targets, np.arange(len(rows.tokens)), np.iinfo(np.int64).max)
    first = np.minimum.reduceat(index, offsets[:-1]) - offsets[:-1]  # a sequence without a target: huge
    return np.minimum(first, rows.lengths - 1)


def shared_prefix_lengths(rows: TokenRows, pad_id: int, until: str = "score") -> np.ndarray:
    """[P] the prefix each pair of `rows` (chosen 2i, rejected 2i + 1) can run once: its longest common prefix, no
    longer than either sequence's reach (the module's `until`)."""
    offsets = rows.offsets
    last = _reach(rows, pad_id, until)  # [2P] within each sequence
    shared = np.zeros(len(rows) // 2, dtype=np.int64)
    for i in range(len(shared)):
        reach = int(min(last[2 * i], last[2 * i + 1]))
        chosen = rows.tokens[offsets[2 * i]:offsets[2 * i] + reach]
        rejected = rows.tokens[offsets[2 * i + 1]:offsets[2 * i + 1] + reach]
        differ = np.flatnonzero(chosen != rejected)
        shared[i] = differ[0] if len(differ) else reach
    return shared


def prefix_batch(rows: TokenRows, pad_id: int, padded_width: int, min_saved: int,
                 until: str = "score") -> PrefixBatch | None:
    """The pairs of `rows` laid out with their shared prefixes once, or None where that does not pay (the module's
    docstring); `padded_width` is the padded batch's width, the layout it would replace."""
    if len(rows) < 2 or rows.model_inputs is not None:
        return None
    shared = shared_prefix_lengths(rows, pad_id, until)
    if not shared.all():
        return None
    cut = np.full_like(shared, shared.min())  # every prefix as long as the shortest: rows of one length
    positions, cut_positions = _positions(rows, shared), _positions(rows, cut)
    if cut_positions < positions:
        shared, positions = cut, cut_positions
    suffix = rows.lengths - np.repeat(shared, 2)  # [2P]
    width, suffix_width = int(shared.max()), int(suffix.max())
    otherwise = len(rows) * padded_width
    saved = otherwise - positions
    if saved < MIN_SAVING * otherwise or saved < min_saved:
        return None
    prefix_ids = np.full((len(shared), width), pad_id, dtype=np.int64)
    prefix_real = np.arange(width)[None, :] >= (width - shared)[:, None]  # left padding
    starts = rows.offsets[:-1]
    chosen_starts = starts[0::2]
    prefix_ids[prefix_real] = rows.tokens[_ranges(chosen_starts, shared)]
    suffix_ids = np.full((len(rows), suffix_width), pad_id, dtype=np.int64)
    suffix_real = np.arange(suffix_width)[None, :] < suffix[:, None]  # right padding
    rest = _ranges(starts + np.repeat(shared, 2), suffix)
    suffix_ids[suffix_real] = rows.tokens[rest]
    suffix_targets = None
    if until == "targets":  # no sequence starts in a continuation: a labelled token there is a target
        suffix_targets = np.zeros(suffix_ids.shape, dtype=bool)
        suffix_targets[suffix_real] = rows.labels[rest]
    return PrefixBatch(torch.from_numpy(prefix_ids), torch.from_numpy(prefix_real.astype(np.int64)),
                       torch.from_numpy(suffix_ids), torch.from_numpy(suffix_real.astype(np.int64)),
                       None if suffix_targets is None else torch.from_numpy(suffix_targets))


def _positions(rows: TokenRows, shared: np.ndarray) -> int:
    """The positions the layout with these [P] prefixes runs: the prefixes padded to the longest, each sequence's
    rest padded to the longest rest."""
    return len(shared) * int(shared.max()) + len(rows) * int((rows.lengths - np.repeat(shared, 2)).max())


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The flat indices starts[k] .. starts[k] + counts[k] - 1, for each k in turn."""
    total = int(counts.sum())
    begins = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    return begins + np.arange(total)
