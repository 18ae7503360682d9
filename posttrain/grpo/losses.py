"""GRPO-family policy losses: pure tensor functions in one name -> (objective, aggregation) table.

A loss is a per-token objective (PPO/GRPO's clipped surrogate, CISPO's clipped-weight REINFORCE, SAPO's soft gate,
VESPO's Gamma-weighted REINFORCE), optionally masked (off-policy sequences, low-entropy tokens), plus beta times the
k3 KL to a reference (times the importance ratio when `use_bias_correction_kl`), then aggregated. Aggregation
divides by a normaliser of the whole optimizer step (all its micro-batches), never of one micro-batch, so the update
is the same for any split of the step into micro-batches:

    per_sequence_mean   grpo, sapo   sum over sequences of (mean over the sequence's tokens) / sequences in the step
    local_token_mean    bnpo         sum over tokens / tokens in this process's step batch
    max_length_mean     dr_grpo      sum over tokens / (sequences in the step * max_completion_length)
    global_token_mean   dapo, cispo, vespo   sum over tokens / (tokens in the step across processes / processes)
    sequence_sum_mean   luspo        sum over sequences of (sum over the sequence's tokens) / sequences in the step

RLOO's loss (`rloo`) is the clipped surrogate of one ratio per sequence, exp(sum of its tokens' log-ratios), with
per_sequence_mean; its KL to the reference is a reward penalty (grpo/advantages.py leave_one_out_advantages).

(DDP averages gradients over processes, which is why the global mean divides by the count per process.)
Shapes: b completions in the micro-batch, C completion tokens.
"""

import math
from dataclasses import dataclass, fields, replace
from typing import Callable

import torch

SEQUENCE_LEVELS = ("sequence", "sequence_sum")  # importance_sampling_level values with one ratio per sequence


@dataclass(frozen=True)
class LossParams:
    """Hyper-parameters fixed at setup (GRPOConfig's fields of the same names)."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    beta: float = 0.0
    importance_sampling_level: str = "token"
    max_completion_length: int = 1
    use_bias_correction_kl: bool = True
    off_policy_mask_threshold: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

    @classmethod
    def from_config(cls, cfg) -> "LossParams":
        """The GRPOConfig fields of the same names (epsilon is epsilon_low)."""
        values = {f.name: getattr(cfg, f.name) for f in fields(cls) if f.name != "epsilon_low"}
        return cls(epsilon_low=cfg.epsilon, **values)


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
        sampling_ratio: [b, C] or None; the importance weight of each token for the engine's sampling distribution
            (grpo/sampler_correction.py): it multiplies the policy loss (KL unaffected), or enters VESPO's weight.
    """

    logps: torch.Tensor
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None
    advantages: torch.Tensor
    mask: torch.Tensor
    entropy_mask: torch.Tensor | None = None
    sampling_ratio: torch.Tensor | None = None


@dataclass(frozen=True)
class LossStats:
    """A micro-batch's sums that the step's metrics are made of (grpo/metrics.py loss_metrics); scalars, except the
    per-sequence [b] fractions; None where the loss type has no such quantity.

    Attributes:
        tokens: loss tokens.
        entropy, entropy_tokens: the entropy summed over the loss tokens, and their count.
        bonus_entropy, bonus_tokens: the same over the tokens the objective kept (the entropy quantile's).
        kl: the k3 KL summed over the loss tokens (beta != 0).
        clip_low, clip_high, clip_region: tokens (or sequences, with one ratio per sequence) clipped below, above,
            either; clip_units what they are divided by. clip_low_seq, clip_high_seq: [b] each sequence's fraction.
        cispo_clip: CISPO's clipped tokens.
        phi_sum, sequences: VESPO's weights summed over sequences, and their count.
    """

    tokens: torch.Tensor
    entropy: torch.Tensor | None = None
    entropy_tokens: torch.Tensor | None = None
    bonus_entropy: torch.Tensor | None = None
    bonus_tokens: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    clip_low: torch.Tensor | None = None
    clip_high: torch.Tensor | None = None
    clip_region: torch.Tensor | None = None
    clip_units: torch.Tensor | None = None
    clip_low_seq: torch.Tensor | None = None
    clip_high_seq: torch.Tensor | None = None
    cispo_clip: torch.Tensor | None = None
    phi_sum: torch.Tensor | None = None
    sequences: torch.Tensor | None = None

    PER_SEQUENCE = ("clip_low_seq", "clip_high_seq")

    def sums(self) -> dict[str, torch.Tensor]:
        """The scalar sums that are set, by name (what processes and micro-batches add up)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in self.PER_SEQUENCE and getattr(self, f.name) is not None}


@dataclass(frozen=True)
class LossOutputs:
    """The micro-batch's contribution to the step loss, and its sums for metrics."""

    loss: torch.Tensor
    stats: LossStats


