"""Importance-sampling correction between the engine that sampled and the trainer (TRL's vllm_importance_sampling_*).

An engine's log-probs differ from the trainer's (other kernels, precision, batch shapes), so its samples are a little
off-policy for the trainer. With use_vllm each completion is weighted by

    ratio = pi_trainer / pi_sampler    per token (token_*), or per sequence (sequence_*: exp of the summed log-ratio)

clamped into [clip_min, clip_max] (*_truncate) or set to 0 outside it (*_mask), and the loss's per-token terms are
multiplied by it (VESPO folds it into its Gamma weight instead).

The sampler drew each token from the distribution restricted to what its filters kept (top-k, top-p, min-p, banned
tokens) and renormalised there. Against the trainer's full-vocabulary log-prob every ratio would be biased by the kept
mass (0.896 per token at top_p=0.8: TRL issue #6789), so the trainer's log-prob is renormalised over the same support,
which is recomputed from the trainer's own logits (never taken from the engine):

    log pi_S(y) = log pi(y) - log sum_{v in S} pi(v)          (`trainer_logps` gives both, from one forward)

When the filters only ban tokens (suppress_tokens, begin_suppress_tokens, EOS before min_new_tokens) the kept mass
comes from those few columns of the output layer; top-k, top-p and min-p need each position's full logits.

A repetition penalty is a deliberate change of distribution, not a support: it stays in the ratio, as in TRL.
"""

import math
from dataclasses import replace

import torch

from posttrain.generation import Rollouts, SamplingParams
from posttrain.generation.sampling import filter_logits
from posttrain.models import logprobs as lp

ROWS_PER_CHUNK = 64  # completion positions whose [rows, V] logits are filtered at once


def restricts_support(params: SamplingParams) -> bool:
    """Whether the sampler's filters can drop tokens (otherwise the kept mass is 1: nothing to renormalise)."""
    return bool(params.top_k or params.top_p < 1.0 or params.min_p or params.suppress_tokens
                or params.begin_suppress_tokens or params.min_new_tokens)


def _banned_only(params: SamplingParams) -> bool:
    """Whether the sampler's support differs from the vocabulary only by banned tokens (no top-k/p, min-p)."""
    return not (params.top_k or params.top_p < 1.0 or params.min_p)


