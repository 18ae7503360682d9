"""Export a policy's weights for a generation engine, with the parameter names of the plain model.

For a plain model this is its state dict. For a LoRA (peft) model it is what `merge_and_unload()` would
produce, without touching the training model:

- each LoRA-wrapped module is merged on a private copy of that one module (peft's own merge, so
  rsLoRA, DoRA and fan-in/fan-out layouts come out exactly as peft defines them), and its weights are
  yielded under the base name: no `base_model.model.` prefix, no `.base_layer`, no `lora_` tensors;
- a `modules_to_save` wrapper yields the active adapter's trained copy under the base name;
- everything else is yielded as is.

Guarantees (each tested in tests/test_weights.py): the training model is never merged in place, so its
forward is bit-identical before and after an export; and no yielded tensor aliases one that an
optimizer step or an adapter unmerge will modify. Merged tensors are fresh, and trainable tensors are
cloned as they are yielded. Frozen tensors are yielded without a copy: nothing writes to them.
"""

import copy
from typing import Iterator

import torch

from posttrain.models.keywords import unwrap
from posttrain.models.peft import is_peft_model


def export_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` for every weight an engine should load, with plain parameter names.

    Lazy: a generator that shares the policy's weights never consumes it, so it costs nothing there.
    Tensors are produced one module at a time, so the extra memory is about one module's weights.
    """
    while hasattr(model, "module") and not is_peft_model(model):  # DDP and similar wrappers
        model = model.module
    if is_peft_model(model):
        yield from _export_peft(model)
    else:
        yield from _export_plain(unwrap(model))


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective: every process calls it), any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor safe to hand out: trainable ones are copied, frozen ones shared; an FSDP2 shard is gathered whole
    (a collective: every process exports)."""
    tensor_ = tensor.detach()
    whole = full_tensor(tensor_)
    if whole is not tensor_:
        return whole  # gathered into a fresh tensor
    return tensor_.clone() if tensor.requires_grad else tensor_


def _export_plain(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    # the state dict's entries read from the modules, not through state_dict(): its hooks may change the model (FSDP2's
    # reshard it, freeing the whole weights that Sharding.whole_weights holds for the export)
    sources = {plain_name(name): tensor for module_name, module in model.named_modules(remove_duplicate=False)
               for name, tensor in _module_entries(module, f"{module_name}." if module_name else "")}
    counts: dict[int, int] = {}
    for source in sources.values():
        counts[id(source)] = counts.get(id(source), 0) + 1
    tied: dict[int, torch.Tensor] = {}  # a tied tensor (embedding = lm_head) is copied once, not once per name
    with torch.no_grad():
        for name, source in sources.items():
            if counts[id(source)] == 1:
                yield name, _own(source)
                continue
            if id(source) not in tied:
                tied[id(source)] = _own(source)
            yield name, tied[id(source)]


WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")  # torch's wrappers' own module names


def plain_name(name: str) -> str:
    """A parameter's name without the module names torch's checkpoint and FSDP1 wrappers insert (their state_dict
    hooks drop them too)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _module_entries(module: torch.nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A module's own parameters and persistent buffers (not its children's), as they are."""
    for name, param in module._parameters.items():
        if param is not None:
            yield f"{prefix}{name}", param
    for name, buf in module._buffers.items():
        if buf is not None and name not in module._non_persistent_buffers_set:
            yield f"{prefix}{name}", buf


def _module_tensors(module: torch.nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A module's own parameters (copied when trained) and persistent buffers."""
    for name, tensor in _module_entries(module, prefix):
        yield name, _own(tensor) if isinstance(tensor, torch.nn.Parameter) else tensor.detach()


def _merged_copy(layer) -> torch.nn.Module:
    """The base layer of a LoRA-wrapped module with the active adapters merged, on a private copy."""
    private = copy.deepcopy(layer)
    private.merge(safe_merge=False, adapter_names=list(private.active_adapters))
    return private.get_base_layer()


def _export_peft(peft_model) -> Iterator[tuple[str, torch.Tensor]]:
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    base = peft_model.get_base_model()
    handled: list[str] = []
    with torch.no_grad():
        for name, module in base.named_modules(remove_duplicate=False):
            if any(name.startswith(h + ".") for h in handled):
                continue  # inside a wrapper already exported
            prefix = f"{name}." if name else ""
            if isinstance(module, BaseTunerLayer):
                handled.append(name)
                merged = _merged_copy(module)
                for sub, tensor in merged.state_dict().items():
                    yield f"{prefix}{sub}", tensor.detach()
            elif isinstance(module, ModulesToSaveWrapper):
                handled.append(name)
                trained = module.modules_to_save[module.active_adapter]
                for sub, tensor in trained.state_dict(keep_vars=True).items():
                    yield f"{prefix}{sub}", _own(tensor)
            else:
                yield from _module_tensors(module, prefix)


def embeddings_still_tied(plain_model: torch.nn.Module, state: dict) -> bool:
    """Whether exported `state` can be saved with the model's tied input/output embeddings.

    False when the config ties them but the exported tensors differ (e.g. lm_head trained through
    LoRA's modules_to_save): such weights must be saved with tie_word_embeddings=False.
    """
    if not getattr(plain_model.config, "tie_word_embeddings", False):
        return False
    names = {m: n for n, m in plain_model.named_modules()}
    inp, out = plain_model.get_input_embeddings(), plain_model.get_output_embeddings()
    keys = [f"{names[m]}.weight" for m in (inp, out) if m in names]
    if len(keys) < 2 or any(k not in state for k in keys):
        return True
    return torch.equal(state[keys[0]], state[keys[1]])
