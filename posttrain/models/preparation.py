"""Turning a loaded model into the policy a trainer trains, and its reference: shared by every trainer."""

import copy

import torch

from posttrain.configs import ConfigError
from posttrain.models import fast_paths
from posttrain.models.loading import cast_output_layer_to_fp32, enable_checkpointing
from posttrain.models.partitioned import gathered, is_partitioned, local_shard, partitioned_copy
from posttrain.models.peft import add_reference_adapter, apply_peft, is_peft_model, refuse_virtual_token_adapter


def prepare_policy(model, args, peft_config, device):
    """Adapters (peft_config), dropout off (disable_dropout), a float32 output layer (cast_lm_head_to_fp32),
    activation checkpointing (gradient_checkpointing), no KV cache in training forwards; on `device`, in train mode."""
    if peft_config is not None:
        model = apply_peft(model, peft_config)
    refuse_virtual_token_adapter(model)  # one the model came with, as peft_config's
    if args.disable_dropout:
        disable_dropout(model)
    if args.cast_lm_head_to_fp32:
        cast_output_layer_to_fp32(model)
    if args.gradient_checkpointing:
        enable_checkpointing(model, args.gradient_checkpointing_kwargs)
    model.config.use_cache = False
    return model.to(device).train()


def disable_dropout(model) -> None:
    """Every dropout probability of `model` set to 0."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def make_reference(model, args, came_with_adapter: bool):
    """(reference model, reference adapter name) when beta > 0; (None, None) otherwise.

    Full fine-tuning: a frozen copy of the initial policy. LoRA: no copy; the policy with adapters
    disabled, or with a frozen copy of the adapter it came with (see models/peft.py).
    """
    if args.beta == 0.0:
        return None, None
    return reference_of(model, args.sync_ref_model, came_with_adapter)


def reference_of(model, sync_ref_model: bool, came_with_adapter: bool):
    """(frozen copy of `model`, None), or for a LoRA model (None, the reference adapter's name, or None for adapters
    off)."""
    if is_peft_model(model):
        if sync_ref_model:
            raise ConfigError("sync_ref_model=True needs a separate reference model, and a LoRA run has none (its "
                              "reference is the policy with adapters off): set sync_ref_model=False, or train "
                              "all weights.")
        return None, (add_reference_adapter(model) if came_with_adapter else None)
    if any(is_partitioned(p) for p in model.parameters()):  # DeepSpeed ZeRO-3 loaded it in shards
        return partitioned_copy(model).eval().requires_grad_(False), None
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    fast_paths.note_copy(reference, model)
    return reference, None


def mix_reference(ref_model, policy, alpha: float) -> None:
    """TR-DPO's reference update, parameter by parameter: ref = alpha * policy + (1 - alpha) * ref."""
    with torch.no_grad():
        for ref, pol in zip(ref_model.parameters(), policy.parameters()):
            if is_partitioned(ref):
                # whole, and written back to the shards: ZeRO-3 keeps a small parameter ("persistent", below
                # stage3_param_persistence_threshold) whole between forwards, and a forward reads that copy, not
                # the shard, so an update of the shard alone would not reach the reference's log-probs
                with gathered([pol]), gathered([ref], keep_changes=True):
                    ref.mul_(1 - alpha).add_(pol.detach().to(ref.dtype), alpha=alpha)
                continue
            # sharded alike: shard into shard (local_shard is training/sharding's local_tensor: a ZeRO-3 shard, or
            # the parameter itself, an FSDP2 DTensor updating its own shard)
            ref, pol = local_shard(ref), local_shard(pol)
            if ref.shape != pol.shape:  # never broadcast one into the other
                raise RuntimeError(f"the reference's parameter {tuple(ref.shape)} and the policy's "
                                   f"{tuple(pol.shape)} differ: they are not sharded alike")
            ref.mul_(1 - alpha).add_(pol.detach().to(ref.dtype), alpha=alpha)
