"""AsyncGRPOTrainer: TRL 1.16's experimental `trl.experimental.async_grpo.AsyncGRPOTrainer` signature over GRPOTrainer
with async_generation (grpo/async_rollout.py: a rollout worker samples and scores the next rounds while the trainer
steps, within max_staleness). docs/async.md."""

from posttrain.configs import AsyncGRPOConfig, ConfigError
from posttrain.grpo.trainer import GRPOTrainer


class AsyncGRPOTrainer(GRPOTrainer):
    """Asynchronous GRPO, with TRL's AsyncGRPOTrainer signature.

    Args:
        model, reward_funcs, train_dataset, processing_class, callbacks, optimizers, peft_config, tools,
        environment_factory: as GRPOTrainer's.
        args: an AsyncGRPOConfig (default: TRL's defaults, output_dir `<model name>-AsyncGRPO`).
        rollout_worker, weight_transfer: TRL's plug-in protocols for its own worker process and NCCL transfer; posttrain's
            worker is a thread of each training process and pushes through the generator (posttrain serve over HTTP,
            vllm serve over NCCL), so these are refused when given.
    """

    _title = "AsyncGRPO"
    _config_class = AsyncGRPOConfig

    def __init__(self, model, reward_funcs=None, args: AsyncGRPOConfig | None = None, train_dataset=None,
                 processing_class=None, callbacks=None, optimizers=(None, None), peft_config=None, tools=None,
                 environment_factory=None, rollout_worker=None, weight_transfer=None):
        for name, value in (("rollout_worker", rollout_worker), ("weight_transfer", weight_transfer)):
            if value is not None:
                raise ConfigError(f"{name} is TRL's plug-in for its own rollout process; posttrain's rollout worker is "
                                  "a thread of each training process that samples through the generation server "
                                  "(or a copy of the policy) and pushes the weights itself: remove it "
                                  "(docs/async.md).")
        super().__init__(model, reward_funcs, args, train_dataset, processing_class=processing_class,
                         callbacks=callbacks, optimizers=optimizers, peft_config=peft_config, tools=tools,
                         environment_factory=environment_factory)
