"""LoRA through peft, imported only when adapters are asked for.

The reference model of a LoRA run is the policy itself, so no second copy of the weights is held:
- adapters created here start as a no-op, so the reference is the policy with adapters disabled;
- a model that arrives with a (pre-trained) adapter gets a frozen copy of it, the `reference` adapter,
  and the reference pass switches to that copy.
"""

import contextlib
import logging
import warnings

from posttrain._optional import require
from posttrain.configs import ConfigError

REFERENCE_ADAPTER = "reference"
logger = logging.getLogger("posttrain")


def is_peft_model(model) -> bool:
    """True for a peft `PeftModel`, checked without importing peft."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def apply_peft(model, peft_config):
    """Wrap `model` with adapters from `peft_config`; a model that already is a PeftModel is kept as it is."""
    peft = require("peft", "Training LoRA adapters (peft_config / --use_peft)")
    if is_peft_model(model):
        raise ConfigError("The model already is a PeftModel and peft_config was given too: pass one or the other.")
    if not isinstance(peft_config, peft.PeftConfig):
        raise _not_a_peft_config(peft_config)
    _refuse_virtual_tokens(peft_config)
    targets = getattr(peft_config, "target_modules", None)
    targets = sorted(set(targets)) if isinstance(targets, (list, set, tuple)) else None
    try:
        with warnings.catch_warnings():
            # peft (through 0.21) reads `is_gradient_checkpointing`, which transformers 5.23 renamed
            # `is_activation_checkpointing`: the FutureWarning is about peft's call, not about this run
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
            wrapped = peft.get_peft_model(model, peft_config)
    except ValueError as err:
        if "not found in the base model" not in str(err):
            raise
        raise _unknown_targets(model, targets or peft_config.target_modules) from err
    missing = _unmatched(wrapped, targets) if targets else []
    if missing:  # peft adapts the others and says nothing: neither does TRL
        logger.warning(f"{_unknown_targets(model, missing)} peft adapts the others, as in TRL; name only modules of "
                       "this model to silence this.")
    return wrapped


def _not_a_peft_config(peft_config) -> ConfigError:
    if isinstance(peft_config, type):
        return ConfigError(f"peft_config is the class {peft_config.__name__}, not a config: pass an instance, e.g. "
                           f"{peft_config.__name__}(r=16, lora_alpha=32).")
    hint = " (LoraConfig(**it) turns this dict into one)" if isinstance(peft_config, dict) else ""
    return ConfigError(f"peft_config is a {type(peft_config).__name__}, not a peft config: pass one such as "
                       f"peft.LoraConfig(r=16, lora_alpha=32){hint}.")


def _refuse_virtual_tokens(peft_config, what: str = "peft_config is") -> None:
    """Prompt tuning and P-tuning put trained virtual tokens before each input, which every token mask, position and
    log-prob of posttrain's passes would have to count; prefix tuning keeps its virtual tokens in the attention's keys
    and values only, and trains like any adapter. `what` names where the config came from."""
    if getattr(peft_config, "is_prompt_learning", False) and peft_config.peft_type != "PREFIX_TUNING":
        raise ConfigError(f"{what} a {type(peft_config).__name__}, which adds trained virtual tokens to every "
                          "input, and posttrain's masks and log-probs cover the real tokens only: use LoRA "
                          "(LoraConfig, --use_peft), another adapter, or prefix tuning (PrefixTuningConfig).")


def refuse_virtual_token_adapter(model) -> None:
    """A model that arrives as a PeftModel whose active adapter adds virtual tokens is refused as that adapter given
    as peft_config is (_refuse_virtual_tokens)."""
    if is_peft_model(model):
        _refuse_virtual_tokens(model.active_peft_config, "The model is a PeftModel whose active adapter is")


def refuse_prefix_tuning_for_sampling(peft_config=None, model=None) -> None:
    """GRPO samples from the policy it trains, and prefix tuning reaches the model as a KV cache, which peft's forward
    puts in place of the one a decode step passes (transformers 5.24 then keeps one of the two with a warning): the
    in-process decode would sample without the prefix, or without the prompt. SFT and DPO, whose passes carry no cache
    of their own, train prefixes. Checks a config about to be applied, or the adapter a model came with."""
    if peft_config is None and model is not None and is_peft_model(model):
        peft_config = model.active_peft_config
    if getattr(peft_config, "peft_type", None) == "PREFIX_TUNING":
        raise ConfigError("Prefix tuning (PrefixTuningConfig) trains SFT and DPO here, not GRPO: its prefix reaches "
                          "the model as a KV cache, which GRPO's in-process decode also passes, so completions would be "
                          "sampled without it; use LoRA (LoraConfig, --use_peft) for GRPO.")


def _unmatched(wrapped, targets: list[str]) -> list[str]:
    """The entries of `targets` (the config's target_modules as given) that peft adapted nothing for: neither a module
    it targeted (the module's name, or its last dotted parts, as peft matches) nor a name it moved to the fused
    parameters of a mixture of experts (peft 0.18 on: gate_proj, up_proj, down_proj on transformers 5's experts)."""
    adapted = list(wrapped.targeted_module_names)
    kept = set(getattr(wrapped.active_peft_config, "target_modules", None) or ())
    return [t for t in targets if t in kept and not any(n == t or n.endswith("." + t) for n in adapted)]


def _unknown_targets(model, missing) -> ConfigError:
    """The LoRA target modules `missing` that match nothing in the model, with the linear layers that exist."""
    import torch

    from posttrain.configs import suggest

    missing = [missing] if isinstance(missing, str) else sorted(missing or [])
    linear = sorted({name.removesuffix(".base_layer").rsplit(".", 1)[-1] for name, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and ".lora_" not in name})  # wrapped or not
    hint = suggest(missing[0], linear) if missing else ""
    return ConfigError(f"LoRA target modules {missing} match no module of the model (its linear layers: "
                       f"{', '.join(linear)}).{hint}")


def add_reference_adapter(model) -> str:
    """Freeze a copy of the active adapter under REFERENCE_ADAPTER and return that name."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    active = model.active_adapter
    model.add_adapter(REFERENCE_ADAPTER, model.peft_config[active])
    set_peft_model_state_dict(model, get_peft_model_state_dict(model, adapter_name=active),
                              adapter_name=REFERENCE_ADAPTER)
    model.set_adapter(active)  # peft marks only the active adapter trainable
    for name, param in model.named_parameters():
        if f".{REFERENCE_ADAPTER}." in name or name.endswith(f".{REFERENCE_ADAPTER}"):
            param.requires_grad_(False)
    return REFERENCE_ADAPTER


@contextlib.contextmanager
def reference_mode(model, reference_adapter: str | None):
    """Within this context the LoRA policy computes the reference model's outputs."""
    if reference_adapter is None:
        with model.disable_adapter():
            yield
        return
    active = model.active_adapter
    model.set_adapter(reference_adapter)
    try:
        yield
    finally:
        model.set_adapter(active)  # also restores which parameters require grad
