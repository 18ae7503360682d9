"""Parameters that DeepSpeed ZeRO-3 partitioned: telling them apart, their local shard, a copy of a partitioned
model, and gathering them whole. They look at the parameters alone (DeepSpeed is imported only to gather), so the
model-level code (models/preparation.py) and the training loop (training/zero.py re-exports them, for
training/sharding/) share them without models/ importing training/.

ZeRO-3 partitions the weights: a parameter is an empty tensor whose shard is `param.ds_tensor`, gathered by the
engine's hooks around each module's forward.
"""

import contextlib

import torch


def is_partitioned(param: torch.Tensor) -> bool:
    """Whether `param` is a ZeRO-3 parameter (its values live in shards, `param.ds_tensor`). Under ZeRO-3 through
    accelerate, transformers builds every model it loads this way (zero.Init), whatever zero3_init_flag says."""
    return hasattr(param, "ds_tensor")


def whole_numel(param: torch.Tensor) -> int:
    """The number of elements of the whole parameter (a ZeRO-3 parameter is empty between its uses)."""
    return param.ds_numel if is_partitioned(param) else param.numel()


def partitioned_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of a model whose weights ZeRO-3 partitioned as it loaded: a new model of the same class built
    partitioned (transformers applies zero.Init under ZeRO-3), each process copying its own shards (`deepcopy` would
    copy empty tensors)."""
    copy = type(model)._from_config(model.config, dtype=next(model.parameters()).dtype)
    with torch.no_grad():
        for (name, mine), theirs in zip(copy.named_parameters(), model.parameters(), strict=True):
            if local_shard(mine).shape != local_shard(theirs).shape:
                raise RuntimeError(f"the copy's {name} is not partitioned as the original's")
            local_shard(mine).copy_(local_shard(theirs))
        for mine, theirs in zip(copy.buffers(), model.buffers(), strict=True):
            mine.copy_(theirs)
    return copy


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """This process's part of a ZeRO-3 parameter (a flat tensor), or the parameter itself."""
    return param.ds_tensor if is_partitioned(param) else param


@contextlib.contextmanager
def gathered(params, keep_changes: bool = False):
    """ZeRO-3 parameters whole on every process for the block (a collective). With `keep_changes`, what the
    processes write (the same values on each) is kept in the shards; otherwise the block only reads."""
    params = [p for p in params if is_partitioned(p)]
    if not params:  # nothing partitioned (DeepSpeed may not even be installed)
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=0 if keep_changes else None):
        yield
