"""Each prefix once, in one forward: a row per prefix holding the prefix and every continuation of it, with an
attention mask that keeps the continuations apart (DPO's and ORPO's pairs, GRPO's groups of rollouts).

Prefixes [P, Lp] left-padded, continuations [N, C] right-padded, and `source` [N], the prefix each continuation follows
(a pair's chosen 2i and rejected 2i + 1 follow prefix i; a group's rollouts their prompt), become P rows of
Lp + K * C columns, K the most continuations of one prefix: the k-th continuation of prefix p fills slot k of row p
(a prefix with fewer leaves its last slots padding):

    row p      [ prefix p (left-padded) | slot 0 (right-padded) | slot 1 | ... | slot K - 1 ]
    positions    0 .. n_p - 1             n_p .. n_p + C - 1      the same in every slot     (n_p: the prefix's
                                                                                             real tokens)
    attention  a real token sees the real tokens before it in its own slot and the prefix's; no slot sees another
               (a padding position sees itself only)

so every position computes what it computes in its own whole sequence, and the body runs P x (Lp + K * C) positions in
one forward and one backward: no cache, and each weight's gradient one product over all the rows (two forwards, as
models/logprobs.py's shared prompts run, make each weight's gradient two products of fewer rows and their sum: 0.8 s
of a DPO backward at Qwen2.5-0.5B's shape). A custom [P, 1, T, T] mask is passed to the model as transformers takes
one (as it is: bool for sdpa, additive for eager), so only models whose every layer is full attention take this path
(a sliding window or a recurrent layer would read the mask otherwise, or not at all), under sdpa or eager attention,
and only where the model reproduces its unshared hidden states so (checked once per model and implementation). With
such a mask attention computes every (query, key) pair of a row, so rows are taken only while that is at most
MAX_ATTENTION_SHARE of their products (`row_width_limit`).

    PrefixRows.input_ids    [P, T] long   T = Lp + K * C
    PrefixRows.position_ids [P, T] long
    PrefixRows.allowed      [P, T, T] bool  query t may attend to key s
    PrefixRows.source       [N, C] long   flat index in [P * T] of the position predicting each continuation token
                                          (the prefix's last column for a continuation's first token, the slot's
                                          previous column otherwise)
    PrefixRows.at           [N, C] long   flat index in [P * T] of each continuation token's own position (where a
                                          reward model's score of the sequence is read: models/scores.py)
"""

from dataclasses import dataclass
from typing import Callable

import torch

from posttrain.models import fast_paths
from posttrain.models.forwards import (agree_within_rounding, final_hidden, in_eval_mode, output_layer,
                                       output_layer_input, sequence_kwargs)
from posttrain.models.keywords import unwrap
from posttrain.models.loading import CHECK_ERRORS, check_raised
from posttrain.models.prompt_sharing import ONE_ROW, TWO_FORWARDS, UNSHARED, body_parameters

# what a model loses where the check fails
ROWS_OFF = "its shared prefixes run in a forward of their own, not in one row with their continuations"
_IMPLEMENTATIONS = ("sdpa", "eager")  # the attention implementations that take a custom 4D mask as it is
# the most a row's attention (every (query, key) pair, 4 FLOPs per pair per attention channel per layer) may cost
# against its products (2 FLOPs per body parameter per position): beyond it the row's masked pairs cost more than one
# forward saves
MAX_ATTENTION_SHARE = 1 / 8


@dataclass
class PrefixRows:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    allowed: torch.Tensor
    source: torch.Tensor
    at: torch.Tensor

    def mask(self, implementation: str, dtype: torch.dtype) -> torch.Tensor:
        """[P, 1, T, T] the attention mask as the implementation takes it: bool (sdpa), else additive in `dtype`."""
        if implementation == "sdpa":
            return self.allowed[:, None]
        blocked = torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device)
        return blocked.masked_fill_(~self.allowed, torch.finfo(dtype).min)[:, None]