def _masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum()


def log_ratio(inp: LossInputs) -> torch.Tensor:
    """log(pi / pi_old) per token [b, C]; 0 (with pi's gradient) when on-policy."""
    old = inp.old_logps if inp.old_logps is not None else inp.logps.detach()
    return inp.logps - old


def importance_ratio(inp: LossInputs, level: str) -> torch.Tensor:
    """pi/pi_old per token [b, C], or per sequence [b, 1]: exp(mean log-ratio) at level "sequence" (GSPO), the
    sequence's probability ratio exp(sum log-ratio) at level "sequence_sum" (RLOO)."""
    log_r = log_ratio(inp)
    if level in SEQUENCE_LEVELS:
        mask = inp.mask.float()
        log_r = (log_r * mask).sum(-1)
        if level == "sequence":
            log_r = log_r / mask.sum(-1).clamp(min=1.0)
        log_r = log_r.unsqueeze(-1)
    return torch.exp(log_r)


def k3_kl(inp: LossInputs) -> torch.Tensor:
    """exp(ref - logp) - (ref - logp) - 1 per token [b, C]: an unbiased, non-negative KL estimate."""
    diff = inp.ref_logps - inp.logps
    return torch.exp(diff) - diff - 1


# ------------------------------------------------------------------ per-token objectives
# Each takes the inputs, the params and the importance ratio ([b, C], or [b, 1] at sequence level), and returns the
# per-token loss (broadcastable to [b, C]) and its sums for metrics, by LossStats field name.


