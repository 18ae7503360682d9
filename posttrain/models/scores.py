"""A sequence-classification model's score of each sequence (the reward model's reward).

transformers' sequence classifiers project every position's final hidden state to `num_labels` scores (`score`, a
[H -> 1] linear for a reward model) and read each row's at its last token that is not the pad token (the argmax
over positions of position * (token != pad_token_id)). Padded rows (one sequence each) are scored by the model's own
forward, its pooled logits. Padding-free, the sequences of a micro-batch run end to end in one row (position ids
restarting per sequence, and their boundaries), where the model keeps them apart (models/packed_layouts.py), and
each one's score is read from the head's output at its own last non-pad token, captured by a forward hook during
the model's own forward (wrapped by DDP, FSDP, DeepSpeed or PEFT as it is); the pooled logits join the result with
weight 0, so that the backward starts from the forward's output, where FSDP1's root wrapper waits for it.

Pairs that begin alike (a prompt and two answers) may run their common prefix once (sequences/prefixes.py), in one
of two layouts: a row per pair (models/prefix_rows.py: the prefix, then both continuations, with a mask that keeps
them apart), each continuation's score read from the head's output at its last token that is not padding
(`prefix_row_scores`: one forward, activation checkpointing included, on a model of full attention in every layer
under sdpa or eager); or the prefixes' forward with a cache, its rows repeated for both sequences of each pair, then
the continuations' forward against it, scored by the model's own pooling over the continuations' ids
(`prefix_shared_scores`). Each where the model reproduces its unshared scores so, checked once per model
(`row_scores_work`, `prefix_sharing_works`).

    last  [S] long   packed rows: the flat index of the position each sequence's score is read at
"""

import numpy as np
import torch

from posttrain.models import fast_paths
from posttrain.models.forwards import agree_within_rounding, in_eval_mode, positions_from_mask, sequence_kwargs
from posttrain.models.keywords import cache_kwarg, missing_from_forward, returned_cache, unwrap
from posttrain.models.loading import CHECK_ERRORS, check_raised, checkpointing, fallback_said
from posttrain.models.prefix_rows import model_mask, pair_source, prefix_rows, takes_row_masks

PREFIX_SHARING_OFF = "its reward forwards run each pair's common prefix twice, not once"
ROW_SCORES_OFF = "its reward forwards run each pair's common prefix in a forward of its own, not in one row"

HEAD_NAMES = ("score", "classifier")  # transformers' names for a decoder's classification head


def score_head(model) -> tuple[str, torch.nn.Module] | None:
    """(name, module) of the model's classification head (a PEFT ModulesToSaveWrapper included), or None."""
    plain = unwrap(model)
    for name in HEAD_NAMES:
        head = getattr(plain, name, None)
        if isinstance(head, torch.nn.Module):
            return name, head
    return None


def score_positions(tokens: np.ndarray, offsets: np.ndarray, pad_id: int) -> np.ndarray:
    """[S] flat index, in sequences laid end to end (sequence s is tokens[offsets[s]:offsets[s + 1]], none empty), of
    each sequence's score position: its last token that is not `pad_id` (its first, when every token is), as
    transformers pools."""
    real = np.where(tokens != pad_id, np.arange(len(tokens)), -1)
    last = np.maximum.reduceat(real, offsets[:-1]) if len(offsets) > 1 else np.zeros(0, dtype=np.int64)
    return np.where(last >= 0, last, offsets[:-1]).astype(np.int64)


def sequence_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    position_ids: torch.Tensor | None, last: torch.Tensor | None, boundaries=None) -> torch.Tensor:
    """[S] scores (float32) of the sequences in [B, T] `input_ids`: padded rows (no `position_ids`), the model's
    pooled logits; a packed row (with its `boundaries`, models/packed_layouts.py), the head's outputs at the flat
    positions `last` (score_positions)."""
    if position_ids is None:
        return model(input_ids=input_ids, attention_mask=attention_mask,
                     **sequence_kwargs(model, None, 0)).logits[:, 0].float()
    _, head = score_head(model)
    captured = []
    handle = head.register_forward_hook(lambda module, inputs, output: captured.append(output))
    try:
        pooled = model(input_ids=input_ids, attention_mask=attention_mask,
                       **sequence_kwargs(model, position_ids, 0, boundaries)).logits
    finally:
        handle.remove()
    scores = captured[-1].reshape(-1)[last]  # [B, T, 1] -> [S]
    return (scores + 0.0 * pooled.sum()).float()


def prefix_shared_scores(model, prefix_ids: torch.Tensor, prefix_mask: torch.Tensor, suffix_ids: torch.Tensor,
                         suffix_mask: torch.Tensor) -> torch.Tensor:
    """[2P] scores (float32) of the pairs laid out by sequences/prefixes.py: [P, Lp] left-padded prefixes, [2P, C]
    right-padded continuations (chosen 2i, rejected 2i + 1). Two forwards before one backward: the gradient that
    reaches a prefix's cached keys and values flows back into its one forward, summed over both continuations."""
    kwargs = {"use_cache": True}
    prefixes = model(input_ids=prefix_ids, attention_mask=prefix_mask,
                     position_ids=positions_from_mask(prefix_mask), **kwargs)
    cache = returned_cache(prefixes)
    cache.batch_repeat_interleave(2)
    mask = torch.cat([prefix_mask.repeat_interleave(2, dim=0), suffix_mask], dim=1)  # [2P, Lp + C]
    positions = positions_from_mask(mask)[:, prefix_ids.size(1):]  # each continuation from its prefix's length
    out = model(input_ids=suffix_ids, attention_mask=mask, position_ids=positions, **{cache_kwarg(model): cache},
                **kwargs)
    return out.logits[:, 0].float()


