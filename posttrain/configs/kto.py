"""KTOConfig: TRL 1.16's KTOConfig, field for field.

The shared groups (configs/fields.py) give the training loop, model, devices, logging, evaluation and checkpoints;
DPO's reference group (precompute_ref_log_probs, sync_ref_model, ...) is KTO's as well. This module adds how unpaired
examples become token rows (KTODataConfig) and the losses (KTOLossConfig; kto/losses.py). TRL fields accepted at
posttrain's behaviour come from configs/trl_compat.py (KTO_COMPAT).
"""

from dataclasses import dataclass
from typing import Optional, Union

from posttrain.configs.base import (AT_LEAST_ONE, NON_NEGATIVE, ConfigError, Range, _help, check_choice,
                                    check_padding_multiple, check_ranges, check_types)
from posttrain.configs.dpo import DPOReferenceConfig
from posttrain.configs.fields import (CheckpointConfig, DeviceConfig, EvaluationConfig, LoggingConfig, ModelConfig,
                                      TrainingLoopConfig)
from posttrain.configs.sft import SAMPLING_STRATEGIES
from posttrain.configs.trl_compat import KTO_COMPAT, KTOCompatConfig, check_compat

KTO_LOSSES = ("kto", "apo_zero_unpaired")
KL_LOSSES = ("kto",)  # the losses with the KL reference point z0


@dataclass
class KTODataConfig:
    """How unpaired examples become token rows, and the order they are trained in."""

    max_length: Optional[int] = _help(
        "Longest sequence (prompt + completion, and each KL pair's prompt + other completion): longer ones keep their "
        "first max_length tokens, as in TRL. An example whose prompt alone has max_length tokens or more is dropped, "
        "and the count logged. None truncates nothing.", range=AT_LEAST_ONE, default=1024)
    pad_to_multiple_of: Optional[Union[int, str]] = _help(
        "Pad every batch's length to a multiple of this; \"auto\" pads to 128 on Neuron devices (which compile once "
        "per shape) and nowhere else.", range=Range(1, note='or "auto", or None for no padding'), default="auto")
    train_sampling_strategy: str = _help(
        "Order of the examples in each epoch: sequential (the dataset's order; TRL's KTO default), random (a new "
        "seeded order per epoch) or group_by_length. The KL pairs are formed within each micro-batch as drawn, so "
        "every strategy works with loss_type kto (TRL 1.16 refuses all but sequential there).",
        default="sequential")
    dataloader_drop_last: bool = _help("Drop the last, incomplete batch of each epoch.", default=False)

    def _check(self):
        check_choice(self, "train_sampling_strategy", SAMPLING_STRATEGIES)
        check_padding_multiple(self)


@dataclass
class KTOLossConfig:
    """The KTO loss (docs/kto.md has the formulas)."""

    loss_type: str = _help(
        "kto (KTO, Eq. 7: each log-ratio against the KL reference point z0) or apo_zero_unpaired (APO-zero, no z0: "
        "desirable completions pushed up, undesirable ones down).", default="kto")
    beta: float = _help("Temperature of the log-ratios; 0 makes the loss a constant and is refused.",
                        range=NON_NEGATIVE, default=0.1)
    desirable_weight: float = _help(
        "Weight of each desirable example's loss (raise it when they are fewer; the KTO paper recommends "
        "desirable_weight * desirable / (undesirable_weight * undesirable) in [1, 4/3]).", range=NON_NEGATIVE,
        default=1.0)
    undesirable_weight: float = _help("Weight of each undesirable example's loss.", range=NON_NEGATIVE, default=1.0)

    def _check(self):
        check_choice(self, "loss_type", KTO_LOSSES)
        if self.beta == 0.0:
            raise ConfigError("beta=0 makes the KTO loss a constant with no gradient (the log-ratios enter only as "
                              "beta times them), so the run would learn nothing: set beta > 0 (TRL's default is 0.1).")
        if self.desirable_weight == 0.0 and self.undesirable_weight == 0.0:
            raise ConfigError("desirable_weight and undesirable_weight are both 0, which leaves no loss: set at least "
                              "one of them above 0 (TRL's defaults are 1.0).")

    @property
    def uses_kl(self) -> bool:
        return self.loss_type in KL_LOSSES


@dataclass
class KTOConfig(TrainingLoopConfig, ModelConfig, DeviceConfig, LoggingConfig, EvaluationConfig, CheckpointConfig,
                KTODataConfig, DPOReferenceConfig, KTOLossConfig, KTOCompatConfig):
    """Everything that configures a KTO run (TRL's `KTOConfig` names and defaults)."""

    GROUPS = (TrainingLoopConfig, ModelConfig, DeviceConfig, LoggingConfig, EvaluationConfig, CheckpointConfig,
              KTODataConfig, DPOReferenceConfig, KTOLossConfig)
    COMPAT = KTOCompatConfig
    NOT_FLAGS = ()  # fields that are not flags of the trainer's command

    learning_rate: float = _help("Peak learning rate (TRL's KTO default).", range=NON_NEGATIVE, default=1e-6)
    disable_dropout: bool = _help("Set every dropout probability in the policy and the reference to 0 (TRL's KTO "
                                  "default).", default=True)

    def __post_init__(self):
        check_types(self)
        check_compat(self, KTO_COMPAT)
        for group in self.GROUPS:
            group._check(self)
        check_ranges(self)