def clipped_surrogate(inp: LossInputs, p: LossParams, ratio: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """-min(r A, clip(r, 1-eps_low, 1+eps_high) A) per token, with r capped at delta when set."""
    adv = inp.advantages.unsqueeze(-1)
    clipped = ratio.clamp(1 - p.epsilon_low, 1 + p.epsilon_high)
    unclipped = ratio.clamp(max=p.delta) if p.delta is not None else ratio
    loss = -torch.min(unclipped * adv, clipped * adv)
    with torch.no_grad():
        low = ((ratio < 1 - p.epsilon_low) & (adv < 0)).float()
        high = ((ratio > 1 + p.epsilon_high) & (adv > 0)).float()
        stats = clip_stats(low, high, inp.mask.float(), ratio.size(-1) == 1 and inp.mask.size(-1) > 1)
    return loss, stats


def clip_stats(low: torch.Tensor, high: torch.Tensor, mask: torch.Tensor, per_sequence: bool) -> dict:
    """Clip counts as TRL logs them: over tokens, or over sequences when the ratio is one per sequence.

    `clip_units` is what the counts are divided by (tokens or sequences); `*_seq` are each sequence's fractions.
    """
    if per_sequence:  # [b, 1]: one decision per sequence
        seq_low, seq_high = low.squeeze(-1), high.squeeze(-1)
        return {"clip_low": low.sum(), "clip_high": high.sum(), "clip_region": ((low + high) > 0).float().sum(),
                "clip_units": torch.tensor(float(low.size(0)), device=low.device),
                "clip_low_seq": seq_low, "clip_high_seq": seq_high}
    low, high = low.expand_as(mask), high.expand_as(mask)
    per_seq = mask.sum(-1).clamp(min=1)
    return {"clip_low": _masked_sum(low, mask), "clip_high": _masked_sum(high, mask),
            "clip_region": _masked_sum(((low + high) > 0).float(), mask), "clip_units": mask.sum(),
            "clip_low_seq": (low * mask).sum(-1) / per_seq, "clip_high_seq": (high * mask).sum(-1) / per_seq}


def cispo_objective(inp: LossInputs, p: LossParams, ratio: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """-min(r, eps_high).detach() * A * logp per token (CISPO: the weight is clipped, the gradient kept).

    Its clip count, as TRL's, is the tokens with r > eps_high and a positive advantage."""
    adv = inp.advantages.unsqueeze(-1)
    loss = -ratio.clamp(max=p.epsilon_high).detach() * adv * inp.logps
    with torch.no_grad():
        clipped = ((ratio > p.epsilon_high) & (adv > 0)).float()
        if ratio.size(-1) == 1 and inp.mask.size(-1) > 1:  # one ratio per sequence: counted per sequence
            stats = {"cispo_clip": clipped.sum(), "clip_units": torch.tensor(float(clipped.size(0)))}
        else:
            mask = inp.mask.float()
            stats = {"cispo_clip": _masked_sum(clipped.expand_as(mask), mask), "clip_units": mask.sum()}
    return loss, stats


def sapo_objective(inp: LossInputs, p: LossParams, ratio: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """-sigmoid(t (r - 1)) * 4 / t * A per token (SAPO's soft gate in place of clipping); t is
    sapo_temperature_pos for A > 0, sapo_temperature_neg otherwise. At r = 1 the gate is 2 / t, with slope 1."""
    adv = inp.advantages.unsqueeze(-1)
    t = torch.where(adv > 0, p.sapo_temperature_pos, p.sapo_temperature_neg)
    return -torch.sigmoid(t * (ratio - 1)) * 4 / t * adv, {}


def vespo_weights(inp: LossInputs, p: LossParams) -> torch.Tensor:
    """VESPO's Gamma weight per sequence [b, 1], detached: phi(w) = exp(lambda + k log w - lambda w) with w the
    sequence's importance weight exp(sum of clamped token log-ratios); (k, lambda) by the advantage's sign.
    phi(1) = 1, so on-policy every weight is 1."""
    with torch.no_grad():
        mask = inp.mask.float()
        seq = (log_ratio(inp).clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
        if inp.sampling_ratio is not None:  # w = pi/pi_old * pi_old/pi_sampler, per token, in log space
            log_is = inp.sampling_ratio.clamp(min=1e-30).log().clamp(math.log(1e-8), 20.0)
            seq = seq + (log_is * mask).sum(-1, keepdim=True)
        log_w = seq.clamp(math.log(1e-8), 20.0)
        nonneg = inp.advantages.unsqueeze(-1) >= 0
        k = torch.where(nonneg, p.vespo_k_pos, p.vespo_k_neg)
        lam = torch.where(nonneg, p.vespo_lambda_pos, p.vespo_lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo_objective(inp: LossInputs, p: LossParams, ratio: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """-phi * A * logp per token, phi the detached Gamma weight of the sequence (VESPO)."""
    phi = vespo_weights(inp, p)
    loss = -phi * inp.advantages.unsqueeze(-1) * inp.logps
    return loss, {"phi_sum": phi.sum(), "sequences": torch.tensor(float(phi.size(0)), device=phi.device)}


def off_policy_keep(inp: LossInputs, p: LossParams) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask [b, 1]: 1 where the advantage is >= 0 or the sequence's mean
    per-token KL(sampler || policy), estimated as mean(old - logp), is at most off_policy_mask_threshold."""
    old = inp.old_logps if inp.old_logps is not None else inp.logps.detach()
    mask = inp.mask.float()
    kl = torch.nan_to_num(old - inp.logps.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    keep = (inp.advantages.unsqueeze(-1) >= 0) | (mean_kl <= p.off_policy_mask_threshold)
    return keep.to(mask.dtype)


def per_token_loss(entry: "Loss", inp: LossInputs, p: LossParams) -> tuple[torch.Tensor, LossStats]:
    """The loss entry's objective with its masks, plus the KL term: [b, C] (or broadcastable) loss, and stats."""
    ratio = importance_ratio(inp, p.importance_sampling_level)
    loss, stats = entry.objective(inp, p, ratio)
    if p.off_policy_mask_threshold is not None:
        loss = loss * off_policy_keep(inp, p)
    if inp.entropy_mask is not None:
        loss = loss * inp.entropy_mask
    if inp.sampling_ratio is not None and not entry.sequence_weight:  # a sequence weight carries it (VESPO's phi)
        loss = loss * inp.sampling_ratio
    if p.beta != 0.0:
        kl = k3_kl(inp)
        if p.use_bias_correction_kl:
            kl = kl * ratio  # the ratio's gradient makes the KL gradient the unbiased reverse-KL one
        loss = loss + p.beta * kl
        stats["kl"] = _masked_sum(kl.detach(), inp.mask.float())
    return loss, LossStats(tokens=inp.mask.float().sum(), **stats)


# ------------------------------------------------------------------ aggregations over the step


def per_sequence_mean(loss, mask, norm: StepNormalizer, p: LossParams) -> torch.Tensor:
    return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / norm.sequences


def local_token_mean(loss, mask, norm: StepNormalizer, p: LossParams) -> torch.Tensor:
    return _masked_sum(loss, mask) / max(norm.tokens, 1.0)


def max_length_mean(loss, mask, norm: StepNormalizer, p: LossParams) -> torch.Tensor:
    return _masked_sum(loss, mask) / (norm.sequences * p.max_completion_length)


def global_token_mean(loss, mask, norm: StepNormalizer, p: LossParams) -> torch.Tensor:
    return _masked_sum(loss, mask) / max(norm.tokens_per_process, 1.0)


def sequence_sum_mean(loss, mask, norm: StepNormalizer, p: LossParams) -> torch.Tensor:
    return _masked_sum(loss, mask) / norm.sequences


@dataclass(frozen=True)
class Loss:
    """A loss type: its per-token objective, how the step aggregates it, and what the trainer may assume of it.

    Attributes:
        sequence_weight: the objective weighs each token by a (detached) function of its whole sequence, logged over
            every sequence, which also carries the engine's sampling ratio (VESPO's phi).
    """

    objective: Callable
    aggregate: Callable
    sequence_weight: bool = False

    def __call__(self, inp: LossInputs, p: LossParams, norm: StepNormalizer) -> LossOutputs:
        loss, stats = per_token_loss(self, inp, p)
        return LossOutputs(self.aggregate(loss, inp.mask.float(), norm, p), stats)

    def token_local(self, p: LossParams, off_policy: bool) -> bool:
        """Whether each token's loss term depends on its own log-prob only, so that its gradient can be predicted in
        the forward (models/chunked.py). Not so on stored old log-probs (`off_policy`) with a sequence-level ratio, a
        sequence weight or the off-policy mask, nor with a bias-corrected KL weighted by a sequence-level ratio."""
        sequence_ratio = p.importance_sampling_level in SEQUENCE_LEVELS
        if off_policy and (sequence_ratio or self.sequence_weight or p.off_policy_mask_threshold is not None):
            return False
        return not (p.beta != 0.0 and p.use_bias_correction_kl and sequence_ratio)

    def needs_zero_advantage_rows(self, p: LossParams) -> bool:
        """Whether a row whose advantage is 0 changes the loss or its metrics: through the KL term, or a sequence
        weight logged over every sequence. Otherwise its gradient is exactly 0 and the row may be skipped."""
        return p.beta != 0.0 or self.sequence_weight


LOSSES = {
    "grpo": Loss(clipped_surrogate, per_sequence_mean),
    "bnpo": Loss(clipped_surrogate, local_token_mean),
    "dr_grpo": Loss(clipped_surrogate, max_length_mean),
    "dapo": Loss(clipped_surrogate, global_token_mean),
    "cispo": Loss(cispo_objective, global_token_mean),
    "sapo": Loss(sapo_objective, per_sequence_mean),
    "luspo": Loss(clipped_surrogate, sequence_sum_mean),
    "vespo": Loss(vespo_objective, global_token_mean, sequence_weight=True),
    # RLOO (posttrain/rloo): the clipped surrogate of each sequence's probability ratio (importance_sampling_level
    # "sequence_sum"), one term per sequence, averaged over the step's sequences; its KL is in the reward instead
    "rloo": Loss(clipped_surrogate, per_sequence_mean),
}


def get_loss(name: str) -> Loss:
    """The loss registered under `name`."""
    if name not in LOSSES:
        raise ValueError(f"Unknown loss_type {name!r}: choose one of {', '.join(LOSSES)}.")
    return LOSSES[name]


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, norm: StepNormalizer) -> torch.Tensor:
    """The step's mean per-token entropy, this micro-batch's share: sum(entropy * mask) / (step tokens across
    processes / processes). Subtracted from the loss times entropy_coef; [b, C] entropy (with grad) -> scalar."""
    return _masked_sum(entropy, mask.float()) / max(norm.tokens_per_process, 1.0)


def entropy_quantile_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor | None:
    """top_entropy_quantile: the [b, C] loss tokens whose entropy is in the top `quantile` of the micro-batch's, or
    None when every token counts (quantile 1)."""
    if quantile >= 1.0:
        return None
    values = entropy[mask].float()
    if values.numel() == 0:
        return mask
    return (entropy >= torch.quantile(values, 1.0 - quantile)) & mask


@dataclass(frozen=True)
class MicroBatchLoss:
    """A micro-batch's loss and what the step's metrics need of it.

    Attributes:
        loss: what is backpropagated: the objective, minus the entropy bonus when there is one.
        policy_loss: the objective alone.
        stats: the objective's sums, with the entropy's over the loss tokens and over the tokens the objective kept
            (the entropy quantile's).
    """

    loss: torch.Tensor
    policy_loss: torch.Tensor
    stats: LossStats

    def detached(self) -> "MicroBatchLoss":
        return MicroBatchLoss(self.loss.detach(), self.policy_loss.detach(), self.stats)


def micro_batch_loss(loss_fn: Loss, params: LossParams, inputs: LossInputs, entropy: torch.Tensor,
                     norm: StepNormalizer, top_entropy_quantile: float = 1.0, bonus: float = 0.0) -> MicroBatchLoss:
    """The GRPO loss of one micro-batch, as training and evaluation compute it: the entropy quantile's tokens, the
    loss table's objective over them, and the entropy bonus (coefficient `bonus`) subtracted.

    Args:
        inputs: the micro-batch (its entropy_mask is set here).
        entropy: [b, C] per-token entropy (with its gradient when the bonus needs it).
    """
    kept = entropy_quantile_mask(entropy.detach(), inputs.mask, top_entropy_quantile)
    out = loss_fn(replace(inputs, entropy_mask=kept), params, norm)
    effective = inputs.mask if kept is None else kept
    loss = out.loss - bonus * entropy_bonus(entropy, effective, norm) if bonus else out.loss
    seen = entropy.detach()
    stats = replace(out.stats, entropy=(seen * inputs.mask).sum(), entropy_tokens=inputs.mask.sum(),
                    bonus_entropy=(seen * effective).sum(), bonus_tokens=effective.sum())
    return MicroBatchLoss(loss, out.loss, stats)
