"""How the trained model is spread over the processes, and the few steps that must know it.

Every sharding-aware step of a trainer goes through one `Sharding` object (built from the Accelerator); the
trainers do not branch on the strategy:

    sharding = Sharding.of(accelerator)       kind: "none" (one process, or DDP: whole weights everywhere) or
                                              "fsdp2" (accelerate's FSDP2: each process holds a shard, a DTensor)
    with sharding.whole_weights(model):       every parameter whole on every process for the whole block (the
        rollouts = generator.generate(...)    decode): processes may stop at different lengths, no collective
                                              inside; call on every process, outside inference_mode
    sharding.prepare_frozen(ref_model)        a model that is not trained, sharded as the policy
    sharding.at_rest(ref_model, policy)       parameters back to their shards (before mixing one into the other)
    sharding.full_state_dict(model)           {name: whole CPU tensor} on the main process, {} elsewhere (a
                                              collective: every process calls it); None when the model is whole
                                              everywhere (save it as it is)
    sharding.load_full_state_dict(model, sd)  its inverse, every process reading the same whole state dict
    sharding.optimizer_state(model, opt)      what a checkpoint stores of the optimizer: whole, keyed by parameter
    sharding.load_optimizer_state(...)        name under FSDP2 (a collective); its inverse
    full_tensor(t)                            a DTensor's whole value (a collective), any other tensor as it is

Why whole weights for generation: under FSDP2 every forward is a collective that gathers the layer it
runs, so processes whose completions end at different steps would wait for each other forever; and under FSDP2 a
first forward inside inference_mode leaves the unshard buffers as inference tensors that the next training forward
cannot write. Unsharding before generating avoids both, at the cost of one whole copy of the weights per process
while generating (as TRL's ds3_gather_for_generation=True).

`check_launch(accelerator)` stops a run that asked for FSDP or DeepSpeed and would silently get something else;
`check_supported(accelerator)` one launched with a strategy the trainers do not run yet (DeepSpeed ZeRO, FSDP1).
"""

import contextlib
import os

import torch

from posttrain.configs import ConfigError
from posttrain.training.distributed import mark_agreed

KINDS = ("none", "fsdp2")


