"""The trainers posttrain has, one entry each: what the exports, the command line and its help, the runs, the config
reference and the TRL field tables are built from. Adding a trainer is its package, its config, its docs page, its
tests and one entry here.

Everything is named by a dotted path ("package.module:Name") and imported only when used (`load`), so this module
imports nothing of posttrain and `posttrain --help` stays fast.
"""

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainerEntry:
    """One trainer.

    Attributes:
        name: the key of everything else: the command (`posttrain kto`), the TRL snapshot's
            (configs/trl_<name>_fields.json).
        title: what the trainer is called in output directories (`<model>-KTO`) and messages.
        trainer: the trainer class, "module:Class" (exported from `posttrain` by its name).
        config: the config class, "module:Class" (exported from `posttrain` by its name).
        trl_config: TRL's config class it answers for, "module:Class".
        compat: its table of TRL fields accepted at posttrain's behaviour (configs/trl_compat.py's Compat list).
        groups: the config reference's sections of its own fields: (title, "module:Class") each.
        command: the command line's help line; None: no command (the trainer is used from Python only).
        script: the command's script arguments: "prompts" (ScriptArguments: rewards, as GRPO's) or "base".
        common: the fields the command's first help page shows, in order.
        run: the function the command runs once its arguments are parsed, "module:function" (runs.py).
        headlines: the metrics a run report shows first (its progress line's), then `eval_headlines`, evaluation's
            ("rewards/*/mean": each reward function's mean); () for another trainer's (`headlines_of`).
    """

    name: str
    title: str
    trainer: str
    config: str
    trl_config: str
    compat: str
    groups: tuple = ()
    command: str | None = None
    script: str = "base"
    common: tuple = ()
    run: str = "posttrain.runs:run_trainer"
    headlines: tuple = ()
    eval_headlines: tuple = ()

    @property
    def trainer_name(self) -> str:
        return self.trainer.rsplit(":", 1)[1]

    @property
    def config_name(self) -> str:
        return self.config.rsplit(":", 1)[1]


