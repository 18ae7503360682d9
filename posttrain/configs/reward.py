"""RewardConfig: TRL 1.16's RewardConfig, field for field.

The shared groups (configs/fields.py) give the training loop, model, devices, logging, evaluation and checkpoints;
this module adds how preference pairs become scored sequences (RewardDataConfig) and the Bradley-Terry loss's one
option (RewardLossConfig). TRL fields accepted at posttrain's behaviour come from configs/trl_compat.py
(REWARD_COMPAT).
"""

from dataclasses import dataclass
from typing import Optional, Union

from posttrain.configs.base import (AT_LEAST_ONE, NON_NEGATIVE, Range, _help, check_choice, check_padding_multiple,
                                    check_ranges, check_types)
from posttrain.configs.fields import (CheckpointConfig, DeviceConfig, EvaluationConfig, LoggingConfig, ModelConfig,
                                      TrainingLoopConfig)
from posttrain.configs.sft import SAMPLING_STRATEGIES
from posttrain.configs.trl_compat import REWARD_COMPAT, RewardCompatConfig, check_compat


@dataclass
class RewardDataConfig:
    """How preference pairs become the two sequences the reward model scores, and their order."""

    eos_token: Optional[str] = _help(
        "Token appended to every standard (not conversational) chosen and rejected text that does not end with it "
        "(default: the tokenizer's EOS); it must be in the vocabulary.", default=None)
    pad_token: Optional[str] = _help(
        "Padding token (default: the tokenizer's, else its EOS), set as the model config's pad_token_id: the score "
        "is read at each sequence's last token that is not this one. TRL deprecates this field; it works here.",
        default=None)
    chat_template_path: Optional[str] = _help(
        "A .jinja file (its special tokens must be in the vocabulary), or a tokenizer directory / hub id whose chat "
        "template replaces the tokenizer's, its missing tokens added and the embeddings resized, as in TRL.",
        default=None)
    max_length: Optional[int] = _help(
        "Longest sequence: a pair whose chosen or rejected sequence is longer is dropped (not truncated: a reward "
        "read from a cut answer is not the answer's), as in TRL; the count is logged. None drops nothing.",
        range=AT_LEAST_ONE, default=1024)
    padding_free: bool = _help(
        "Score each micro-batch's sequences end to end as one row, with position ids restarting per sequence, TRL's "
        "sequence boundaries and no attention mask (posttrain's; TRL pads), where the model keeps them apart (checked "
        "once per model; else padded rows, said once: docs/packing.md). The scores are the padded ones to float "
        "rounding.", default=False)
    pad_to_multiple_of: Optional[Union[int, str]] = _help(
        "Pad every batch's length (the flattened row's, padding-free) to a multiple of this; \"auto\" pads to 128 "
        "on Neuron devices (which compile once per shape) and nowhere else.",
        range=Range(1, note='or "auto", or None for no padding'), default="auto")
    train_sampling_strategy: str = _help(
        "Order of the pairs in each epoch: random (a new seeded order per epoch), sequential (the dataset's order) "
        "or group_by_length (random mega-batches of 50 global batches, each sorted longest first).", default="random")
    dataloader_drop_last: bool = _help("Drop the last, incomplete batch of each epoch.", default=False)

    def _check(self):
        check_choice(self, "train_sampling_strategy", SAMPLING_STRATEGIES)
        check_padding_multiple(self)


@dataclass
class RewardLossConfig:
    """The Bradley-Terry loss, -log sigmoid(r_chosen - r_rejected - margin), and its centring term."""

    center_rewards_coefficient: Optional[float] = _help(
        "Add this times the mean of (r_chosen + r_rejected)^2 to the loss, pulling the rewards toward mean zero "
        "(arXiv 2312.09244, Eq. 2; 0.01 recommended); None adds nothing.", range=NON_NEGATIVE, default=None)

    def _check(self):
        pass


@dataclass
class RewardConfig(TrainingLoopConfig, ModelConfig, DeviceConfig, LoggingConfig, EvaluationConfig, CheckpointConfig,
                   RewardDataConfig, RewardLossConfig, RewardCompatConfig):
    """Everything that configures a reward-model run (TRL's `RewardConfig` names and defaults)."""

    GROUPS = (TrainingLoopConfig, ModelConfig, DeviceConfig, LoggingConfig, EvaluationConfig, CheckpointConfig,
              RewardDataConfig, RewardLossConfig)
    COMPAT = RewardCompatConfig
    NOT_FLAGS = ()  # fields that are not flags of the trainer's command

    learning_rate: float = _help("Peak learning rate (TRL's reward default).", range=NON_NEGATIVE, default=1e-4)
    disable_dropout: bool = _help("Set every dropout probability in the model to 0 (TRL's reward default).",
                                  default=True)

    def __post_init__(self):
        check_types(self)
        check_compat(self, REWARD_COMPAT)
        for group in self.GROUPS:
            group._check(self)
        check_ranges(self)
