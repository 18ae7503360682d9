"""Typed configs for posttrain's trainers, YAML loading and `--key value` overrides.

This package imports no torch and no transformers, so that `posttrain --help` stays fast.

Field names and defaults follow TRL's `GRPOConfig`, `SFTConfig`, `DPOConfig`, `RLOOConfig`, `RewardConfig`, `KTOConfig`, `DistillationConfig` and the
experimental `AsyncGRPOConfig` (and the
`transformers.TrainingArguments` fields they inherit): every TRL field is either implemented or listed in
`trl_compat.py` with what posttrain does instead.

    base.py        ConfigError, field declaration, the checks fields run at construction
    fields.py      field groups every trainer shares: loop, model, devices, logging, evaluation, checkpoints
    grpo.py        sampling and the GRPO objective; GRPOConfig
    sft.py         SFT data preparation and loss; SFTConfig
    dpo.py         DPO data, reference and loss, TRL 0.18 names; DPOConfig
    rloo.py        RLOOConfig: GRPOConfig's fields with RLOO's advantage options and defaults
    reward.py      reward-model data and loss; RewardConfig
    kto.py         KTO data and loss (DPO's reference group); KTOConfig
    distillation.py  the teacher and the divergence on GRPOConfig's sampling; DistillationConfig
    async_generation.py  the rollout worker's fields (async_generation, max_staleness, ...), part of GRPOConfig
    async_grpo.py  AsyncGRPOConfig: GRPOConfig with async_generation on and TRL's AsyncGRPOConfig defaults
    trl_compat.py  TRL fields accepted at posttrain's behaviour; the snapshot of TRL's field list
    script.py      ScriptArguments, LoraArguments (the command line)
    parsing.py     YAML, typed conversion of flags, unknown names with their real near-misses
    reference.py   docs/config.md
"""

from posttrain.configs.base import ConfigError, field_help, field_types, resolve_steps
from posttrain.configs.grpo import GRPOConfig
from posttrain.configs.sft import SFTConfig
from posttrain.configs.dpo import DPOConfig
from posttrain.configs.rloo import RLOOConfig
from posttrain.configs.reward import RewardConfig
from posttrain.configs.kto import KTOConfig
from posttrain.configs.distillation import DistillationConfig
from posttrain.configs.async_grpo import AsyncGRPOConfig
from posttrain.configs.parsing import UNKNOWN_HINT, build, coerce, load_yaml, split_values, suggest
from posttrain.configs.script import LoraArguments, ScriptArguments


def config_reference() -> str:
    from posttrain.configs.reference import config_reference as reference

    return reference()


__all__ = ["ConfigError", "DistillationConfig", "DPOConfig", "GRPOConfig", "KTOConfig", "RLOOConfig", "RewardConfig", "SFTConfig", "LoraArguments", "ScriptArguments",
           "UNKNOWN_HINT", "build", "coerce",
           "config_reference", "field_help", "field_types", "load_yaml", "resolve_steps", "split_values", "suggest"]
