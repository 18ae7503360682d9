"""Padding-free rows for the log-prob passes: each rollout's real tokens end to end, in fewer and shorter rows.

A batch of rollouts is [N, P + C]: prompts left-padded to P, completions right-padded to C. With natural lengths
much of that block is padding, and the model's body runs over every position of it. Packed, each rollout's real
tokens (its prompt without the left padding, then its completion up to its mask's end) are one sequence, told apart
from the others by position ids restarting at 0, with no attention mask. Two layouts, as the model allows
(models/packed_layouts.py, checked once per model):
    rows     the sequences in bins, longest first, each into the first bin with room (first-fit decreasing); a bin
             holds at most W tokens, W the longest sequence, so the batch is [B', W] with B' <= N and attention
             costs at most W^2 per row as it does padded; the positions left at a bin's end are one more sequence,
             never read
    one row  every sequence end to end in one row [1, T] (T the real tokens, nothing left over), with the
             sequences' Boundaries for the kernels that read them (flash attention, linear-attention layers)

Packing is used when it removes at least 1/16 of the positions (`packing_plan`; completions all run to the same
length leave nothing to remove), when the masks are a contiguous run of real tokens per row (left-padded prompt,
right-padded completion), and when the model keeps the layout's sequences apart. Otherwise the padded batch is used
as is.
"""

from dataclasses import dataclass

import torch

from posttrain.models.packed_layouts import Boundaries

MIN_SAVING = 1 / 16  # pack when it removes at least this share of the padded batch's positions


@dataclass
class PackedRows:
    input_ids: torch.Tensor  # [B', W] the rollouts' real tokens, end to end
    position_ids: torch.Tensor  # [B', W] restarting at 0 at each sequence (and at a bin's unused tail)
    source_mask: torch.Tensor  # [B', W] bool: the position's hidden state predicts a completion token
    targets: torch.Tensor  # [M] the completion tokens, in the row-major order of source_mask's True entries
    positions: torch.Tensor  # [M] each target's flat index in the rollouts' [N, C] completion block
    boundaries: Boundaries | None = None  # one row: its sequences' boundaries; rows: None (position ids only)


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of total length <= capacity: longest first, each into the first bin
    with room. Every length must be <= capacity."""
    bins, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, left in enumerate(room):
            if lengths[i] <= left:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def packing_plan(sequence_lengths: list[int], padded_width: int, one_row: bool = False
                 ) -> tuple[list[list[int]], int] | None:
    """(bins, their width) of sequences of these lengths: first-fit decreasing with capacity the longest sequence,
    or (`one_row`) every sequence in one row as wide as all of them; None when that would not remove MIN_SAVING of
    the padded [N, padded_width] batch's positions."""
    if not sequence_lengths:
        return None
    if one_row:
        bins, width = [list(range(len(sequence_lengths)))], sum(sequence_lengths)
    else:
        bins, width = first_fit_decreasing(sequence_lengths, max(sequence_lengths)), max(sequence_lengths)
    if len(bins) * width > (1 - MIN_SAVING) * len(sequence_lengths) * padded_width:
        return None
    return bins, width


def _run_lengths(prompt_mask: torch.Tensor, completion_mask: torch.Tensor):
    """([N] prompt lengths, [N] completion lengths), or None when a row's real tokens are not one contiguous run
    (a prompt mask with a hole or right padding, a completion mask with a hole)."""
    prompt_lengths = prompt_mask.sum(1)
    completion_lengths = completion_mask.sum(1)
    columns = torch.arange(prompt_mask.size(1), device=prompt_mask.device)
    prompt_run = columns >= prompt_mask.size(1) - prompt_lengths[:, None]  # [N, P] where a suffix run would be
    completion_run = torch.arange(completion_mask.size(1), device=completion_mask.device) < completion_lengths[:, None]
    if not (torch.equal(prompt_run, prompt_mask.bool()) and torch.equal(completion_run, completion_mask.bool())):
        return None
    return prompt_lengths, completion_lengths


def pack_rollouts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                  completion_mask: torch.Tensor, one_row: bool = False) -> PackedRows | None:
    """The packed rows of a batch of rollouts ([N, P] left-padded prompts, [N, C] right-padded completions): bins of
    the longest sequence's width, or (`one_row`) one row with the sequences' Boundaries; None when packing would not
    remove MIN_SAVING of the positions or the masks are not contiguous runs."""
    lengths = _run_lengths(prompt_mask, completion_mask)
    if lengths is None:
        return None
    prompt_lengths, completion_lengths = (t.tolist() for t in lengths)
    sequence_lengths = [p + c for p, c in zip(prompt_lengths, completion_lengths)]
    n, (big_p, big_c) = len(sequence_lengths), (prompt_ids.size(1), completion_ids.size(1))
    if 0 in prompt_lengths:
        return None  # an empty prompt: a completion's first token would have no position to be predicted from
    plan = packing_plan(sequence_lengths, big_p + big_c, one_row)
    if plan is None:
        return None
    bins, width = plan
    # where each rollout's run starts in the packed batch, as a flat index into [B', W]
    starts = [0] * n
    for b, members in enumerate(bins):
        offset = b * width
        for i in members:
            starts[i] = offset
            offset += sequence_lengths[i]
    device = prompt_ids.device
    starts = torch.tensor(starts, device=device)
    p_len = torch.tensor(prompt_lengths, device=device)
    s_len = torch.tensor(sequence_lengths, device=device)
    # every real token: its rollout, its index k in the run, its column in the [N, P + C] batch
    row = torch.repeat_interleave(torch.arange(n, device=device), s_len)
    k = torch.arange(int(s_len.sum()), device=device) - torch.repeat_interleave(s_len.cumsum(0) - s_len, s_len)
    column = big_p - p_len[row] + k
    flat = starts[row] + k
    ids = torch.zeros(len(bins) * width, dtype=prompt_ids.dtype, device=device)
    ids[flat] = torch.cat([prompt_ids, completion_ids], 1)[row, column]
    # position ids restart at each sequence's first token and at a bin's unused tail (a sequence of its own)
    first = torch.zeros(len(bins) * width, dtype=torch.bool, device=device)
    first[starts] = True
    used = torch.zeros(len(bins) * width, dtype=torch.bool, device=device)
    used[flat] = True
    first[1:] |= used[:-1] & ~used[1:]  # where a bin's tail begins
    column_in_bin = torch.arange(width, device=device).expand(len(bins), width)
    latest_first = torch.where(first.view(len(bins), width), column_in_bin, 0).cummax(1).values
    positions = column_in_bin - latest_first
    # targets: completion token j of rollout i is predicted at its run's position p_i + j - 1
    is_completion = column >= big_p
    source = torch.zeros(len(bins) * width, dtype=torch.bool, device=device)
    source[flat[is_completion] - 1] = True
    order = (flat[is_completion] - 1).argsort()  # row-major over the packed batch
    target_row, target_col = row[is_completion][order], column[is_completion][order] - big_p
    boundaries = Boundaries.of_lengths(sequence_lengths, device) if one_row else None  # bins[0] is range(n)
    return PackedRows(ids.view(len(bins), width), positions, source.view(len(bins), width),
                      completion_ids[target_row, target_col], target_row * big_c + target_col, boundaries)
