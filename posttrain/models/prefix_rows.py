"""Each pair's common prefix once, in one forward: a row per pair holding its prefix and both continuations, with an
attention mask that keeps the continuations apart.

The pairs laid out by sequences/prefixes.py ([P, Lp] left-padded prefixes, [2P, C] right-padded continuations, chosen
2i and rejected 2i + 1) become P rows of Lp + 2C columns:

    row i      [ prefix i (left-padded) | chosen continuation (right-padded) | rejected continuation (right-padded) ]
    positions    0 .. n_i - 1             n_i .. n_i + C - 1                   n_i .. n_i + C - 1   (n_i: the prefix's
                                                                                                    real tokens)
    attention  a real token sees the real tokens before it in its own part and the prefix's; the rejected
               continuation never sees the chosen one (a padding position sees itself only)

so every position computes what it computes in its own whole sequence, and the body runs P x (Lp + 2C) positions in
one forward and one backward: no cache, and each weight's gradient one product over all the rows (two forwards, as
models/logprobs.py's shared prompts run, make each weight's gradient two products of fewer rows and their sum: 0.8 s
of a DPO backward at Qwen2.5-0.5B's shape). A custom [P, 1, T, T] mask is passed to the model as transformers takes
one (as it is: bool for sdpa, additive for eager), so only models whose every layer is full attention take this path
(a sliding window or a recurrent layer would read the mask otherwise, or not at all), under sdpa or eager attention,
and only where the model reproduces its unshared hidden states so (checked once per model and implementation).

    PrefixRows.input_ids    [P, T] long   T = Lp + 2C
    PrefixRows.position_ids [P, T] long
    PrefixRows.allowed      [P, T, T] bool  query t may attend to key s
    PrefixRows.source       [M] long      flat index in [P * T] of the position predicting each target, in the
                                          targets' order (sequence 0, 1, ..., each in its order)
"""

from dataclasses import dataclass

import torch

from posttrain.models import fast_paths
from posttrain.models.forwards import (agree_within_rounding, final_hidden, in_eval_mode, output_layer,
                                       output_layer_input, sequence_kwargs)
from posttrain.models.keywords import unwrap
from posttrain.models.loading import CHECK_ERRORS, check_raised

# what a model loses where the check fails
ROWS_OFF = "its pairs' common prefixes run in a forward of their own, not in one row with both continuations"
_IMPLEMENTATIONS = ("sdpa", "eager")  # the attention implementations that take a custom 4D mask as it is


@dataclass
class PrefixRows:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    allowed: torch.Tensor
    source: torch.Tensor

    def mask(self, implementation: str, dtype: torch.dtype) -> torch.Tensor:
        """[P, 1, T, T] the attention mask as the implementation takes it: bool (sdpa), else additive in `dtype`."""
        if implementation == "sdpa":
            return self.allowed[:, None]
        blocked = torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device)
        return blocked.masked_fill_(~self.allowed, torch.finfo(dtype).min)[:, None]


def prefix_rows(prefix_ids: torch.Tensor, prefix_mask: torch.Tensor, suffix_ids: torch.Tensor,
                suffix_mask: torch.Tensor, suffix_targets: torch.Tensor) -> PrefixRows:
    """The rows of pairs laid out by sequences/prefixes.py (the module's docstring)."""
    width = prefix_ids.size(1)
    c = suffix_ids.size(1)
    chosen, rejected = suffix_ids[0::2], suffix_ids[1::2]
    input_ids = torch.cat([prefix_ids, chosen, rejected], dim=1)  # [P, T]
    real = torch.cat([prefix_mask.bool(), suffix_mask[0::2].bool(), suffix_mask[1::2].bool()], dim=1)
    lengths = prefix_mask.sum(1, keepdim=True)  # [P, 1]
    prefix_positions = (prefix_mask.cumsum(1) - 1).clamp(min=0)
    suffix_positions = lengths + torch.arange(c, device=prefix_ids.device)[None]  # [P, C]
    position_ids = torch.cat([prefix_positions, suffix_positions, suffix_positions], dim=1)
    part = torch.cat([torch.zeros(width, dtype=torch.long), torch.ones(c, dtype=torch.long),
                      torch.full((c,), 2, dtype=torch.long)]).to(prefix_ids.device)  # [T] 0 prefix, 1, 2
    column = torch.arange(part.numel(), device=prefix_ids.device)
    causal = column[None, :] <= column[:, None]  # [T, T] key s at or before query t
    same_part = (part[None, :] == 0) | (part[None, :] == part[:, None])
    allowed = causal & same_part & real[:, None, :] & real[:, :, None]  # [P, T, T]
    allowed |= torch.eye(part.numel(), dtype=torch.bool, device=allowed.device)  # padding sees itself
    return PrefixRows(input_ids, position_ids, allowed, _sources(suffix_targets, width, c))


