"""The field groups every trainer config is built from, with TRL's (and transformers' TrainingArguments') names and
defaults. Each group checks its own fields in `_check()`; a trainer config combines groups and calls every `_check`.

A step interval (`logging_steps`, `save_steps`, `eval_steps`) is a whole number of optimizer steps, or a fraction in
(0, 1) of the run's total steps, as in transformers.
"""

import dataclasses
import enum
import os
from dataclasses import dataclass
from typing import Optional, Union

from posttrain.configs.base import (AT_LEAST_ONE, FRACTION, NON_NEGATIVE, POSITIVE, SEED, ConfigError, Range, _help,
                                    check_choice, check_positive, check_steps)

SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay")
# transformers' OptimizerNames that posttrain builds (through transformers' own optimizer table)
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop", "adamw_bnb_8bit",
              "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit", "lion_8bit", "lion_32bit", "paged_lion_32bit",
              "paged_lion_8bit", "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit", "ademamix", "ademamix_8bit",
              "paged_ademamix_32bit", "paged_ademamix_8bit", "adamw_torch_4bit", "adamw_torch_8bit", "stable_adamw")
TRACKERS = ("wandb", "trackio", "tensorboard")
LOG_LEVELS = ("passive", "debug", "info", "warning", "error", "critical")


@dataclass
class TrainingLoopConfig:
    """Batches, optimizer and learning-rate schedule: the optimisation loop every trainer shares."""

    output_dir: str = _help("Where checkpoints, the final model, `metrics.jsonl` and the config are written.",
                            default="trainer_output")
    seed: int = _help("Random seed for initialisation, sampling and (unless data_seed is set) data order.",
        range=SEED, default=42)
    data_seed: Optional[int] = _help("Seed of the data order only; default: seed.", range=SEED, default=None)
    max_steps: int = _help("Total optimizer steps; -1 means derive from `num_train_epochs`.",
                           range=Range(-1, note="-1 derives it from num_train_epochs; 0 trains nothing"), default=-1)
    num_train_epochs: float = _help("Passes over the training data when `max_steps` is -1 (then > 0).", range=NON_NEGATIVE,
                                    default=3.0)
    per_device_train_batch_size: int = _help(
        "Rows per process in one micro-batch: completions (not prompts) in GRPO, sequences (or packed rows) in SFT.",
        range=AT_LEAST_ONE, default=8)
    gradient_accumulation_steps: int = _help(
        "Micro-batches accumulated into one optimizer step (in GRPO independent of how often it generates: "
        "`steps_per_generation`).", range=AT_LEAST_ONE, default=1)
    learning_rate: float = _help("Peak learning rate.", range=NON_NEGATIVE, default=1e-6)
    weight_decay: float = _help("Weight decay (not applied to biases and norm weights).",
        range=NON_NEGATIVE, default=0.0)
    adam_beta1: float = _help("Adam beta1.", range=Range(0, 1, high_open=True), default=0.9)
    adam_beta2: float = _help("Adam beta2.", range=Range(0, 1, high_open=True), default=0.999)
    adam_epsilon: float = _help("Adam epsilon.", range=NON_NEGATIVE, default=1e-8)
    max_grad_norm: float = _help("Clip the global gradient norm to this value; 0 disables clipping.",
        range=Range(0, note="0 disables clipping"), default=1.0)
    optim: str = _help(f"Optimizer, by transformers' name: {', '.join(OPTIMIZERS)} (bitsandbytes and torchao ones "
                       "need their package).", default="adamw_torch_fused")
    optim_args: Optional[str] = _help(
        "Extra optimizer arguments as `key=value,key=value` (e.g. momentum=0.9 for sgd), as in transformers.",
        default=None)
    lr_scheduler_type: str = _help(
        f"Learning-rate schedule, by transformers' name: {', '.join(SCHEDULERS)}.", default="linear")
    lr_scheduler_kwargs: Union[dict, str, None] = _help(
        "Extra arguments of the schedule, e.g. {\"num_cycles\": 2} for cosine_with_restarts or {\"min_lr_rate\": 0.1}.",
        default=None)
    warmup_steps: float = _help(
        "Linear warm-up steps; a value in (0, 1) is a fraction of the total steps.", range=NON_NEGATIVE, default=0)
    warmup_ratio: Optional[float] = _help(
        "Fraction of the total steps spent in warm-up (the older transformers name; warmup_steps wins when both are "
        "set).", range=FRACTION, default=None)

    def _check(self):
        check_positive(self, "per_device_train_batch_size", "gradient_accumulation_steps")
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(f"max_steps={self.max_steps} must be a positive number of steps, or -1 to train for "
                              "num_train_epochs.")
        if self.max_steps == -1 and not self.num_train_epochs > 0:
            raise ConfigError(f"num_train_epochs={self.num_train_epochs} trains for no step: set it > 0, or set "
                              "max_steps.")
        if self.warmup_steps:
            check_steps(self, "warmup_steps")
        check_choice(self, "optim", OPTIMIZERS)
        check_choice(self, "lr_scheduler_type", SCHEDULERS)
        if self.optim_args is not None:
            pairs = [p for p in self.optim_args.replace(" ", "").split(",") if p]
            if any(p.count("=") != 1 for p in pairs):
                raise ConfigError(f"optim_args={self.optim_args!r} must be `key=value` pairs separated by commas, e.g. "
                                  "'momentum=0.9,nesterov=True'.")
        # TRL's (transformers') None means the default directory
        self.output_dir = os.path.expanduser(self.output_dir if self.output_dir is not None else "trainer_output")

    def to_dict(self) -> dict:
        """The fields as plain YAML/JSON values (this dict is written to posttrain_config.yaml and to trackers), which
        construct the same config when read back: `hub_token` redacted, and every value plain (`plain_value`)."""
        values = {field.name: plain_value(getattr(self, field.name)) for field in dataclasses.fields(self)}
        if values.get("hub_token"):
            values["hub_token"] = "<HUB_TOKEN>"
        return values