def check_launch(accelerator) -> None:
    """One sentence when the launcher asked for FSDP or DeepSpeed and accelerate set up something else: on a machine
    without a GPU it drops both and trains with DDP, or starts one independent single-process run per rank."""
    from accelerate.utils import DistributedType

    world = int(os.environ.get("WORLD_SIZE", "1"))
    for variable, name, wanted in (("ACCELERATE_USE_FSDP", "FSDP", DistributedType.FSDP),
                                   ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed", DistributedType.DEEPSPEED)):
        if os.environ.get(variable, "").lower() not in ("1", "true"):
            continue
        got = accelerator.distributed_type
        if got != wanted:
            what = f"DDP over {accelerator.num_processes} processes" if accelerator.num_processes > 1 else \
                "a single process"
        elif accelerator.num_processes != world:
            what = f"{world} separate runs of {accelerator.num_processes} process each"
        else:
            continue
        raise mark_agreed(ConfigError(  # every process raises it
            f"This run was launched with {name}, but accelerate set up {what} instead, as it does on a machine "
            "without a GPU or with use_cpu=True, so nothing would be sharded: run it on GPUs without use_cpu, or "
            "launch with DDP (accelerate_config multi_gpu)."))


def check_supported(accelerator) -> None:
    """One sentence for a sharding strategy posttrain's trainers do not run yet (DeepSpeed ZeRO, FSDP1)."""
    from accelerate.utils import DistributedType

    state = accelerator.state
    if state.distributed_type == DistributedType.DEEPSPEED:
        what = f"DeepSpeed ZeRO-{state.deepspeed_plugin.zero_stage}"
    elif state.distributed_type == DistributedType.FSDP and getattr(state.fsdp_plugin, "fsdp_version", 1) != 2:
        what = "FSDP1"
    else:
        return
    raise mark_agreed(ConfigError(f"This run was launched with {what}, which posttrain does not train with yet: "
                                  "launch with FSDP2 (accelerate_config fsdp2) to shard the model, or with DDP "
                                  "(accelerate_config multi_gpu)."))  # every process raises it


def _fsdp2_units(model: torch.nn.Module) -> list:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model` (or a module in it) is sharded with FSDP2."""
    return bool(_fsdp2_units(model))


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective), any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class Sharding:
    """Args:
        kind: one of KINDS.
        accelerator: the run's Accelerator (accelerate prepares a frozen model with it).
    """

    def __init__(self, kind: str, accelerator=None):
        if kind not in KINDS:
            raise ValueError(f"unknown sharding {kind!r}")
        self.kind, self.accelerator = kind, accelerator

    @classmethod
    def of(cls, accelerator) -> "Sharding":
        """The run's sharding (call check_launch and check_supported first)."""
        from accelerate.utils import DistributedType

        return cls("fsdp2" if accelerator.state.distributed_type == DistributedType.FSDP else "none", accelerator)

    @property
    def shards_parameters(self) -> bool:
        """Whether a process holds only part of each parameter between steps."""
        return self.kind == "fsdp2"

    # ------------------------------------------------------------------ whole weights for generation

    @contextlib.contextmanager
    def whole_weights(self, model: torch.nn.Module):
        """Every parameter of `model` whole on this process for the block (entering is a collective)."""
        if self.kind == "fsdp2" or is_sharded(model):
            with _fsdp2_unsharded(model):
                yield model
        else:
            yield model

    def prepare_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """A model that is not trained (a reference) sharded the way the policy is, so that it costs each process
        its share only; its forwards are then collectives, run by every process alike."""
        if self.kind == "fsdp2":
            from accelerate.utils.fsdp_utils import fsdp2_prepare_model

            return fsdp2_prepare_model(self.accelerator, model)
        return model

    def at_rest(self, *models: torch.nn.Module) -> None:
        """Every FSDP2 unit of `models` resharded (a local step), so that their parameters are the shards an update
        writes to: accelerate leaves the output layer's unit unsharded after a forward."""
        for model in models:
            for unit in _fsdp2_units(model):
                unit.reshard()

    # ------------------------------------------------------------------ saving

    def full_state_dict(self, model: torch.nn.Module) -> dict | None:
        """The whole model's state dict on the main process ({} on the others; a collective), or None when each
        process holds the whole model (save it directly)."""
        if not self.shards_parameters and not is_sharded(model):
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return _without_tied_copies(model, state)

    def load_full_state_dict(self, model: torch.nn.Module, state: dict) -> None:
        """Load a whole state dict (read by every process) into the sharded model; KeyError when it does not fit
        (a tied output layer, stored once, may be missing)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        result = set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
        params = dict(model.named_parameters(remove_duplicate=False))
        loaded = {id(params[name]) for name in state if name in params}
        missing = [name for name in result.missing_keys if id(params.get(name)) not in loaded]
        if missing or result.unexpected_keys:
            raise KeyError(f"weights do not match the model (missing {missing}, unexpected "
                           f"{list(result.unexpected_keys)})")

    def optimizer_state(self, model: torch.nn.Module, optimizer) -> dict:
        """What a checkpoint stores of the optimizer: under FSDP2 the whole state, gathered (a collective; keyed by
        parameter name, so it does not depend on the number of processes); otherwise its state dict."""
        if self.kind == "fsdp2":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            return get_optimizer_state_dict(model, optimizer,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return optimizer.state_dict()

    def load_optimizer_state(self, model: torch.nn.Module, optimizer, state: dict) -> None:
        if self.kind == "fsdp2":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            if any(isinstance(v, torch.Tensor) and v.dim() for per in state["state"].values() for v in per.values()):
                set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
                return
            # no per-parameter tensors (plain SGD), which torch's loader cannot place: the hyperparameters only
            for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
                group.update({k: v for k, v in saved.items() if k != "params"})
            return
        optimizer.load_state_dict(state)


def _without_tied_copies(model: torch.nn.Module, state: dict) -> dict:
    """A gathered state dict holds a tied weight (the output layer sharing the embedding) once per name, as separate
    tensors: keep the first name only, as save_pretrained does for a model's own state dict."""
    first: dict[int, str] = {}
    drop = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        name = name.replace("_checkpoint_wrapped_module.", "").replace("_fsdp_wrapped_module.", "")
        if id(param) in first:
            drop.add(name)
        else:
            first[id(param)] = name
    return {k: v for k, v in state.items() if k not in drop}


@contextlib.contextmanager
def _fsdp2_unsharded(model: torch.nn.Module):
    """Every FSDP2 unit unsharded on entry and kept whole until exit, then resharded: forwards inside gather
    nothing."""
    units = _fsdp2_units(model)
    if units:
        # FSDP2 takes the first unit that runs forward as the root: the lean decoder calls submodules (the
        # embedding, the layers) directly, so settle the root first, as its own first forward would
        units[0]._get_fsdp_state()._lazy_init()
    for unit in units:
        unit.unshard()
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_reshard_after_forward(True, recurse=False)
            unit.reshard()


def gathered_for_generation(model: torch.nn.Module):
    """Whole weights for a model sharded with `fully_shard` outside accelerate (kept for direct FSDP2 users)."""
    return Sharding("none").whole_weights(model)
