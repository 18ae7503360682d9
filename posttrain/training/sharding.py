"""Where sharded training (FSDP2's `fully_shard`) meets a step that needs whole weights.

Under FSDP2 each process holds a shard of every parameter (a DTensor) and every forward is a collective that
gathers the layer it runs. Two steps need more:

    with gathered_for_generation(model):   # every unit unsharded once, kept whole for the whole decode
        rollouts = generator.generate(...)  # processes may stop at different lengths: no collective inside
    full_tensor(t)                          # a DTensor's whole value (a collective: every process calls it)

Generating through the sharded model would make each decode step a collective, so processes whose completions end
at different steps would wait for each other forever; and a first forward under inference_mode would leave FSDP's
unshard buffers as inference tensors that the next training forward cannot write. Unsharding before generation
(outside inference_mode) avoids both, at the cost of one whole copy of the weights per process while generating
(as TRL's ds3_gather_for_generation). Without FSDP2 units both are no-ops.
"""

import contextlib

import torch


def _fsdp_units(model: torch.nn.Module) -> list:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model` (or a module in it) is sharded with FSDP2."""
    return bool(_fsdp_units(model))


@contextlib.contextmanager
def gathered_for_generation(model: torch.nn.Module):
    """Every FSDP2 unit of `model` unsharded on entry and kept whole until exit, then resharded: forwards inside the
    block gather nothing (call it on every process, outside inference_mode)."""
    units = _fsdp_units(model)
    if not units:
        yield model
        return
    for unit in units:
        unit.unshard()
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield model
    finally:
        for unit in units:
            unit.set_reshard_after_forward(True, recurse=False)
            unit.reshard()


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective), any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
