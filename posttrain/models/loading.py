"""Load a causal LM and its tokenizer from a path, a hub id, or take them as given."""

import contextlib
import functools
import logging
import os

from posttrain.errors import UserError
from posttrain.models.checkpoint_classes import (config_field, keep_used_conversions, no_class_for,
                                                vision_language_architecture)

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


def hub_reachable_or_cached(name: str, what: str = "model", revision: str | None = None) -> None:
    """For a hub id: stop at once, in one sentence, when it is neither in the local cache nor downloadable (no
    network, or HF_HUB_OFFLINE), instead of transformers' retries. Local directories pass."""
    if os.path.isdir(name) or name.count("/") != 1:
        return
    from huggingface_hub import constants, try_to_load_from_cache

    cached = try_to_load_from_cache(name, "config.json", revision=revision)
    if isinstance(cached, str) and os.path.exists(cached):
        return
    if constants.HF_HUB_OFFLINE:
        raise ModelLoadError(f"The {what} {name!r} is not a local directory and not in the Hugging Face cache, and "
                             "HF_HUB_OFFLINE is set: download it first (hf download) or give a local path.")
    import socket
    from urllib.parse import urlparse

    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=5).close()
    except OSError:
        raise ModelLoadError(f"The {what} {name!r} is not a local directory and not in the Hugging Face cache, and "
                             f"{host} cannot be reached (offline?): download it where there is network access, or give "
                             "a local path.") from None


def with_trl_default_dtype(kwargs: dict | None) -> dict:
    """A trained model's `model_init_kwargs` with TRL's default dtype, float32, where neither `dtype` nor
    `torch_dtype` is given (TRL's create_model_from_path). transformers 5 would load a checkpoint's own dtype, bfloat16
    for most hub models, where AdamW's small updates round away; `dtype: auto` (or None) asks for that explicitly."""
    kwargs = dict(kwargs or {})
    if "dtype" not in kwargs and "torch_dtype" not in kwargs:
        kwargs["dtype"] = "float32"
    return kwargs


def from_pretrained_kwargs(kwargs: dict | None) -> dict:
    """Normalise `model_init_kwargs`: dtype strings to torch dtypes, and the dtype keyword's name."""
    import torch

    kwargs = dict(kwargs or {})
    kwargs.setdefault("trust_remote_code", False)  # never transformers' interactive prompt
    dtype, legacy = kwargs.pop("dtype", None), kwargs.pop("torch_dtype", None)
    dtype = legacy if dtype is None else dtype  # both given: `dtype` wins, as in transformers
    if isinstance(dtype, str) and dtype != "auto":
        if dtype not in _DTYPES:
            raise ModelLoadError(f"dtype={dtype!r} is not one of: auto, {', '.join(sorted(set(_DTYPES)))}.")
        dtype = getattr(torch, _DTYPES[dtype])
    if dtype is not None:
        kwargs["dtype"] = dtype  # `torch_dtype` is older than every transformers posttrain supports
    return kwargs


@contextlib.contextmanager
def without_progress_bars():
    """transformers' bars for loading and writing weights ("Loading weights", "Writing model shards") off for the
    block, unless its logging is at info or debug (log_level info: posttrain's --verbose); then as they were."""
    from transformers.utils import logging as hf_logging

    quiet = hf_logging.is_progress_bar_enabled() and hf_logging.get_verbosity() > logging.INFO
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet:
            hf_logging.enable_progress_bar()


def load_causal_lm(model, init_kwargs: dict | None = None):
    """Return a `PreTrainedModel` for causal LM: a checkpoint whose architecture is a vision-language model
    (`Qwen3_5ForConditionalGeneration`, `Gemma3ForConditionalGeneration`, `LlavaForConditionalGeneration`, ...) as
    that class, as TRL 1.16 loads it (create_model_from_path: `config.architectures[0]`), trained on text through its
    language model; any other through `AutoModelForCausalLM`.

    Args:
        model: a loaded model (returned as is) or a local path / hub id.
        init_kwargs: keyword arguments for `from_pretrained`.
    """
    return _load("AutoModelForCausalLM", model, from_pretrained_kwargs(init_kwargs), init_kwargs)