def plain_value(value):
    """`value` as YAML's and JSON's plain types, meaning the same to a config that reads it back: a torch dtype as its
    name ("bfloat16"), a path as a string, an enum as its value, an object with `to_dict` (a quantization or peft
    config) as that dict, a set as a sorted list, a function as its dotted path `module.name` (which imports back
    when the function is a module's own; a lambda or a nested function is written under its name, for the record
    only), recursively through dicts, lists and tuples."""
    if value is None or isinstance(value, (bool, int, float, str)) and not isinstance(value, enum.Enum):
        return value
    if isinstance(value, enum.Enum):
        return plain_value(value.value)
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":  # without importing torch here
        return str(value).removeprefix("torch.")
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, dict):
        return {str(plain_value(k)): plain_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_value(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((plain_value(v) for v in value), key=repr)
    if callable(getattr(value, "to_dict", None)):
        return plain_value(value.to_dict())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain_value(dataclasses.asdict(value))
    if callable(value):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__name__)}"
    return repr(value)


@dataclass
class ModelConfig:
    """How the policy is loaded and run."""

    model_init_kwargs: Union[dict, str, None] = _help(
        "Keyword arguments for `AutoModelForCausalLM.from_pretrained` when `model` is a path or hub id "
        "(e.g. {\"dtype\": \"bfloat16\", \"attn_implementation\": \"sdpa\"}). Without `dtype` (or `torch_dtype`) the "
        "model loads in float32, as in TRL; `dtype: auto` keeps the checkpoint's own.", default=None)
    trust_remote_code: bool = _help(
        "Allow models, tokenizers and reward models with custom code from their repository.", default=False)
    disable_dropout: bool = _help("Set every dropout probability in the policy (and reference) to 0.",
                                  default=False)
    cast_lm_head_to_fp32: bool = _help(
        "Keep the output layer in float32 and compute logits in float32 even when the model is bf16/fp16 (for a tied "
        "embedding, its output is cast back to the model's dtype).", default=False)
    gradient_checkpointing: bool = _help(
        "Recompute activations in the backward pass to save memory (slower; TRL's default).", default=True)
    gradient_checkpointing_kwargs: Union[dict, str, None] = _help(
        "Keyword arguments for `model.gradient_checkpointing_enable`; default {\"use_reentrant\": false}.",
        default=None)
    activation_checkpointing: Optional[bool] = _help(
        "transformers 5's name for gradient_checkpointing: when set, it wins, and the two always agree.", default=None)
    activation_checkpointing_kwargs: Union[dict, str, None] = _help(
        "transformers 5's name for gradient_checkpointing_kwargs (wins when set).", default=None)
    fast_paths: bool = _help(
        "posttrain's own fast paths, each checked once per model against the model's own results: the output layer "
        "in chunks, packed rows, shared prompts, the lean decoder and oneDNN products on a CPU. false runs the "
        "model's plain transformers forward with whole logits, padded rows and torch's products (for debugging, or a "
        "model the checks do not know); the numbers agree within float rounding. On a CPU it also leaves the C "
        "library's allocator as it was (with fast paths on, gradient checkpointing off and weights of 1 GiB or more, "
        "training/heap.py keeps freed memory in the heap: faster steps, a higher peak) and torch's intra-op threads as they were (with fast "
        "paths on, each step runs on as many threads as the cores other processes leave free, at most the run's own "
        "count, unless OMP_NUM_THREADS or MKL_NUM_THREADS is set: training/threads.py).", default=True)
    router_aux_loss_coef: Optional[float] = _help(
        "Coefficient of a mixture-of-experts model's router load-balancing loss, added to the training loss (and "
        "logged as aux_loss) as in TRL. None: the model config's own coefficient (0 where it has none); 0 turns it "
        "off. A non-zero value for a model without a router is an error.", range=NON_NEGATIVE, default=None)
    activation_offloading: bool = _help(
        "Move the activations saved for the backward from the accelerator to (pinned) CPU memory during the training "
        "forward, and back as the backward uses them; parameters and tensors under 1 KiB stay. On a CPU they are in "
        "host memory already: it changes nothing (said once). TRL's SFT/DPO field, for GRPO too.", default=False)

    def _check(self):
        # transformers 5 renamed gradient_checkpointing*; the new name wins, and afterwards both say the same
        if self.activation_checkpointing is not None:
            self.gradient_checkpointing = self.activation_checkpointing
        if self.activation_checkpointing_kwargs is not None:
            self.gradient_checkpointing_kwargs = self.activation_checkpointing_kwargs
        self.activation_checkpointing = self.gradient_checkpointing
        self.activation_checkpointing_kwargs = self.gradient_checkpointing_kwargs


