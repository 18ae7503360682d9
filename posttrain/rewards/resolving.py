"""What the user named as rewards, resolved: built-in names, dotted paths (imported from the current directory first,
as `python -m` and TRL's scripts import them), reward models; and the reward functions' signatures checked against
what they will be passed (TRL's convention plus the dataset's columns) before any training."""

import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from posttrain._optional import require
from posttrain.configs import ConfigError, suggest
from posttrain.data import DataError
from posttrain.rewards.builtin import BUILTIN_NAMES, by_name

NO_REWARD = "No reward function given: pass reward_funcs (e.g. --reward_funcs accuracy)"
# the keyword arguments every reward function is passed besides the dataset's columns (TRL 1.16's _calculate_rewards)
CONVENTION_ARGS = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric"}
PASSED_WHOLE = {"trainer_state", "log_extra", "log_metric"}  # keyword arguments that are not one value per completion


@dataclass
class RewardFunction:
    """One reward source. `model` and `tokenizer` are set for sequence-classification reward models."""

    name: str
    fn: Callable | None = None
    model: Any = None
    tokenizer: Any = None

    @property
    def is_async(self) -> bool:
        return self.fn is not None and inspect.iscoroutinefunction(self.fn)


def _is_dotted(path: str) -> bool:
    """`module.name` (or `package.module.name`): identifiers joined by dots, and no file or folder of that name."""
    parts = path.split(".")
    return len(parts) > 1 and all(p.isidentifier() for p in parts) and not os.path.exists(path)


def _current_directory_on_path() -> None:
    """The current directory first on sys.path, where `python -m posttrain` and TRL's scripts have it (the
    `posttrain` console script has its own folder there instead), so that a module beside the user imports."""
    cwd = os.getcwd()
    if not any(os.path.abspath(p or os.curdir) == cwd for p in sys.path if isinstance(p, str)):
        sys.path.insert(0, cwd)
        importlib.invalidate_caches()


def _missing(err: ModuleNotFoundError, module: str) -> bool:
    """Whether `err` says `module` itself (or a package above it) does not exist, not a module it imports."""
    return err.name is not None and (module == err.name or module.startswith(err.name + "."))


def import_dotted(path: str, what: str = "Reward function"):
    """The function a dotted path `module.name` names, its module imported from the current directory or the installed
    packages; None when `path` is not a dotted path or no such module exists (it may name a reward model instead).

    Raises ConfigError, naming `what`, for a module that raises on import (its own error), a name it does not define,
    or one that is not callable.
    """
    if not _is_dotted(path):
        return None
    module_name, _, attr = path.rpartition(".")
    _current_directory_on_path()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if _missing(err, module_name):
            return None
        raise _import_failed(path, module_name, err, what) from err
    except SyntaxError as err:  # its message names the file and line; importlib's frames would add nothing
        raise _import_failed(path, module_name, err, what) from None
    except Exception as err:  # noqa: BLE001 - whatever the user's module raises on import: its traceback is shown
        raise _import_failed(path, module_name, err, what) from err
    where = getattr(module, "__file__", None) or module_name
    if not hasattr(module, attr):
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise ConfigError(f"{what} {path!r}: the module {module_name} ({where}) has no {attr!r}: check the name."
                          f"{suggest(attr, names)}")
    found = getattr(module, attr)
    if not callable(found):
        raise ConfigError(f"{what} {path!r} is not a function ({type(found).__name__} in {where}): name a function.")
    return found


def _import_failed(path: str, module: str, err: BaseException, what: str) -> ConfigError:
    text = str(err).strip()
    detail = f": {text.splitlines()[0].rstrip('.')}" if text else ""
    fix = "install the package it imports, or fix the import" if isinstance(err, ImportError) else "fix the module"
    error = ConfigError(f"{what} {path!r} could not be imported: its module {module} raised {type(err).__name__} on "
                        f"import{detail}; {fix}.")
    error.shows_cause = True  # the traceback points into the user's module
    return error


def _not_a_reward(source: str) -> ConfigError:
    """The error for a reward name that is no built-in, no importable module, no local directory and no hub id."""
    builtins = ", ".join(BUILTIN_NAMES)
    if _is_dotted(source):
        module = source.rpartition(".")[0]
        return ConfigError(f"Reward function {source!r} could not be imported: there is no module {module} in the "
                           f"current directory ({os.getcwd()}) or the installed packages; check the name, or run from "
                           f"the folder that holds {module.split('.')[0]}.py.")
    return ConfigError(f"Reward {source!r} is not a built-in ({builtins}), an importable dotted path, a local "
                       f"reward-model directory or a hub id (org/name).{suggest(source, BUILTIN_NAMES)}")


