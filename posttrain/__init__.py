"""posttrain: post-train language models with GRPO and its family, RLOO, SFT, DPO, KTO, ORPO, reward models,
on-policy distillation and asynchronous GRPO, a drop-in for TRL users.

    from posttrain import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer, DPOConfig, DPOTrainer, RLOOConfig, RLOOTrainer
    from posttrain import RewardConfig, RewardTrainer, KTOConfig, KTOTrainer, DistillationConfig, DistillationTrainer
    from posttrain import AsyncGRPOConfig, AsyncGRPOTrainer, ORPOConfig, ORPOTrainer

Every trainer and its config is an entry of posttrain/registry.py, exported from there.

Heavy modules (torch, transformers) load on first use of a name, so `posttrain --help` stays fast.
"""

from posttrain._version import __version__
from posttrain.registry import TRAINERS as _TRAINERS

_EXPORTS = {
    "LoraArguments": "posttrain.configs",
    "ScriptArguments": "posttrain.scripts",
    "ModelConfig": "posttrain.scripts",
    "DatasetMixtureConfig": "posttrain.scripts",
    "TrlParser": "posttrain.scripts",
    "get_dataset": "posttrain.scripts",
    "get_peft_config": "posttrain.scripts",
    "get_quantization_config": "posttrain.scripts",
    "get_kbit_device_map": "posttrain.scripts",
    "TrainerState": "transformers",
    "TrainerCallback": "transformers",
    "Rollouts": "posttrain.generation",
    "SamplingParams": "posttrain.generation",
    "export_weights": "posttrain.weights",
    "token_logprobs": "posttrain.models.logprobs",
}

for _entry in _TRAINERS:  # every trainer and its config, as the registry names them
    _EXPORTS[_entry.trainer_name] = _entry.trainer.split(":")[0]
    _EXPORTS[_entry.config_name] = _entry.config.split(":")[0]

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'posttrain' has no attribute {name!r}")