def prefix_row_scores(model, prefix_ids: torch.Tensor, prefix_mask: torch.Tensor, suffix_ids: torch.Tensor,
                      suffix_mask: torch.Tensor) -> torch.Tensor:
    """[2P] scores (float32) of the pairs laid out by sequences/prefixes.py (as `prefix_shared_scores` takes them) in
    one forward of a row per pair (models/prefix_rows.py): each continuation's score is the head's output at the
    continuation's last token that is not the pad token (the pooling's rule; the continuation holds its sequence's
    score position, until="score"), captured as `sequence_scores` captures a packed row's."""
    pairs, width = prefix_ids.size(0), suffix_ids.size(1)
    rows = prefix_rows(prefix_ids, prefix_mask, suffix_ids, suffix_mask, pair_source(pairs, prefix_ids.device))
    pad = unwrap(model).config.pad_token_id
    real = suffix_ids != pad if pad is not None else suffix_mask.bool()
    column = torch.where(real, torch.arange(width, device=real.device), -1).amax(1).clamp(min=0)  # [2P]
    _, head = score_head(model)
    captured = []
    handle = head.register_forward_hook(lambda module, inputs, output: captured.append(output))
    try:
        pooled = model(input_ids=rows.input_ids, attention_mask=model_mask(model, rows),
                       **sequence_kwargs(model, rows.position_ids, 0)).logits
    finally:
        handle.remove()
    scores = captured[-1].reshape(-1)[rows.at.gather(1, column[:, None]).squeeze(1)]  # [P, T, 1] -> [2P]
    return (scores + 0.0 * pooled.sum()).float()


def row_scores_work(model) -> bool:
    """Whether the model may score pairs as a row per pair (`prefix_row_scores`): full attention in every layer under
    sdpa or eager attention, a classification head, and its scores so equal its unshared ones (a check decided once
    per model and implementation)."""
    name = takes_row_masks(model)
    if name is None or score_head(model) is None:
        return False
    return fast_paths.decided(model, f"prefix_row_scores_{name}",
                              lambda: _check_scores(unwrap(model), prefix_row_scores, ROW_SCORES_OFF))


def prefix_sharing_works(model) -> bool:
    """Whether the model may score pairs with their common prefix run once: it trains without activation
    checkpointing (transformers turns the cache off in a checkpointed training forward), its forward takes position
    ids and a cache, and its scores so equal its unshared ones (a check decided once per model object)."""
    if checkpointing(unwrap(model)):
        return False
    return fast_paths.decided(model, "shared_prefix_scores", lambda: _decide_prefix_sharing(unwrap(model)))


def _decide_prefix_sharing(plain) -> bool:
    missing = missing_from_forward(plain, ("position_ids", "cache", "use_cache"))
    return fallback_said(plain, PREFIX_SHARING_OFF, missing) if missing else _check_scores(
        plain, prefix_shared_scores, PREFIX_SHARING_OFF)


def _check_scores(plain, scores, off: str) -> bool:
    """A pair of 5 and 3 tokens after a common 4-token prefix (the shorter continuation right-padded): its scores
    through `scores` (a layout of the pair's prefix once) against the two sequences' unshared ones
    (agree_within_rounding); `off` says what the model loses where they differ or the layout raises."""
    device = next(plain.parameters()).device
    vocab = plain.get_input_embeddings().num_embeddings
    pad = plain.config.pad_token_id
    ids = (torch.arange(3, 15, device=device) * 7919) % vocab  # [12]
    ids = torch.where(ids == pad, (ids + 1) % vocab, ids) if pad is not None else ids
    prefix = ids[None, :4]
    suffix = torch.stack([ids[4:9], torch.cat([ids[9:12], ids.new_full((2,), pad if pad is not None else 0)])])
    suffix_mask = torch.tensor([[1] * 5, [1, 1, 1, 0, 0]], device=device)
    whole = torch.cat([prefix.expand(2, 4), suffix], dim=1)
    try:
        with in_eval_mode(plain), torch.no_grad(), torch.autocast(device.type, enabled=False):
            together = scores(plain, prefix, torch.ones_like(prefix), suffix, suffix_mask)
            apart = plain(input_ids=whole, attention_mask=torch.cat([torch.ones_like(whole[:, :4]), suffix_mask], 1),
                          **sequence_kwargs(plain, None, 0)).logits[:, 0].float()
        return agree_within_rounding(plain, together, apart)
    except CHECK_ERRORS as err:
        return check_raised(plain, off, err)