def load_sequence_classifier(model, init_kwargs: dict | None = None):
    """A reward model: `AutoModelForSequenceClassification` with one label (a causal LM's checkpoint gets a new score
    head, drawn from the seeded generator, as in TRL). A loaded model is returned as is."""
    kwargs = {**from_pretrained_kwargs(init_kwargs), "num_labels": 1}
    loaded = _load("AutoModelForSequenceClassification", model, dict(kwargs, output_loading_info=True), init_kwargs)
    if not isinstance(model, str):
        return loaded
    loaded, info = loaded
    new = sorted(k for k in info.get("missing_keys", []) if not k.startswith(loaded.base_model_prefix + "."))
    if new:  # transformers' table of missing keys is kept quiet: this is what it means
        logger.info("%s: a new score head (%s), drawn from the seeded generator, on the checkpoint's body.", model,
                    ", ".join(new))
        _same_new_weights_everywhere(loaded, new)
    return loaded


def _same_new_weights_everywhere(model, names: list[str]) -> None:
    """The newly drawn weights `names` as the main process drew them, on every process: with FSDP's CPU-RAM-efficient
    loading transformers leaves them on the meta device outside the main process (to be sent from it), and a process
    that drew its own would train another head."""
    import torch
    import torch.distributed as dist

    everywhere = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    for name in names:
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        tensor = getattr(module, leaf)
        if tensor.is_meta:
            real = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            tensor = torch.nn.Parameter(real, tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) else real
            setattr(module, leaf, tensor)
        if everywhere and not hasattr(tensor, "ds_tensor"):  # DeepSpeed ZeRO-3's partitions are its own to keep
            with torch.no_grad():
                dist.broadcast(tensor.data, src=0)


def _load(auto_class: str, model, kwargs: dict, init_kwargs: dict | None):
    if not isinstance(model, str):
        return model
    import transformers

    model = os.path.expanduser(model)
    _check_path(model)
    hub_reachable_or_cached(model, "model", kwargs.get("revision"))
    vision_language = vision_language_architecture(model, kwargs) if auto_class == "AutoModelForCausalLM" else None
    if vision_language is not None:
        logger.info("%s: a vision-language checkpoint, loaded as %s (as TRL loads it); trained on text through its "
                    "language model, its vision tower gets no gradient.", model, vision_language)
        auto_class = vision_language
    try:
        with without_progress_bars(), _quiet_transformers(auto_class == "AutoModelForSequenceClassification"):
            loaded = getattr(transformers, auto_class).from_pretrained(model, **kwargs)
    except TypeError as err:
        raise _unknown_init_kwarg(model, kwargs, err) from err
    except (ValueError, ImportError, AttributeError) as err:
        raise _init_kwarg_refused(model, init_kwargs or {}, err) or _explained(model, err, auto_class) from err
    except OSError as err:
        raise ModelLoadError(f"Could not load model {model!r}: {err}") from err
    keep_used_conversions(loaded[0] if isinstance(loaded, tuple) else loaded)
    return loaded


@contextlib.contextmanager
def _quiet_transformers(quiet: bool):
    """transformers' warnings off for the block (its report of a classifier's new head), when `quiet`."""
    if not quiet:
        yield
        return
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _unknown_init_kwarg(model: str, kwargs: dict, err: TypeError) -> Exception:
    """A ConfigError for a model_init_kwargs key that from_pretrained and the model do not take (a typo); `err`
    itself when it is some other TypeError."""
    import inspect
    import re

    from transformers import AutoConfig, PreTrainedModel

    from posttrain.configs import ConfigError, suggest

    found = re.search(r"unexpected keyword argument '(\w+)'", str(err))
    if not found or found.group(1) not in kwargs:
        return err
    source = inspect.getsource(PreTrainedModel.from_pretrained)
    known = set(inspect.signature(PreTrainedModel.from_pretrained).parameters)
    known |= set(re.findall(r'kwargs\.pop\(\s*"(\w+)"', source)) | {"revision", "trust_remote_code"}
    try:
        known |= set(AutoConfig.from_pretrained(model, trust_remote_code=kwargs.get("trust_remote_code", False))
                     .to_dict())
    except (OSError, ValueError):
        pass
    key = found.group(1)
    return ConfigError(f"model_init_kwargs has {key!r}, which neither from_pretrained nor the model's config takes."
                       f"{suggest(key, known, ' Remove it.')}")