def _reward_model_path(source: str) -> str:
    """A reward model's local directory or hub id, expanded; one sentence for a name that is neither (a misspelt
    built-in) or a path that does not exist."""
    source = os.path.expanduser(source)
    if "/" not in source and not os.path.isdir(source):  # neither a local directory nor an org/name hub id
        raise _not_a_reward(source)
    if not os.path.isdir(source) and (source.startswith((".", "/")) or source.count("/") > 1):
        raise ConfigError(f"Reward model path {source!r} does not exist: check the path (or give a hub id such "
                          "as 'org/name').")
    return source


def check_reward_names(specs, config) -> None:
    """What resolve_reward_funcs would refuse without loading anything: no reward given, a name that is neither a
    built-in, an importable dotted path nor a reward model's directory or hub id, a built-in whose optional package
    is missing. For the command line, before the datasets and the model load."""
    specs = specs if isinstance(specs, (list, tuple)) else [specs]
    if not specs or specs == [None]:
        raise ConfigError(NO_REWARD + ".")
    for spec in specs:
        if not isinstance(spec, str):
            continue
        fn = by_name(spec, config) or import_dotted(spec)
        if fn is None:
            _reward_model_path(spec)
        elif getattr(fn, "requires", None):
            require(fn.requires, f"The {getattr(fn, '__name__', spec)} reward")


def _load_reward_model(source, trust_remote_code: bool, tokenizer=None, dtype=None) -> RewardFunction:
    if isinstance(source, str):
        source = _reward_model_path(source)
    from transformers import AutoTokenizer

    from posttrain.models.loading import ModelLoadError, load_tokenizer

    if isinstance(source, str):
        model, name = _reward_model(source, trust_remote_code, dtype), source
    else:
        model, name = source, getattr(source.config, "_name_or_path", "") or type(source).__name__
    try:
        tokenizer = load_tokenizer(tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(
            model.config._name_or_path, trust_remote_code=trust_remote_code))
    except (OSError, ModelLoadError) as err:
        raise ModelLoadError(f"Could not load the tokenizer of reward model {name!r}: {err} Pass it in "
                             "reward_processing_classes.") from err
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.eval().requires_grad_(False)
    return RewardFunction(name=name.rstrip("/").split("/")[-1], model=model, tokenizer=tokenizer)


def _reward_model(source: str, trust_remote_code: bool, dtype=None):
    """A sequence-classification model whose score head was trained (loading a causal LM this way would give it a
    randomly initialised head that scores noise), in `dtype` (model_init_kwargs' dtype, as TRL loads reward models;
    None: the checkpoint's own)."""
    from transformers import AutoModelForSequenceClassification

    from posttrain.models.loading import (ModelLoadError, from_pretrained_kwargs, hub_reachable_or_cached,
                                          without_progress_bars)

    hub_reachable_or_cached(source, "reward model")
    kwargs = from_pretrained_kwargs({"trust_remote_code": trust_remote_code, "dtype": dtype})
    try:
        with without_progress_bars():
            model, info = AutoModelForSequenceClassification.from_pretrained(
                source, num_labels=1, output_loading_info=True, **kwargs)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"Reward {source!r} is neither a built-in ({', '.join(BUILTIN_NAMES)}), an importable "
                             f"dotted path, nor a loadable reward model ({str(err).splitlines()[0]})."
                             f"{suggest(source, BUILTIN_NAMES)}") from err
    head = getattr(model, "base_model_prefix", "model")
    untrained = [k for k in info.get("missing_keys", []) if not k.startswith(head + ".")]
    if untrained:
        raise ModelLoadError(f"{source!r} has no trained classification head ({', '.join(sorted(untrained)[:2])} "
                             "missing): it is not a reward model, and as one it would score noise. Give a "
                             "sequence-classification reward model, or write a reward function.")
    return model


def _processing_classes(classes, n: int) -> list:
    """TRL's reward_processing_classes: None, one tokenizer (for a single reward), or one entry per reward."""
    if classes is None:
        return [None] * n
    classes = classes if isinstance(classes, (list, tuple)) else [classes]
    if len(classes) != n:
        raise ConfigError(f"reward_processing_classes has {len(classes)} entries for {n} reward functions: give one "
                          "per reward function (None where it is not a reward model).")
    return list(classes)


