"""GRPOConfig: TRL's GRPOConfig, field for field.

The fields come in groups (configs/fields.py for the training loop, logging, evaluation and checkpoints; sampling
and the GRPO objective here; configs/trl_compat.py for TRL fields that posttrain accepts at its own behaviour).
The result is flat, as in TRL: `GRPOConfig(num_generations=8, beta=0.0)`.
"""

import os
from dataclasses import dataclass
from typing import Optional, Union

from posttrain.configs.base import (AT_LEAST_ONE, FRACTION, NON_NEGATIVE, POSITIVE, ConfigError, Range, _help,
                                    check_choice, check_count_or_auto, check_padding_multiple, check_positive,
                                    check_ranges, check_types)
from posttrain.configs.async_generation import AsyncGenerationConfig
from posttrain.configs.fields import (CheckpointConfig, DeviceConfig, EvaluationConfig, LoggingConfig, ModelConfig,
                                      TrainingLoopConfig)
from posttrain.configs.generation_server import GenerationServerConfig
from posttrain.configs.trl_compat import GRPO_COMPAT, GRPOCompatConfig, check_compat

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
IS_LEVELS = ("token", "sequence")


@dataclass
class SamplingConfig:
    """How completions are sampled."""

    max_prompt_length: Optional[int] = _help(
        "If set, prompts longer than this many tokens are truncated from the left (TRL before 1.0 had this field).",
        range=AT_LEAST_ONE, default=None)
    max_completion_length: int = _help("Maximum completion length in tokens.", range=AT_LEAST_ONE, default=512)
    temperature: float = _help("Sampling temperature; training log-probs are computed from logits divided by it too.",
                               range=POSITIVE, default=1.0)
    top_p: float = _help("Nucleus sampling: keep the smallest set of tokens with this much probability.",
                         range=Range(0, 1, low_open=True), default=1.0)
    top_k: int = _help("Keep only the k most likely tokens; 0 disables.",
        range=Range(0, note="0 disables it"), default=0)
    min_p: Optional[float] = _help(
        "Drop tokens whose probability is below min_p times the most likely one's.", range=FRACTION, default=None)
    repetition_penalty: float = _help(
        "Penalise tokens already in the prompt or completion (> 1 discourages repeats).",
        range=Range(0, low_open=True, note="1.0 disables it"), default=1.0)
    generation_kwargs: Union[dict, str, None] = _help(
        "Extra sampling options, as transformers' generate takes them (e.g. {\"min_new_tokens\": 8, "
        "\"suppress_tokens\": [13]}); docs/grpo.md lists the keys the sampler honours. Any other key is an error, "
        "never silently dropped; beam search (num_beams > 1) is refused, a beam not being a sample of the policy.",
        default=None)
    chat_template_kwargs: Union[dict, str, None] = _help(
        "Keyword arguments for `apply_chat_template` with conversational prompts (e.g. enable_thinking).",
        default=None)
    num_generations_eval: Optional[int] = _help(
        "Completions sampled per eval prompt; default num_generations.", range=AT_LEAST_ONE, default=None)
    max_tool_calling_iterations: Optional[int] = _help(
        "With tools or an environment_factory: the most rounds of tool calls a rollout may make; None, no limit "
        "(a rollout then ends with a turn that calls no tool, or at max_completion_length, counted over every turn "
        "and tool result).", range=NON_NEGATIVE, default=None)
    tool_timeout: Optional[float] = _help(
        "With tools or an environment_factory: seconds one tool call may take; past it the call is an error to the "
        "model, counted in tools/failure_frequency. None (as TRL) waits.", range=POSITIVE, default=None)
    tool_results_as_text: bool = _help(
        "With tools (posttrain's): a tool result holding a special token's text (a fetched page) is tokenized as that "
        "text, so it cannot forge the template's turn markers; False: as the special token, as TRL.", default=True)

    def _check(self):
        check_positive(self, "max_completion_length")
        if self.max_prompt_length is not None:
            check_positive(self, "max_prompt_length")
        if self.num_generations_eval is not None:
            check_positive(self, "num_generations_eval")


