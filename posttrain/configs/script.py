"""What the command line needs besides a trainer config: model, data (one dataset or a mixture), rewards and LoRA
(TRL's script names)."""

from dataclasses import dataclass
from typing import Optional

from posttrain.configs.base import POSITIVE, ConfigError, _help
from posttrain.configs.parsing import suggest


@dataclass
class BaseScriptArguments:
    """Model and dataset, as TRL's `ScriptArguments`, `ModelConfig` and `DatasetMixtureConfig` name them."""

    model_name_or_path: Optional[str] = _help("Local path or hub id of the policy model.", default=None)
    dataset_name: Optional[str] = _help(
        "Hub dataset name, or a local .json/.jsonl/.csv/.parquet file or a directory saved with "
        "`save_to_disk`.", default=None)
    dataset_config: Optional[str] = _help("Dataset configuration (subset) name.", default=None)
    dataset_train_split: str = _help("Split to train on.", default="train")
    dataset_test_split: str = _help("Split to evaluate on (read only when eval_strategy is not no).", default="test")
    dataset_streaming: bool = _help("Read the dataset as a stream (an IterableDataset: set max_steps).",
                                    default=False)
    datasets: Optional[list[dict]] = _help(
        "A mixture instead of dataset_name (YAML): a list of {path, name, data_dir, data_files, split, columns, "
        "fraction}. With fraction on every entry, the fractions are the shares of the mixture, whose size is the "
        "largest that takes no dataset's rows twice (each gives its first rows), as in TRL.", default=None)
    streaming: bool = _help("Read the mixture's datasets as streams (no fraction then).", default=False)
    test_split_size: Optional[float] = _help(
        "Split the mixture into train and test (this fraction, or this many rows when >= 1), seeded by seed.",
        range=POSITIVE, default=None)
    trust_remote_code: bool = _help("Allow models with custom code from their repository.", default=False)
    model_revision: str = _help("Model revision (branch, tag or commit).", default="main")
    dtype: Optional[str] = _help("Weights dtype for loading: auto (the checkpoint's own), float32, bfloat16 or "
                                 "float16; unset, float32 (TRL's default).", default=None)
    attn_implementation: Optional[str] = _help("Attention implementation, e.g. sdpa or eager.", default=None)

    def __post_init__(self):
        check_mixture(self)


@dataclass
class ScriptArguments(BaseScriptArguments):
    """Model, dataset and reward functions: the `grpo` command's script arguments (TRL's `GRPOScriptArguments`)."""

    reward_model_name_or_path: Optional[str] = _help(
        "Path or hub id of a sequence-classification reward model, used before the reward_funcs (TRL's grpo script "
        "argument).", default=None)
    reward_funcs: Optional[list[str]] = _help(
        "Reward functions: built-in names (accuracy, think_format, soft_overlong, length; and the names TRL's grpo "
        "script takes: accuracy_reward, reasoning_accuracy_reward, think_format_reward, get_soft_overlong_punishment, "
        "plus get_cosine_scaled_reward and get_repetition_penalty_reward), dotted import paths "
        "(my_module.my_reward), or paths/hub ids of sequence-classification reward models.", default=None)


MIXTURE_KEYS = ("path", "name", "data_dir", "data_files", "split", "columns", "fraction")


def check_mixture(script) -> None:
    """The `datasets` mixture of a script's arguments (see check_mixture_entries)."""
    if script.datasets is not None:
        check_mixture_entries(script.datasets, script.streaming)


def check_mixture_entries(entries, streaming: bool) -> None:
    """A `datasets` mixture: entries with a path and known keys, fractions on all or none, not with streaming."""
    if not isinstance(entries, list) or not entries:
        raise ConfigError("datasets must be a non-empty list of {path, name, split, columns, fraction} entries.")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or "path" not in entry:
            raise ConfigError(f"datasets entry {i} ({entry!r}) needs a path: write it as {{path: ..., split: ...}}.")
        unknown = [k for k in entry if k not in MIXTURE_KEYS]
        if unknown:
            raise ConfigError(f"datasets entry {i} has {', '.join(map(repr, unknown))}: its keys are "
                              f"{', '.join(MIXTURE_KEYS)}.{suggest(unknown[0], MIXTURE_KEYS)}")
        fraction = entry.get("fraction")
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                     or not fraction > 0):
            raise ConfigError(f"datasets entry {i} has fraction={fraction!r}: it must be a positive number.")
    given = [e.get("fraction") is not None for e in entries]
    if any(given) and not all(given):
        raise ConfigError("fraction is set on some datasets entries and not others: set it on all of them, or on "
                          "none.")
    if any(given) and streaming:
        raise ConfigError("fraction needs the datasets' lengths, which streaming does not give: drop fraction or "
                          "streaming.")


@dataclass
class LoraArguments:
    """LoRA on the command line (TRL's ModelConfig names). Ignored unless `use_peft` is true."""

    use_peft: bool = _help("Train LoRA adapters instead of all weights (needs `pip install 'posttrain[peft]'`).",
                           default=False)
    lora_r: int = _help("LoRA rank.", default=16)
    lora_alpha: int = _help("LoRA scaling numerator (scale = alpha / r, or alpha / sqrt(r) with rsLoRA).", default=32)
    lora_dropout: float = _help("Dropout on the LoRA input.", default=0.05)
    lora_target_modules: Optional[list[str]] = _help(
        "Module names to adapt, or all-linear; default: peft's choice for the architecture.", default=None)
    lora_target_parameters: Optional[list[str]] = _help(
        "Parameter names to adapt directly (peft's target_parameters, e.g. the experts of a MoE layer).", default=None)
    lora_modules_to_save: Optional[list[str]] = _help(
        "Modules trained in full and saved beside the adapters (e.g. lm_head).", default=None)
    lora_task_type: str = _help("peft's task type: CAUSAL_LM for the policies; `posttrain reward` takes the default "
                                "as SEQ_CLS, its model's.", default="CAUSAL_LM")
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
        # target_parameters only where asked: peft before 0.17 has no such argument
        extra = {} if self.lora_target_parameters is None else {"target_parameters": self.lora_target_parameters}
        return peft.LoraConfig(r=self.lora_r, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout,
                               target_modules=targets, modules_to_save=self.lora_modules_to_save, bias="none",
                               use_rslora=self.use_rslora, use_dora=self.use_dora, task_type=self.lora_task_type,
                               **extra)
