"""The interface every sharding strategy implements (`Sharding`), with the steps of a model whose weights are whole
on every process as its defaults, and `NoSharding`, the strategy that keeps them all (one process, or DDP).

The defaults are accelerate's own steps (its prepare, no_sync, backward and clipping, then `optimizer.step()`); a
strategy overrides what its sharding changes. Two defaults look at the model rather than at the strategy: a model
with FSDP2 units (`fully_shard`, applied by accelerate or by hand) is unsharded by `whole_weights`, resharded by
`at_rest` and gathered by `full_state_dict` whatever the run's strategy.
"""

import contextlib
import os
from typing import ContextManager

import torch

from posttrain.models import fast_paths
from posttrain.models.loading import is_fully_shard_unit
from posttrain.training import zero
from posttrain.weights import plain_name

OPTIMIZER_FILE = "optimizer.pt"  # a checkpoint's whole optimizer state (outside DeepSpeed)


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """What this process holds of a parameter, to update in place: a ZeRO-3 parameter's shard (flat); the parameter
    itself otherwise (an FSDP2 DTensor updates its own shard)."""
    return zero.local_shard(param)


def fsdp2_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` (itself included) that FSDP2's fully_shard made units, outermost first."""
    return [m for m in model.modules() if is_fully_shard_unit(m)]


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether `model` (or a module in it) is sharded with FSDP2."""
    return bool(fsdp2_units(model))


class Sharding:
    """How the trained model is spread over the processes, and the steps that must know it. One instance per run,
    chosen once by `sharding_of(accelerator)` (posttrain/training/sharding/__init__.py); the trainers call these
    methods and never ask which strategy they hold.

    Args:
        accelerator: the run's Accelerator (it prepares the models; only its main process writes files). None for a
            model sharded by hand (tests): then nothing that needs accelerate is called.

    Attributes:
        shards_parameters: whether a process holds only part of each parameter between steps.
    """

    shards_parameters = False

    def __init__(self, accelerator=None):
        self.accelerator = accelerator

    def forward_module(self, model: torch.nn.Module, policy: torch.nn.Module) -> torch.nn.Module:
        """The module every forward of the trained model calls, given the prepared `model` and its unwrapped
        `policy`: the policy itself."""
        return policy

    def reads_gradients_in_backward(self) -> bool:
        """Whether anything reads or moves a parameter's gradient while the backward runs (a reduction as each
        gradient is ready, a partition): then a weight's gradient must be whole when autograd accumulates it
        (models/tied_embedding.py adds to it just before). True but for one process holding whole weights."""
        return True

    # ------------------------------------------------------------------ the training step

    def prepare(self, model, optimizer, scheduler, args) -> tuple:
        """(model, optimizer, scheduler) after accelerate's prepare; `args` (the trainer's config) is unused here."""
        return self.accelerator.prepare(model, optimizer, scheduler)

    def accumulating(self, model, sync: bool) -> ContextManager:
        """The block of one micro-batch's forward and backward; gradients are reduced across processes only when
        `sync` (the step's last micro-batch)."""
        return contextlib.nullcontext() if sync else self.accelerator.no_sync(model)

    def backward(self, model, loss: torch.Tensor) -> None:
        """Backpropagate a micro-batch's loss (a scalar), already normalised for the whole step (never divided
        again)."""
        self.accelerator.backward(loss)

    def clip_gradients(self, model, max_norm: float) -> float | None:
        """Clip the step's gradients to `max_norm` (<= 0: no clipping); returns their norm before clipping (None
        when the optimizer step clips and measures)."""
        params = [p for p in model.parameters() if p.requires_grad]
        return float(self.accelerator.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf")))

    def optimizer_step(self, model, optimizer) -> float | None:
        """Apply the update; returns the gradient norm when the step measured it (here None: clip_gradients did)."""
        scaler = getattr(self.accelerator, "scaler", None)
        self._scale_before = scaler.get_scale() if scaler is not None else None
        optimizer.step()
        return None

    def scales_loss(self, model) -> bool:
        """Whether a dynamic loss scaler (fp16: accelerate's GradScaler) owns the step: it skips an update whose
        gradients overflowed and lowers its scale, rather than the run stopping."""
        return getattr(self.accelerator, "scaler", None) is not None

    def step_skipped(self, model, optimizer) -> bool:
        """Whether the loss scaler skipped the last optimizer step: a GradScaler lowers its scale exactly when it
        found non-finite gradients, and then steps nothing."""
        scaler = getattr(self.accelerator, "scaler", None)
        before = getattr(self, "_scale_before", None)
        return scaler is not None and before is not None and scaler.get_scale() < before

    def all_finite(self, model, skip: torch.Tensor | None = None) -> tuple[bool, str | None]:
        """(whether every trainable weight but `skip` (one the caller checks itself) is finite on every process,
        None) or (False, the first non-finite weight's name); a collective when the parameters are sharded."""
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p is not skip]
        if not params:
            return True, None
        from torch.distributed.tensor import DTensor

        local = [local_tensor(p) for _, p in params]
        local = [t.to_local() if isinstance(t, DTensor) else t for t in local]
        finite = _finite_each(local).to(torch.int32)  # [parameters]
        if self.shards_parameters and torch.distributed.is_initialized():
            torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
        if bool(finite.all()):
            return True, None
        return False, params[int((finite == 0).nonzero()[0])][0]

    # ------------------------------------------------------------------ whole weights, frozen models

    @contextlib.contextmanager
    def whole_weights(self, model: torch.nn.Module):
        """Every parameter of `model` whole on this process for the block, which receives `model` (entering is a
        collective: call on every process, outside inference_mode; nothing inside may be a collective). A model
        with FSDP2 units has them unsharded, whatever the strategy."""
        with _fsdp2_unsharded(model) if is_sharded(model) else self._own_whole_weights(model):
            yield model

    def _own_whole_weights(self, model: torch.nn.Module) -> ContextManager:
        """What whole_weights enters for a model without FSDP2 units: nothing, its weights are whole."""
        return contextlib.nullcontext()

    def writable_whole(self, model: torch.nn.Module) -> ContextManager:
        """A block in which every trainable parameter of `model` is whole on every process, and what the processes
        write into them (the same values on each) is kept in their shards on exit; the module tree as the model's
        own. A collective: to load a LoRA adapter into a sharded policy. Here nothing to do (whole weights, or
        FSDP2's parameters, which take a whole tensor as they are)."""
        return contextlib.nullcontext()

    def prepare_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """A model that is not trained (a reference) sharded the way the policy is, so that it costs each process
        its share only (its forwards are then collectives, run by every process alike): here `model` as it is."""
        return model

    def at_rest(self, *models: torch.nn.Module) -> None:
        """Every unit of `models` that holds whole weights between steps resharded (a local step), so that their
        parameters are the shards an update or a mix writes to and the next forward gathers: accelerate leaves
        FSDP2's output-layer unit unsharded after a forward. Pass the prepared models."""
        for model in models:
            for unit in fsdp2_units(model):
                unit.reshard()

    # ------------------------------------------------------------------ saving

    def full_state_dict(self, model: torch.nn.Module) -> dict | None:
        """{name: whole CPU tensor} on the main process, {} on the others (a collective: every process calls it); or
        None when each process holds the whole model (save it as it is)."""
        if not self.shards_parameters and not is_sharded(model):
            return None
        return self._gathered_state_dict(model)

    def _gathered_state_dict(self, model: torch.nn.Module) -> dict:
        """full_state_dict of a sharded model: torch's full state dict (plain names, a tied weight once)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=gathers_to_cpu(model)))
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

    def save_optimizer(self, model: torch.nn.Module, optimizer, directory: str) -> None:
        """Write the optimizer's whole state to `directory`/optimizer.pt (every process calls; `directory` exists on
        the main process, which writes)."""
        state = self._whole_optimizer_state(model, optimizer)
        if self.accelerator is None or self.accelerator.is_main_process:
            torch.save(state, os.path.join(directory, OPTIMIZER_FILE))

    def _whole_optimizer_state(self, model: torch.nn.Module, optimizer) -> dict:
        """What save_optimizer writes: the optimizer's own state dict."""
        return optimizer.state_dict()

    def load_optimizer(self, model: torch.nn.Module, optimizer, directory: str) -> None:
        """Restore what save_optimizer wrote (every process calls and reads it)."""
        state = torch.load(os.path.join(directory, OPTIMIZER_FILE), weights_only=True,
                           map_location="cpu")  # moved to each parameter's device by the optimizer
        self._load_whole_optimizer_state(model, optimizer, state)

    def _load_whole_optimizer_state(self, model: torch.nn.Module, optimizer, state: dict) -> None:
        """Load what _whole_optimizer_state gave, read back from the checkpoint."""
        optimizer.load_state_dict(state)


class NoSharding(Sharding):
    """One process, or DDP: every process holds the whole weights; every step is accelerate's own (the defaults)."""

    def reads_gradients_in_backward(self) -> bool:
        """DDP reduces gradients in buckets as they are ready; one process reads them after the backward."""
        return self.accelerator is None or self.accelerator.num_processes > 1

    def prepare_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` as it is; a reference copied from the policy shares its fast-path decisions (models/fast_paths.py:
        both run unwrapped alike, so each one-time check runs once)."""
        fast_paths.share_with_source(model)
        return model


def gathers_to_cpu(model: torch.nn.Module) -> bool:
    """Whether a gathered state dict is moved to the CPU as it is gathered: off the CPU only (there is nothing to
    move, and FSDP1's offloading gathers crash on a CPU)."""
    first = next(model.parameters(), None)
    return first is not None and first.device.type != "cpu"


def _without_tied_copies(model: torch.nn.Module, state: dict) -> dict:
    """A gathered state dict holds a tied weight (the output layer sharing the embedding) once per name, as separate
    tensors: `state` with the first name only, as save_pretrained does for a model's own state dict."""
    first: dict[int, str] = {}
    drop = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        name = plain_name(name)
        if id(param) in first:
            drop.add(name)
        else:
            first[id(param)] = name
    return {k: v for k, v in state.items() if k not in drop}


@contextlib.contextmanager
def _fsdp2_unsharded(model: torch.nn.Module):
    """Every FSDP2 unit unsharded on entry and kept whole until exit, then resharded: forwards inside gather
    nothing."""
    units = fsdp2_units(model)
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


def _finite_each(tensors: list) -> torch.Tensor:
    """[len(tensors)] bool: whether each tensor holds only finite values. A sum is NaN or infinite when any value is,
    and one pass of it costs a fraction of isfinite's (which writes a mask of the tensor's size: 70 ms a step on a
    152k x 128 embedding); the rare finite tensor whose sum overflows float32 is checked value by value."""
    sums = torch.stack([t.sum(dtype=torch.float32) for t in tensors])
    finite = torch.isfinite(sums)
    for i in (~finite).nonzero().flatten().tolist():
        finite[i] = torch.isfinite(tensors[i]).all()
    return finite