@dataclass
class PromptDataConfig:
    """The prompts' order, the columns reward functions see, and the log of completions."""

    shuffle_dataset: bool = _help("Shuffle the training prompts each epoch.", default=True)
    remove_unused_columns: bool = _help(
        "Drop every dataset column but the prompt before training, so reward functions receive none of them (TRL's "
        "meaning; its default, False, passes every column to the reward functions).", default=False)
    log_completions: bool = _help(
        "Append the prompts, completions, rewards and advantages of each logging step to output_dir/completions.jsonl "
        "and print a sample.", default=False)
    num_completions_to_print: Optional[int] = _help(
        "With log_completions, how many completions to print at each logging step; None prints all.",
        range=NON_NEGATIVE, default=None)
    log_unique_prompts: bool = _help(
        "With log_completions, the completions table sent to the trackers in report_to holds each prompt's first "
        "completion only (completions.jsonl keeps every one).", default=False)

    def _check(self):
        pass


@dataclass
class GRPOObjectiveConfig:
    """Groups, advantages, the policy loss and its regularisers."""

    num_generations: int = _help("Completions sampled per prompt (the group size G); at least 2.",
        range=Range(2), default=8)
    generation_batch_size: Optional[int] = _help(
        "Completions generated at once across all processes. Default: "
        "per_device_train_batch_size * num_processes * steps_per_generation.", range=AT_LEAST_ONE, default=None)
    steps_per_generation: Optional[int] = _help(
        "Micro-batches taken from one generation batch. Default: gradient_accumulation_steps.",
        range=AT_LEAST_ONE, default=None)
    num_iterations: int = _help("Passes over each generation batch (the mu of the GRPO paper).",
        range=AT_LEAST_ONE, default=1)
    pad_to_multiple_of: Optional[Union[int, str]] = _help(
        "Pad the prompt and completion widths of every training forward to a multiple of this; \"auto\" pads to 128 "
        "on Neuron devices (which compile once per shape) and nowhere else.",
        range=Range(1, note='or "auto", or None for no padding'), default="auto")
    max_completion_tokens_per_pass: Optional[Union[int, str]] = _help(
        "posttrain's own: a training micro-batch whose completion tokens (rows x completion width, padding included) "
        "exceed this runs as several forward and backward passes of whole rows, their gradients added before the "
        "optimizer step. The update is the same within float rounding (the loss divides by the step's counts, never "
        "a pass's), with a pass's activations; every process runs as many passes. Passes lower the peak where the "
        "activations they save outweigh the gradients every pass after the first holds (long completions, LoRA); "
        "with full fine-tuning and a micro-batch just above the limit they can raise it. \"auto\" (the default): "
        "the pass count the model's shape says lowers the step's estimated peak by at least a quarter and 256 MiB, "
        "else one pass (grpo/pass_memory.py, docs/performance.md). A micro-batch runs whole where its loss looks at "
        "all its rows at once (top_entropy_quantile below 1, a router loss) or where training_step or compute_loss "
        "is overridden. None: one pass per micro-batch, as in TRL.",
        range=Range(1, note='or "auto", or None for one pass'), default="auto")
    beta: float = _help(
        "Weight of the k3 KL penalty to a frozen reference model; 0 loads no reference model.",
        range=NON_NEGATIVE, default=0.0)
    use_bias_correction_kl: bool = _help(
        "Multiply the per-token KL by the (differentiable) importance ratio, which makes its gradient the unbiased "
        "reverse-KL gradient (DeepSeek-V3.2). It changes the KL gradient even on-policy, where the ratio's value is 1.",
        default=True)
    epsilon: float = _help("Lower clipping range of the ratio: 1 - epsilon.",
        range=Range(0, 1, high_open=True), default=0.2)
    epsilon_high: Optional[float] = _help(
        "Upper clipping range: 1 + epsilon_high (DAPO's clip-higher); default epsilon. For loss_type cispo it "
        "is the cap of the (detached) ratio itself; 5.0 is the value recommended for cispo.",
        range=NON_NEGATIVE, default=None)
    delta: Optional[float] = _help(
        "Two-sided clipping: cap the unclipped ratio at delta (> 1 + epsilon_high), so negative advantages "
        "cannot push an arbitrarily large ratio.",
        range=Range(1, low_open=True, note="and above 1 + epsilon_high"), default=None)
    sapo_temperature_neg: float = _help(
        "SAPO: temperature of the soft gate for tokens with a non-positive advantage.", range=POSITIVE, default=1.05)
    sapo_temperature_pos: float = _help("SAPO: temperature of the soft gate for positive advantages.",
        range=POSITIVE, default=1.0)
    vespo_k_pos: float = _help("VESPO: power k of the Gamma weight for non-negative advantages.",
        range=NON_NEGATIVE, default=2.0)
    vespo_lambda_pos: float = _help("VESPO: decay lambda of the Gamma weight for non-negative advantages.",
                                    range=POSITIVE, default=3.0)
    vespo_k_neg: float = _help("VESPO: power k of the Gamma weight for negative advantages.",
        range=NON_NEGATIVE, default=3.0)
    vespo_lambda_neg: float = _help("VESPO: decay lambda of the Gamma weight for negative advantages.",
        range=POSITIVE, default=2.0)
    loss_type: str = _help(
        "Loss: grpo (per-sequence mean), bnpo (mean over the local batch's tokens), dr_grpo "
        "(sum over tokens / (sequences * max_completion_length)), dapo (mean over the global batch's tokens), "
        "cispo (clipped importance-sampling weights, normalised as dapo), sapo (soft sigmoid gate instead of clipping, "
        "per-sequence mean), luspo (GSPO with each sequence's loss scaled by its length) or vespo (Gamma-weighted "
        "sequence-level weights, normalised as dapo). docs/grpo.md has the formulas.", default="dapo")
    importance_sampling_level: str = _help(
        "token: one ratio per token; sequence: one geometric-mean ratio per sequence (GSPO).", default="token")
    off_policy_mask_threshold: Optional[float] = _help(
        "Off-policy sequence masking (DeepSeek-V3.2): drop from the policy loss the sequences with a negative "
        "advantage whose mean per-token KL between sampler and policy exceeds this (e.g. 0.5); None disables.",
        range=NON_NEGATIVE, default=None)
    scale_rewards: str = _help(
        "Divide advantages by the group's reward std (group), the whole batch's (batch) or not at all "
        "(none, as in Dr. GRPO). true/false are accepted as group/none.", default="group")
    multi_objective_aggregation: str = _help(
        "sum_then_normalize: weight and sum the rewards, then normalise. normalize_then_sum: normalise each "
        "reward within its group, then weight and sum (GDPO).", default="sum_then_normalize")
    reward_weights: Optional[list[float]] = _help(
        "One weight per reward function; default 1.0 each.", default=None)
    mask_truncated_completions: bool = _help(
        "Exclude completions that hit max_completion_length without EOS from the loss.", default=False)
    top_entropy_quantile: float = _help(
        "Train only on the tokens whose entropy is in this top fraction of the micro-batch; 1.0 trains on all, 0.0 "
        "keeps only the highest-entropy token.", range=FRACTION, default=1.0)
    entropy_coef: float = _help(
        "Weight of an entropy bonus: the loss minus entropy_coef times the mean per-token entropy (whatever the "
        "loss_type). With use_adaptive_entropy, the starting coefficient.",
        range=Range(note="negative values penalise entropy"), default=0.0)
    use_adaptive_entropy: bool = _help(
        "Adapt entropy_coef each optimizer step (Skywork-OR1): up by entropy_coef_delta while the step's entropy is "
        "at or below entropy_target, down otherwise; the bonus applies only at or below the target.", default=False)
    entropy_coef_min: float = _help("Lower bound of the adaptive entropy coefficient.", range=NON_NEGATIVE, default=0.0)
    entropy_coef_max: float = _help("Upper bound of the adaptive entropy coefficient.", range=NON_NEGATIVE, default=1.0)
    entropy_coef_delta: float = _help("Step of the adaptive entropy coefficient.", range=NON_NEGATIVE, default=0.005)
    entropy_target: float = _help(
        "Target mean per-token entropy (nats) of adaptive entropy control.", range=NON_NEGATIVE, default=0.2)
    sync_ref_model: bool = _help(
        "TR-DPO: every ref_model_sync_steps steps, move the reference model towards the policy: "
        "ref = alpha * policy + (1 - alpha) * ref. Needs beta > 0 and full fine-tuning.", default=False)
    ref_model_mixup_alpha: float = _help("TR-DPO's alpha for sync_ref_model.", range=FRACTION, default=0.6)
    ref_model_sync_steps: int = _help("TR-DPO's tau: optimizer steps between reference syncs.",
        range=AT_LEAST_ONE, default=512)
    reward_timeout: Optional[float] = _help(
        "Seconds a reward function may take on one batch; past it the run stops naming the function, the step and "
        "(when one alone hangs it) the completion, or with on_bad_reward=skip the batch is skipped. None (the default, "
        "as TRL) waits as long as it takes.", range=POSITIVE, default=None)
    on_bad_reward: str = _help(
        "What a NaN or inf reward does: stop (the run, naming the function and step) or skip (its whole group "
        "gets advantage 0; counted in rewards/skipped_groups).", default="stop")
    dynamic_sampling: bool = _help(
        "DAPO's dynamic sampling: drop the prompt groups whose completions all got the same reward (advantage 0: "
        "nothing to learn) and sample further rounds of prompts until the kept groups fill the generation batch, "
        "before the optimizer step; the batch size and the loss normaliser never change (sampling/groups_filtered, "
        "sampling/generation_rounds). Not in TRL.", default=False)
    dynamic_sampling_max_rounds: int = _help(
        "With dynamic_sampling, the most generation rounds one batch may take; past it the run stops saying how "
        "many groups it found.", range=AT_LEAST_ONE, default=10)
    dynamic_sampling_filter: Optional[str] = _help(
        "With dynamic_sampling, which groups to keep instead of those whose rewards differ: a function (a dotted "
        "path module.function, or in Python the function) taking a group's [num_generations, reward functions] "
        "rewards tensor and returning whether to train on it.", default=None)

    def _check(self):
        check_positive(self, "num_iterations", "ref_model_sync_steps", "dynamic_sampling_max_rounds")
        if self.dynamic_sampling_filter is not None and not self.dynamic_sampling:
            raise ConfigError("dynamic_sampling_filter is set but dynamic_sampling is False, so it would filter "
                              "nothing: set dynamic_sampling=True, or remove dynamic_sampling_filter.")
        if self.num_generations < self.MIN_GENERATIONS:
            raise ConfigError(
                f"num_generations={self.num_generations} leaves no group to compare against: "
                f"{type(self).__name__.removesuffix('Config')} needs num_generations >= 2 (e.g. 8).")
        for name, choices in (("loss_type", LOSS_TYPES), ("scale_rewards", SCALE_REWARDS),
                              ("multi_objective_aggregation", AGGREGATIONS),
                              ("importance_sampling_level", IS_LEVELS), ("on_bad_reward", ("stop", "skip"))):
            check_choice(self, name, choices)
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if self.delta is not None and self.delta <= 1 + self.epsilon_high:
            raise ConfigError(
                f"delta={self.delta} must be greater than 1 + epsilon_high = {1 + self.epsilon_high} "
                "(e.g. delta=4.0), otherwise it clips the ratio below the trust region.")
        if self.entropy_coef_max < self.entropy_coef_min:
            raise ConfigError(f"entropy_coef_max={self.entropy_coef_max} is below entropy_coef_min="
                              f"{self.entropy_coef_min}: raise it or lower entropy_coef_min.")
        if self.sync_ref_model and self.beta == 0.0:
            raise ConfigError("sync_ref_model=True needs a reference model, and beta=0.0 loads none: set beta > 0 "
                              "(e.g. 0.04) or sync_ref_model=False.")
        if self.reward_weights is not None:
            for w in self.reward_weights:
                if isinstance(w, bool) or not isinstance(w, (int, float)) or w != w or abs(w) == float("inf"):
                    raise ConfigError(f"reward_weights={self.reward_weights!r} must hold finite numbers, one per "
                                      "reward function.")
        check_padding_multiple(self)
        check_count_or_auto(self, "max_completion_tokens_per_pass")


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class GRPOConfig(TrainingLoopConfig, ModelConfig, DeviceConfig, LoggingConfig, EvaluationConfig, CheckpointConfig,
                 PromptDataConfig, SamplingConfig, GRPOObjectiveConfig, GenerationServerConfig, AsyncGenerationConfig,
                 GRPOCompatConfig):
    """Everything that configures a GRPO run (TRL's `GRPOConfig` names and defaults).

    Derived values are filled in at construction: `steps_per_generation`, `generation_batch_size`,
    `epsilon_high`. Impossible combinations raise `ConfigError` with one sentence naming the fields.
    """

    GROUPS = (TrainingLoopConfig, ModelConfig, DeviceConfig, LoggingConfig, EvaluationConfig, CheckpointConfig,
              PromptDataConfig, SamplingConfig, GRPOObjectiveConfig, GenerationServerConfig, AsyncGenerationConfig)
    COMPAT = GRPOCompatConfig
    MIN_GENERATIONS = 2  # a group to compare against (distillation samples one completion per prompt)
    NOT_FLAGS = ()  # fields that are not flags of the trainer's command

    def __post_init__(self):
        self._coerce_aliases()
        check_types(self)
        check_compat(self, GRPO_COMPAT)
        for group in self.GROUPS:
            group._check(self)
        if (self.loss_type == "vespo" and self.corrects_sampling
                and not self.vllm_importance_sampling_mode.startswith("token_")):
            raise ConfigError(f"loss_type='vespo' folds the sampling correction into its per-token weights, so it "
                              f"needs vllm_importance_sampling_mode='token_truncate' or 'token_mask', not "
                              f"{self.vllm_importance_sampling_mode!r}.")
        self._derive_batches()
        self._check_eval_batches()
        check_ranges(self)

    def _coerce_aliases(self):
        # TRL accepted booleans for scale_rewards before it grew the group/batch/none choice.
        if self.scale_rewards is True or str(self.scale_rewards).lower() == "true":
            self.scale_rewards = "group"
        elif self.scale_rewards is False or str(self.scale_rewards).lower() == "false":
            self.scale_rewards = "none"

    def _derive_batches(self):
        world = _world_size()
        per_step = self.per_device_train_batch_size * world
        if self.steps_per_generation is not None and self.generation_batch_size is not None:
            # both are written to posttrain_config.yaml, which reads back as a config: agreeing, they are one setting
            if self.generation_batch_size != per_step * self.steps_per_generation:
                raise ConfigError(
                    f"steps_per_generation={self.steps_per_generation} and generation_batch_size="
                    f"{self.generation_batch_size} both set, and they disagree (per_device_train_batch_size x "
                    f"processes = {per_step}): they say the same thing, keep one.")
            self.generation_batch_size = None
        if self.generation_batch_size is None:
            if self.steps_per_generation is None:
                self.steps_per_generation = self.gradient_accumulation_steps
            check_positive(self, "steps_per_generation")
            self.generation_batch_size = per_step * self.steps_per_generation
        else:
            if self.generation_batch_size <= 0 or self.generation_batch_size % per_step:
                raise ConfigError(
                    f"generation_batch_size={self.generation_batch_size} must be a positive multiple of "
                    f"per_device_train_batch_size * num_processes = {per_step}, e.g. {per_step * 2}.")
            self.steps_per_generation = self.generation_batch_size // per_step
        if self.generation_batch_size % self.num_generations:
            g = self.num_generations
            valid = [n for n in range(2, 2 * g + 1) if self.generation_batch_size % n == 0]
            hint = f"num_generations to one of {valid}" if valid else "the batch sizes"
            raise ConfigError(
                f"The generation batch of {self.generation_batch_size} completions (per_device_train_batch_size"
                f" {self.per_device_train_batch_size} x {world} process(es) x steps_per_generation "
                f"{self.steps_per_generation}) is not a multiple of num_generations={g}: change {hint}, or "
                f"per_device_train_batch_size to a multiple of {g}.")

    def _check_eval_batches(self):
        if self.eval_strategy == "no" and not self.eval_on_start:
            return
        g = self.num_generations_eval or self.num_generations
        total = self.per_device_eval_batch_size * _world_size()
        if total % g:
            raise ConfigError(
                f"The eval batch of {total} completions (per_device_eval_batch_size {self.per_device_eval_batch_size} "
                f"x {_world_size()} process(es)) is not a multiple of the {g} completions sampled per eval prompt: set "
                f"per_device_eval_batch_size to a multiple of {g}, or change num_generations_eval.")

    @property
    def drops_reward_columns(self) -> bool:
        """Whether the reward functions see no dataset column but the prompt (remove_unused_columns, GRPO's meaning)."""
        return self.remove_unused_columns

    @property
    def prompts_per_generation(self) -> int:
        """Unique prompts in one generation batch, across all processes."""
        return self.generation_batch_size // self.num_generations


def refuse_grpo_only(config, names: tuple, trl_config: str, trainer: str, why: str) -> None:
    """One sentence for a GRPOConfig field among `names`, which TRL's `trl_config` (RLOOConfig, DistillationConfig)
    lacks, set to anything but its default in `config` (a GRPOConfig subclass that keeps them as fields so that a
    written config reads back)."""
    from dataclasses import fields

    defaults = {f.name: f.default for f in fields(type(config))}
    for name in names:
        if getattr(config, name) != defaults[name]:
            raise ConfigError(f"{name}={getattr(config, name)!r} is a GRPOConfig field that TRL's {trl_config} does "
                              f"not have, and {trainer} has no use for it ({why}): remove {name}, or use GRPOConfig "
                              "and GRPOTrainer.")