def _init_kwarg_refused(model: str, init_kwargs: dict, err: Exception) -> Exception | None:
    """A ConfigError for a model_init_kwargs value from_pretrained refuses (an unknown attn_implementation, a device_map
    it cannot place, an attention implementation whose package is not installed): the error names the key or its
    value, or is an ImportError while an attention implementation was asked for. None when none of them is named."""
    from posttrain.configs import ConfigError

    text = str(err).strip()
    reason = text.splitlines()[0].rstrip(".") if text else type(err).__name__
    key = next((k for k, v in init_kwargs.items()
                if k != "trust_remote_code" and (f"{k}=" in text or f"`{k}`" in text
                                                 or (isinstance(v, str) and len(v) > 2 and v in text))), None)
    if key is None and isinstance(err, ImportError) and "attn_implementation" in init_kwargs:
        key = "attn_implementation"
    if key is None:
        return None
    return ConfigError(f"model_init_kwargs {key}={init_kwargs[key]!r} does not work with model {model!r} ({reason}): "
                       "change it, or leave it out for the default.")


def _explained(model: str, err: Exception, auto_class: str = "AutoModelForCausalLM") -> Exception:
    """A ModelLoadError for the ValueErrors of `from_pretrained` a user can fix; `err` itself otherwise."""
    text = str(err)
    unloadable = no_class_for(model, auto_class, text)
    if unloadable is not None:
        return ModelLoadError(unloadable)
    if "trust_remote_code" in text:
        return ModelLoadError(f"Model {model!r} ships its own modelling code, which runs only if you allow it: pass "
                              "trust_remote_code=True in model_init_kwargs (--trust_remote_code on the command line) "
                              "if you trust that code.")
    if "does not recognize this architecture" in text:
        model_type = config_field(model, "model_type")
        return ModelLoadError(f"Model {model!r} has model_type {model_type!r}, which this version of transformers "
                              "does not know: upgrade transformers (pip install -U transformers).")
    return err


def load_tokenizer(source, trust_remote_code: bool = False):
    """Load a tokenizer (or take one as given) and make sure it has a pad token.

    Args:
        source: a tokenizer or processor (returned after the pad-token check), or a path / hub id.
    """
    if isinstance(source, str):
        from transformers import AutoTokenizer

        hub_reachable_or_cached(source, "tokenizer")
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        except OSError as err:
            raise ModelLoadError(f"Could not load a tokenizer from {source!r}: {err}") from err
    else:
        tokenizer = source
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # processors wrap a tokenizer
    if tokenizer.pad_token is None:
        _pad_with_eos(tokenizer)
    return tokenizer


_PAD_WARNED: set[str] = set()  # tokenizer paths already reported as padding with EOS


def _pad_with_eos(tokenizer) -> None:
    """Use EOS as the pad token, saying so once per tokenizer (and once per path when it is loaded again)."""
    name = getattr(tokenizer, "name_or_path", "") or ""
    whose = f"The tokenizer of {name!r}" if name else "The tokenizer"
    if tokenizer.eos_token is None:
        raise ModelLoadError(f"{whose} has neither a pad nor an EOS token: set tokenizer.pad_token (e.g. "
                             "tokenizer.add_special_tokens({'pad_token': '<pad>'}) and resize the embeddings).")
    if name not in _PAD_WARNED:
        logger.warning("%s has no pad token: using its EOS token %r for padding (set tokenizer.pad_token to choose "
                       "another).", whose, tokenizer.eos_token)
    if name:
        _PAD_WARNED.add(name)
    tokenizer.pad_token = tokenizer.eos_token


def cast_output_layer_to_fp32(model) -> None:
    """Keep the output layer's weights in float32 and compute logits in float32, autocast or not (TRL's
    cast_lm_head_to_fp32).

    The layer becomes a `Float32Linear`. With tied embeddings the shared weight becomes float32 too, so the input
    embedding's output is cast back to the model's dtype, leaving the body's activations as they were.
    """
    import torch

    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise ModelLoadError("cast_lm_head_to_fp32=True needs a plain Linear output layer, and this one is "
                             f"{type(head).__name__} (a LoRA adapter on lm_head?): remove lm_head from the adapter's "
                             "target modules, or set cast_lm_head_to_fp32=False.")
    dtype = head.weight.dtype
    head.float()
    head.__class__ = _float32_linear()
    embedding = model.get_input_embeddings()
    if dtype != torch.float32 and embedding is not None and embedding.weight is head.weight:
        embedding.register_forward_hook(_CastOutput(dtype))


