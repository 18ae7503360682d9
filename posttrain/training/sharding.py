"""How the trained model is spread over the processes, and the few steps that must know it.

Every sharding-aware step of a trainer goes through one `Sharding` object (built from the Accelerator); the
trainers do not branch on the strategy:

    sharding = Sharding.of(accelerator)       kind: "none" (one process, or DDP: whole weights everywhere),
                                              "fsdp2" (accelerate's FSDP2: each process holds a shard, a DTensor),
                                              "fsdp1" (accelerate's FSDP1 with use_orig_params: each process holds
                                              a flat shard; every forward runs through the root wrapper)
                                              or "zero" (DeepSpeed ZeRO-1/2/3 through accelerate, training/zero.py;
                                              ZeRO-3 shards the weights)
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
    sharding.load_optimizer(model, opt, dir)  parameter name under FSDP2), or under DeepSpeed the engine's own
                                              files, one per process (collectives: every process calls)
    local_tensor(p)                           the part of a parameter this process holds (an update writes it)
    full_tensor(t)                            a DTensor's whole value (a collective), any other tensor as it is

Why whole weights for generation: under FSDP2 every forward is a collective that gathers the layer it
runs, so processes whose completions end at different steps would wait for each other forever; and under FSDP2 a
first forward inside inference_mode leaves the unshard buffers as inference tensors that the next training forward
cannot write. Unsharding before generating avoids both, at the cost of one whole copy of the weights per process
while generating (as TRL's ds3_gather_for_generation=True). FSDP1 refuses a forward while its weights are summoned
whole, so inside whole_weights each of its wrappers is set aside and the model runs as the plain module it wraps.

`check_launch(accelerator)` stops a run that asked for FSDP or DeepSpeed and would silently get something else;
`check_supported(accelerator)` one launched with FSDP1 settings the trainers do not run (use_orig_params=False).
"""

import contextlib
import os

import torch

from posttrain.configs import ConfigError
from posttrain.models.loading import is_fully_shard_unit
from posttrain.training.distributed import mark_agreed

from posttrain.training import zero

KINDS = ("none", "fsdp1", "fsdp2", "zero")
OPTIMIZER_FILE = "optimizer.pt"


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
    return int(getattr(plugin, "fsdp_version", 1) or 1)


