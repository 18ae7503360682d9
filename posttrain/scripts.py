"""What TRL's scripts (`trl/scripts/grpo.py`, `sft.py`, `dpo.py`) and its documentation import besides the trainers,
under TRL's names, so that such a script runs with `trl` changed to `posttrain` in its import lines:

    TrlParser              transformers' HfArgumentParser with `--config run.yaml` (its `env:` mapping set first)
    ScriptArguments        the dataset: dataset_name, dataset_config, the splits, streaming
    ModelConfig            the model's name and loading, LoRA (posttrain's LoraArguments) and 4/8-bit quantization
    DatasetConfig,         a mixture of datasets (`datasets:` in YAML), loaded by get_dataset
    DatasetMixtureConfig
    get_dataset, get_peft_config, get_quantization_config, get_kbit_device_map

Differences from TRL 1.16, by design: keys of a YAML config that no dataclass takes are said in a warning when the
script asks to go on (`fail_with_unknown_args=False`, as TRL's scripts do) rather than dropped in silence; a YAML key
given twice is an error; get_dataset's train/test split is seeded (42), where TRL's is not.
"""

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Optional, Union

from transformers import HfArgumentParser

from posttrain.configs import ConfigError
from posttrain.configs.base import _help
from posttrain.configs.parsing import load_yaml, suggest
from posttrain.configs.script import LoraArguments, check_mixture_entries

logger = logging.getLogger("posttrain")


@dataclass
class ScriptArguments:
    """The dataset a script trains on (TRL's ScriptArguments)."""

    dataset_name: Optional[str] = _help("Hub dataset name, or a local file or directory.", default=None)
    dataset_config: Optional[str] = _help("Dataset configuration (subset) name.", default=None)
    dataset_train_split: str = _help("Split to train on.", default="train")
    dataset_test_split: str = _help("Split to evaluate on.", default="test")
    dataset_streaming: bool = _help("Read the dataset as a stream.", default=False)
    ignore_bias_buffers: bool = _help(
        "TRL's workaround for DDP and boolean buffers; posttrain's trainers need none, so it changes nothing.",
        default=False)


@dataclass
class ModelConfig(LoraArguments):
    """The model, how it loads, its LoRA adapters and its quantization (TRL's ModelConfig)."""

    model_name_or_path: Optional[str] = _help("Local path or hub id of the model.", default=None)
    model_revision: str = _help("Model revision (branch, tag or commit).", default="main")
    dtype: Optional[str] = _help("auto, bfloat16, float16 or float32 (TRL's default).", default="float32")
    attn_implementation: Optional[str] = _help("Attention implementation, e.g. sdpa or eager.", default=None)
    load_in_8bit: bool = _help("Load the weights in 8 bits (bitsandbytes, a CUDA GPU).", default=False)
    load_in_4bit: bool = _help("Load the weights in 4 bits (bitsandbytes, a CUDA GPU).", default=False)
    bnb_4bit_quant_type: str = _help("4-bit quantization type: fp4 or nf4.", default="nf4")
    use_bnb_nested_quant: bool = _help("Quantize the 4-bit quantization constants too.", default=False)
    bnb_4bit_quant_storage: Optional[str] = _help("The dtype that stores the 4-bit weights.", default=None)

    def __post_init__(self):
        if self.load_in_8bit and self.load_in_4bit:
            raise ConfigError("load_in_8bit and load_in_4bit are both set: choose one precision.")
        if self.bnb_4bit_quant_type not in ("fp4", "nf4"):
            raise ConfigError(f"bnb_4bit_quant_type={self.bnb_4bit_quant_type!r} is not one of: fp4, nf4.")
        if isinstance(self.lora_target_modules, str):
            self.lora_target_modules = [self.lora_target_modules]  # LoraArguments' form; to_peft_config unwraps it


@dataclass
class DatasetConfig:
    """One dataset of a mixture (TRL's DatasetConfig): the arguments of `datasets.load_dataset`, the columns to keep,
    and its share of the mixture."""

    path: str
    name: Optional[str] = None
    data_dir: Optional[str] = None
    data_files: Union[str, list[str], dict, None] = None
    split: str = "train"
    columns: Optional[list[str]] = None
    fraction: Optional[float] = None


@dataclass
class DatasetMixtureConfig:
    """Several datasets as one (TRL's DatasetMixtureConfig); `datasets:` entries may be mappings (from YAML) or
    DatasetConfig objects."""

    datasets: list[DatasetConfig] = field(default_factory=list, metadata={
        "help": "The datasets of the mixture, each {path, name, data_dir, data_files, split, columns, fraction}."})
    streaming: bool = _help("Read the datasets as streams (no fraction then).", default=False)
    test_split_size: Optional[float] = _help(
        "Split the mixture into train and test (this fraction, or this many rows when >= 1).", default=None)

    def __post_init__(self):
        self.datasets = list(self.datasets or [])
        if self.datasets:
            check_mixture_entries(self.entries, self.streaming)  # keys and fractions, before they become objects
        self.datasets = [DatasetConfig(**d) if isinstance(d, dict) else d for d in self.datasets]

    @property
    def entries(self) -> list[dict]:
        """The datasets as posttrain's mixture entries (mappings without the unset keys)."""
        mappings = [vars(d) if isinstance(d, DatasetConfig) else d for d in self.datasets]
        return [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in mappings]