@dataclass
class DeviceConfig:
    """Precision, devices and processes."""

    bf16: Optional[bool] = _help(
        "Train with bfloat16 autocast. None means: on when a CUDA device supports bf16, off on CPU (TRL turns it "
        "on everywhere; on CPU it is slow and changes the numbers).", default=None)
    fp16: bool = _help("Train with float16 autocast (with loss scaling on CUDA).", default=False)
    tf32: Optional[bool] = _help("Allow TF32 matmuls on Ampere+ GPUs (no effect on CPU).", default=None)
    use_cpu: bool = _help("Train on the CPU even when a GPU is present.", default=False)
    full_determinism: bool = _help(
        "Deterministic algorithms everywhere (torch.use_deterministic_algorithms; slower), as transformers' "
        "enable_full_determinism.", default=False)
    torch_empty_cache_steps: Optional[int] = _help(
        "Empty the accelerator's memory cache every this many steps (CUDA only); None never.",
        range=AT_LEAST_ONE, default=None)
    ddp_find_unused_parameters: Optional[bool] = _help("DDP's find_unused_parameters.", default=None)
    ddp_bucket_cap_mb: Optional[int] = _help("DDP's bucket_cap_mb.", range=AT_LEAST_ONE, default=None)
    ddp_broadcast_buffers: Optional[bool] = _help("DDP's broadcast_buffers.", default=None)
    ddp_static_graph: Optional[bool] = _help("DDP's static_graph.", default=None)
    ddp_backend: Optional[str] = _help("Process-group backend: nccl, gloo, mpi, ccl, hccl, cncl or mccl.", default=None)
    ddp_timeout: int = _help("Seconds a collective may wait before the process group times out.",
        range=AT_LEAST_ONE, default=1800)
    deepspeed: Optional[Union[str, dict]] = _help(
        "A DeepSpeed config (a JSON file's path, or a dict), as transformers' field: the run trains under DeepSpeed "
        "ZeRO through accelerate with it, as with an accelerate config naming it (docs/distributed.md). Launch "
        "several processes (accelerate launch, torchrun, or --num_processes).", default=None)

    def _check(self):
        if self.bf16 and self.fp16:
            raise ConfigError("bf16=True and fp16=True both set: choose one precision.")
        if self.torch_empty_cache_steps is not None:
            check_positive(self, "torch_empty_cache_steps")
        check_positive(self, "ddp_timeout")
        if self.ddp_bucket_cap_mb is not None:
            check_positive(self, "ddp_bucket_cap_mb")
        if self.ddp_backend is not None:
            check_choice(self, "ddp_backend", ("nccl", "gloo", "mpi", "ccl", "hccl", "cncl", "mccl"))
        if isinstance(self.deepspeed, str) and not os.path.isfile(os.path.expanduser(self.deepspeed)):
            raise ConfigError(f"deepspeed={self.deepspeed!r} is not a file: give the path of a DeepSpeed JSON config "
                              "(or a dict).")


