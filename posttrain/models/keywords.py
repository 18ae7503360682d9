"""The names transformers gives the keywords posttrain passes to a model, chosen in this one place.

transformers renames a keyword from time to time, keeps the old name working for a while with a deprecation
warning, then removes it. posttrain never picks a name by guessing:

    what                         newest name        older names           renamed in transformers
    a forward's KV cache         cache              past_key_values,      5.24 (old names warn; removal announced
                                                    cache_params (Mamba)  for 5.40); also the output's field
    logits of the last positions logits_to_keep     num_logits_to_keep    4.49 (the old name warned until 4.50)
    from_pretrained's dtype      dtype              torch_dtype           4.56: below the declared minimum (5.23),
                                                                          so `dtype` always (a user's torch_dtype
                                                                          is read as dtype, models/loading.py)
    save_pretrained's format     (safetensors only) safe_serialization    removed in 5.0 (peft's keeps it)
    checkpointing's method       activation_        gradient_             5.23 (old name warns; chosen by
                                 checkpointing_     checkpointing_        presence in models/loading.py's
                                 enable             enable                enable_checkpointing)

A packed row's sequence boundaries go by TRL's names (BOUNDARY_NAMES), passed only to a forward that can take them
(`takes_boundaries`).

A forward keyword is chosen from the model class's own forward signature, since a model's code (a remote-code
model, a subclass) may use any of the names on any transformers version. A model whose forward names none takes the
name transformers' own models take now, through its **kwargs. A name whose rename is older than the declared minimum
transformers (pyproject.toml) is written in its new form only.
"""

import dataclasses
import functools
import inspect

# the names of each renamed forward keyword, newest first
FORWARD_NAMES = {
    "cache": ("cache", "past_key_values", "cache_params"),
    "logits_to_keep": ("logits_to_keep", "num_logits_to_keep"),
}


def unwrap(model):
    """The module whose `forward` signature describes the model: strips DDP/compile and PEFT wrappers."""
    while True:
        if hasattr(model, "module") and not hasattr(model, "get_base_model"):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif hasattr(model, "get_base_model"):
            model = model.get_base_model()
        else:
            return model


@functools.lru_cache(maxsize=64)
def _forward_params(model_type: type) -> frozenset:
    return frozenset(inspect.signature(model_type.forward).parameters)


def forward_accepts(model, name: str) -> bool:
    """Whether the (unwrapped) model's forward names `name` explicitly (not just **kwargs)."""
    return name in _forward_params(type(unwrap(model)))


def forward_keyword(model, what: str) -> str | None:
    """The name the model's forward gives `what` (a key of FORWARD_NAMES), newest first; None when it names none."""
    return next((name for name in FORWARD_NAMES[what] if forward_accepts(model, name)), None)


def logits_to_keep_kwarg(model) -> str | None:
    """`logits_to_keep`, `num_logits_to_keep`, or None when the model's forward takes neither."""
    return forward_keyword(model, "logits_to_keep")


@functools.cache
def transformers_cache_name() -> str:
    """The name transformers' own causal LMs give the cache keyword in the installed version."""
    from transformers import LlamaForCausalLM

    return next(name for name in FORWARD_NAMES["cache"] if name in _forward_params(LlamaForCausalLM))


def cache_kwarg(model) -> str:
    """The keyword the model's forward takes its KV cache under: its own name for it, else (a forward that takes it
    through **kwargs) the installed transformers' name."""
    return forward_keyword(model, "cache") or transformers_cache_name()


def returned_cache(output):
    """The KV cache a forward returned, read from the output's own field (`cache` from transformers 5.24,
    `past_key_values` before), so that the deprecated alias is never touched."""
    fields = {field.name for field in dataclasses.fields(output)} if dataclasses.is_dataclass(output) else set()
    for name in FORWARD_NAMES["cache"]:
        if name in fields:
            return getattr(output, name)
    return getattr(output, transformers_cache_name(), None)


def safetensors_kwargs(model) -> dict:
    """`save_pretrained`'s keyword for safetensors where it has one: peft's models, and transformers before 5.0,
    which dropped it (safetensors is the only format there, and the keyword would fall into **kwargs unread)."""
    takes = "safe_serialization" in inspect.signature(type(model).save_pretrained).parameters
    return {"safe_serialization": True} if takes else {}


@functools.lru_cache(maxsize=64)
def _takes_any_keyword(model_type: type) -> bool:
    parameters = inspect.signature(model_type.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def takes_boundaries(model) -> bool:
    """Whether the (unwrapped) model's forward can receive the sequence-boundary keywords of a packed row
    (BOUNDARY_NAMES): it names them, or takes **kwargs, which transformers' models hand on to their attention and
    linear-attention layers."""
    return _takes_any_keyword(type(unwrap(model))) or all(forward_accepts(model, name) for name in BOUNDARY_NAMES)


# TRL's names for the sequence boundaries of a packed row (its padding-free collator's), which transformers' flash
# attention and the kernels of recurrent and convolutional layers (flash-linear-attention, mamba-ssm, causal-conv1d)
# read: cumulative sequence lengths, the longest sequence, and each token's sequence index
BOUNDARY_NAMES = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def missing_from_forward(model, needs: tuple[str, ...]) -> str | None:
    """Why the model's forward cannot take what a fast path passes, or None when it takes all of it.

    Args:
        model: the model (wrappers are looked through).
        needs: plain keyword names, or keys of FORWARD_NAMES (any of whose names will do).
    Returns:
        e.g. "its forward (Qwen2ForCausalLM, transformers 5.24.0) takes no `position_ids`",
        naming every missing keyword.
    """
    import transformers

    missing = []
    for need in needs:
        names = FORWARD_NAMES.get(need, (need,))
        if not any(forward_accepts(model, name) for name in names):
            missing.append(_none_of(names))
    if not missing:
        return None
    return (f"its forward ({type(unwrap(model)).__name__}, transformers {transformers.__version__}) takes "
            f"{', '.join(missing)}")


def _none_of(names: tuple[str, ...]) -> str:
    quoted = [f"`{name}`" for name in names]
    if len(quoted) == 1:
        return f"no {quoted[0]}"
    if len(quoted) == 2:
        return f"neither {quoted[0]} nor {quoted[1]}"
    return f"none of {', '.join(quoted)}"