def get_dataset(mixture_config: DatasetMixtureConfig):
    """The mixture as a DatasetDict: `train`, and `test` when test_split_size is set (an IterableDatasetDict when
    streaming)."""
    import datasets

    from posttrain.dataset_loading import load_mixture

    if not mixture_config.datasets:
        raise ConfigError("The datasets mixture is empty: give `datasets:` entries, or use dataset_name.")
    train, test = load_mixture(mixture_config.entries, mixture_config.streaming, mixture_config.test_split_size)
    splits = {"train": train} if test is None else {"train": train, "test": test}
    return (datasets.IterableDatasetDict if mixture_config.streaming else datasets.DatasetDict)(splits)


def get_peft_config(model_args: ModelConfig):
    """A peft LoraConfig from the model arguments when use_peft is set, else None (TRL's get_peft_config)."""
    return model_args.to_peft_config()


def get_quantization_config(model_args: ModelConfig):
    """A transformers BitsAndBytesConfig for load_in_4bit or load_in_8bit, else None (TRL's get_quantization_config:
    4-bit computes in the model's dtype)."""
    from transformers import BitsAndBytesConfig

    if model_args.load_in_4bit:
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=model_args.dtype,
                                  bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,
                                  bnb_4bit_use_double_quant=model_args.use_bnb_nested_quant,
                                  bnb_4bit_quant_storage=model_args.bnb_4bit_quant_storage)
    if model_args.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def get_kbit_device_map() -> dict | None:
    """Where a quantized model's weights go: this process's accelerator, or None without one (TRL's)."""
    import torch
    from accelerate import PartialState

    return {"": PartialState().local_process_index} if torch.accelerator.is_available() else None


class TrlParser(HfArgumentParser):
    """transformers' HfArgumentParser with TRL's `--config FILE.yaml`: the file's values become the defaults, flags
    override them, and its `env:` mapping is set in the environment first.

    Args:
        dataclass_types: the dataclasses to fill (none may have a field named `config`).
        **kwargs: HfArgumentParser's (prog, description, ...).
    """

    def __init__(self, dataclass_types=None, **kwargs):
        types = [] if dataclass_types is None else (
            list(dataclass_types) if isinstance(dataclass_types, (list, tuple)) else [dataclass_types])
        for cls in types:
            if "config" in cls.__dataclass_fields__:
                raise ConfigError(f"{cls.__name__} has a field named 'config', which TrlParser keeps for the YAML "
                                  "file's path: rename the field.")
        super().__init__(dataclass_types=types, **kwargs)

    def parse_args_and_config(self, args=None, return_remaining_strings: bool = False,
                              fail_with_unknown_args: bool = True, separate_remaining_strings: bool = False):
        """The dataclasses filled from `--config FILE` (if given) and the flags, which win.

        Returns:
            one instance per dataclass; with return_remaining_strings, then the unused strings (the config file's and
            the command line's together, or as two lists with separate_remaining_strings).
        """
        args = list(sys.argv[1:] if args is None else args)
        from_config = []
        if "--config" in args:
            at = args.index("--config")
            if at + 1 >= len(args):
                raise ConfigError("--config needs the path of a YAML file.")
            path = args[at + 1]
            del args[at:at + 2]
            from_config = self.set_defaults_with_config(**self._config_values(path))
        output = self.parse_args_into_dataclasses(args=args, return_remaining_strings=return_remaining_strings)
        if return_remaining_strings:
            *parsed, remaining = output
            return (*parsed, from_config, remaining) if separate_remaining_strings else (*parsed,
                                                                                          from_config + remaining)
        if from_config:
            unknown = from_config[::2]
            known = [action.dest for action in self._actions]
            if fail_with_unknown_args:
                raise ConfigError(f"The config file has {', '.join(unknown)}, which no argument of this script takes."
                                  f"{suggest(unknown[0].lstrip('-'), known)}")
            logger.warning("Ignored from the config file: %s (no argument of this script takes them).%s",
                           ", ".join(unknown), suggest(unknown[0].lstrip("-"), known))
        return output

    @staticmethod
    def _config_values(path: str) -> dict:
        values = load_yaml(path)
        env = values.pop("env", {})
        if not isinstance(env, dict):
            raise ConfigError(f"{path}: `env` must be a mapping of environment variables to values.")
        for key, value in env.items():
            os.environ[str(key)] = str(value)
        return values

    def set_defaults_with_config(self, **values) -> list[str]:
        """The parser's defaults set from `values` (subparsers too; an argument with a default is no longer
        required). Returns `--key value` strings for the keys no argument takes."""
        used = set()

        def apply(parser):
            for action in parser._actions:
                if hasattr(action, "choices") and isinstance(action.choices, dict):  # subparsers
                    for sub in action.choices.values():
                        apply(sub)
                elif action.dest in values:
                    action.default, action.required = values[action.dest], False
                    used.add(action.dest)

        apply(self)
        return [text for key, value in values.items() if key not in used for text in (f"--{key}", str(value))]
