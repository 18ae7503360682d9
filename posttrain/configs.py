"""Typed configs for posttrain's trainers, YAML loading and `--key value` overrides.

This module imports no torch, so that `posttrain --help` stays fast.

Field names and defaults follow TRL's `GRPOConfig` (and the `transformers.TrainingArguments`
fields it inherits) where the concept is the same, so a TRL config file or script keeps working.
The fields are grouped into small dataclasses (training loop, sampling, GRPO objective) that
`GRPOConfig` combines; the result is flat, as in TRL: `GRPOConfig(num_generations=8, beta=0.0)`.
"""

import dataclasses
import difflib
import json
import numbers
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from posttrain.errors import UserError


class ConfigError(UserError, ValueError):
    """A config value that cannot work; the message names the field and a valid choice."""


def _help(text: str, **kw) -> Any:
    return field(metadata={"help": text}, **kw)


# --------------------------------------------------------------------------------------------
# Field groups
# --------------------------------------------------------------------------------------------


@dataclass
class TrainingLoopConfig:
    """The optimisation loop shared by every trainer: batches, optimizer, schedule, logging, saving."""

    output_dir: str = _help("Where checkpoints, the final model, `metrics.jsonl` and the config are written.",
                            default="trainer_output")
    seed: int = _help("Random seed for data order, sampling and initialisation.", default=42)
    max_steps: int = _help("Total optimizer steps; -1 means derive from `num_train_epochs`.", default=-1)
    num_train_epochs: float = _help("Passes over the prompts when `max_steps` is -1.", default=3.0)
    per_device_train_batch_size: int = _help(
        "Completions (not prompts) per process in one micro-batch.", default=8)
    gradient_accumulation_steps: int = _help(
        "Micro-batches accumulated into one optimizer step. Independent of how often we generate "
        "(`steps_per_generation`).", default=1)
    learning_rate: float = _help("Peak learning rate of AdamW.", default=1e-6)
    weight_decay: float = _help("AdamW weight decay (not applied to biases and norm weights).", default=0.0)
    adam_beta1: float = _help("AdamW beta1.", default=0.9)
    adam_beta2: float = _help("AdamW beta2.", default=0.999)
    adam_epsilon: float = _help("AdamW epsilon.", default=1e-8)
    max_grad_norm: float = _help("Clip the global gradient norm to this value; 0 disables clipping.", default=1.0)
    lr_scheduler_type: str = _help(
        "Learning-rate schedule: constant, constant_with_warmup, linear or cosine.", default="linear")
    warmup_ratio: float = _help("Fraction of `max_steps` spent in linear warm-up.", default=0.0)
    warmup_steps: int = _help("Warm-up steps; overrides `warmup_ratio` when > 0.", default=0)
    logging_steps: int = _help("Log metrics every this many optimizer steps.", default=10)
    save_strategy: str = _help("`steps` saves every `save_steps`; `no` saves only the final model.",
                               default="steps")
    save_steps: int = _help("Save a checkpoint every this many optimizer steps.", default=500)
    save_total_limit: Optional[int] = _help(
        "Keep at most this many checkpoints (the newest); None keeps all.", default=None)
    resume_from_checkpoint: Optional[str] = _help(
        "Resume from this checkpoint directory, or `true` for the newest complete one in output_dir.",
        default=None)
    save_merged: bool = _help(
        "With LoRA, also write merged full weights to output_dir/merged (loadable with plain "
        "AutoModelForCausalLM.from_pretrained); the adapter is always saved.", default=False)
    report_to: Union[str, list] = _help(
        "Trackers to send metrics to besides `metrics.jsonl`: none, wandb or trackio "
        "(install with `pip install 'posttrain[trackers]'`).", default="none")
    gradient_checkpointing: bool = _help(
        "Recompute activations in the backward pass to save memory (slower; TRL's default).", default=True)
    gradient_checkpointing_kwargs: Optional[dict] = _help(
        "Keyword arguments for `model.gradient_checkpointing_enable`.", default=None)
    bf16: Optional[bool] = _help(
        "Train with bfloat16 autocast. None means: on when a CUDA device supports bf16, off on CPU.",
        default=None)
    use_cpu: bool = _help("Train on the CPU even when a GPU is present.", default=False)
    model_init_kwargs: Optional[dict] = _help(
        "Keyword arguments for `AutoModelForCausalLM.from_pretrained` when `model` is a path or hub id "
        "(e.g. {\"dtype\": \"bfloat16\", \"attn_implementation\": \"sdpa\"}).", default=None)
    disable_dropout: bool = _help("Set every dropout probability in the policy (and reference) to 0.",
                                  default=False)
    shuffle_dataset: bool = _help("Shuffle the prompts each epoch.", default=True)


