"""Metrics of a GRPO step, with TRL's names, reduced over processes."""

import math

import torch

from posttrain.grpo.advantages import Advantages, nanmean, nanstd
from posttrain.grpo.losses import LossStats


def _f(x) -> float:
    return float(x) if x is not None else math.nan


def reward_metrics(rewards: torch.Tensor, adv: Advantages, names: list[str]) -> dict:
    """reward, reward_std, rewards/<name>/mean|std and frac_reward_zero_std over the gathered batch [N, F]."""
    out = {"reward": _f(nanmean(adv.rewards)), "reward_std": _f(nanstd(adv.rewards)),
           "frac_reward_zero_std": float(torch.isclose(adv.group_std.nan_to_num(0.0),
                                                       torch.zeros_like(adv.group_std)).float().mean())}
    for k, name in enumerate(names):
        out[f"rewards/{name}/mean"] = _f(nanmean(rewards[:, k]))
        out[f"rewards/{name}/std"] = _f(nanstd(rewards[:, k]))
    return out


def completion_metrics(lengths: torch.Tensor, is_eos: torch.Tensor) -> dict:
    """completions/* length statistics over the gathered batch; `clipped_ratio` = ended without EOS."""
    lengths = lengths.float()
    ended = lengths[is_eos]
    out = {"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
           "completions/max_length": float(lengths.max()), "completions/clipped_ratio": float((~is_eos).float().mean())}
    if ended.numel():
        out.update({"completions/mean_terminated_length": float(ended.mean()),
                    "completions/min_terminated_length": float(ended.min()),
                    "completions/max_terminated_length": float(ended.max())})
    return out


def loss_metrics(stats: list[LossStats], accelerator) -> dict:
    """Means over the step's micro-batches and all processes: entropy and kl per token (kl where the loss has a KL
    term), clip_ratio/* per token (per sequence with a sequence-level ratio), as TRL computes them."""
    device = accelerator.device
    sums = {k: accelerator.reduce(torch.stack([s.sums()[k].detach().float() for s in stats]).sum().to(device),
                                  reduction="sum")
            for k in stats[0].sums()}
    tokens = max(float(sums["tokens"]), 1.0)
    out = {"entropy": float(sums["entropy"]) / max(float(sums["entropy_tokens"]), 1.0)}
    if "kl" in sums:
        out["kl"] = float(sums["kl"]) / tokens
    units = max(float(sums["clip_units"]), 1.0) if "clip_units" in sums else tokens
    if "clip_low" in sums:
        # per-sequence extremes: reduced locally first, since processes may hold different numbers of rows
        # (zero-advantage rows are skipped), and gather needs the same shape everywhere
        low = accelerator.gather(torch.cat([s.clip_low_seq for s in stats]).min().reshape(1).to(device))
        high = accelerator.gather(torch.cat([s.clip_high_seq for s in stats]).max().reshape(1).to(device))
        out.update({"clip_ratio/low_mean": float(sums["clip_low"]) / units,
                    "clip_ratio/low_min": float(low.min()),
                    "clip_ratio/high_mean": float(sums["clip_high"]) / units,
                    "clip_ratio/high_max": float(high.max()),
                    "clip_ratio/region_mean": float(sums["clip_region"]) / units})
    if "cispo_clip" in sums:
        out["cispo_clip_ratio"] = float(sums["cispo_clip"]) / units
    if "phi_sum" in sums:
        out["vespo/phi_seq_mean"] = float(sums["phi_sum"]) / max(float(sums["sequences"]), 1.0)
    return out


def tool_metrics(counts: torch.Tensor | None, accelerator) -> dict:
    """tools/call_frequency (tool calls per completion) and tools/failure_frequency (failed calls per call, 0 without
    calls) over every process's completions, as TRL computes them; {} without tools. `counts`: [3] this process's
    completions, calls and failed calls."""
    if counts is None:
        return {}
    rows, calls, failures = (float(x) for x in accelerator.reduce(counts.to(accelerator.device), reduction="sum"))
    return {"tools/call_frequency": calls / max(rows, 1.0),
            "tools/failure_frequency": failures / calls if calls > 0 else 0.0}


def with_tokens_seen(metrics: dict, state) -> dict:
    """A generation batch's metrics with num_tokens, TRL's running total of the tokens fed to the model (prompts and
    the model's completion tokens, every process's), kept in `state` (transformers' TrainerState:
    num_input_tokens_seen, saved with each checkpoint)."""
    out = dict(metrics)
    state.num_input_tokens_seen += int(out.pop("input_tokens"))
    out["num_tokens"] = float(state.num_input_tokens_seen)
    return out
