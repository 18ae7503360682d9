"""FSDP through accelerate: FSDP2 (torch's fully_shard: each process holds a DTensor shard of every parameter) and
FSDP1 (torch's FullyShardedDataParallel with use_orig_params: each process holds a flat shard, and every forward
runs through the root wrapper, which gathers the weights outside the decoder layers' own wrappers).

FSDP1 refuses a forward while its weights are summoned whole, so whenever they are, each of its wrappers is set aside
in its parent for the plain module it wraps (`fsdp1_wrappers_set_aside`, also used to save a gathered state dict
under the model's own names).
"""

import contextlib
from typing import ContextManager

import torch

from posttrain.training.sharding.base import Sharding, gathers_to_cpu


class FsdpSharding(Sharding):
    """What FSDP1 and FSDP2 share: sharded parameters, and a checkpoint's optimizer state gathered whole and keyed by
    parameter name (so that it does not depend on the number of processes)."""

    shards_parameters = True

    def prepare(self, model, optimizer, scheduler, args) -> tuple:
        """accelerate's prepare, its units the model's layers that are present (`wrap_present_layers`)."""
        wrap_present_layers(self.accelerator, model)
        return super().prepare(model, optimizer, scheduler, args)

    def _whole_optimizer_state(self, model: torch.nn.Module, optimizer) -> dict:
        """The optimizer's whole state, gathered from every process's shards (a collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                   cpu_offload=gathers_to_cpu(model)))

    def _load_whole_optimizer_state(self, model: torch.nn.Module, optimizer, state: dict) -> None:
        """Every process keeps its shard of the whole `state`; an optimizer without per-parameter tensors (plain SGD),
        which torch's loader cannot place, gets its hyperparameters only. A parameter that never had a gradient (a
        vision tower's layer the features leave out, an expert no token reached) has no state to restore, as on one
        process, where the optimizer's own loader leaves it without one too (torch's strict loader would refuse)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if any(isinstance(v, torch.Tensor) and v.dim() for per in state["state"].values() for v in per.values()):
            set_optimizer_state_dict(model, optimizer, state,
                                     options=StateDictOptions(full_state_dict=True, strict=False))
            return
        for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})


class Fsdp2Sharding(FsdpSharding):
    """accelerate's FSDP2: every step is accelerate's own; whole_weights unsharding the units and at_rest
    resharding them are the defaults' (they find the units on the model)."""

    def prepare_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` sharded by accelerate as the policy is (fully_shard with the run's plugin)."""
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        wrap_present_layers(self.accelerator, model)
        return fsdp2_prepare_model(self.accelerator, model)


class Fsdp1Sharding(FsdpSharding):
    """accelerate's FSDP1 with use_orig_params: forwards run through the root wrapper, whose output layer is marked
    for the chunked log-prob path; gradients are clipped by the root wrapper; whole weights are summoned."""

    def forward_module(self, model: torch.nn.Module, policy: torch.nn.Module) -> torch.nn.Module:
        """The root wrapper `model` (it gathers the weights outside the decoder layers' own wrappers)."""
        return model

    def prepare(self, model, optimizer, scheduler, args) -> tuple:
        """accelerate's prepare, then the prepared model's output layer marked (mark_output_layer)."""
        prepared = super().prepare(model, optimizer, scheduler, args)
        mark_output_layer(prepared[0])
        return prepared

    def clip_gradients(self, model, max_norm: float) -> float:
        """The norm of the whole gradient, from every process's shards (a collective), before clipping."""
        return float(model.clip_grad_norm_(max_norm if max_norm > 0 else float("inf")))

    def _own_whole_weights(self, model: torch.nn.Module) -> ContextManager:
        """Every parameter summoned whole (not written back: nothing inside changes them), run as plain modules."""
        return _summoned_as_plain_modules(model, writeback=False)

    @contextlib.contextmanager
    def writable_whole(self, model: torch.nn.Module):
        """Every parameter summoned whole and written back to the shards on exit, run as plain modules."""
        with _summoned_as_plain_modules(model, writeback=True):
            yield

    def prepare_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` wrapped by accelerate as the policy is, its output layer marked (mark_output_layer)."""
        wrap_present_layers(self.accelerator, model)
        prepared = self.accelerator.prepare_model(model)
        mark_output_layer(prepared)
        return prepared

    def at_rest(self, *models: torch.nn.Module) -> None:
        """Also frees the whole weights FSDP1 keeps in its root unit after a forward without backward (a
        reference's), which its next forward would take as they are instead of gathering the shards."""
        for model in models:
            _fsdp1_reshard(model)
        super().at_rest(*models)


def wrap_present_layers(accelerator, model: torch.nn.Module) -> None:
    """With the transformer-based wrap policy and no layer classes named in the accelerate config, the units are the
    classes of the model's `_no_split_modules` that it holds. accelerate takes them all and stops at one it lacks:
    a vision-language model lists its vision tower's family's classes (LLaVA's CLIP lists CLIPTextEmbeddings, which
    a CLIPVisionModel does not hold). Classes named in the config are left to accelerate."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    plugin = accelerator.state.fsdp_plugin
    if plugin.auto_wrap_policy is not transformer_auto_wrap_policy or plugin.transformer_cls_names_to_wrap is not None:
        return
    held = {type(module).__name__ for module in model.modules()}
    plugin.transformer_cls_names_to_wrap = [name for name in getattr(model, "_no_split_modules", None) or []
                                            if name in held]


def mark_output_layer(model: torch.nn.Module) -> None:
    """Under FSDP1 the output layer's weight is whole only inside the root wrapper's forward and backward: the
    chunked log-prob path then runs as that layer's forward (models/logprobs.py)."""
    from posttrain.models.forwards import WHOLE_ONLY_IN_FORWARD, output_layer

    layer = output_layer(model)
    if layer is not None:
        setattr(layer, WHOLE_ONLY_IN_FORWARD, True)


def _fsdp1_reshard(model: torch.nn.Module) -> None:
    """Every FSDP1 unit of `model` whose whole weights a forward left allocated (the root, after a forward without
    backward) freed (a local step): an update or a mix outside FSDP has changed the shards since."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp._runtime_utils import _reshard  # torch's FSDP1 has no public reshard

    for unit in FSDP.fsdp_modules(model):
        handle = unit._handle
        if handle is not None and handle.uses_sharded_strategy and not handle.needs_unshard():
            _reshard(unit, handle, free_unsharded_flat_param=True)


@contextlib.contextmanager
def _summoned_as_plain_modules(model: torch.nn.Module, writeback: bool):
    """Every FSDP1 parameter whole (with `writeback`, what the block writes is kept in the shards on exit), and every
    FSDP1 wrapper below the root set aside in its parent for the plain module it wraps (FSDP1 refuses a forward while
    summoned); a collective on entry."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model, recurse=True, writeback=writeback), fsdp1_wrappers_set_aside(model):
        yield


@contextlib.contextmanager
def fsdp1_wrappers_set_aside(model: torch.nn.Module):
    """Every FSDP1 wrapper below `model` replaced in its parent by the module it wraps, for the block (a local step;
    nothing else changes): the module tree, and its names, as before FSDP1 wrapped it. A no-op on other models."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # a torch without FSDP
        yield
        return
    swapped = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, FSDP)]
    for parent, name, child in swapped:
        setattr(parent, name, child.module)
    try:
        yield
    finally:
        for parent, name, child in reversed(swapped):
            setattr(parent, name, child)