@dataclass
class SamplingConfig:
    """How completions are sampled."""

    max_prompt_length: Optional[int] = _help(
        "If set, prompts longer than this many tokens are truncated from the left.", default=None)
    max_completion_length: int = _help("Maximum completion length in tokens.", default=512)
    temperature: float = _help(
        "Sampling temperature; training log-probs are computed from logits divided by it too.", default=1.0)
    top_p: float = _help("Nucleus sampling: keep the smallest set of tokens with this much probability.",
                         default=1.0)
    top_k: int = _help("Keep only the k most likely tokens; 0 disables.", default=0)
    min_p: Optional[float] = _help(
        "Drop tokens whose probability is below min_p times the most likely one's.", default=None)
    repetition_penalty: float = _help(
        "Penalise tokens already in the prompt or completion (> 1 discourages repeats).", default=1.0)
    generation_kwargs: Optional[dict] = _help(
        "Extra sampling options, e.g. {\"min_new_tokens\": 8}. Each key must be one the generator supports; "
        "unknown keys are an error, never silently dropped.", default=None)
    chat_template_kwargs: Optional[dict] = _help(
        "Keyword arguments for `apply_chat_template` with conversational prompts (e.g. enable_thinking).",
        default=None)


@dataclass
class GRPOObjectiveConfig:
    """Groups, advantages and the policy loss."""

    num_generations: int = _help("Completions sampled per prompt (the group size G); at least 2.", default=8)
    generation_batch_size: Optional[int] = _help(
        "Completions generated at once across all processes. Default: "
        "per_device_train_batch_size * num_processes * steps_per_generation.", default=None)
    steps_per_generation: Optional[int] = _help(
        "Micro-batches taken from one generation batch. Default: gradient_accumulation_steps.", default=None)
    num_iterations: int = _help("Passes over each generation batch (the mu of the GRPO paper).", default=1)
    beta: float = _help(
        "Weight of the k3 KL penalty to a frozen reference model; 0 loads no reference model.", default=0.0)
    epsilon: float = _help("Lower clipping range of the ratio: 1 - epsilon.", default=0.2)
    epsilon_high: Optional[float] = _help(
        "Upper clipping range: 1 + epsilon_high (DAPO's clip-higher); default epsilon. For loss_type cispo it "
        "is the cap of the (detached) ratio itself; 5.0 is the value recommended for cispo.", default=None)
    delta: Optional[float] = _help(
        "Two-sided clipping: cap the unclipped ratio at delta (> 1 + epsilon_high), so negative advantages "
        "cannot push an arbitrarily large ratio.", default=None)
    loss_type: str = _help(
        "Loss aggregation: grpo (per-sequence mean), bnpo (mean over the local batch's tokens), dr_grpo "
        "(sum over tokens / (sequences * max_completion_length)), dapo (mean over the global batch's tokens) "
        "or cispo (clipped importance-sampling weights, token-normalised like dapo).", default="dapo")
    importance_sampling_level: str = _help(
        "token: one ratio per token; sequence: one geometric-mean ratio per sequence (GSPO).", default="token")
    scale_rewards: str = _help(
        "Divide advantages by the group's reward std (group), the whole batch's (batch) or not at all "
        "(none, as in Dr. GRPO). true/false are accepted as group/none.", default="group")
    multi_objective_aggregation: str = _help(
        "sum_then_normalize: weight and sum the rewards, then normalise. normalize_then_sum: normalise each "
        "reward within its group, then weight and sum (GDPO).", default="sum_then_normalize")
    reward_weights: Optional[list] = _help(
        "One weight per reward function; default 1.0 each.", default=None)
    mask_truncated_completions: bool = _help(
        "Exclude completions that hit max_completion_length without EOS from the loss.", default=False)
    top_entropy_quantile: float = _help(
        "Train only on the tokens whose entropy is in this top fraction of the micro-batch; 1.0 trains on all.",
        default=1.0)
    on_bad_reward: str = _help(
        "What a NaN or inf reward does: stop (the run, naming the function and step) or skip (its whole group "
        "gets advantage 0; counted in rewards/skipped_groups).", default="stop")
    log_completions: bool = _help(
        "Append the prompts, completions and rewards of each logging step to output_dir/completions.jsonl.",
        default=False)


LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
IS_LEVELS = ("token", "sequence")
SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
TRACKERS = ("none", "wandb", "trackio")


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class GRPOConfig(TrainingLoopConfig, SamplingConfig, GRPOObjectiveConfig):
    """Everything that configures a GRPO run (TRL's `GRPOConfig` names and defaults).

    Derived values are filled in at construction: `steps_per_generation`, `generation_batch_size`,
    `epsilon_high`. Impossible combinations raise `ConfigError` with one sentence naming the fields.
    """

    def __post_init__(self):
        self._coerce_aliases()
        _check_types(self)
        _check_positive(self, "per_device_train_batch_size", "gradient_accumulation_steps",
                        "max_completion_length", "num_iterations", "logging_steps", "save_steps")
        if self.max_prompt_length is not None:
            _check_positive(self, "max_prompt_length")
        _check_choice(self, "loss_type", LOSS_TYPES)
        _check_choice(self, "scale_rewards", SCALE_REWARDS)
        _check_choice(self, "multi_objective_aggregation", AGGREGATIONS)
        _check_choice(self, "importance_sampling_level", IS_LEVELS)
        _check_choice(self, "lr_scheduler_type", SCHEDULERS)
        _check_choice(self, "save_strategy", ("steps", "no"))
        _check_choice(self, "on_bad_reward", ("stop", "skip"))
        self.report_to = _trackers(self.report_to)
        if self.num_generations < 2:
            raise ConfigError(
                f"num_generations={self.num_generations} leaves no group to compare against: "
                "GRPO needs num_generations >= 2 (e.g. 8).")
        if self.temperature <= 0:
            raise ConfigError(f"temperature={self.temperature} must be > 0 (use e.g. 1.0).")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1].")
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k} must be >= 0 (0 disables it).")
        if not 0 < self.top_entropy_quantile <= 1:
            raise ConfigError(f"top_entropy_quantile={self.top_entropy_quantile} must be in (0, 1].")
        if self.beta < 0:
            raise ConfigError(f"beta={self.beta} must be >= 0.")
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if self.delta is not None and self.delta <= 1 + self.epsilon_high:
            raise ConfigError(
                f"delta={self.delta} must be greater than 1 + epsilon_high = {1 + self.epsilon_high} "
                "(e.g. delta=4.0), otherwise it clips the ratio below the trust region.")
        self._derive_batches()

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
            raise ConfigError(
                "steps_per_generation and generation_batch_size both set: they say the same thing, keep one.")
        if self.generation_batch_size is None:
            if self.steps_per_generation is None:
                self.steps_per_generation = self.gradient_accumulation_steps
            _check_positive(self, "steps_per_generation")
            spg = self.steps_per_generation
            self.generation_batch_size = per_step * spg
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

    @property
    def prompts_per_generation(self) -> int:
        """Unique prompts in one generation batch, across all processes."""
        return self.generation_batch_size // self.num_generations

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class ScriptArguments:
    """What the command line needs besides the trainer config: model, data, rewards (TRL's script names)."""

    model_name_or_path: Optional[str] = _help("Local path or hub id of the policy model.", default=None)
    dataset_name: Optional[str] = _help(
        "Hub dataset name, or a local .json/.jsonl/.csv/.parquet file or a directory saved with "
        "`save_to_disk`.", default=None)
    dataset_config: Optional[str] = _help("Dataset configuration (subset) name.", default=None)
    dataset_train_split: str = _help("Split to train on.", default="train")
    dataset_test_split: str = _help("Split to evaluate on.", default="test")
    reward_funcs: Optional[list] = _help(
        "Reward functions: built-in names (accuracy, think_format, soft_overlong, length), dotted import paths "
        "(my_module.my_reward), or paths/hub ids of sequence-classification reward models.", default=None)
    trust_remote_code: bool = _help("Allow models with custom code from their repository.", default=False)
    model_revision: str = _help("Model revision (branch, tag or commit).", default="main")
    dtype: Optional[str] = _help("Weights dtype for loading: auto, float32, bfloat16 or float16.",
                                 default=None)
    attn_implementation: Optional[str] = _help("Attention implementation, e.g. sdpa or eager.", default=None)


