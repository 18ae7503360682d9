"""DeepSpeed ZeRO through accelerate, as a Sharding strategy: the engine owns backward, gradient reduction,
clipping, the norm and the step; ZeRO-1/2 keep the whole weights on every process (`ZeroSharding`), ZeRO-3 partitions
them too (`Zero3Sharding`). The calls into DeepSpeed itself are posttrain/training/zero.py's.
"""

import contextlib
import os
from typing import ContextManager

import torch

from posttrain.training import zero
from posttrain.training.sharding.base import Sharding


class ZeroSharding(Sharding):
    """DeepSpeed ZeRO-1/2: the optimizer state (and the gradients) partitioned, the weights whole everywhere. A
    checkpoint's optimizer state is the engine's own files, one per process."""

    @property
    def _deepspeed_config(self) -> dict:
        """The run's DeepSpeed config (accelerate's plugin holds it)."""
        return self.accelerator.state.deepspeed_plugin.deepspeed_config

    def prepare(self, model, optimizer, scheduler, args) -> tuple:
        """The config's batch, accumulation and clipping entries filled from `args` (zero.fill_config), then
        accelerate's prepare of the model and optimizer; the schedule stays a plain one that the loop steps after each
        applied update (accelerate would hand DeepSpeed a wrapper that never steps it)."""
        zero.fill_config(self._deepspeed_config, args, self.accelerator.num_processes)
        model, optimizer = self.accelerator.prepare(model, optimizer)
        return model, optimizer, scheduler

    def accumulating(self, model, sync: bool) -> ContextManager:
        """Tells the engine whether this micro-batch ends the step (it reduces the gradients at that boundary)."""
        model.set_gradient_accumulation_boundary(sync)
        return contextlib.nullcontext()

    def backward(self, model, loss: torch.Tensor) -> None:
        """The engine's backward, without its own division by the accumulation steps."""
        model.backward(loss, scale_wrt_gas=False)

    def clip_gradients(self, model, max_norm: float) -> None:
        """None: the engine's step clips (the config's gradient_clipping) and measures."""
        return None

    def optimizer_step(self, model, optimizer) -> float:
        """The engine clips, steps and returns the norm before clipping: inf or nan when it was not finite, and then
        the engine did not apply the update."""
        model.step()
        return zero.global_grad_norm(model)

    def scales_loss(self, model) -> bool:
        """DeepSpeed's fp16 runs its own dynamic loss scale, which skips an overflowed step."""
        return bool(model.fp16_enabled())

    def step_skipped(self, model, optimizer) -> bool:
        return not model.was_step_applied()

    def _gathered_state_dict(self, model: torch.nn.Module) -> dict:
        """The engine's module's whole state dict, gathered one parameter at a time (engine_full_state_dict)."""
        return engine_full_state_dict(model, self.accelerator.is_main_process)

    def load_full_state_dict(self, model: torch.nn.Module, state: dict) -> None:
        """Written one parameter at a time into the engine's shards (load_engine_full_state_dict)."""
        load_engine_full_state_dict(model, state)

    def save_optimizer(self, model: torch.nn.Module, optimizer, directory: str) -> None:
        """The engine's own files in `directory`/deepspeed (each process writes its partition; the engine's loader
        unpickles them, as every DeepSpeed checkpoint)."""
        model.save_checkpoint(directory, tag=zero.CHECKPOINT_TAG, save_latest=False)

    def load_optimizer(self, model: torch.nn.Module, optimizer, directory: str) -> None:
        """The engine restores its weights (full-precision master copies included) and its optimizer partitions;
        FileNotFoundError when `directory` holds none."""
        loaded, _ = model.load_checkpoint(directory, tag=zero.CHECKPOINT_TAG, load_optimizer_states=True,
                                          load_lr_scheduler_states=False)
        if loaded is None:
            raise FileNotFoundError(f"no DeepSpeed state in {os.path.join(directory, zero.CHECKPOINT_TAG)}")


class Zero3Sharding(ZeroSharding):
    """DeepSpeed ZeRO-3: the weights partitioned too (a parameter is an empty tensor whose shard is
    `param.ds_tensor`), gathered whole for generation and for writing."""

    shards_parameters = True

    def _own_whole_weights(self, model: torch.nn.Module) -> ContextManager:
        """Every weight of the engine whole and its per-module gather hooks off (DeepSpeed's own context for
        generation)."""
        return zero.whole_for_generation(model)

    def writable_whole(self, model: torch.nn.Module) -> ContextManager:
        """The trainable parameters gathered whole, what the processes write kept in the shards on exit."""
        return zero.gathered([p for p in model.parameters() if p.requires_grad], keep_changes=True)

    def prepare_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """An engine without an optimizer, in eval mode, partitioning `model` as the policy is."""
        return zero.frozen_engine(model, self._deepspeed_config)


def engine_full_state_dict(model: torch.nn.Module, is_main: bool) -> dict:
    """{name: whole CPU tensor} of a DeepSpeed engine's module on the main process ({} elsewhere), gathered one
    parameter at a time (a collective; the tied output layer once), named as the engine's module names them (a LoRA
    policy's names keep their PeftModel prefix: peft picks the adapter's entries by them)."""
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


def load_engine_full_state_dict(model: torch.nn.Module, state: dict) -> None:
    """Write a whole state dict (read by every process) into a DeepSpeed engine's shards; KeyError when it does not
    fit (a tied output layer, stored once, may be missing)."""
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
