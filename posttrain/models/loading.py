"""Load a causal LM and its tokenizer from a path, a hub id, or take them as given."""

import logging
import os

from posttrain.errors import UserError

logger = logging.getLogger("posttrain")

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


class ModelLoadError(UserError, ValueError):
    """A model or tokenizer that cannot be loaded as asked."""


def _check_path(name: str):
    if os.path.isdir(name):
        return
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ModelLoadError(f"Model path {name!r} does not exist: pass an existing directory or a hub id "
                             "like 'Qwen/Qwen2.5-0.5B-Instruct'.")


def _init_kwargs(kwargs: dict | None) -> dict:
    """Normalise `model_init_kwargs`: dtype strings to torch dtypes, and the dtype keyword's name."""
    import torch
    import transformers
    from packaging.version import Version

    kwargs = dict(kwargs or {})
    dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None)
    if isinstance(dtype, str) and dtype != "auto":
        if dtype not in _DTYPES:
            raise ModelLoadError(f"dtype={dtype!r} is not one of: auto, {', '.join(sorted(set(_DTYPES)))}.")
        dtype = getattr(torch, _DTYPES[dtype])
    if dtype is not None:
        # transformers renamed `torch_dtype` to `dtype` in 4.56.
        key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
        kwargs[key] = dtype
    return kwargs


def load_causal_lm(model, init_kwargs: dict | None = None):
    """Return a `PreTrainedModel` for causal LM.

    Args:
        model: a loaded model (returned as is) or a local path / hub id.
        init_kwargs: keyword arguments for `AutoModelForCausalLM.from_pretrained`.
    """
    if not isinstance(model, str):
        return model
    from transformers import AutoModelForCausalLM

    model = os.path.expanduser(model)
    _check_path(model)
    kwargs = _init_kwargs(init_kwargs)
    try:
        return AutoModelForCausalLM.from_pretrained(model, **kwargs)
    except ValueError as err:
        if "trust_remote_code" in str(err):
            raise ModelLoadError(f"Model {model!r} ships its own code: set trust_remote_code=True "
                                 "(--trust_remote_code true) if you trust it.") from err
        raise
    except OSError as err:
        raise ModelLoadError(f"Could not load model {model!r}: {err}") from err


def load_tokenizer(source, trust_remote_code: bool = False):
    """Load a tokenizer (or take one as given) and make sure it has a pad token.

    Args:
        source: a tokenizer or processor (returned after the pad-token check), or a path / hub id.
    """
    if isinstance(source, str):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        except OSError as err:
            raise ModelLoadError(f"Could not load a tokenizer from {source!r}: {err}") from err
    else:
        tokenizer = source
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # processors wrap a tokenizer
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError("The tokenizer has neither a pad nor an EOS token: set tokenizer.pad_token.")
        logger.warning("The tokenizer has no pad token: using its EOS token %r for padding.", tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


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