def _sources(suffix_targets: torch.Tensor, width: int, c: int) -> torch.Tensor:
    """[M] the flat index in [P * (width + 2C)] of the position predicting each target: the prefix's last column for
    a continuation's first token, the continuation's previous column otherwise."""
    n = suffix_targets.size(0)
    row = torch.arange(n, device=suffix_targets.device) // 2
    start = width + (torch.arange(n, device=suffix_targets.device) % 2) * c  # each continuation's first column
    j = torch.arange(c, device=suffix_targets.device)[None]  # [1, C]
    column = torch.where(j == 0, width - 1, start[:, None] + j - 1)  # [2P, C]
    flat = row[:, None] * (width + 2 * c) + column
    return flat[suffix_targets]


def implementation(model) -> str | None:
    """The model's attention implementation, as its (text) config names it."""
    return getattr(_text_config(unwrap(model)), "_attn_implementation", None)


def _text_config(plain):
    config = plain.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def prefix_rows_work(model) -> bool:
    """Whether `model` runs pairs as prefix rows: full attention in every layer, sdpa or eager attention, and its
    hidden states through the rows those of its whole sequences (decided once per model and implementation)."""
    name = implementation(model)
    if name not in _IMPLEMENTATIONS or not _full_attention_only(unwrap(model)):
        return False
    return fast_paths.decided(model, f"prefix_rows_{name}", lambda: _check(unwrap(model), name))


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
    """[M, H] the hidden states predicting the targets, of [P, T, H] final hidden states of the rows."""
    return hidden.reshape(-1, hidden.size(-1))[rows.source]


def _check(plain, name: str) -> bool:
    """A pair of 3- and 2-token continuations (the shorter right-padded) after a 4-token prefix left-padded to 5:
    the rows' hidden states at the targets against the two whole sequences', within agree_within_rounding."""
    device = next(plain.parameters()).device
    vocab = plain.get_input_embeddings().num_embeddings
    ids = (torch.arange(3, 12, device=device) * 7919) % vocab  # [9]
    prefix, prefix_mask = torch.cat([ids[:1], ids[:4]])[None], torch.tensor([[0, 1, 1, 1, 1]], device=device)
    suffix = torch.stack([ids[4:7], torch.cat([ids[7:9], ids[:1]])])
    suffix_mask = torch.tensor([[1, 1, 1], [1, 1, 0]], device=device)
    rows = prefix_rows(prefix, prefix_mask, suffix, suffix_mask, suffix_mask.bool())
    try:
        with in_eval_mode(plain), torch.no_grad(), torch.autocast(device.type, enabled=False):
            together = at_sources(rows, output_layer_input(
                plain, output_layer(plain), 0, input_ids=rows.input_ids, attention_mask=model_mask(plain, rows),
                **sequence_kwargs(plain, rows.position_ids, 0)))
            whole = torch.cat([prefix[:, 1:].expand(2, 4), suffix], dim=1)  # [2, 7]
            mask = torch.cat([torch.ones((2, 4), dtype=torch.long, device=device), suffix_mask], dim=1)
            apart = final_hidden(plain, whole, mask)[:, 3:-1][suffix_mask.bool()]
        return agree_within_rounding(plain, together.float(), apart.float())
    except CHECK_ERRORS as err:
        return check_raised(plain, ROWS_OFF, err)
