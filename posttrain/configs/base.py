"""What every config module shares: the error type, field declaration, and the checks fields run at construction.

No torch or transformers here: `posttrain --help` imports this package.
"""

import dataclasses
import functools
import math
import numbers
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from posttrain.errors import UserError


class ConfigError(UserError, ValueError):
    """A config value that cannot work; the message names the field and a valid choice."""


@dataclass(frozen=True)
class Range:
    """The values a numeric field accepts, checked at construction and shown in docs/config.md."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    note: str = ""  # what a boundary value means, e.g. "0 disables clipping"

    def contains(self, value) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def text(self) -> str:
        low, high = _number(self.low), _number(self.high)
        if low is None and high is None:
            return "any"
        if low is not None and high is not None:
            return f"{'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        if low is not None:
            return f"{'>' if self.low_open else '>='} {low}"
        return f"{'<' if self.high_open else '<='} {high}"


def _number(x):
    return None if x is None else int(x) if float(x).is_integer() else x


ANY = Range()
POSITIVE = Range(0, low_open=True)
NON_NEGATIVE = Range(0)
AT_LEAST_ONE = Range(1)
FRACTION = Range(0, 1)
SEED = Range(0, 2 ** 32 - 1)  # numpy's seeds


class Help(str):
    """A field's help text that also carries its numeric range. The range rides on the text, not as a key of its own,
    because transformers' HfArgumentParser passes every metadata key to argparse's add_argument."""

    def __new__(cls, text: str, range: Range | None = None):
        help_text = super().__new__(cls, text)
        help_text.range = range
        return help_text


def _help(text: str, range: Range | None = None, **kw) -> Any:
    """A dataclass field with its help text (shown by `--help` and in docs/config.md) and, for a number, its range."""
    return field(metadata={"help": Help(text, range)}, **kw)


def field_range(f: dataclasses.Field) -> Range | None:
    """The range a field declared with `_help` checks, or None."""
    return getattr(f.metadata.get("help"), "range", None)


def check_ranges(cfg) -> None:
    """Every numeric field inside its declared range (None, where a field allows it, means unset)."""
    for f in dataclasses.fields(cfg):
        bounds = field_range(f)
        value = getattr(cfg, f.name)
        if bounds is None or value is None or isinstance(value, bool) or not isinstance(value, numbers.Real):
            continue
        if not bounds.contains(value):
            whole = isinstance(value, int) and bounds == AT_LEAST_ONE
            two_sided = bounds.low is not None and bounds.high is not None
            wanted = "a positive integer" if whole else f"in {bounds.text()}" if two_sided else bounds.text()
            note = f" ({bounds.note})" if bounds.note else ""
            raise ConfigError(f"{f.name}={value!r} must be {wanted}{note}.")


def field_types(cls) -> dict:
    """Map each field name of dataclass `cls` to its resolved type (a copy of the map resolved once per class: the CLI
    reads it for every group of flags, and resolving 200 annotations is most of building its parser)."""
    return dict(_resolved_types(cls))


@functools.cache
def _resolved_types(cls) -> dict:
    return typing.get_type_hints(cls)


def field_help(cls) -> dict:
    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}


def union_args(tp) -> list:
    """The non-None members of Optional/Union `tp`, or [tp] for a plain type."""
    if typing.get_origin(tp) is Union:
        return [a for a in typing.get_args(tp) if a is not type(None)]
    return [tp]


def base_type(tp):
    """Optional[X] -> X; a Union with list -> list (the most general); Union[int, str] -> int; Literal -> str."""
    args = union_args(tp)
    if len(args) > 1:
        return list if list in args else base_type(args[0])
    origin = typing.get_origin(args[0])
    if origin is Literal:
        return str
    return origin or args[0]


# ------------------------------------------------------------------ checks run by __post_init__

_TYPE_HINTS = {int: "a whole number", float: "a number", bool: "true or false", dict: "a mapping (JSON object)",
               list: "a list", str: "a string"}


def invalid(name: str, value, base) -> ConfigError:
    hint = _TYPE_HINTS.get(base, getattr(base, "__name__", str(base)))
    return ConfigError(f"{name}={value!r} is not a valid {getattr(base, '__name__', base)}: use {hint}.")


# mappings that may also come as a JSON string, as transformers' TrainingArguments takes them (their fields are typed
# `dict | str | None`, so that HfArgumentParser passes `--model_init_kwargs '{"dtype": "bfloat16"}'` on as a string)
JSON_MAPPINGS = frozenset({"model_init_kwargs", "ref_model_init_kwargs", "gradient_checkpointing_kwargs",
                           "activation_checkpointing_kwargs", "lr_scheduler_kwargs", "generation_kwargs",
                           "chat_template_kwargs", "dataset_kwargs", "accelerator_config", "fsdp_config",
                           "transformers_continuous_batching_config"})


def json_mappings_to_dicts(cfg) -> None:
    """A JSON_MAPPINGS field given as a JSON string becomes its dict; any other string is refused in one sentence."""
    import json

    for name in JSON_MAPPINGS & {f.name for f in dataclasses.fields(cfg)}:
        value = getattr(cfg, name)
        if not isinstance(value, str):
            continue
        try:
            loaded = json.loads(value)
        except json.JSONDecodeError:
            loaded = None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{name}={value!r} is not a mapping: give a dict, or a JSON object such as "
                              f"'{{\"key\": \"value\"}}'.")
        setattr(cfg, name, loaded)


def check_types(cfg) -> None:
    """Numbers and flags set from Python must have their field's type (YAML and flags are converted by `coerce`);
    mappings given as JSON strings become dicts first."""
    json_mappings_to_dicts(cfg)
    for name, tp in field_types(type(cfg)).items():
        value, members = getattr(cfg, name), union_args(tp)
        if value is None or len(members) > 1:
            continue
        base = base_type(tp)
        if base not in (int, float, bool):
            continue
        if isinstance(value, bool) != (base is bool):
            raise invalid(name, value, base)
        if not isinstance(value, numbers.Integral if base is int else numbers.Real):
            raise invalid(name, value, base)
        if base is float and not math.isfinite(value):
            raise ConfigError(f"{name}={value!r} must be a finite number.")


def check_positive(cfg, *names) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{name}={value!r} must be a positive integer.")


def check_choice(cfg, name: str, choices) -> None:
    value = getattr(cfg, name)
    if value not in choices:
        near = suggest(value, [str(c) for c in choices]) if isinstance(value, str) else ""
        raise ConfigError(f"{name}={value!r} is not one of: {', '.join(map(str, choices))}.{near}")


def _edit_distance(a: str, b: str) -> int:
    """Optimal string alignment distance: insertions, deletions, substitutions and adjacent transpositions."""
    prev2, prev = None, list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[-1]


def suggest(name: str, known, otherwise: str = "") -> str:
    """' Did you mean <closest>?' for a real near-miss (a typo: a few edits for the name's length), else `otherwise`.

    Names that merely share a suffix (eval_strategy vs save_strategy) are not near-misses.
    """
    budget = max(1, len(name) // 5)
    scored = sorted((_edit_distance(name, k), k) for k in set(known))
    if scored and scored[0][0] <= budget:
        return f" Did you mean {scored[0][1]}?"
    return otherwise


def check_padding_multiple(cfg) -> None:
    """pad_to_multiple_of: a positive integer, "auto" or None (a string from YAML or a flag is converted)."""
    check_count_or_auto(cfg, "pad_to_multiple_of")


def check_count_or_auto(cfg, name: str) -> None:
    """A field that takes a positive integer, "auto" or None (a string from YAML or a flag is converted)."""
    value = getattr(cfg, name)
    if isinstance(value, str):
        if value.lower() in ("none", "null"):
            setattr(cfg, name, None)
        elif value.isdigit():
            setattr(cfg, name, int(value))
        elif value != "auto":
            raise ConfigError(f"{name}={value!r} must be a positive integer, \"auto\" or None.")
    if getattr(cfg, name) not in (None, "auto"):
        check_positive(cfg, name)


def check_steps(cfg, name: str) -> None:
    """A step interval: a whole number >= 1, or a ratio of the run's total steps in (0, 1) (TRL's convention)."""
    value = getattr(cfg, name)
    if value is None:
        return
    if value <= 0 or (value >= 1 and float(value) != int(value)):
        raise ConfigError(f"{name}={value!r} must be a whole number of steps >= 1, or a fraction of the run's total "
                          "steps in (0, 1).")


def resolve_steps(value, total_steps: int) -> int:
    """The step interval a `check_steps` value stands for in a run of `total_steps` optimizer steps."""
    if value < 1:
        return max(1, math.ceil(value * total_steps))
    return int(value)