@dataclass
class LoggingConfig:
    """What is logged, where, and how often."""

    logging_strategy: str = _help("When to log: steps (every logging_steps), epoch, or no.", default="steps")
    logging_steps: float = _help(
        "Log every this many optimizer steps (a value in (0, 1) is a fraction of the total steps).",
        range=POSITIVE, default=10)
    logging_first_step: bool = _help("Also log the first step.", default=False)
    logging_dir: Optional[str] = _help(
        "TensorBoard directory (transformers' older field); default $TENSORBOARD_LOGGING_DIR, else "
        "output_dir/runs/<date>_<host>.", default=None)
    report_to: Union[str, list[str]] = _help(
        "Trackers to send metrics to besides `metrics.jsonl`: none, all (every one installed), wandb, trackio or "
        "tensorboard (install with `pip install 'posttrain[trackers]'`).", default="none")
    run_name: Optional[str] = _help("Name of the run in trackers; default: the output directory's name.", default=None)
    project: str = _help("Project name in wandb / trackio (WANDB_PROJECT overrides it for wandb).",
                         default="huggingface")
    trackio_space_id: Optional[str] = _help("Hugging Face Space that trackio syncs the run to.", default=None)
    disable_tqdm: Optional[bool] = _help("Hide the progress bar (None: shown on a terminal).", default=None)
    log_level: str = _help("Level of posttrain's and transformers' loggers on the main process: passive (leave as "
                           "is), debug, info, warning, error or critical.", default="passive")
    log_level_replica: str = _help("The same, on the other processes.", default="warning")
    plot_on_end: Optional[bool] = _help(
        "Draw the run's curves into output_dir/plots.png and write output_dir/report.html at the end of training "
        "(posttrain plot, posttrain report): None (default) "
        "when matplotlib (the plot extra) is installed, True always (matplotlib required), False never.",
        default=None)

    def _check(self):
        if self.plot_on_end:
            import importlib.util

            if importlib.util.find_spec("matplotlib") is None:
                raise ConfigError("plot_on_end=True needs matplotlib: install it with `pip install matplotlib`, "
                                  "or set plot_on_end=False.")
        check_choice(self, "logging_strategy", ("steps", "epoch", "no"))
        check_steps(self, "logging_steps")
        check_choice(self, "log_level", LOG_LEVELS)
        check_choice(self, "log_level_replica", LOG_LEVELS)
        self.report_to = trackers(self.report_to)
        if self.logging_dir is not None:
            self.logging_dir = os.path.expanduser(self.logging_dir)


def trackers(value) -> list:
    """report_to as a list of tracker names: 'none' -> [], 'all' -> every known tracker (kept if installed)."""
    names = [value] if isinstance(value, str) or value is None else list(value)
    names = [n for n in names if n not in ("none", None)]
    if names == ["all"]:
        return ["all"]
    for n in names:
        if n not in TRACKERS:
            raise ConfigError(f"report_to={n!r} is not one of: none, all, {', '.join(TRACKERS)}.")
    return names


@dataclass
class EvaluationConfig:
    """Evaluation during training (TRL's fields): GRPO samples and scores completions of the eval prompts; SFT
    computes the loss on the eval sequences."""

    eval_strategy: str = _help("When to evaluate on eval_dataset: no, steps (every eval_steps) or epoch.",
                               default="no")
    eval_steps: Optional[float] = _help(
        "Evaluate every this many optimizer steps (a value in (0, 1) is a fraction of the total steps); default: "
        "logging_steps.", range=POSITIVE, default=None)
    eval_delay: float = _help("Skip evaluations before this many steps (or epochs, with eval_strategy=epoch).",
                              range=NON_NEGATIVE, default=0)
    eval_on_start: bool = _help("Evaluate once before the first training step.", default=False)
    per_device_eval_batch_size: int = _help("Rows per process in one evaluation batch (completions in GRPO).",
        range=AT_LEAST_ONE, default=8)

    def _check(self):
        check_choice(self, "eval_strategy", ("no", "steps", "epoch"))
        check_steps(self, "eval_steps")
        check_positive(self, "per_device_eval_batch_size")