def prefix_rows(prefix_ids: torch.Tensor, prefix_mask: torch.Tensor, suffix_ids: torch.Tensor,
                suffix_mask: torch.Tensor, source: torch.Tensor) -> PrefixRows:
    """The rows of prefixes [P, Lp] and the continuations [N, C] that follow them (`source` [N]: the module's
    docstring)."""
    p, width = prefix_ids.shape
    c, device = suffix_ids.size(1), prefix_ids.device
    slot = slots(source, p)  # [N]
    k = int(slot.max()) + 1
    in_slots = suffix_ids.new_zeros((p, k, c))
    in_slots[source, slot] = suffix_ids
    real_in_slots = torch.zeros((p, k, c), dtype=torch.bool, device=device)
    real_in_slots[source, slot] = suffix_mask.bool()
    input_ids = torch.cat([prefix_ids, in_slots.view(p, k * c)], dim=1)  # [P, T]
    real = torch.cat([prefix_mask.bool(), real_in_slots.view(p, k * c)], dim=1)
    lengths = prefix_mask.sum(1, keepdim=True)  # [P, 1]
    prefix_positions = (prefix_mask.cumsum(1) - 1).clamp(min=0)
    slot_positions = (lengths + torch.arange(c, device=device)[None]).repeat(1, k)  # [P, K * C]
    position_ids = torch.cat([prefix_positions, slot_positions], dim=1)
    part = torch.cat([torch.zeros(width, dtype=torch.long, device=device),
                      torch.arange(1, k + 1, device=device).repeat_interleave(c)])  # [T] 0 the prefix, 1 + k slot k
    column = torch.arange(part.numel(), device=device)
    causal = column[None, :] <= column[:, None]  # [T, T] key s at or before query t
    same_part = (part[None, :] == 0) | (part[None, :] == part[:, None])
    allowed = causal & same_part & real[:, None, :] & real[:, :, None]  # [P, T, T]
    allowed |= torch.eye(part.numel(), dtype=torch.bool, device=device)  # padding sees itself
    row_width = width + k * c
    at = source[:, None] * row_width + width + slot[:, None] * c + torch.arange(c, device=device)[None]  # [N, C]
    return PrefixRows(input_ids, position_ids, allowed, _sources(at, source, width, row_width), at)


def slots(source: torch.Tensor, prefixes: int) -> torch.Tensor:
    """[N] each continuation's slot: how many continuations of its prefix come before it."""
    same = torch.nn.functional.one_hot(source, prefixes)  # [N, P]
    return (same.cumsum(0) * same).sum(1) - 1


def _sources(at: torch.Tensor, source: torch.Tensor, width: int, row_width: int) -> torch.Tensor:
    """[N, C] the flat index of the position predicting each continuation token: the prefix's last column for a
    continuation's first token, the slot's previous column otherwise."""
    before = at - 1
    if before.size(1):  # continuations of no width (C = 0) predict nothing
        before[:, 0] = source * row_width + width - 1
    return before


def row_width(prefix_width: int, source: torch.Tensor, continuation_width: int) -> int:
    """T, the width of the rows of prefixes `prefix_width` wide and continuations `continuation_width` wide following
    them as `source` says: a slot for each continuation of the prefix with the most."""
    return prefix_width + int(torch.bincount(source).max()) * continuation_width


def pair_source(pairs: int, device) -> torch.Tensor:
    """[2P] the prefix each sequence of P pairs follows: i for chosen 2i and rejected 2i + 1."""
    return torch.arange(pairs, device=device).repeat_interleave(2)


def layout(model, width: int | None, rows_work: Callable, forwards_work: Callable) -> int:
    """How `model` runs prefixes shared by several continuations (prompt_sharing's layouts), where a row per prefix
    would be `width` wide (None: rows would not pay): ONE_ROW where the row's attention pays (`row_width_limit`) and
    `rows_work(model)`, else TWO_FORWARDS (the prefixes with a cache, the continuations against it) where
    `forwards_work(model)`, else UNSHARED."""
    if width is not None and width <= row_width_limit(model) and rows_work(model):
        return ONE_ROW
    return TWO_FORWARDS if forwards_work(model) else UNSHARED


