"""Which transformers class a checkpoint loads as, and why one cannot be loaded.

A checkpoint whose architecture is a vision-language model (Qwen3.5 ships `Qwen3_5ForConditionalGeneration` from
0.8B up; Gemma 3, LLaVA, Qwen2.5-VL, SmolVLM) loads as that class, as TRL 1.16's create_model_from_path loads it
(`config.architectures[0]`), and trains on text through its language model, its vision tower without gradient
(training/setup.py allow_unused_parameters). A checkpoint transformers has no class of the kind asked for (a causal
LM, a sequence classifier) is refused in one sentence that names its architecture and what to give instead. A
checkpoint's weights written under a family's legacy names (save_pretrained reverts transformers' renamings) are read
back under the model's own (`in_model_names`).
"""

import contextlib
import functools
import json
import os

# what a checkpoint of each auto class is for, and what to give instead when transformers has no such class for it
_AUTO_CLASS_USE = {
    "AutoModelForCausalLM": ("a causal language model", "give a causal language model's checkpoint (a text model, or "
                             "a vision-language model transformers loads as image-text-to-text)"),
    "AutoModelForSequenceClassification": ("a sequence classifier (the reward model)", "start the reward model from a "
                                           "text model's checkpoint, a causal LM or a sequence classifier, as TRL's "
                                           "RewardTrainer needs too"),
}


@functools.cache
def vision_language_classes() -> frozenset[str]:
    """The class names of transformers' image-text-to-text models (its AutoModelForImageTextToText mapping)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return frozenset(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.values())


def is_vision_language(model) -> bool:
    """Whether the (unwrapped) model is one of transformers' image-text-to-text models."""
    from posttrain.models.keywords import unwrap

    return type(unwrap(model)).__name__ in vision_language_classes()


def vision_language_architecture(path: str, kwargs: dict) -> str | None:
    """The checkpoint's architecture (`config.architectures[0]`) when it is a vision-language model class of the
    installed transformers, its parts' classes imported for the loading that follows (`_import_parts`); else None (a
    text model, a remote-code model, or no readable config: loading says)."""
    import transformers
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        config = transformers.AutoConfig.from_pretrained(
            path, trust_remote_code=kwargs.get("trust_remote_code", False),
            **{k: kwargs[k] for k in ("revision", "token", "cache_dir") if k in kwargs})
    except (OSError, ValueError):
        return None
    finally:
        hf_logging.set_verbosity(level)
    name = (getattr(config, "architectures", None) or [None])[0]
    if name not in vision_language_classes() or not hasattr(transformers, name):
        return None
    _import_parts(config)
    return name


def _import_parts(config) -> None:
    """Import the classes of a composite model's parts (its text model's, its vision tower's) before it loads. Its
    `__init__` builds them through AutoModel, which would import their modules inside DeepSpeed ZeRO-3's zero.Init:
    a class created there has the `__init__` it had before its decorators restored when the context ends (kernels'
    `use_kernelized_func`, from transformers 5.25), and every later instance of it (a ZeRO-3 reference copy) lacks
    what they set up (`'LlamaAttention' object has no attribute '_kernel_funcs'`)."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    for name in getattr(config, "sub_configs", None) or {}:
        part = getattr(config, name, None)
        if part is not None and type(part) in MODEL_MAPPING:
            MODEL_MAPPING[type(part)]  # imports the part's modeling module


def no_class_for(model: str, auto_class: str, error: str) -> str | None:
    """The sentence for `from_pretrained`'s error when transformers has no `auto_class` for the checkpoint's config
    ("Unrecognized configuration class ..."); None for any other error."""
    if "Unrecognized configuration class" not in error or auto_class not in _AUTO_CLASS_USE:
        return None
    import transformers

    what, instead = _AUTO_CLASS_USE[auto_class]
    architecture = (config_field(model, "architectures") or ["an architecture its config does not name"])[0]
    return (f"Model {model!r} ({architecture}, model_type {config_field(model, 'model_type')!r}) cannot be loaded as "
            f"{what}: transformers {transformers.__version__} has no such class for it; {instead}.")


def config_field(model: str, field: str):
    """A field of a local checkpoint's config.json, or None."""
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(model, "config.json")) as f:
            return json.load(f).get(field)
    return None


def keep_used_conversions(model) -> None:
    """The weight renamings `save_pretrained` reverts: those that renamed the checkpoint's weights at loading, as
    transformers keeps them, also where DeepSpeed ZeRO-3 loads the model (its loader keeps every renaming of the
    family's mapping, and a LLaVA saved from it got `language_model.model.model.` names that load as nothing)."""
    conversions = getattr(model, "_weight_conversions", None)
    if conversions:
        model._weight_conversions = [c for c in conversions if c.was_used()]


def in_model_names(model, state: dict, own: dict | None = None) -> dict:
    """A checkpoint's weights under the model's own names: save_pretrained writes some families under their legacy
    names (transformers' weight conversions reverted: a vision-language model's `model.language_model.*` as
    `model.*`, its `model.visual.*` as `visual.*`), which a renaming maps back one to one. `own`: the model's
    {name: tensor} (default its state_dict(); a sharded model's plain names, whose state_dict hooks must not run)."""
    own = own if own is not None else model.state_dict()
    if set(state) <= set(own):
        return state
    from transformers.core_model_loading import revert_weight_conversion

    saved_as = {}  # each own name reverted alone: tied names share a tensor, so a tensor does not tell them apart
    for name, tensor in own.items():
        for saved in revert_weight_conversion(model, {name: tensor}):
            saved_as[saved] = name
    return {saved_as.get(key) or key: value for key, value in state.items()}