def _fsdp2_units(model: torch.nn.Module) -> list:
    return [m for m in model.modules() if is_fully_shard_unit(m)]


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model` (or a module in it) is sharded with FSDP2."""
    return bool(_fsdp2_units(model))


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective), any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """What this process holds of a parameter, to update in place: a ZeRO-3 parameter's shard; the parameter itself
    otherwise (an FSDP2 DTensor updates its own shard)."""
    return zero.local_shard(param)


class Sharding:
    """Args:
        kind: one of KINDS.
        accelerator: the run's Accelerator (accelerate prepares a frozen model with it).
    """

    def __init__(self, kind: str, accelerator=None, zero_stage: int = 0):
        if kind not in KINDS:
            raise ValueError(f"unknown sharding {kind!r}")
        self.kind, self.accelerator, self.zero_stage = kind, accelerator, zero_stage

    @classmethod
    def of(cls, accelerator) -> "Sharding":
        """The run's sharding (call check_launch and check_supported first)."""
        from accelerate.utils import DistributedType

        kind = accelerator.state.distributed_type
        if kind == DistributedType.DEEPSPEED:
            return cls("zero", accelerator, int(accelerator.state.deepspeed_plugin.zero_stage))
        if kind == DistributedType.FSDP:
            return cls(f"fsdp{_fsdp_version(accelerator.state.fsdp_plugin)}", accelerator)
        return cls("none", accelerator)

    @property
    def shards_parameters(self) -> bool:
        """Whether a process holds only part of each parameter between steps."""
        return self.kind in ("fsdp1", "fsdp2") or (self.kind == "zero" and self.zero_stage == 3)

    def forward_module(self, model: torch.nn.Module, policy: torch.nn.Module) -> torch.nn.Module:
        """The module that every forward of the trained model calls, given the prepared `model` and its unwrapped
        `policy`: FSDP1's root wrapper (it gathers the weights outside the decoder layers' own wrappers), else the
        policy itself."""
        return model if self.kind == "fsdp1" else policy

    # ------------------------------------------------------------------ the training step

    def prepare(self, model, optimizer, scheduler, args):
        """accelerate's prepare of the model and optimizer (and, outside DeepSpeed, the schedule). Under DeepSpeed
        the config's batch, accumulation and clipping entries come from `args` (training/zero.fill_config), and the
        schedule stays a plain one that the loop steps after each applied update (accelerate would hand DeepSpeed a
        wrapper that never steps it)."""
        if self.kind != "zero":
            prepared = self.accelerator.prepare(model, optimizer, scheduler)
            if self.kind == "fsdp1":
                _mark_output_layer(prepared[0])
            return prepared
        zero.fill_config(self.accelerator.state.deepspeed_plugin.deepspeed_config, args,
                         self.accelerator.num_processes)
        model, optimizer = self.accelerator.prepare(model, optimizer)
        return model, optimizer, scheduler

    def accumulating(self, model, sync: bool):
        """The block of one micro-batch's forward and backward; gradients are reduced across processes only when
        `sync` (the step's last micro-batch)."""
        if self.kind == "zero":
            model.set_gradient_accumulation_boundary(sync)  # DeepSpeed reduces at the boundary
            return contextlib.nullcontext()
        return contextlib.nullcontext() if sync else self.accelerator.no_sync(model)

    def backward(self, model, loss: torch.Tensor) -> None:
        """Backpropagate a micro-batch's loss, already normalised for the whole step (never divided again)."""
        if self.kind == "zero":
            model.backward(loss, scale_wrt_gas=False)
        else:
            self.accelerator.backward(loss)

    def clip_gradients(self, model, max_norm: float) -> float | None:
        """Clip the step's gradients to `max_norm` (<= 0: no clipping); returns their norm before clipping, or None
        under DeepSpeed, whose step clips and measures."""
        if self.kind == "zero":
            return None
        if self.kind == "fsdp1":  # the norm of the whole gradient, from every process's shards
            return float(model.clip_grad_norm_(max_norm if max_norm > 0 else float("inf")))
        params = [p for p in model.parameters() if p.requires_grad]
        return float(self.accelerator.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf")))

    def optimizer_step(self, model, optimizer) -> float | None:
        """Apply the update. Under DeepSpeed the engine clips, steps and returns the norm before clipping: inf or nan
        when it was not finite, and then the engine did not apply the update."""
        if self.kind == "zero":
            model.step()
            return zero.global_grad_norm(model)
        optimizer.step()
        return None

    def all_finite(self, model) -> tuple[bool, str | None]:
        """Whether every trainable weight is finite on every process, and else the first non-finite one's name."""
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not params:
            return True, None
        local = [local_tensor(p) for _, p in params]
        from torch.distributed.tensor import DTensor

        local = [t.to_local() if isinstance(t, DTensor) else t for t in local]
        finite = torch.stack([torch.isfinite(t).all() for t in local]).to(torch.int32)
        if self.shards_parameters and torch.distributed.is_initialized():
            torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
        if bool(finite.all()):
            return True, None
        return False, params[int((finite == 0).nonzero()[0])][0]

    # ------------------------------------------------------------------ whole weights for generation

    @contextlib.contextmanager
    def whole_weights(self, model: torch.nn.Module):
        """Every parameter of `model` whole on this process for the block (entering is a collective)."""
        if self.kind == "fsdp2" or is_sharded(model):
            with _fsdp2_unsharded(model):
                yield model
        elif self.kind == "fsdp1":
            with _fsdp1_summoned(model):
                yield model
        elif self.kind == "zero" and self.zero_stage == 3:
            with zero.whole_for_generation(model):
                yield model
        else:
            yield model

    @contextlib.contextmanager
    def writable_whole(self, model: torch.nn.Module):
        """Every trainable parameter of `model` whole on every process for the block, and what the processes write
        into them (the same values on each) kept in their shards on exit; the module tree as the model's own (FSDP1's
        wrappers set aside). A collective: to load a LoRA adapter into a sharded policy (FSDP2's parameters take a
        whole tensor as they are)."""
        if self.kind == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            with FSDP.summon_full_params(model, recurse=True, writeback=True), fsdp1_wrappers_set_aside(model):
                yield
        elif self.kind == "zero" and self.zero_stage == 3:
            with zero.gathered([p for p in model.parameters() if p.requires_grad], keep_changes=True):
                yield
        else:
            yield

    def prepare_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """A model that is not trained (a reference) sharded the way the policy is, so that it costs each process
        its share only; its forwards are then collectives, run by every process alike."""
        if self.kind == "fsdp2":
            from accelerate.utils.fsdp_utils import fsdp2_prepare_model

            return fsdp2_prepare_model(self.accelerator, model)
        if self.kind == "fsdp1":
            prepared = self.accelerator.prepare_model(model)
            _mark_output_layer(prepared)
            return prepared
        if self.kind == "zero" and self.zero_stage == 3:  # ZeRO-1/2 keep whole weights on every process: as it is
            return zero.frozen_engine(model, self.accelerator.state.deepspeed_plugin.deepspeed_config)
        return model

    def at_rest(self, *models: torch.nn.Module) -> None:
        """Every unit of `models` that holds whole weights between steps resharded (a local step), so that their
        parameters are the shards an update or a mix writes to and the next forward gathers: accelerate leaves
        FSDP2's output-layer unit unsharded after a forward, and FSDP1 keeps its root unit's whole weights after a
        forward without backward (a reference's). Pass the prepared models (FSDP1's root wrapper)."""
        for model in models:
            _fsdp1_reshard(model)
            for unit in _fsdp2_units(model):
                unit.reshard()

    # ------------------------------------------------------------------ saving

    def full_state_dict(self, model: torch.nn.Module) -> dict | None:
        """The whole model's state dict on the main process ({} on the others; a collective), or None when each
        process holds the whole model (save it directly)."""
        if not self.shards_parameters and not is_sharded(model):
            return None
        if self.kind == "zero":
            return _zero3_full_state_dict(model, self.accelerator.is_main_process)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=_offload(model)))
        return _without_tied_copies(model, state)

    def load_full_state_dict(self, model: torch.nn.Module, state: dict) -> None:
        """Load a whole state dict (read by every process) into the sharded model; KeyError when it does not fit
        (a tied output layer, stored once, may be missing)."""
        if self.kind == "zero":
            _zero3_load_full_state_dict(model, state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        result = set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
        params = dict(model.named_parameters(remove_duplicate=False))
        loaded = {id(params[name]) for name in state if name in params}
        missing = [name for name in result.missing_keys if id(params.get(name)) not in loaded]
        if missing or result.unexpected_keys:
            raise KeyError(f"weights do not match the model (missing {missing}, unexpected "
                           f"{list(result.unexpected_keys)})")

    def save_optimizer(self, model: torch.nn.Module, optimizer, directory: str) -> None:
        """Write the optimizer's state into a checkpoint directory (every process calls; `directory` exists on
        the main process). Under FSDP2 the whole state, gathered and keyed by parameter name (so it does not depend
        on the number of processes); under DeepSpeed the engine's own files in directory/deepspeed (each process
        writes its partition; the engine's loader unpickles them, as every DeepSpeed checkpoint); otherwise the
        optimizer's state dict."""
        if self.kind == "zero":
            model.save_checkpoint(directory, tag=zero.CHECKPOINT_TAG, save_latest=False)
            return
        if self.kind in ("fsdp1", "fsdp2"):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                        cpu_offload=_offload(model)))
        else:
            state = optimizer.state_dict()
        if self.accelerator is None or self.accelerator.is_main_process:
            torch.save(state, os.path.join(directory, OPTIMIZER_FILE))

    def load_optimizer(self, model: torch.nn.Module, optimizer, directory: str) -> None:
        """Restore what save_optimizer wrote (every process calls). Under DeepSpeed the engine restores its weights
        (full-precision master copies included) and its optimizer partitions."""
        if self.kind == "zero":
            loaded, _ = model.load_checkpoint(directory, tag=zero.CHECKPOINT_TAG, load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
            if loaded is None:
                raise FileNotFoundError(f"no DeepSpeed state in {os.path.join(directory, zero.CHECKPOINT_TAG)}")
            return
        state = torch.load(os.path.join(directory, OPTIMIZER_FILE), weights_only=True,
                           map_location="cpu")  # moved to each parameter's device by the optimizer
        if self.kind in ("fsdp1", "fsdp2"):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            if any(isinstance(v, torch.Tensor) and v.dim() for per in state["state"].values() for v in per.values()):
                set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
                return
            # no per-parameter tensors (plain SGD), which torch's loader cannot place: the hyperparameters only
            for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
                group.update({k: v for k, v in saved.items() if k != "params"})
            return
        optimizer.load_state_dict(state)


def _offload(model: torch.nn.Module) -> bool:
    """Whether a gathered state dict is moved to the CPU as it is gathered: off the CPU only (there is nothing to
    move, and FSDP1's offloading gathers crash on a CPU)."""
    first = next(model.parameters(), None)
    return first is not None and first.device.type != "cpu"


def _zero3_full_state_dict(model: torch.nn.Module, is_main: bool) -> dict:
    """A ZeRO-3 model's whole state dict on the main process ({} elsewhere), gathered one parameter at a time (a
    collective; the tied output layer once), named as the engine's module names them (a LoRA policy's names keep
    their PeftModel prefix: peft picks the adapter's entries by them)."""
    from accelerate.utils import extract_model_from_parallel

    plain = extract_model_from_parallel(model)  # the engine's module (a PeftModel stays one)
    state = {}
    for name, param in plain.named_parameters():
        with zero.gathered([param]):
            if is_main:
                state[name] = param.detach().to("cpu", copy=True)
    if is_main:
        params = dict(plain.named_parameters(remove_duplicate=False))
        for name, tensor in plain.state_dict().items():
            if name not in params:  # persistent buffers
                state[name] = tensor.detach().to("cpu", copy=True)
    return state


def _zero3_load_full_state_dict(model: torch.nn.Module, state: dict) -> None:
    """Write a whole state dict (read by every process) into a ZeRO-3 model's shards; KeyError when it does not fit
    (a tied output layer, stored once, may be missing)."""
    from posttrain.models.keywords import unwrap

    plain = unwrap(model)
    params = dict(plain.named_parameters())  # tied ones once
    buffers = dict(plain.named_buffers())
    known = {name for name, _ in plain.named_parameters(remove_duplicate=False)} | set(buffers)  # tied names too
    unexpected = [name for name in state if name not in known]
    missing = [name for name in params if name not in state]
    if missing or unexpected:
        raise KeyError(f"weights do not match the model (missing {missing}, unexpected {unexpected})")
    with torch.no_grad():
        for name, param in params.items():
            with zero.gathered([param], keep_changes=True):
                param.copy_(state[name].to(param.dtype))
        for name, buffer in buffers.items():
            if name in state:
                buffer.copy_(state[name])


def _without_tied_copies(model: torch.nn.Module, state: dict) -> dict:
    """A gathered state dict holds a tied weight (the output layer sharing the embedding) once per name, as separate
    tensors: keep the first name only, as save_pretrained does for a model's own state dict."""
    from posttrain import weights  # it imports this module

    first: dict[int, str] = {}
    drop = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        name = weights.plain_name(name)
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


def _fsdp1_reshard(model: torch.nn.Module) -> None:
    """Every FSDP1 unit of `model` whose whole weights a forward left allocated (the root, after a forward without
    backward) freed (a local step): its next forward would take them as they are instead of gathering the shards,
    which an update or a mix outside FSDP has changed since."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp._runtime_utils import _reshard  # torch's FSDP1 has no public reshard

    for unit in FSDP.fsdp_modules(model):
        handle = unit._handle
        if handle is not None and handle.uses_sharded_strategy and not handle.needs_unshard():
            _reshard(unit, handle, free_unsharded_flat_param=True)


def _mark_output_layer(model: torch.nn.Module) -> None:
    """Under FSDP1 the output layer's weight is whole only inside the root wrapper's forward and backward: the
    chunked log-prob path then runs as that layer's forward (models/logprobs.py)."""
    from posttrain.models.logprobs import WHOLE_ONLY_IN_FORWARD, output_layer

    layer = output_layer(model)
    if layer is not None:
        setattr(layer, WHOLE_ONLY_IN_FORWARD, True)


@contextlib.contextmanager
def _fsdp1_summoned(model: torch.nn.Module):
    """Every FSDP1 parameter whole (summoned, not written back: nothing inside changes them), and every FSDP1 wrapper
    below the root set aside in its parent for the plain module it wraps (FSDP1 refuses a forward while summoned); a
    collective on entry."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model, recurse=True, writeback=False), fsdp1_wrappers_set_aside(model):
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
