"""RLOOConfig: TRL 1.16's RLOOConfig, field for field.

TRL's RLOOConfig holds GRPOConfig's fields less the GRPO objective's own (loss types, their parameters, reward
scaling, the entropy controls, the sampler correction), plus `normalize_advantages` and `reward_clip_range`, with
num_generations 2 and beta 0.05 by default. RLOOConfig is GRPOConfig with RLOOObjectiveConfig's fields and defaults
(the `rloo` group of `posttrain rloo --help`); a GRPO-only field set to anything but its default is refused in one
sentence rather than ignored.
"""

from dataclasses import dataclass
from typing import Optional

from posttrain.configs.base import NON_NEGATIVE, ConfigError, Range, _help
from posttrain.configs.grpo import GRPOConfig, refuse_grpo_only

# GRPOConfig fields that TRL 1.16's RLOOConfig does not have: RLOO's objective has no such knob
GRPO_ONLY = ("loss_type", "importance_sampling_level", "scale_rewards", "multi_objective_aggregation", "delta",
             "off_policy_mask_threshold", "use_bias_correction_kl", "top_entropy_quantile", "entropy_coef",
             "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target",
             "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
             "vespo_lambda_neg", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
             "vllm_importance_sampling_cap", "vllm_importance_sampling_clip_min",
             "vllm_importance_sampling_clip_max", "async_generation", "max_staleness", "weight_sync_steps",
             "max_inflight_tasks", "queue_maxsize", "heartbeat_stale_after_s")


@dataclass
class RLOOObjectiveConfig:
    """RLOO's advantage and its KL penalty: the leave-one-out baseline over each prompt's `num_generations`
    completions, `normalize_advantages`, `reward_clip_range`, and `beta` times log(pi_old / pi_ref) taken from each
    completion's reward."""

    num_generations: int = _help(
        "Completions sampled per prompt; each one's baseline is the mean reward of the others (at least 2).",
        range=Range(2), default=2)
    beta: float = _help(
        "Weight of the KL penalty subtracted from each completion's reward: beta times the sum over its tokens of "
        "log(pi_old / pi_ref) (RLOO's first-order estimate); 0 loads no reference model.",
        range=NON_NEGATIVE, default=0.05)
    normalize_advantages: bool = _help(
        "Standardise the leave-one-out advantages over the generation batch (mean 0, std 1).", default=False)
    reward_clip_range: Optional[list[float]] = _help(
        "Clamp each completion's weighted reward to [low, high] before the KL penalty and the baseline (`--"
        "reward_clip_range -10 10`, YAML `[-10, 10]`); None keeps it as it is.", default=None)

    def _check(self):
        clip = self.reward_clip_range
        if clip is None:
            return
        try:
            low, high = (float(x) for x in clip)
        except (TypeError, ValueError):
            raise ConfigError(f"reward_clip_range={clip!r} must be two numbers [low, high], e.g. [-10, 10].") from None
        if not low <= high:
            raise ConfigError(f"reward_clip_range={clip!r} has its low end above its high end: give [low, high].")
        self.reward_clip_range = (low, high)


@dataclass
class RLOOConfig(RLOOObjectiveConfig, GRPOConfig):
    """Everything that configures an RLOO run (TRL's `RLOOConfig` names and defaults): GRPOConfig's sampling, data,
    loop and generation fields, RLOO's advantage (leave-one-out baseline, `normalize_advantages`,
    `reward_clip_range`, the KL to the reference as a reward penalty) and its sequence-level clipped loss.

    GRPOConfig's objective fields that TRL's RLOOConfig lacks (GRPO_ONLY) stay fields, so that a config written by a
    run reads back, but any value other than the default is refused; they are not flags of `posttrain rloo`.
    """

    # before GRPO's sampling and objective groups, so that num_generations and beta are shown with RLOO's defaults
    GROUPS = (*GRPOConfig.GROUPS[:6], RLOOObjectiveConfig, *GRPOConfig.GROUPS[6:])
    NOT_FLAGS = GRPO_ONLY

    vllm_importance_sampling_correction: bool = _help(
        "Not an RLOO field (TRL's RLOO does not correct for the engine's sampling): kept False.", default=False)

    def __post_init__(self):
        self._refuse_grpo_only()
        super().__post_init__()

    def _refuse_grpo_only(self):
        refuse_grpo_only(self, GRPO_ONLY, "RLOOConfig", "RLOO", "its loss is the clipped surrogate of each sequence's "
                         "probability ratio, its advantage the leave-one-out baseline")