@dataclass
class CheckpointConfig:
    """Checkpoints, the final model, resuming, and the Hub."""

    save_strategy: str = _help("When to checkpoint: steps (every save_steps and at the end), epoch, best (after an "
                               "evaluation that reaches a new best metric_for_best_model), or no (only the final "
                               "model).", default="steps")
    save_steps: float = _help(
        "Checkpoint every this many optimizer steps (a value in (0, 1) is a fraction of the total steps).",
        range=POSITIVE, default=500)
    save_total_limit: Optional[int] = _help(
        "Keep at most this many checkpoints (the newest, and the best one when metric_for_best_model is set); None "
        "keeps all.", range=AT_LEAST_ONE, default=None)
    load_best_model_at_end: bool = _help(
        "At the end of training, load the weights of the checkpoint with the best metric_for_best_model (default "
        "loss), so the final model saved is the best one; needs save_strategy equal to eval_strategy (save_steps a "
        "multiple of eval_steps) or save_strategy best.", default=False)
    metric_for_best_model: Optional[str] = _help(
        "Evaluation metric (with or without its eval_ prefix) that picks the best checkpoint: recorded in "
        "state.best_metric, best_global_step and best_model_checkpoint, and never rotated away.", default=None)
    greater_is_better: Optional[bool] = _help(
        "Whether a larger metric_for_best_model is better; default: True unless its name ends with loss.",
        default=None)
    save_only_model: bool = _help(
        "Checkpoints hold the model only (no optimizer, scheduler, RNG or buffered batches): smaller, but they cannot "
        "be resumed from.", default=False)
    save_on_interrupt: bool = _help(
        "On SIGINT or SIGTERM, finish the current step, checkpoint it, and stop saying where the checkpoint is.",
        default=True)
    resume_from_checkpoint: Optional[str] = _help(
        "Resume from this checkpoint directory, or `true` for the newest complete one in output_dir.",
        default=None)
    ignore_data_skip: bool = _help(
        "On resume, start again from the first rows of the data instead of where the checkpoint left off.", default=False)
    save_merged: bool = _help(
        "With LoRA, also write merged full weights to output_dir/merged (loadable with plain "
        "AutoModelForCausalLM.from_pretrained); the adapter is always saved.", default=False)
    push_to_hub: bool = _help(
        "Upload output_dir to the Hugging Face Hub at the end of training (needs network access and a token: "
        "`hf auth login` or hub_token).", default=False)
    hub_model_id: Optional[str] = _help("Repository to push to (user/name or name); default: output_dir's name.",
                                        default=None)
    hub_token: Optional[str] = _help("Token for the Hub; default: the one `hf auth login` stored.", default=None)
    hub_private_repo: Optional[bool] = _help("Create the repository as private.", default=None)
    hub_strategy: str = _help("end: push once at the end; every_save: also push output_dir at every checkpoint.",
                              default="every_save")
    hub_always_push: bool = _help("With every_save, push even while the previous push is still running (posttrain "
                                  "pushes synchronously, so every push completes).", default=False)
    hub_revision: Optional[str] = _help("Branch of the repository to push to.", default=None)

    def _check(self):
        check_choice(self, "save_strategy", ("steps", "epoch", "best", "no"))
        check_steps(self, "save_steps")
        self._check_best_model()
        if self.save_total_limit is not None:
            check_positive(self, "save_total_limit")
        if self.hub_strategy not in ("end", "every_save"):
            raise ConfigError(f"hub_strategy={self.hub_strategy!r} is not supported: posttrain pushes output_dir at the "
                              "end (end) or also at every checkpoint (every_save), not checkpoint folders themselves.")

    def _check_best_model(self):
        """transformers' defaults and rules for the best checkpoint (TrainingArguments and Trainer), plus one it
        leaves silent: save_strategy best never saves without evaluations."""
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            self.metric_for_best_model = "loss"
        if self.greater_is_better is None and self.metric_for_best_model is not None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")
        evaluates = getattr(self, "eval_strategy", "no") != "no"
        if self.save_strategy == "best" and (self.metric_for_best_model is None or not evaluates):
            raise ConfigError("save_strategy='best' saves after an evaluation that improves metric_for_best_model: "
                              "set metric_for_best_model and an eval_strategy other than 'no'.")
        if not self.load_best_model_at_end or self.save_strategy == "best":
            return
        if self.eval_strategy != self.save_strategy:
            raise ConfigError(f"load_best_model_at_end needs a checkpoint at every evaluation, but eval_strategy="
                              f"{self.eval_strategy!r} and save_strategy={self.save_strategy!r}: make them equal, or "
                              "use save_strategy='best'.")
        eval_steps = self.eval_steps if self.eval_steps is not None else self.logging_steps
        if self.save_strategy == "steps" and ((eval_steps < 1) != (self.save_steps < 1) or
                                              round(self.save_steps * 1_000_000) % round(eval_steps * 1_000_000)):
            raise ConfigError(f"load_best_model_at_end needs a checkpoint at every evaluation, but save_steps="
                              f"{self.save_steps} is not a multiple of eval_steps={eval_steps}: make it one.")