def _banned_columns(steps: torch.Tensor, params: SamplingParams, eos_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """The tokens the sampler may ban and, per position, which it banned: (ids [K], [M, K] bool)."""
    columns = sorted(set(params.suppress_tokens) | set(params.begin_suppress_tokens)
                     | (set(eos_ids) if params.min_new_tokens else set()))
    banned = torch.zeros((steps.numel(), len(columns)), dtype=torch.bool, device=steps.device)
    for k, token in enumerate(columns):
        if token in params.suppress_tokens:
            banned[:, k] = True
        if token in params.begin_suppress_tokens:
            banned[:, k] |= steps == 0
        if params.min_new_tokens and token in eos_ids:
            banned[:, k] |= steps < params.min_new_tokens
    return columns, banned


def _kept(logits: torch.Tensor, steps: torch.Tensor, params: SamplingParams, eos_ids: list[int]) -> torch.Tensor:
    """The sampler's filters applied to logits [r, V] (temperature applied) at completion steps [r]: -inf where a
    token was not available to it."""
    columns, banned = _banned_columns(steps, params, eos_ids)
    if columns:
        logits = logits.clone()
        logits[:, columns] = logits[:, columns].masked_fill(banned, float("-inf"))
    return filter_logits(logits, replace(params, temperature=1.0))


def _kept_in_chunks(scaled_logits, count: int, steps: torch.Tensor, params: SamplingParams,
                    eos_ids: list[int]) -> torch.Tensor:
    """[count] log of the kept mass, ROWS_PER_CHUNK positions at a time; `scaled_logits(rows)` gives their
    [r, V] logits / T."""
    out = torch.empty(count, dtype=torch.float32, device=steps.device)
    for start in range(0, count, ROWS_PER_CHUNK):
        rows = slice(start, start + ROWS_PER_CHUNK)
        scaled = scaled_logits(rows)
        out[rows] = _kept(scaled, steps[rows], params, eos_ids).logsumexp(-1) - scaled.logsumexp(-1)
    return out


def _kept_from_hidden(hidden, layer, ids, logps, steps, params, temperature, eos_ids) -> torch.Tensor:
    """[M] log of the kept mass from the output layer's input [M, H], given the chosen tokens' log-probs [M]."""
    weight = layer.weight.float()
    bias = None if layer.bias is None else layer.bias.float()
    if _banned_only(params):  # a few columns: log p(v) = z_v - logsumexp, where logsumexp = z_y - log p(y)
        columns, banned = _banned_columns(steps, params, eos_ids)
        cols = torch.tensor(columns, device=hidden.device)
        h = hidden.float()
        z_cols = h @ weight[cols].T + (0 if bias is None else bias[cols])
        z_chosen = (h * weight[ids]).sum(-1) + (0 if bias is None else bias[ids])
        log_z = z_chosen / temperature - logps
        banned_mass = ((z_cols / temperature - log_z[:, None]).exp() * banned).sum(-1)
        return torch.log1p(-banned_mass.clamp(max=1 - 1e-7))
    return _kept_in_chunks(lambda rows: torch.nn.functional.linear(hidden[rows].float(), weight, bias) / temperature,
                           hidden.size(0), steps, params, eos_ids)


def trainer_logps(model, rollouts: Rollouts, params: SamplingParams, temperature: float,
                  eos_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's log-probs of the sampled tokens, over the vocabulary and over the sampler's support, from one
    forward: ([N, C], [N, C]) float32, 0 on padding. The first is what `token_logprobs` gives (the old log-probs);
    the second subtracts log sum_{v in S} softmax(logits / T)_v, S what the sampler's filters kept."""
    ids = torch.cat([rollouts.prompt_ids, rollouts.completion_ids], dim=1)
    attention = torch.cat([rollouts.prompt_mask, rollouts.completion_mask], dim=1).long()
    width = rollouts.completion_ids.size(1)
    mask = rollouts.completion_mask.bool()
    extra = rollouts.forward_inputs()
    if not restricts_support(params):
        full, _ = lp.token_logprobs(model, rollouts.prompt_ids, rollouts.prompt_mask, rollouts.completion_ids,
                                   rollouts.completion_mask, temperature, model_inputs=extra)
        return full, full
    steps = torch.arange(width, device=mask.device).expand_as(mask)[mask]
    chosen = rollouts.completion_ids[mask]
    layer = lp.output_layer(model) if lp.fast_path_available(model) and not extra else None
    if layer is not None and not lp.whole_only_in_forward(layer):  # as token_logprobs computes them, and the kept mass from the same hidden states
        hidden = lp.final_hidden(model, ids, attention)[:, -width - 1:-1][mask]  # [M, H]
        logps, _ = lp.chunked_token_logprobs(hidden, layer.weight, layer.bias, chosen, temperature, False)
        kept = _kept_from_hidden(hidden, layer, chosen, logps, steps, params, temperature, eos_ids)
    else:
        logits = lp.completion_logits(model, ids, attention, width + 1, extra)[:, :-1][mask].float() / temperature
        logps = logits.gather(-1, chosen[:, None]).squeeze(-1) - logits.logsumexp(-1)
        kept = _kept_in_chunks(lambda rows: logits[rows], logps.numel(), steps, params, eos_ids)
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    return zeros.masked_scatter(mask, logps), zeros.masked_scatter(mask, logps - kept)


def sampling_ratio(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                   clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """The importance weight of each token.

    Args:
        trainer_logps: [N, C] the trainer's log-probs over the sampler's support.
        sampler_logps: [N, C] the engine's.
        mask: [N, C] bool, completion tokens.
    Returns:
        [N, C], 1 on padding; a sequence mode repeats the sequence's ratio over its tokens.
    """
    diff = torch.nan_to_num((trainer_logps - sampler_logps) * mask, nan=0.0)  # NaN: the engine gave no log-prob
    log_ratio = diff.sum(-1, keepdim=True) if mode.startswith("sequence_") else diff
    ratio = log_ratio.exp()
    if mode.endswith("_truncate"):
        ratio = ratio.clamp(min=clip_min, max=clip_max)
    else:
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    return torch.where(mask, ratio.expand_as(diff), torch.ones_like(diff))


def local_stats(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, ratio: torch.Tensor,
                sequence_level: bool) -> torch.Tensor:
    """This process's [7] float: sum and count of |trainer - sampler| over tokens, its max, and the ratio's
    min, sum, count and max (per sequence or per token), for `reduce_stats` after a gather."""
    delta = (trainer_logps - sampler_logps).abs()[mask]
    delta = delta[~delta.isnan()]
    values = ratio[:, 0][mask.any(1)] if sequence_level else ratio[mask]
    some = bool(values.numel())
    return torch.stack([delta.sum().cpu(), torch.tensor(float(delta.numel())),
                        delta.max().cpu() if delta.numel() else torch.tensor(0.0),
                        values.min().cpu() if some else torch.tensor(math.inf), values.sum().cpu(),
                        torch.tensor(float(values.numel())),
                        values.max().cpu() if some else torch.tensor(-math.inf)]).float()


def reduce_stats(gathered: torch.Tensor) -> dict:
    """TRL's metric names from every process's `local_stats` ([P, 7] or [7 * P])."""
    s = gathered.view(-1, 7)
    tokens, ratios = float(s[:, 1].sum()), float(s[:, 5].sum())
    metrics = {"sampling/sampling_logp_difference/mean": float(s[:, 0].sum()) / max(tokens, 1.0),
               "sampling/sampling_logp_difference/max": float(s[:, 2].max())}
    if ratios:
        metrics.update({"sampling/importance_sampling_ratio/min": float(s[:, 3].min()),
                        "sampling/importance_sampling_ratio/mean": float(s[:, 4].sum()) / ratios,
                        "sampling/importance_sampling_ratio/max": float(s[:, 6].max())})
    return metrics