@dataclass
class LoraArguments:
    """LoRA on the command line (TRL's ModelConfig names). Ignored unless `use_peft` is true."""

    use_peft: bool = _help("Train LoRA adapters instead of all weights (needs `pip install 'posttrain[peft]'`).",
                           default=False)
    lora_r: int = _help("LoRA rank.", default=16)
    lora_alpha: int = _help("LoRA scaling numerator (scale = alpha / r, or alpha / sqrt(r) with rsLoRA).", default=32)
    lora_dropout: float = _help("Dropout on the LoRA input.", default=0.05)
    lora_target_modules: Optional[list] = _help(
        "Module names to adapt, or all-linear; default: peft's choice for the architecture.", default=None)
    lora_modules_to_save: Optional[list] = _help(
        "Modules trained in full and saved beside the adapters (e.g. lm_head).", default=None)
    use_rslora: bool = _help("Rank-stabilised LoRA scaling alpha / sqrt(r).", default=False)
    use_dora: bool = _help("Weight-decomposed LoRA (DoRA).", default=False)

    def to_peft_config(self):
        """A peft LoraConfig when use_peft is set, else None; raises with the install line if peft is missing."""
        if not self.use_peft:
            return None
        from posttrain._optional import require

        peft = require("peft", "--use_peft")
        targets = self.lora_target_modules
        if targets == ["all-linear"]:
            targets = "all-linear"
        return peft.LoraConfig(r=self.lora_r, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout,
                               target_modules=targets, modules_to_save=self.lora_modules_to_save,
                               use_rslora=self.use_rslora, use_dora=self.use_dora, task_type="CAUSAL_LM")


# --------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------


_TYPE_HINTS = {int: "a whole number", float: "a number", bool: "true or false", dict: "a mapping (JSON object)",
               list: "a list", str: "a string"}


def _invalid(name: str, value, base) -> ConfigError:
    hint = _TYPE_HINTS.get(base, getattr(base, "__name__", str(base)))
    return ConfigError(f"{name}={value!r} is not a valid {getattr(base, '__name__', base)}: use {hint}.")


def _check_types(cfg) -> None:
    """Numbers and flags set from Python must have their field's type (YAML and flags are converted by `coerce`)."""
    for name, tp in field_types(type(cfg)).items():
        value, base = getattr(cfg, name), _base_type(tp)
        if value is None or base not in (int, float, bool):
            continue
        if isinstance(value, bool) != (base is bool):
            raise _invalid(name, value, base)
        if not isinstance(value, numbers.Integral if base is int else numbers.Real):
            raise _invalid(name, value, base)


def _check_positive(cfg, *names):
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{name}={value!r} must be a positive integer.")


def _check_choice(cfg, name, choices):
    value = getattr(cfg, name)
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of: {', '.join(choices)}.")


def _trackers(value) -> list:
    names = [value] if isinstance(value, str) else list(value or [])
    names = [n for n in names if n not in ("none", None)] if names != ["all"] else ["wandb"]
    for n in names:
        if n not in TRACKERS:
            raise ConfigError(f"report_to={n!r} is not one of: {', '.join(TRACKERS)}.")
    return names