class _CastOutput:
    """A forward hook casting a module's output to `dtype` (a class, so that deep copies keep it)."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __call__(self, module, args, output):
        return output.to(self.dtype)


_FLOAT32_LINEAR = None


def _float32_linear():
    """nn.Linear whose forward runs in float32 with autocast off (made on first use: this module avoids torch at
    import)."""
    global _FLOAT32_LINEAR
    if _FLOAT32_LINEAR is None:
        import torch

        class Float32Linear(torch.nn.Linear):
            def forward(self, x):
                with torch.autocast(device_type=x.device.type, enabled=False):
                    return torch.nn.functional.linear(x.float(), self.weight.float(),
                                                      None if self.bias is None else self.bias.float())

        _FLOAT32_LINEAR = Float32Linear
    return _FLOAT32_LINEAR


def keeps_float32(layer) -> bool:
    """Whether this output layer computes in float32 whatever the autocast (cast_lm_head_to_fp32's layer): the
    chunked products over it then stay float32 on a GPU too (models/output_products.py)."""
    return _float32_linear() in (type(layer), class_before_fully_shard(type(layer)))


def is_plain_linear(layer) -> bool:
    """An nn.Linear computing exactly x W^T + b: the plain class or the float32 one above, also as FSDP2's
    `fully_shard` retypes it (accelerate makes the output layer a unit of its own)."""
    import torch

    plain = (torch.nn.Linear, _float32_linear())
    return type(layer) in plain or class_before_fully_shard(type(layer)) in plain


def is_fully_shard_unit(module) -> bool:
    """Whether FSDP2's `fully_shard` was applied to this module itself: its parameters are whole from its group's
    forward to the backward, and sharded (DTensors) elsewhere."""
    fsdp_module = _fsdp_module_class()
    return fsdp_module is not None and isinstance(module, fsdp_module)


def class_before_fully_shard(cls: type) -> type | None:
    """The module class that `fully_shard` derived `cls` from (it retypes a module to a class whose bases are
    FSDPModule and the module's own class, adding nothing but a refusal to deepcopy), else None."""
    fsdp_module, bases = _fsdp_module_class(), cls.__bases__
    return bases[1] if fsdp_module is not None and len(bases) == 2 and bases[0] is fsdp_module else None


@functools.cache
def _fsdp_module_class():
    """FSDP2's FSDPModule, or None in a torch without FSDP2 (looked up once: every module of a model may ask)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def enable_checkpointing(model, kwargs: dict | None) -> None:
    """Activation (gradient) checkpointing, non-reentrant unless `kwargs` say otherwise, through transformers 5's
    `activation_checkpointing_enable` where the model has it (its older name warns that it is deprecated).

    The kwargs reach torch.utils.checkpoint.checkpoint at the first forward: a key it does not take is refused here,
    in one sentence, rather than as a TypeError in the middle of training."""
    import inspect

    import torch.utils.checkpoint

    from posttrain.configs import ConfigError, suggest

    kwargs = kwargs or {"use_reentrant": False}
    known = set(inspect.signature(torch.utils.checkpoint.checkpoint).parameters) - {"function", "args", "kwargs"}
    for key in kwargs:
        if key not in known:
            raise ConfigError(f"gradient_checkpointing_kwargs has {key!r}, which torch's checkpoint does not take "
                              f"(it takes {', '.join(sorted(known))}).{suggest(key, known)}")
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()


def checkpointing(plain) -> bool:
    """Whether the model recomputes activations in its backward: transformers' gradient checkpointing, in training
    mode."""
    return plain.training and any(getattr(m, "gradient_checkpointing", False) is True for m in plain.modules())


# what a one-time check of a model may raise where the model does not support what is checked
CHECK_ERRORS = (TypeError, AttributeError, IndexError, RuntimeError, ValueError, KeyError)


def check_raised(plain, consequence: str, err: BaseException) -> bool:
    """Warn (once: the checks' results are cached per model) that `consequence` holds for this model because its
    one-time check raised `err`; False."""
    return fallback_said(plain, consequence, f"its one-time check raised {raised(err)}")


_SAID: set[str] = set()  # the fallbacks said in this process


def fallback_said(plain, consequence: str, reason: str) -> bool:
    """Warn that `consequence` holds for this model because of `reason`, once per process for a model class and
    reason (a reference copy of the policy says nothing new); False."""
    message = f"{type(plain).__name__}: {consequence}, because {reason.rstrip('.')}."
    if message not in _SAID:
        _SAID.add(message)
        logger.warning(message)
    return False


def forget_fallbacks_said() -> None:
    """Let every fallback be said again (tests that read the warnings)."""
    _SAID.clear()


def raised(err: BaseException) -> str:
    """`err` in a few words: its type and its message's first line."""
    message = str(err).strip()
    return f"{type(err).__name__}: {message.splitlines()[0] if message else 'no message'}"
