"""GRPO-family policy losses: pure tensor functions in one name -> function table.

A loss is an objective per token (the clipped surrogate of PPO/GRPO, or CISPO's clipped-weight
REINFORCE), optionally plus beta times the k3 KL to a reference, then aggregated. Aggregation divides
by a normaliser of the whole optimizer step (all its micro-batches), never of one micro-batch, so
the update is the same for any split of the step into micro-batches:

    grpo     sum over sequences of (mean over the sequence's tokens) / sequences in the step
    bnpo     sum over tokens / tokens in this process's step batch
    dr_grpo  sum over tokens / (sequences in the step * max_completion_length)
    dapo     sum over tokens / (tokens in the step across all processes / processes)
    cispo    as dapo, with CISPO's objective

(DDP averages gradients over processes, which is why dapo divides by the global count per process.)
Shapes: b completions in the micro-batch, C completion tokens.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossParams:
    """Hyper-parameters fixed at setup."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    beta: float = 0.0
    importance_sampling_level: str = "token"
    max_completion_length: int = 1


@dataclass(frozen=True)
class StepNormalizer:
    """Counts over the whole optimizer step that aggregation divides by.

    Attributes:
        sequences: completions in this process's step batch.
        tokens: loss tokens in this process's step batch.
        tokens_per_process: loss tokens in the step batch of all processes, divided by the process count.
    """

    sequences: int
    tokens: float
    tokens_per_process: float


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch.

    Attributes:
        logps: [b, C] log-probs under the policy being trained (with grad).
        old_logps: [b, C] log-probs under the policy that sampled, or None when on-policy (ratio 1).
        ref_logps: [b, C] log-probs under the reference model, or None when beta = 0.
        advantages: [b].
        mask: [b, C] bool, tokens that count in the loss and its normaliser.
        entropy_mask: [b, C] bool or None; policy-loss tokens kept by top_entropy_quantile (KL unaffected).
    """

    logps: torch.Tensor
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None
    advantages: torch.Tensor
    mask: torch.Tensor
    entropy_mask: torch.Tensor | None = None


@dataclass(frozen=True)
class LossOutputs:
    """The micro-batch's contribution to the step loss, and token sums for metrics."""

    loss: torch.Tensor
    stats: dict


def _masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def importance_ratio(inp: LossInputs, level: str) -> torch.Tensor:
    """pi/pi_old per token [b, C], or per sequence [b, 1] as exp(mean log-ratio) (GSPO)."""
    old = inp.old_logps if inp.old_logps is not None else inp.logps.detach()
    log_ratio = inp.logps - old
    if level == "sequence":
        mask = inp.mask.float()
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    return torch.exp(log_ratio)


def k3_kl(inp: LossInputs) -> torch.Tensor:
    """exp(ref - logp) - (ref - logp) - 1 per token [b, C]: an unbiased, non-negative KL estimate."""
    diff = inp.ref_logps - inp.logps
    return torch.exp(diff) - diff - 1


def clipped_surrogate(inp: LossInputs, p: LossParams) -> tuple[torch.Tensor, dict]:
    """-min(r A, clip(r, 1-eps_low, 1+eps_high) A) per token, with r capped at delta when set."""
    ratio = importance_ratio(inp, p.importance_sampling_level)
    adv = inp.advantages.unsqueeze(-1)
    clipped = ratio.clamp(1 - p.epsilon_low, 1 + p.epsilon_high)
    unclipped = ratio.clamp(max=p.delta) if p.delta is not None else ratio
    loss = -torch.min(unclipped * adv, clipped * adv)
    mask = inp.mask.float()
    with torch.no_grad():
        low = ((ratio < 1 - p.epsilon_low) & (adv < 0)).float().expand_as(mask)
        high = ((ratio > 1 + p.epsilon_high) & (adv > 0)).float().expand_as(mask)
        per_seq = mask.sum(-1).clamp(min=1)
        stats = {"clip_low": _masked_sum(low, mask), "clip_high": _masked_sum(high, mask),
                 "clip_region": _masked_sum(((low + high) > 0).float(), mask),
                 "clip_low_seq": (low * mask).sum(-1) / per_seq, "clip_high_seq": (high * mask).sum(-1) / per_seq}
    return loss, stats


def cispo_objective(inp: LossInputs, p: LossParams) -> tuple[torch.Tensor, dict]:
    """-min(r, eps_high).detach() * A * logp per token (CISPO: the weight is clipped, the gradient kept)."""
    ratio = importance_ratio(inp, p.importance_sampling_level)
    weight = ratio.clamp(max=p.epsilon_high).detach()
    loss = -weight * inp.advantages.unsqueeze(-1) * inp.logps
    with torch.no_grad():
        stats = {"cispo_clip": _masked_sum((ratio > p.epsilon_high).float().expand_as(inp.mask), inp.mask.float())}
    return loss, stats


def _per_token(objective, inp: LossInputs, p: LossParams) -> tuple[torch.Tensor, dict]:
    loss, stats = objective(inp, p)
    if inp.entropy_mask is not None:
        loss = loss * inp.entropy_mask
    if p.beta != 0.0:
        kl = k3_kl(inp)
        loss = loss + p.beta * kl
        stats["kl"] = _masked_sum(kl.detach(), inp.mask.float())
    stats["tokens"] = inp.mask.float().sum()
    return loss, stats


def grpo_loss(inp: LossInputs, p: LossParams, norm: StepNormalizer) -> LossOutputs:
    """Clipped surrogate, mean over each sequence's tokens, then over the step's sequences."""
    loss, stats = _per_token(clipped_surrogate, inp, p)
    mask = inp.mask.float()
    per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return LossOutputs(per_seq.sum() / norm.sequences, stats)


def bnpo_loss(inp: LossInputs, p: LossParams, norm: StepNormalizer) -> LossOutputs:
    """Clipped surrogate, mean over the tokens of this process's step batch."""
    loss, stats = _per_token(clipped_surrogate, inp, p)
    return LossOutputs(_masked_sum(loss, inp.mask.float()) / max(norm.tokens, 1.0), stats)


def dr_grpo_loss(inp: LossInputs, p: LossParams, norm: StepNormalizer) -> LossOutputs:
    """Clipped surrogate, summed and divided by sequences * max_completion_length (Dr. GRPO)."""
    loss, stats = _per_token(clipped_surrogate, inp, p)
    return LossOutputs(_masked_sum(loss, inp.mask.float()) / (norm.sequences * p.max_completion_length), stats)


def dapo_loss(inp: LossInputs, p: LossParams, norm: StepNormalizer) -> LossOutputs:
    """Clipped surrogate, mean over the tokens of the global step batch (DAPO's token-level loss)."""
    loss, stats = _per_token(clipped_surrogate, inp, p)
    return LossOutputs(_masked_sum(loss, inp.mask.float()) / max(norm.tokens_per_process, 1.0), stats)


def cispo_loss(inp: LossInputs, p: LossParams, norm: StepNormalizer) -> LossOutputs:
    """CISPO's objective, normalised as dapo."""
    loss, stats = _per_token(cispo_objective, inp, p)
    return LossOutputs(_masked_sum(loss, inp.mask.float()) / max(norm.tokens_per_process, 1.0), stats)


LOSSES = {"grpo": grpo_loss, "bnpo": bnpo_loss, "dr_grpo": dr_grpo_loss, "dapo": dapo_loss, "cispo": cispo_loss}


def get_loss(name: str):
    """The loss function registered under `name`."""
    if name not in LOSSES:
        raise ValueError(f"Unknown loss_type {name!r}: choose one of {', '.join(LOSSES)}.")
    return LOSSES[name]
