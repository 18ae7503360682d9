"""DeepSpeed ZeRO through accelerate: the few calls posttrain makes into DeepSpeed (checked against deepspeed 0.19).

Under DeepSpeed the engine owns what the loop otherwise does itself: the backward of each micro-batch (reducing
gradients at the last one), clipping (the config's `gradient_clipping`), the gradient norm and the optimizer step,
which it skips when that norm is not finite. training/sharding/ calls these; nothing else names DeepSpeed but
models/partitioned.py, whose parameter-level ZeRO-3 helpers (is_partitioned, whole_numel, partitioned_copy,
local_shard, gathered) are re-exported here.

ZeRO-1 and ZeRO-2 partition the optimizer state (and the gradients); every process holds the whole weights. ZeRO-3
also partitions the weights: a parameter is an empty tensor whose shard is `param.ds_tensor`, gathered by the
engine's hooks around each module's forward.
"""

import contextlib

import torch

from posttrain.configs import ConfigError
from posttrain.models.partitioned import gathered, is_partitioned, local_shard, partitioned_copy, whole_numel
from posttrain.training.distributed import mark_agreed

__all__ = ["CHECKPOINT_TAG", "fill_config", "frozen_engine", "gathered", "global_grad_norm", "is_partitioned",
           "local_shard", "partitioned_copy", "whole_for_generation", "whole_numel"]

CHECKPOINT_TAG = "deepspeed"  # the engine's files inside a posttrain checkpoint: checkpoint-N/deepspeed/


def fill_config(config: dict, args, num_processes: int) -> None:
    """Fill the batch, accumulation and clipping entries of a DeepSpeed config from the trainer's config (TRL's
    fields), where the config says "auto" or nothing; an explicit value that disagrees stops the run in one
    sentence, as transformers' Trainer does."""
    micro, steps = args.per_device_train_batch_size, args.gradient_accumulation_steps
    wanted = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": steps,
              "train_batch_size": micro * steps * num_processes,
              "gradient_clipping": float(args.max_grad_norm) if args.max_grad_norm and args.max_grad_norm > 0 else 0.0}
    sources = {"train_micro_batch_size_per_gpu": "per_device_train_batch_size",
               "gradient_accumulation_steps": "gradient_accumulation_steps",
               "train_batch_size": "per_device_train_batch_size x gradient_accumulation_steps x processes",
               "gradient_clipping": "max_grad_norm"}
    for key, value in wanted.items():
        given = config.get(key, "auto")
        if given == "auto":
            config[key] = value
        elif float(given) != float(value):
            raise mark_agreed(ConfigError(
                f"The DeepSpeed config sets {key}={given}, but the trainer's {sources[key]} gives {value}: set it to "
                "\"auto\" in the DeepSpeed config (or to the same value)."))
    for section, what in (("optimizer", "the optimizer (optim, learning_rate, ...)"),
                          ("scheduler", "the learning-rate schedule (lr_scheduler_type, warmup_steps, ...)")):
        if section in config:
            raise mark_agreed(ConfigError(
                f"The DeepSpeed config has its own \"{section}\" section, but posttrain builds {what} from the trainer's "
                f"config, as TRL does by default: remove the \"{section}\" section."))
    bf16 = config.get("bf16")
    if isinstance(bf16, dict) and bf16.get("enabled") in (True, "auto"):
        # DeepSpeed's ZeRO-1/2 apply a non-finite bf16 update unless asked to check: posttrain stops on one instead
        bf16.setdefault("check_grad_overflow", True)


@contextlib.contextmanager
def whole_for_generation(engine):
    """Every weight of a ZeRO-3 engine whole, and the engine's per-module gather hooks off, for a decode in which
    processes stop at different lengths (DeepSpeed's own context for generation)."""
    from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

    with unwrap_model_for_generation(engine):
        yield


def frozen_engine(model: torch.nn.Module, config: dict) -> torch.nn.Module:
    """A model that is not trained (a reference) partitioned by ZeRO-3 like the policy: an engine without an
    optimizer, in eval mode. Its forwards are collectives."""
    import copy

    import deepspeed

    config = copy.deepcopy(config)
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def global_grad_norm(engine) -> float:
    """The gradient norm (before clipping) of the engine's last step; inf when the step was skipped as not finite."""
    norm = engine.get_global_grad_norm()
    return float(norm) if norm is not None else float("nan")
