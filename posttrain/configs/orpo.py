"""ORPOConfig: TRL 1.16's experimental ORPOConfig (`trl.experimental.orpo`), field for field.

The shared groups (configs/fields.py) and DPO's data group (how pairs become token rows: ORPO's pairs are DPO's) give
everything but the loss (ORPOLossConfig; posttrain/orpo.py). TRL fields accepted at posttrain's behaviour: ORPO_COMPAT
below, DPO's table with ORPO's own entries.
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional

from posttrain.configs.base import AT_LEAST_ONE, NON_NEGATIVE, _help, check_ranges, check_types
from posttrain.configs.dpo import DPODataConfig
from posttrain.configs.fields import (CheckpointConfig, DeviceConfig, EvaluationConfig, LoggingConfig, ModelConfig,
                                      TrainingLoopConfig)
from posttrain.configs.trl_compat import DPO_COMPAT, check_compat, compat_config, same, unsupported

_NOT_DPO = {  # DPO's entries whose reasons name DPO
    "label_smoothing_factor": "ORPO's loss has no labels to smooth; remove it",
    "neftune_noise_alpha": "NEFTune noise is for supervised fine-tuning (SFTTrainer), not ORPO; remove it",
    "label_names": "ORPO builds its labels from the completion boundaries",
}
ORPO_COMPAT = [dataclasses.replace(c, why=_NOT_DPO.get(c.name, c.why)) for c in DPO_COMPAT] + [
    same("max_completion_length", Optional[int], None, "TRL's ORPOTrainer reads it for encoder-decoder models only, "
         "which posttrain does not train; max_length bounds each sequence", range=AT_LEAST_ONE),
    unsupported("padding_value", Optional[int], None, "the batches are padded with the tokenizer's pad token; set "
                "pad_token to choose another"),
    unsupported("generate_during_eval", bool, False, "posttrain logs no sampled completions during ORPO's "
                "evaluation; sample from the saved model instead"),
    unsupported("is_encoder_decoder", Optional[bool], None, "posttrain trains decoder-only causal LMs", accepts=(None,
                False)),
]
ORPOCompatConfig = compat_config("ORPOCompatConfig", ORPO_COMPAT)


@dataclass
class ORPOLossConfig:
    """The ORPO loss: the chosen completions' NLL minus beta times the log-sigmoid of the log odds ratio (docs/orpo.md)."""

    beta: float = _help("lambda of the ORPO paper: the weight of the odds-ratio term beside the NLL.",
                        range=NON_NEGATIVE, default=0.1)

    def _check(self):
        """beta's range is checked with every number's (check_ranges)."""


@dataclass
class ORPOConfig(TrainingLoopConfig, ModelConfig, DeviceConfig, LoggingConfig, EvaluationConfig, CheckpointConfig,
                 DPODataConfig, ORPOLossConfig, ORPOCompatConfig):
    """Everything that configures an ORPO run (TRL's experimental `ORPOConfig` names and defaults)."""

    GROUPS = (TrainingLoopConfig, ModelConfig, DeviceConfig, LoggingConfig, EvaluationConfig, CheckpointConfig,
              DPODataConfig, ORPOLossConfig)
    COMPAT = ORPOCompatConfig
    NOT_FLAGS = ()  # fields that are not flags of the trainer's command

    learning_rate: float = _help("Peak learning rate (TRL's ORPO default).", range=NON_NEGATIVE, default=1e-6)
    disable_dropout: bool = _help("Set every dropout probability in the policy to 0 (TRL's ORPO default).",
                                  default=True)

    def __post_init__(self):
        check_types(self)
        check_compat(self, ORPO_COMPAT)
        for group in self.GROUPS:
            group._check(self)
        check_ranges(self)
