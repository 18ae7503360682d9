"""SFTConfig: TRL's SFTConfig, field for field.

The shared groups (configs/fields.py) give the training loop, model, devices, logging, evaluation and checkpoints;
this module adds how the data becomes token rows (formats, truncation, packing, padding) and what the loss trains on.
TRL fields accepted at posttrain's behaviour come from configs/trl_compat.py (SFT_COMPAT).
"""

from dataclasses import dataclass
from typing import Optional, Union

from posttrain.configs.base import (AT_LEAST_ONE, NON_NEGATIVE, ConfigError, Range, _help, check_choice,
                                    check_padding_multiple, check_ranges, check_types)
from posttrain.configs.fields import (CheckpointConfig, DeviceConfig, EvaluationConfig, LoggingConfig, ModelConfig,
                                      TrainingLoopConfig)
from posttrain.configs.trl_compat import SFT_COMPAT, SFTCompatConfig, check_compat

PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")
SFT_LOSSES = ("nll", "dft")
TRUNCATION_MODES = ("keep_start", "keep_end")
SAMPLING_STRATEGIES = ("random", "sequential", "group_by_length")


@dataclass
class SFTDataConfig:
    """How dataset rows become token rows: formats, truncation, packing, padding and order."""

    dataset_text_field: str = _help("Column holding the text of a language-modelling dataset.", default="text")
    dataset_kwargs: Union[dict, str, None] = _help(
        "Options of dataset preparation. The one key is skip_prepare_dataset: true means the rows are already "
        "tokenized (input_ids, with labels or completion_mask / assistant_masks) and are used as they are: no EOS "
        "is added and nothing is truncated.", default=None)
    eos_token: Optional[str] = _help(
        "Token that ends a sequence or turn (default: the tokenizer's EOS). It must be in the vocabulary; it is set "
        "on the tokenizer, the model config and its generation config, appended to every text and completion, and "
        "must appear among the labels of every conversation.", default=None)
    pad_token: Optional[str] = _help(
        "Padding token (default: the tokenizer's, else its EOS). TRL deprecates this field; it works here.",
        default=None)
    chat_template_path: Optional[str] = _help(
        "A .jinja file (its special tokens must be in the vocabulary), or a tokenizer directory / hub id whose chat "
        "template replaces the tokenizer's, its missing tokens added and the embeddings resized, as in TRL.",
        default=None)
    max_length: Optional[int] = _help(
        "Longest token row: longer sequences are truncated (truncation_mode); with packing, the length of a packed "
        "row. None truncates nothing (not with packing).", range=AT_LEAST_ONE, default=1024)
    truncation_mode: str = _help(
        "keep_start keeps the first max_length tokens; keep_end (deprecated in TRL) the last ones.",
        default="keep_start")
    shuffle_dataset: bool = _help(
        "Shuffle the rows once (with seed) before packing, as TRL does; each epoch's order is "
        "train_sampling_strategy's.", default=False)
    train_sampling_strategy: str = _help(
        "Order of the rows in each epoch: random (a new seeded order per epoch), sequential (the dataset's order) or "
        "group_by_length (random mega-batches of 50 global batches, each sorted longest first: less padding).",
        default="random")
    dataloader_drop_last: bool = _help("Drop the last, incomplete batch of each epoch.", default=False)
    packing: bool = _help(
        "Pack several sequences into each row of max_length tokens. Packed rows are always trained padding-free: "
        "position ids restart at every sequence, attention never crosses one, and no target is predicted across "
        "a boundary.", default=False)
    packing_strategy: str = _help(
        "bfd: best-fit decreasing, a sequence longer than max_length is truncated; bfd_split: best-fit decreasing, "
        "a longer sequence is split into pieces of at most max_length; wrapped: the sequences concatenated and cut "
        "every max_length tokens (a sequence cut in two continues in the next row with fresh positions).",
        default="bfd")
    padding_free: bool = _help(
        "Train each micro-batch as one flattened row with position ids, TRL's sequence boundaries (cu_seq_lens, "
        "max_length, seq_idx) and no padding (packing implies it), where the model keeps the row's sequences apart "
        "(checked once per model: sdpa, eager and flash attention do; recurrent or convolutional layers need their "
        "kernels); else padded rows, said once. docs/packing.md.", default=False)
    pad_to_multiple_of: Optional[Union[int, str]] = _help(
        "Pad every batch's length (the flattened row's, padding-free) to a multiple of this; \"auto\" pads to 128 "
        "on Neuron devices (which compile once per shape) and nowhere else.",
        range=Range(1, note='or "auto", or None for no padding'), default="auto")
    eval_packing: Optional[bool] = _help("Pack the eval dataset; None: the same as packing.", default=None)

    def _check(self):
        if self.packing_strategy == "bfd-requeue":  # TRL's earlier name
            self.packing_strategy = "bfd_split"
        check_choice(self, "packing_strategy", PACKING_STRATEGIES)
        check_choice(self, "truncation_mode", TRUNCATION_MODES)
        check_choice(self, "train_sampling_strategy", SAMPLING_STRATEGIES)
        check_padding_multiple(self)
        if (self.packing or self.eval_packing) and self.max_length is None:
            raise ConfigError("packing=True needs max_length, the length of a packed row: set max_length (e.g. 1024).")
        unknown = sorted(set(self.dataset_kwargs or {}) - {"skip_prepare_dataset"})
        if unknown:
            raise ConfigError(f"dataset_kwargs has {', '.join(map(repr, unknown))}: the only key is "
                              "skip_prepare_dataset.")

    @property
    def skip_prepare_dataset(self) -> bool:
        return bool((self.dataset_kwargs or {}).get("skip_prepare_dataset", False))


