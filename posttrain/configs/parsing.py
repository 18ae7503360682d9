"""Values from YAML files and the command line: typed conversion, unknown names with real near-misses, and
building a config dataclass from a flat dict."""

import json
import os
import typing
from typing import Any, Union

from posttrain.configs.base import ConfigError, base_type, field_types, invalid, suggest, union_args  # noqa: F401

UNKNOWN_HINT = " `posttrain grpo --help-all` and docs/config.md list every field."


def _convert(base, value):
    """`value` as `base` (bool, int, float, dict, list, str); raises ValueError/TypeError when it is not one."""
    if base is bool:
        if isinstance(value, bool):
            return value
        text = str(value).lower()
        if text in ("true", "1", "yes"):
            return True
        if text in ("false", "0", "no"):
            return False
        raise ValueError(value)
    if base is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(value)
        return int(value)
    if base is float:
        if isinstance(value, bool):
            raise ValueError(value)
        return float(value)
    if base is dict:
        if isinstance(value, dict):
            return value
        loaded = json.loads(value)
        if not isinstance(loaded, dict):
            raise ValueError(value)
        return loaded
    if base is list:
        if isinstance(value, str):
            return json.loads(value) if value.startswith("[") else [_json_object(value)]
        return [_json_object(v) for v in value]
    if base is str:
        return value if isinstance(value, str) else str(value)
    return value  # Any and other types: as given


def _json_object(value):
    """A list element from the command line: a JSON object (`--datasets '{"path": ...}'`) becomes a dict."""
    if isinstance(value, str) and value.startswith("{"):
        loaded = json.loads(value)
        if isinstance(loaded, dict):
            return loaded
    return value


def _members(tp) -> list:
    return [typing.get_origin(a) or a for a in union_args(tp)]


def coerce(name: str, tp, value):
    """Convert `value` (from YAML or a CLI string) to the field's type, or raise ConfigError."""
    optional = typing.get_origin(tp) is Union and type(None) in typing.get_args(tp) or tp is Any
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        if value[0].lower() in ("none", "null") and optional:
            value = None  # `--field none` of a list-valued flag arrives as ["none"]
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise ConfigError(f"{name} cannot be None: give a value, or leave it out for the default.")
    members = _members(tp)
    if len(members) > 1:
        if not isinstance(value, str) and any(
                isinstance(value, m) and not (isinstance(value, bool) and m in (int, float))
                for m in members if isinstance(m, type)):
            return value
        # otherwise (a string from the command line): the first member it converts to, str last as the catch-all
        for member in sorted(members, key=lambda m: m is str):
            try:
                return _convert(member, value)
            except (ValueError, TypeError, json.JSONDecodeError):
                continue
        raise invalid(name, value, base_type(tp))
    base = base_type(tp)
    try:
        converted = _convert(base, value)
        element = _list_element(tp)
        return [_convert(element, v) for v in converted] if base is list and element is not None else converted
    except (ValueError, TypeError, json.JSONDecodeError):
        raise invalid(name, value, base) from None


def _list_element(tp):
    """A list field's element type where it is a number or a flag (`list[float]`: `--reward_weights 1.0 0.5` arrives as
    strings), else None."""
    for member in union_args(tp):
        args = typing.get_args(member) if typing.get_origin(member) is list else ()
        if args and args[0] in (int, float, bool):
            return args[0]
    return None


def build(cls, values: dict, extra_known=()):
    """Construct `cls` from a dict of raw values, with typed coercion and a suggestion for unknown keys."""
    types = field_types(cls)
    for key in values:
        if key not in types and key not in extra_known:
            raise ConfigError(f"Unknown config field {key!r}.{suggest(key, list(types) + list(extra_known), UNKNOWN_HINT)}")
    kwargs = {k: coerce(k, types[k], v) for k, v in values.items() if k in types}
    return cls(**kwargs)


def _strict_loader():
    """yaml's SafeLoader refusing a key given twice in one mapping (PyYAML would keep the last one silently)."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f"{key!r} is given twice in {loader.name} (lines {seen[key] + 1} and "
                                  f"{key_node.start_mark.line + 1}): keep one.")
            seen[key] = key_node.start_mark.line
        return yaml.SafeLoader.construct_mapping(loader, node, deep)

    StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return StrictLoader


def yaml_problem(err) -> str:
    """A YAML parse error in words, with where it is: 'is not valid YAML at line 2, column 5 (expected ...)'."""
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"is not valid YAML{where} ({getattr(err, 'problem', None) or str(err).splitlines()[0]})"


def load_yaml(path: str) -> dict:
    import yaml

    if not os.path.exists(path):
        raise ConfigError(f"Config file {path} does not exist: check the path given to --config.")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_strict_loader()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"Config file {path} {yaml_problem(err)}: fix it.") from None
    except UnicodeDecodeError:
        raise ConfigError(f"Config file {path} is not text (not UTF-8): give --config a YAML file.") from None
    except OSError as err:
        raise ConfigError(f"Config file {path} could not be read ({err.strerror or err}): give --config a YAML "
                          "file.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {path} must hold a mapping of field: value, not {type(data).__name__}.")
    return data


def split_values(values: dict, *classes, hint: str = UNKNOWN_HINT) -> list:
    """Distribute a flat dict of field values over dataclasses; unknown keys raise with a suggestion."""
    names = [set(field_types(c)) for c in classes]
    every = set().union(*names)
    for key in values:
        if key not in every:
            raise ConfigError(f"Unknown config field {key!r}.{suggest(key, every, hint)}")
    return [{k: v for k, v in values.items() if k in n} for n in names]


def refuse_repeated_flags(argv: list[str]) -> None:
    """A flag given twice (argparse would keep the last one silently) is refused, --config included."""
    seen = {}
    for token in argv:
        if token.startswith("--") and len(token) > 2:
            name = token[2:].split("=", 1)[0]
            if name in seen:
                raise ConfigError(f"--{name} is given twice on the command line: give it once.")
            seen[name] = True
