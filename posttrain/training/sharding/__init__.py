"""How the trained model is spread over the processes, and the few steps that must know it.

Every sharding-aware step of a trainer goes through one strategy object, chosen once from the Accelerator; the
trainers do not branch on the strategy, and no strategy's method branches on it either:

    sharding = sharding_of(accelerator)       one of
                                              NoSharding      one process, or DDP: whole weights everywhere (base.py)
                                              Fsdp2Sharding   accelerate's FSDP2: each process holds a shard, a DTensor
                                              Fsdp1Sharding   accelerate's FSDP1 with use_orig_params: each process
                                                              holds a flat shard; every forward runs through the root
                                                              wrapper (fsdp.py)
                                              ZeroSharding    DeepSpeed ZeRO-1/2 through accelerate (the engine steps)
                                              Zero3Sharding   ZeRO-3, which shards the weights too (deepspeed_zero.py,
                                                              calling into DeepSpeed through training/zero.py)
    sharding.forward_module(model, policy)    the module training and no-grad forwards call: the unwrapped policy,
                                              or FSDP1's root wrapper (its forward gathers the root's weights)
    sharding.prepare(model, opt, schedule)    accelerate's prepare (DeepSpeed: the config's batch and clipping
                                              entries filled from the trainer's config; the schedule stepped by the
                                              loop)
    with sharding.accumulating(model, sync):  one micro-batch; gradients reduced across processes when `sync`
        sharding.backward(model, loss)
    sharding.clip_gradients(model, max_norm)  the norm before clipping (None under DeepSpeed: its step clips)
    sharding.optimizer_step(model, opt)       the step; under DeepSpeed returns the norm (inf: step skipped)
    with sharding.whole_weights(model):       every parameter whole on every process for the whole block (the
        rollouts = generator.generate(...)    decode): processes may stop at different lengths, no collective
                                              inside; call on every process, outside inference_mode
    sharding.prepare_frozen(ref_model)        a model that is not trained, sharded as the policy
    sharding.at_rest(ref_model, policy)       parameters back to their shards (before mixing one into the other)
    sharding.full_state_dict(model)           {name: whole CPU tensor} on the main process, {} elsewhere (a
                                              collective: every process calls it); None when the model is whole
                                              everywhere (save it as it is)
    sharding.load_full_state_dict(model, sd)  its inverse, every process reading the same whole state dict
    sharding.save_optimizer(model, opt, dir)  a checkpoint's optimizer state: optimizer.pt (whole, keyed by
    sharding.load_optimizer(model, opt, dir)  parameter name under FSDP), or under DeepSpeed the engine's own
                                              files, one per process (collectives: every process calls)
    local_tensor(p)                           the part of a parameter this process holds (an update writes it)
    full_tensor(t)                            a DTensor's whole value (a collective), any other tensor as it is
                                              (posttrain/weights.py, which the weight export uses too)

Each method is documented on the base class, `Sharding` (base.py), whose implementations are the whole-weights
steps; each strategy overrides what its sharding changes.

Why whole weights for generation: under FSDP2 every forward is a collective that gathers the layer it
runs, so processes whose completions end at different steps would wait for each other forever; and under FSDP2 a
first forward inside inference_mode leaves the unshard buffers as inference tensors that the next training forward
cannot write. Unsharding before generating avoids both, at the cost of one whole copy of the weights per process
while generating (as TRL's ds3_gather_for_generation=True). FSDP1 refuses a forward while its weights are summoned
whole, so inside whole_weights each of its wrappers is set aside and the model runs as the plain module it wraps.

`check_launch(accelerator)` stops a run that asked for FSDP or DeepSpeed and would silently get something else;
`check_supported(accelerator)` one launched with FSDP1 settings the trainers do not run (use_orig_params=False).
"""

import os

