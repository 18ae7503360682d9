"""DistillationConfig: TRL 1.16's DistillationConfig, field for field.

TRL's DistillationConfig holds GRPOConfig's data, loop, sampling and generation-server fields (one completion per
prompt, sampled from the student), none of its objective's, plus the teacher's fields, with `beta` choosing the
divergence (0 forward KL, 1 reverse KL, between them the generalized Jensen-Shannon divergence) and its defaults:
beta 1.0, disable_dropout False, remove_unused_columns False. DistillationConfig is
GRPOConfig with DistillationObjectiveConfig's fields and defaults (the `distillation` group of `posttrain
distillation --help`); a GRPO objective field set to anything but its default is refused in one sentence rather than
ignored, and is not a flag.
"""

from dataclasses import dataclass
from typing import Optional, Union

from posttrain.configs.base import FRACTION, ConfigError, _help
from posttrain.configs.grpo import GRPOConfig, refuse_grpo_only

# GRPOConfig fields that TRL 1.16's DistillationConfig does not have: its objective and its groups have no such knob
GRPO_ONLY = ("num_iterations", "use_bias_correction_kl", "epsilon", "delta", "sapo_temperature_neg",
             "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
             "loss_type", "importance_sampling_level", "off_policy_mask_threshold", "scale_rewards",
             "multi_objective_aggregation", "reward_weights", "mask_truncated_completions", "top_entropy_quantile",
             "entropy_coef", "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta",
             "entropy_target", "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps", "reward_timeout",
             "on_bad_reward", "dynamic_sampling", "dynamic_sampling_max_rounds", "dynamic_sampling_filter",
             "num_generations_eval", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
             "vllm_importance_sampling_cap", "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max",
             "log_multimodal", "log_completions_hub_repo", "use_transformers_continuous_batching",
             "transformers_continuous_batching_config", "use_transformers_paged", "vllm_kv_cache_dtype",
             "router_aux_loss_coef", "activation_offloading", "async_generation", "max_staleness",
             "weight_sync_steps", "max_inflight_tasks", "queue_maxsize", "heartbeat_stale_after_s")
# derived at construction from the batch sizes (one generation a step, TRL's): written to posttrain_config.yaml and
# read back, so they are fields, checked against what they must be, but not flags
DERIVED = ("num_generations", "generation_batch_size", "steps_per_generation", "epsilon_high")


@dataclass
class DistillationObjectiveConfig:
    """The teacher, and the divergence between its next-token distributions and the student's on the student's own
    completions."""

    teacher_model_name_or_path: Optional[str] = _help(
        "The teacher: a path or hub id, loaded with teacher_model_init_kwargs (or pass teacher_model to the trainer). "
        "It must share the student's vocabulary.", default=None)
    teacher_model_revision: Optional[str] = _help("The teacher's revision (branch, tag or commit).", default=None)
    teacher_model_init_kwargs: Union[dict, str, None] = _help(
        "Keyword arguments for the teacher's from_pretrained (a dict, or a JSON string on the command line).",
        default=None)
    beta: float = _help(
        "The divergence: 0 forward KL(teacher || student), 1 reverse KL(student || teacher), between them the "
        "generalized Jensen-Shannon divergence (0.5 the standard JSD). Not GRPO's KL coefficient: there is no "
        "reference model.", range=FRACTION, default=1.0)

    def _check(self):
        if isinstance(self.teacher_model_init_kwargs, str):
            import json

            try:
                self.teacher_model_init_kwargs = json.loads(self.teacher_model_init_kwargs)
            except json.JSONDecodeError:
                raise ConfigError(f"teacher_model_init_kwargs={self.teacher_model_init_kwargs!r} is not a JSON "
                                  'object: write it as {"dtype": "bfloat16"}.') from None


@dataclass
class DistillationConfig(DistillationObjectiveConfig, GRPOConfig):
    """Everything that configures an on-policy distillation run (TRL's `DistillationConfig` names and defaults):
    GRPOConfig's sampling, data, loop and generation fields with one completion per prompt, the teacher, and the
    divergence.

    GRPOConfig's objective fields that TRL's DistillationConfig lacks (GRPO_ONLY) stay fields, so that a config
    written by a run reads back, but any value other than the default is refused; they are not flags of `posttrain
    distillation`.
    """

    GROUPS = (*GRPOConfig.GROUPS[:6], DistillationObjectiveConfig, *GRPOConfig.GROUPS[6:])
    NOT_FLAGS = GRPO_ONLY + DERIVED
    MIN_GENERATIONS = 1

    learning_rate: float = _help("Peak learning rate (TRL's distillation default).", default=1e-6)
    vllm_importance_sampling_correction: bool = _help(
        "Not a distillation field (the loss reads the teacher's distributions, not sampled log-probs): kept False.",
        default=False)
    num_generations: int = _help("One completion per prompt (distillation compares distributions, not samples).",
                                 default=1)

    def __post_init__(self):
        self._refuse_grpo_only()
        super().__post_init__()
        if self.num_generations != 1:
            raise ConfigError(f"num_generations={self.num_generations}: on-policy distillation samples one "
                              "completion per prompt (TRL's DistillationConfig has no such field); remove it.")
        if self.steps_per_generation != self.gradient_accumulation_steps:
            raise ConfigError(f"steps_per_generation={self.steps_per_generation}: distillation generates once per "
                              f"optimizer step, for its gradient_accumulation_steps={self.gradient_accumulation_steps} "
                              "micro-batches (TRL's DistillationConfig has no such field); remove it.")

    def _refuse_grpo_only(self):
        refuse_grpo_only(self, GRPO_ONLY, "DistillationConfig", "distillation", "its loss is the divergence from the "
                         "teacher on the student's own completions")