# --------------------------------------------------------------------------------------------
# Parsing values from YAML and the command line
# --------------------------------------------------------------------------------------------


def field_types(cls) -> dict:
    """Map each field name of dataclass `cls` to its resolved type."""
    return typing.get_type_hints(cls)


def field_help(cls) -> dict:
    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}


def _base_type(tp):
    """Optional[X] -> X; Union[str, list] -> list (the most general); Literal -> str."""
    origin = typing.get_origin(tp)
    if origin is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return list if list in args else _base_type(args[0])
    if origin is Literal:
        return str
    return origin or tp


def coerce(name: str, tp, value):
    """Convert `value` (from YAML or a CLI string) to the field's type, or raise ConfigError."""
    base = _base_type(tp)
    optional = typing.get_origin(tp) is Union and type(None) in typing.get_args(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional or base is type(None):
            return None
        raise ConfigError(f"{name} cannot be None: give a value, or leave it out for the default.")
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            text = str(value).lower()
            if text in ("true", "1", "yes"):
                return True
            if text in ("false", "0", "no"):
                return False
            raise ValueError
        if base is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if base is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if base is dict:
            return value if isinstance(value, dict) else json.loads(value)
        if base is list:
            if isinstance(value, str):
                return json.loads(value) if value.startswith("[") else [value]
            return list(value)
        if base is str:
            return value if isinstance(value, str) else str(value)
    except (ValueError, TypeError, json.JSONDecodeError):
        pass
    raise _invalid(name, value, base)


UNKNOWN_HINT = " `posttrain grpo --help` and docs/config.md list every field."


def suggest(name: str, known, otherwise: str = "") -> str:
    """' Did you mean <closest>?' for a misspelled name, else `otherwise`."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" Did you mean {close[0]}?" if close else otherwise


def build(cls, values: dict, extra_known=()):
    """Construct `cls` from a dict of raw values, with typed coercion and a suggestion for unknown keys."""
    types = field_types(cls)
    for key in values:
        if key not in types and key not in extra_known:
            raise ConfigError(f"Unknown config field {key!r}.{suggest(key, list(types) + list(extra_known), UNKNOWN_HINT)}")
    kwargs = {k: coerce(k, types[k], v) for k, v in values.items() if k in types}
    return cls(**kwargs)


def load_yaml(path: str) -> dict:
    import yaml

    if not os.path.exists(path):
        raise ConfigError(f"Config file {path} does not exist: check the path given to --config.")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {path} must hold a mapping of field: value, not {type(data).__name__}.")
    return data


def split_values(values: dict, *classes) -> list:
    """Distribute a flat dict of field values over dataclasses; unknown keys raise with a suggestion."""
    names = [set(field_types(c)) for c in classes]
    every = set().union(*names)
    for key in values:
        if key not in every:
            raise ConfigError(f"Unknown config field {key!r}.{suggest(key, every, UNKNOWN_HINT)}")
    return [{k: v for k, v in values.items() if k in n} for n in names]


# --------------------------------------------------------------------------------------------
# Reference documentation, generated from the dataclasses (docs/config.md; a test keeps it in sync)
# --------------------------------------------------------------------------------------------


def config_reference() -> str:
    """Markdown tables of every field: name, default, meaning, grouped as the dataclasses are."""
    groups = [("Training loop", TrainingLoopConfig), ("Sampling", SamplingConfig),
              ("GRPO objective", GRPOObjectiveConfig), ("Command-line script", ScriptArguments),
              ("LoRA (command line)", LoraArguments)]
    lines = ["# Configuration reference", "",
             "Generated from `posttrain/configs.py` by `python -m posttrain.configs > docs/config.md`.",
             "`GRPOConfig` holds the first three groups (flat, as TRL's). On the command line every field is a "
             "flag (`--name value`) and a YAML key.", ""]
    for title, cls in groups:
        lines += [f"## {title}", "", "| field | default | meaning |", "|---|---|---|"]
        for f in dataclasses.fields(cls):
            lines.append(f"| `{f.name}` | `{f.default!r}` | {f.metadata.get('help', '')} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(config_reference(), end="")