def resolve_reward_funcs(specs, config, trust_remote_code: bool = False,
                         processing_classes=None) -> list[RewardFunction]:
    """Turn callables, built-in names, dotted paths, model paths or loaded models into RewardFunctions.

    Args:
        processing_classes: TRL's reward_processing_classes: the tokenizer of each reward model (None entries, and
            entries for plain functions, mean: load the model's own).
    """
    specs = specs if isinstance(specs, (list, tuple)) else [specs]
    if not specs or specs == [None]:
        raise ConfigError(NO_REWARD + ".")
    init = getattr(config, "model_init_kwargs", None) or {}
    dtype = init.get("dtype", init.get("torch_dtype"))  # TRL loads reward models with model_init_kwargs
    funcs = []
    for spec, tokenizer in zip(specs, _processing_classes(processing_classes, len(specs))):
        if isinstance(spec, str):
            fn = by_name(spec, config) or import_dotted(spec)
            # named as TRL names them: by the function's __name__ (a factory's class sets it)
            funcs.append(RewardFunction(name=getattr(fn, "__name__", spec.split(".")[-1]), fn=fn) if fn else
                         _load_reward_model(spec, trust_remote_code, tokenizer, dtype))
        elif isinstance(spec, torch.nn.Module):
            funcs.append(_load_reward_model(spec, trust_remote_code, tokenizer))
        elif callable(spec):
            funcs.append(RewardFunction(name=getattr(spec, "__name__", type(spec).__name__), fn=spec))
        else:
            raise ConfigError(f"Reward function {spec!r} is not a callable, a name, or a model.")
    _dedupe_names(funcs)
    for f in funcs:  # a built-in's optional package, before the model loads (not at step 1)
        if getattr(f.fn, "requires", None):
            require(f.fn.requires, f"The {f.name} reward")
    return funcs


def _dedupe_names(funcs):
    seen = {}
    for f in funcs:
        count = seen.get(f.name, 0)
        seen[f.name] = count + 1
        if count:
            f.name = f"{f.name}_{count}"


def unaccepted_keywords(fn: Callable, passed) -> list[str]:
    """The names in `passed` that `fn` cannot take as keyword arguments (none when it has **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return []
    named = {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                  inspect.Parameter.KEYWORD_ONLY)}
    return sorted(set(passed) - named)


def without_kwargs_message(name: str, unaccepted: list[str]) -> str:
    """The one sentence for a reward function that cannot take every argument reward functions are passed."""
    return (f"Add **kwargs to the signature of reward function {name!r}: every reward function is passed "
            f"{', '.join(sorted(CONVENTION_ARGS))} and the dataset's columns as keyword arguments (as in TRL), and it "
            f"does not take {', '.join(unaccepted)}.")


def check_required_columns(funcs: list[RewardFunction], columns, provided=(), more_columns: bool = False) -> None:
    """Stop before training when a reward function requires a keyword the dataset has no column for, cannot take
    every keyword it will be passed (no **kwargs), or a column is named like an argument reward functions already
    receive (the two would collide).

    Args:
        provided: keywords passed besides the columns and the conventional ones (`environments`, with an
            environment_factory).
        more_columns: columns may be added at generation time (rollout_func's extra keys): a required keyword
            without a column is then checked when the functions are called.
    """
    given = CONVENTION_ARGS | set(provided)
    clashing = sorted(set(columns) & given)
    if clashing:
        raise DataError(f"The dataset's column {clashing[0]!r} has the name of an argument reward functions already "
                        f"receive ({', '.join(sorted(given))}): rename the column.")
    for f in funcs:
        if f.fn is None:
            continue
        for name, param in inspect.signature(f.fn).parameters.items():
            required = param.default is inspect.Parameter.empty and param.kind in (
                inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            if required and name not in given and name not in columns and not more_columns:
                close = suggest(name, given | set(columns))
                fix = "rename it, add the column, or give it a default" if close else (
                    "add the column, or give the argument a default")
                raise DataError(f"Reward function {f.name!r} requires the argument {name!r}, but the dataset has "
                                f"no {name!r} column (columns: {', '.join(sorted(columns)) or 'none'}): {fix}.{close}")
        unaccepted = unaccepted_keywords(f.fn, given | set(columns))
        if unaccepted:
            raise ConfigError(without_kwargs_message(f.name, unaccepted))
