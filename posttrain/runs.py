"""What each trainer command runs once its arguments are parsed (posttrain/cli.py): the model's init kwargs from the
script's, the datasets (a name or a mixture, the test split when evaluating), the trainer, train() and close().
Each function takes the trainer's registry entry (posttrain/registry.py names which one a trainer runs); nothing heavy
is imported before a command runs."""

from posttrain.configs import ConfigError, DistillationConfig, KTOConfig, LoraArguments, RewardConfig, ScriptArguments
from posttrain.configs.script import BaseScriptArguments
from posttrain.registry import TrainerEntry, load


def _model_init_kwargs(script, config) -> None:
    """The script's dtype, attn_implementation, revision and trust_remote_code into config.model_init_kwargs."""
    init = dict(config.model_init_kwargs or {})
    for key in ("dtype", "attn_implementation"):
        if getattr(script, key) is not None:
            init.setdefault(key, getattr(script, key))
    config.trust_remote_code = config.trust_remote_code or script.trust_remote_code
    init.setdefault("trust_remote_code", config.trust_remote_code)
    init.setdefault("revision", script.model_revision)
    config.model_init_kwargs = init


def _datasets(script, config):
    """(train dataset, eval dataset or None) from dataset_name or the `datasets` mixture (one of them is set)."""
    from posttrain.dataset_loading import load_mixture, load_prompt_dataset

    wants_eval = config.eval_strategy != "no" or config.eval_on_start
    if script.datasets is not None:
        return load_mixture(script.datasets, script.streaming, script.test_split_size, config.seed, wants_eval)
    train = load_prompt_dataset(script.dataset_name, script.dataset_config, script.dataset_train_split,
                                streaming=script.dataset_streaming)
    evaluation = None
    if wants_eval:
        evaluation = load_prompt_dataset(script.dataset_name, script.dataset_config, script.dataset_test_split,
                                         for_eval=True)
    return train, evaluation


def _prepare_run(script, lora, config, check=None):
    """(peft config or None, train dataset, eval dataset or None), the model's init kwargs set in `config`; a missing
    model or dataset stops first, then a missing peft, then `check()` (the trainer's checks that need neither model
    nor data), before the datasets load."""
    if not script.model_name_or_path:
        raise ConfigError("No model given: set model_name_or_path (a local path or hub id).")
    if not script.dataset_name and script.datasets is None:
        raise ConfigError("No dataset given: set dataset_name (a hub name or a .json/.jsonl/.csv/.parquet file), or "
                          "a datasets: mixture.")
    peft_config = lora.to_peft_config()  # before anything slow: a missing peft is reported first
    if check is not None:
        check()
    _model_init_kwargs(script, config)
    train, evaluation = _datasets(script, config)
    return peft_config, train, evaluation


def _train_and_close(trainer) -> None:
    try:
        trainer.train()
    except BaseException:
        trainer.close(failed=True)  # no process waits for one that stopped
        raise
    trainer.close()


def _trainer(entry, script, config, peft_config, dataset, eval_dataset, **kwargs):
    """The entry's trainer on the run's model, config and datasets (imported only now: after the quick checks)."""
    return load(entry.trainer)(script.model_name_or_path, args=config, train_dataset=dataset,
                               eval_dataset=eval_dataset, peft_config=peft_config, **kwargs)


def run_trainer(entry: TrainerEntry, script: BaseScriptArguments, lora: LoraArguments, config) -> None:
    """A trainer that takes the model, its config and the datasets, and nothing else from the script."""
    peft_config, dataset, eval_dataset = _prepare_run(script, lora, config)
    _train_and_close(_trainer(entry, script, config, peft_config, dataset, eval_dataset))


def run_online(entry: TrainerEntry, script: ScriptArguments, lora: LoraArguments, config) -> None:
    """GRPO or RLOO: the reward model (if any) first, then the reward functions, as TRL's scripts list them; their
    names checked before the datasets and the model load."""
    from posttrain.rewards.resolving import check_reward_names

    rewards = ([script.reward_model_name_or_path] if script.reward_model_name_or_path else []) + list(
        script.reward_funcs or [])
    peft_config, dataset, eval_dataset = _prepare_run(script, lora, config, lambda: check_reward_names(rewards, config))
    _train_and_close(_trainer(entry, script, config, peft_config, dataset, eval_dataset, reward_funcs=rewards))


def run_kto(entry: TrainerEntry, script: BaseScriptArguments, lora: LoraArguments, config: KTOConfig) -> None:
    import os

    from posttrain.kto.trainer import check_settings

    peft_config, dataset, eval_dataset = _prepare_run(
        script, lora, config, lambda: check_settings(config, int(os.environ.get("WORLD_SIZE", "1"))))
    _train_and_close(_trainer(entry, script, config, peft_config, dataset, eval_dataset))


def run_distillation(entry: TrainerEntry, script: BaseScriptArguments, lora: LoraArguments,
                     config: DistillationConfig) -> None:
    """The teacher is the config's teacher_model_name_or_path (with teacher_model_init_kwargs), as in `trl
    distillation`."""
    from posttrain.training.reference import check_teacher_given

    peft_config, dataset, eval_dataset = _prepare_run(script, lora, config, lambda: check_teacher_given(None, config))
    _train_and_close(_trainer(entry, script, config, peft_config, dataset, eval_dataset))


def run_reward(entry: TrainerEntry, script: BaseScriptArguments, lora: LoraArguments, config: RewardConfig) -> None:
    if lora.use_peft and lora.lora_task_type == "CAUSAL_LM":  # the default, which names the other trainers' models
        lora.lora_task_type = "SEQ_CLS"
    run_trainer(entry, script, lora, config)