def row_width_limit(model) -> int:
    """The widest row whose attention costs at most MAX_ATTENTION_SHARE of its products: 4 x T^2 x A x L FLOPs against
    2 x T x (body parameters), A the attention's channels (heads x head size), L the layers; 0 (no row) for a config
    that does not say them."""
    text = _text_config(unwrap(model))
    heads, layers = getattr(text, "num_attention_heads", None), getattr(text, "num_hidden_layers", None)
    head_size = getattr(text, "head_dim", None) or getattr(text, "hidden_size", 0) // max(heads or 1, 1)
    if not (heads and layers and head_size):
        return 0
    return int(MAX_ATTENTION_SHARE * body_parameters(unwrap(model)) / (2 * heads * head_size * layers))


def implementation(model) -> str | None:
    """The model's attention implementation, as its (text) config names it."""
    return getattr(_text_config(unwrap(model)), "_attn_implementation", None)


def _text_config(plain):
    config = plain.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def prefix_rows_work(model) -> bool:
    """Whether `model` may run shared prefixes as rows: full attention in every layer, sdpa or eager attention, and
    its hidden states through the rows those of its whole sequences (decided once per model and implementation)."""
    name = takes_row_masks(model)
    return name is not None and fast_paths.decided(model, f"prefix_rows_{name}", lambda: _check(unwrap(model), name))


def takes_row_masks(model) -> str | None:
    """The model's attention implementation where it takes the rows' mask as it is (sdpa or eager, full attention in
    every layer), else None."""
    name = implementation(model)
    return name if name in _IMPLEMENTATIONS and _full_attention_only(unwrap(model)) else None


def _full_attention_only(plain) -> bool:
    text = _text_config(plain)
    for field in ("layer_types", "layers_block_type"):
        kinds = getattr(text, field, None)
        if kinds and any(kind not in ("full_attention", "attention") for kind in kinds):
            return False
    window = getattr(text, "sliding_window", None)
    return window is None or getattr(text, "layer_types", None) is not None or not getattr(
        text, "use_sliding_window", True)


def model_mask(model, rows: PrefixRows) -> torch.Tensor:
    """The rows' [P, 1, T, T] attention mask as `model`'s attention implementation takes it."""
    return rows.mask(implementation(model), unwrap(model).get_input_embeddings().weight.dtype)


def at_sources(rows: PrefixRows, hidden: torch.Tensor) -> torch.Tensor:
    """[N, C, H] the hidden states predicting each continuation token, of [P, T, H] final hidden states of the
    rows (a padding position's: finite garbage)."""
    return hidden.reshape(-1, hidden.size(-1))[rows.source]


def _check(plain, name: str) -> bool:
    """Two continuations of 3 and 2 tokens (the shorter right-padded) after a 4-token prefix left-padded to 5:
    the rows' hidden states at the targets against the two whole sequences', within agree_within_rounding."""
    device = next(plain.parameters()).device
    vocab = plain.get_input_embeddings().num_embeddings
    ids = (torch.arange(3, 12, device=device) * 7919) % vocab  # [9]
    prefix, prefix_mask = torch.cat([ids[:1], ids[:4]])[None], torch.tensor([[0, 1, 1, 1, 1]], device=device)
    suffix = torch.stack([ids[4:7], torch.cat([ids[7:9], ids[:1]])])
    suffix_mask = torch.tensor([[1, 1, 1], [1, 1, 0]], device=device)
    rows = prefix_rows(prefix, prefix_mask, suffix, suffix_mask, torch.zeros(2, dtype=torch.long, device=device))
    try:
        with in_eval_mode(plain), torch.no_grad(), torch.autocast(device.type, enabled=False):
            together = at_sources(rows, output_layer_input(
                plain, output_layer(plain), 0, input_ids=rows.input_ids, attention_mask=model_mask(plain, rows),
                **sequence_kwargs(plain, rows.position_ids, 0)))[suffix_mask.bool()]
            whole = torch.cat([prefix[:, 1:].expand(2, 4), suffix], dim=1)  # [2, 7]
            mask = torch.cat([torch.ones((2, 4), dtype=torch.long, device=device), suffix_mask], dim=1)
            apart = final_hidden(plain, whole, mask)[:, 3:-1][suffix_mask.bool()]
        return agree_within_rounding(plain, together.float(), apart.float())
    except CHECK_ERRORS as err:
        return check_raised(plain, ROWS_OFF, err)