from posttrain.configs import ConfigError
from posttrain.training.distributed import mark_agreed
from posttrain.training.sharding.base import NoSharding, Sharding, is_sharded, local_tensor
from posttrain.training.sharding.deepspeed_zero import Zero3Sharding, ZeroSharding
from posttrain.training.sharding.fsdp import Fsdp1Sharding, Fsdp2Sharding, fsdp1_wrappers_set_aside, mark_output_layer
from posttrain.weights import full_tensor

__all__ = ["Fsdp1Sharding", "Fsdp2Sharding", "NoSharding", "Sharding", "Zero3Sharding", "ZeroSharding",
           "check_launch", "check_supported", "fsdp1_wrappers_set_aside", "full_tensor", "is_sharded", "local_tensor",
           "mark_output_layer", "sharding_named", "sharding_of"]

STRATEGIES = {"none": NoSharding, "fsdp1": Fsdp1Sharding, "fsdp2": Fsdp2Sharding, "zero": ZeroSharding}


def sharding_named(kind: str, accelerator=None, zero_stage: int = 0) -> Sharding:
    """The strategy named `kind`, one of STRATEGIES ("zero" with `zero_stage` 3: Zero3Sharding), given the run's
    Accelerator (None for a model sharded by hand); ValueError for another name."""
    if kind not in STRATEGIES:
        raise ValueError(f"unknown sharding {kind!r}")
    if kind == "zero" and zero_stage == 3:
        return Zero3Sharding(accelerator)
    return STRATEGIES[kind](accelerator)


def sharding_of(accelerator) -> Sharding:
    """The run's strategy, from accelerate's distributed type (call check_launch and check_supported first)."""
    from accelerate.utils import DistributedType

    state = accelerator.state
    if state.distributed_type == DistributedType.DEEPSPEED:
        return sharding_named("zero", accelerator, int(state.deepspeed_plugin.zero_stage))
    if state.distributed_type == DistributedType.FSDP:
        return sharding_named(f"fsdp{_fsdp_version(state.fsdp_plugin)}", accelerator)
    return sharding_named("none", accelerator)


def check_launch(accelerator) -> None:
    """One sentence when the launcher asked for FSDP or DeepSpeed and accelerate set up something else (on a machine
    without a GPU it drops both and trains with DDP), or when it started several processes and accelerate set up no
    process group for them (without a GPU and without use_cpu: one independent single-process run per rank)."""
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
    if world > 1 and accelerator.num_processes != world:  # no process group: each process would train alone
        alone = "a single process" if accelerator.num_processes == 1 else f"{accelerator.num_processes} processes"
        raise mark_agreed(ConfigError(  # every process raises it
            f"This process is one of {world} that the launcher started (WORLD_SIZE), but accelerate set up {alone} "
            "instead, as it does on a machine without a GPU unless told to use the CPU, "
            f"so {world} separate runs would share output_dir: set use_cpu=True (--use_cpu true) to train the {world} "
            "processes together on the CPU over gloo, or run them on GPUs."))


def check_supported(accelerator) -> None:
    """One sentence for FSDP1 without use_orig_params: its optimizer would hold flattened parameters, which
    posttrain's parameter groups, reference mixing and checks by name do not see."""
    from accelerate.utils import DistributedType

    state = accelerator.state
    plugin = getattr(state, "fsdp_plugin", None)
    if state.distributed_type == DistributedType.FSDP and _fsdp_version(plugin) == 1 and not plugin.use_orig_params:
        raise mark_agreed(ConfigError(  # every process raises it
            "This run was launched with FSDP1 and fsdp_use_orig_params: false, which posttrain does not train with "
            "(its optimizer would see flattened parameters): set fsdp_use_orig_params: true in the accelerate "
            "config (accelerate's default), or launch with fsdp2."))


def _fsdp_version(plugin) -> int:
    """accelerate's FSDP plugin's version, 1 or 2 (1 when it names none)."""
    return int(getattr(plugin, "fsdp_version", 1) or 1)