@dataclass
class SFTLossConfig:
    """Which tokens the loss trains on, and how."""

    completion_only_loss: Optional[bool] = _help(
        "Train on the completion tokens only. None: yes when the data says where completions are (prompt-completion "
        "data, a formatting function returning {\"prompt\", \"completion\"}, or a completion_mask column), otherwise "
        "every token.", default=None)
    assistant_only_loss: bool = _help(
        "Conversational data: train on the assistant turns only (their end-of-turn token included). A chat template "
        "with {% generation %} markers marks them itself; for any other, each assistant turn is found by rendering "
        "the conversation up to it, and a template that renders a conversation's start differently from the whole "
        "stops with an error.", default=False)
    loss_type: str = _help(
        "nll: the mean negative log-likelihood of the label tokens; dft: Dynamic Fine-Tuning (each token's term "
        "weighted by its detached probability, arXiv 2508.05629). chunked_nll is TRL's old name of nll.",
        default="nll")
    neftune_noise_alpha: Optional[float] = _help(
        "NEFTune: add uniform noise of scale alpha / sqrt(length * hidden) to the input embeddings in training "
        "(e.g. 5); None disables.", range=NON_NEGATIVE, default=None)

    def _check(self):
        if self.loss_type == "chunked_nll":
            self.loss_type = "nll"
        check_choice(self, "loss_type", SFT_LOSSES)


@dataclass
class SFTConfig(TrainingLoopConfig, ModelConfig, DeviceConfig, LoggingConfig, EvaluationConfig, CheckpointConfig,
                SFTDataConfig, SFTLossConfig, SFTCompatConfig):
    """Everything that configures an SFT run (TRL's `SFTConfig` names and defaults)."""

    GROUPS = (TrainingLoopConfig, ModelConfig, DeviceConfig, LoggingConfig, EvaluationConfig, CheckpointConfig,
              SFTDataConfig, SFTLossConfig)
    COMPAT = SFTCompatConfig
    NOT_FLAGS = ()  # fields that are not flags of the trainer's command

    learning_rate: float = _help("Peak learning rate (TRL's SFT default).", range=NON_NEGATIVE, default=2e-5)

    def __post_init__(self):
        check_types(self)
        check_compat(self, SFT_COMPAT)
        for group in self.GROUPS:
            group._check(self)
        check_ranges(self)
