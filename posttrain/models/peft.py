"""LoRA through peft, imported only when adapters are asked for."""

from posttrain._optional import require


def is_peft_model(model) -> bool:
    """True for a peft `PeftModel`, checked without importing peft."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def apply_peft(model, peft_config):
    """Wrap `model` with adapters from `peft_config`; a model that already is a PeftModel is kept as it is."""
    if is_peft_model(model):
        return model
    peft = require("peft", "Training LoRA adapters (peft_config / --use_peft)")
    return peft.get_peft_model(model, peft_config)
