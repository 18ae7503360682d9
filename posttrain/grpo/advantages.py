"""Group-relative advantages from a reward matrix.

Shapes: N = B*G completions (B prompts, G completions each, group members contiguous), F reward functions.
NaN in the reward matrix means "not applicable" and is left out of every mean and std.
"""

from dataclasses import dataclass

import torch

STD_EPS = 1e-4  # added to the std before dividing, as in TRL


def nanmean(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    return x.nanmean() if dim is None else x.nanmean(dim=dim, keepdim=keepdim)


def nanstd(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """Unbiased std ignoring NaN; NaN where fewer than two values are present."""
    valid = ~torch.isnan(x)
    if dim is None:
        x, valid, dim = x.reshape(-1), valid.reshape(-1), 0
    count = valid.sum(dim=dim, keepdim=True)
    mean = x.nansum(dim=dim, keepdim=True) / count.clamp(min=1)
    var = ((x - mean) ** 2).nansum(dim=dim, keepdim=True) / (count - 1).clamp(min=1)
    std = var.sqrt().masked_fill(count < 2, float("nan"))
    return std if keepdim else std.squeeze(dim)


@dataclass(frozen=True)
class Advantages:
    """Per-completion advantages and the statistics logged with them.

    Attributes:
        advantages: [N] float32; 0 where no reward applied.
        rewards: [N] weighted reward of each completion (NaN where no function applied).
        group_std: [N] std of the weighted reward within each completion's group.
    """

    advantages: torch.Tensor
    rewards: torch.Tensor
    group_std: torch.Tensor


def _grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    if x.size(0) % group_size:
        raise ValueError(f"{x.size(0)} rewards do not split into groups of {group_size}.")
    return x.view(-1, group_size, *x.shape[1:])


def _group_stats(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group mean and std of x [N] (or [N, F]), each repeated back to x's shape."""
    g = _grouped(x, group_size)
    mean = nanmean(g, dim=1, keepdim=True).expand_as(g).reshape(x.shape)
    std = nanstd(g, dim=1, keepdim=True).expand_as(g).reshape(x.shape)
    return mean, std


def weighted_sum(rewards: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_k w_k r_k ignoring NaN; NaN for rows where every function returned None. [N, F] -> [N]."""
    total = (rewards * weights).nansum(dim=1)
    return total.masked_fill(torch.isnan(rewards).all(dim=1), float("nan"))


def group_advantages(rewards: torch.Tensor, weights: torch.Tensor, group_size: int, scale: str = "group",
                     aggregation: str = "sum_then_normalize") -> Advantages:
    """Advantages relative to each group.

    sum_then_normalize: r = sum_k w_k r_k; A = (r - mean_group(r)) / (std + 1e-4), where std is the
    group's (scale="group"), the whole batch's ("batch"), or no division at all ("none").
    normalize_then_sum (GDPO): each r_k is normalised within its group first, then weighted and summed,
    then normalised over the batch; `scale` does not apply.

    Args:
        rewards: [N, F] rewards of every completion in the (global) batch, NaN = not applicable.
        weights: [F] reward weights.
        group_size: G; rows i*G..(i+1)*G-1 share a prompt.
    Returns:
        Advantages with [N] tensors.
    """
    rewards = rewards.float()
    weights = weights.to(rewards)
    total = weighted_sum(rewards, weights)
    _, group_std = _group_stats(total, group_size)
    if aggregation == "sum_then_normalize":
        mean, std = _group_stats(total, group_size)
        adv = total - mean
        if scale == "batch":
            adv = adv / (nanstd(total) + STD_EPS)
        elif scale == "group":
            adv = adv / (std + STD_EPS)
    elif aggregation == "normalize_then_sum":
        mean_k, std_k = _group_stats(rewards, group_size)
        summed = weighted_sum((rewards - mean_k) / (std_k + STD_EPS), weights)
        adv = (summed - nanmean(summed)) / (nanstd(summed) + STD_EPS)
    else:
        raise ValueError(f"Unknown multi_objective_aggregation {aggregation!r}.")
    return Advantages(advantages=torch.nan_to_num(adv, nan=0.0), rewards=total, group_std=group_std)


def leave_one_out_advantages(rewards: torch.Tensor, weights: torch.Tensor, group_size: int,
                             kl: torch.Tensor | None = None, beta: float = 0.0,
                             clip_range: tuple[float, float] | None = None, normalize: bool = False) -> Advantages:
    """RLOO's advantages (TRL 1.16's RLOOTrainer): each completion's reward less the mean reward of the other
    completions of its group.

    r = sum_k w_k r_k, clamped to `clip_range`, minus beta * KL (each sequence's summed log-ratio to the reference);
    A_i = r_i - (sum_{j != i} r_j) / (n - 1) over the group's n scorable completions (a completion every function
    returned None for is left out of its siblings' baselines and gets 0, as does the sole scorable one of a group);
    with `normalize`, A is standardised over the batch's scorable completions.

    Args:
        rewards: [N, F] rewards of every completion in the (global) batch, NaN = not applicable.
        weights: [F] reward weights.
        group_size: G; rows i*G..(i+1)*G-1 share a prompt.
        kl: [N] each completion's summed per-token log(pi_old / pi_ref), or None (beta = 0).
    Returns:
        Advantages: `rewards` the weighted sum before clipping and the KL penalty (what TRL logs as reward),
        `group_std` the std of the penalised rewards within each group.
    """
    rewards = rewards.float()
    total = weighted_sum(rewards, weights.to(rewards))
    penalised = total if clip_range is None else total.clamp(min=clip_range[0], max=clip_range[1])
    if beta != 0.0 and kl is not None:
        penalised = penalised - beta * kl.float()
    _, group_std = _group_stats(penalised, group_size)
    grouped = _grouped(penalised, group_size)  # [B, G]
    scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    others = (grouped.nansum(dim=1, keepdim=True) - grouped) / (scorable - 1)  # NaN (0/0) with one scorable
    adv = (grouped - others).reshape(-1) if group_size > 1 else torch.zeros_like(penalised)
    if normalize:
        adv = (adv - nanmean(adv)) / (nanstd(adv) + STD_EPS)
    return Advantages(advantages=torch.nan_to_num(adv, nan=0.0), rewards=total, group_std=group_std)