def load(path: str):
    """The object a "module:Name" path names."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


_COMMON = ("model_name_or_path", "dataset_name", "output_dir", "learning_rate", "per_device_train_batch_size",
           "gradient_accumulation_steps", "max_steps", "num_train_epochs")
_LAST = ("use_peft", "logging_steps", "save_steps")
_GRPO_GROUPS = (("GRPO: prompts and completions", "posttrain.configs.grpo:PromptDataConfig"),
                ("GRPO: sampling", "posttrain.configs.grpo:SamplingConfig"),
                ("GRPO: objective", "posttrain.configs.grpo:GRPOObjectiveConfig"),
                ("GRPO: asynchronous generation", "posttrain.configs.async_generation:AsyncGenerationConfig"))

TRAINERS = (
    TrainerEntry(
        "grpo", "GRPO", "posttrain.grpo.trainer:GRPOTrainer", "posttrain.configs.grpo:GRPOConfig", "trl:GRPOConfig",
        "posttrain.configs.trl_compat:GRPO_COMPAT", _GRPO_GROUPS,
        command="Train with GRPO from a YAML config and flags.", script="prompts",
        common=(*_COMMON[:2], "reward_funcs", *_COMMON[2:], "num_generations", "max_completion_length", "temperature",
                "beta", "loss_type", "use_vllm", *_LAST),
        run="posttrain.runs:run_online",
        headlines=("reward", "rewards/*/mean", "kl", "entropy", "completions/mean_length"),
        eval_headlines=("eval_reward", "eval_rewards/*/mean")),
    TrainerEntry(
        "rloo", "RLOO", "posttrain.rloo.trainer:RLOOTrainer", "posttrain.configs.rloo:RLOOConfig", "trl:RLOOConfig",
        "posttrain.configs.trl_compat:RLOO_COMPAT", (("RLOO: advantage", "posttrain.configs.rloo:RLOOObjectiveConfig"),),
        command="Train with RLOO (REINFORCE leave-one-out) from a YAML config and flags.", script="prompts",
        common=(*_COMMON[:2], "reward_funcs", *_COMMON[2:], "num_generations", "max_completion_length", "temperature",
                "beta", "normalize_advantages", "reward_clip_range", "use_vllm", *_LAST),
        run="posttrain.runs:run_online"),
    TrainerEntry(
        "sft", "SFT", "posttrain.sft.trainer:SFTTrainer", "posttrain.configs.sft:SFTConfig", "trl:SFTConfig",
        "posttrain.configs.trl_compat:SFT_COMPAT",
        (("SFT: data", "posttrain.configs.sft:SFTDataConfig"), ("SFT: loss", "posttrain.configs.sft:SFTLossConfig")),
        command="Supervised fine-tuning from a YAML config and flags.",
        common=(*_COMMON, "max_length", "packing", "completion_only_loss", "assistant_only_loss", *_LAST),
        headlines=("loss", "mean_token_accuracy"),
        eval_headlines=("eval_loss", "eval_mean_token_accuracy")),
    TrainerEntry(
        "dpo", "DPO", "posttrain.dpo.trainer:DPOTrainer", "posttrain.configs.dpo:DPOConfig", "trl:DPOConfig",
        "posttrain.configs.trl_compat:DPO_COMPAT",
        (("DPO: data", "posttrain.configs.dpo:DPODataConfig"), ("DPO: reference", "posttrain.configs.dpo:DPOReferenceConfig"),
         ("DPO: loss", "posttrain.configs.dpo:DPOLossConfig"), ("DPO: TRL 0.18 names", "posttrain.configs.dpo:DPOLegacyConfig")),
        command="Direct preference optimisation from a YAML config and flags.",
        common=(*_COMMON, "beta", "loss_type", "max_length", "precompute_ref_log_probs", *_LAST),
        headlines=("loss", "rewards/accuracies", "rewards/margins"),
        eval_headlines=("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins")),
    TrainerEntry(
        "reward", "Reward", "posttrain.reward.trainer:RewardTrainer", "posttrain.configs.reward:RewardConfig",
        "trl:RewardConfig", "posttrain.configs.trl_compat:REWARD_COMPAT",
        (("Reward: data", "posttrain.configs.reward:RewardDataConfig"),
         ("Reward: loss", "posttrain.configs.reward:RewardLossConfig")),
        command="Train a reward model on preference pairs from a YAML config and flags.",
        common=(*_COMMON, "max_length", "center_rewards_coefficient", "eval_strategy", *_LAST),
        run="posttrain.runs:run_reward",
        headlines=("loss", "accuracy", "margin"),
        eval_headlines=("eval_loss", "eval_accuracy", "eval_margin")),
    TrainerEntry(
        "kto", "KTO", "posttrain.kto.trainer:KTOTrainer", "posttrain.configs.kto:KTOConfig", "trl:KTOConfig",
        "posttrain.configs.trl_compat:KTO_COMPAT",
        (("KTO: data", "posttrain.configs.kto:KTODataConfig"), ("KTO: loss", "posttrain.configs.kto:KTOLossConfig")),
        command="Train with KTO on unpaired (prompt, completion, label) examples from a YAML config and flags.",
        common=(*_COMMON, "beta", "loss_type", "desirable_weight", "undesirable_weight", "max_length",
                "precompute_ref_log_probs", *_LAST),
        run="posttrain.runs:run_kto",
        headlines=("loss", "rewards/margins", "kl"),
        eval_headlines=("eval_loss", "eval_rewards/margins", "eval_kl")),
    TrainerEntry(
        "distillation", "Distillation", "posttrain.distillation.trainer:DistillationTrainer",
        "posttrain.configs.distillation:DistillationConfig", "trl:DistillationConfig",
        "posttrain.configs.trl_compat:DISTILLATION_COMPAT",
        (("Distillation: teacher and divergence", "posttrain.configs.distillation:DistillationObjectiveConfig"),),
        command="Distil a teacher into the student on the student's own completions from a YAML config and flags.",
        common=(_COMMON[0], "teacher_model_name_or_path", *_COMMON[1:], "beta", "temperature", "max_completion_length",
                "use_vllm", *_LAST),
        run="posttrain.runs:run_distillation",
        headlines=("loss", "entropy", "completions/mean_length"),
        eval_headlines=("eval_loss", "eval_entropy")),
    TrainerEntry(
        "orpo", "ORPO", "posttrain.orpo:ORPOTrainer", "posttrain.configs.orpo:ORPOConfig",
        "trl.experimental.orpo:ORPOConfig", "posttrain.configs.orpo:ORPO_COMPAT",
        (("ORPO: loss", "posttrain.configs.orpo:ORPOLossConfig"),),
        command="Odds ratio preference optimisation (no reference model) from a YAML config and flags.",
        common=(*_COMMON, "beta", "max_length", *_LAST),
        headlines=("loss", "rewards/accuracies", "log_odds_ratio"),
        eval_headlines=("eval_loss", "eval_rewards/accuracies", "eval_log_odds_ratio")),
    TrainerEntry(
        "async_grpo", "AsyncGRPO", "posttrain.grpo.async_trainer:AsyncGRPOTrainer",
        "posttrain.configs.async_grpo:AsyncGRPOConfig", "trl.experimental.async_grpo:AsyncGRPOConfig",
        "posttrain.configs.trl_compat:ASYNC_GRPO_COMPAT",
        (("AsyncGRPO: model", "posttrain.configs.async_grpo:AsyncModelConfig"),)),
)
BY_NAME = {entry.name: entry for entry in TRAINERS}
# which trainer wrote a run (the run report): a config field of its own, looked for in this order (a trainer's before
# those whose fields it shares), else a metric of its own
IDENTIFYING_FIELDS = (("RLOO", "reward_clip_range"), ("Distillation", "teacher_model_name_or_path"),
                      ("GRPO", "num_generations"), ("KTO", "desirable_weight"), ("DPO", "precompute_ref_log_probs"),
                      ("SFT", "dataset_text_field"), ("Reward", "center_rewards_coefficient"))
IDENTIFYING_METRICS = (("GRPO", "reward"), ("ORPO", "log_odds_ratio"), ("DPO", "rewards/accuracies"),
                       ("KTO", "rewards/margins"), ("SFT", "mean_token_accuracy"), ("Reward", "max_reward"))


def headlines_of(title: str | None) -> tuple[tuple, tuple]:
    """(headlines, eval_headlines) of the trainer titled `title` (RLOO and AsyncGRPO: GRPO's; None: a run whose
    trainer is not known)."""
    by_title = {entry.title: entry for entry in TRAINERS}
    entry = by_title.get({"RLOO": "GRPO", "AsyncGRPO": "GRPO"}.get(title, title))
    if entry is None or not entry.headlines:
        return ("reward", "loss"), ("eval_reward", "eval_loss")
    return entry.headlines, entry.eval_headlines
COMMANDS = {entry.name: entry for entry in TRAINERS if entry.command is not None}
