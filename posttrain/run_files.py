"""Reading a run's own files (metrics.jsonl, completions.jsonl, posttrain_config.yaml, the JSON files beside them)
for `posttrain plot` and `posttrain report`, which must draw what is intact and say what is not: a file damaged by a
full disk, a crash, an editor or another program (invalid UTF-8, a truncated line, a value of the wrong type, a
config that does not parse) is skipped in part or whole, and each skip is noted once in `damage`, a list of short
sentences the caller shows (the plot command on stderr, the report on its page).

A running run's last record, begun but not yet ended with a newline, is not damage: it is skipped silently.

    read_jsonl(path, damage, valid)     the records of a .jsonl file that parse as JSON objects and pass `valid`
    read_yaml_mapping(path, damage)     a YAML file's top-level mapping; None (and a note) when it is not one
    read_json_object(path)              a JSON file's top-level object, or None (optional files: no note)

Imports nothing of posttrain: the report, which a training run writes at its end, needs no trainer package.
"""

import json
import os
from typing import Callable

SHOWN_LINES = 5  # damaged line numbers named in a note; the rest counted


def read_jsonl(path: str, damage: list[str], valid: Callable[[dict], bool] = lambda record: True) -> list[dict]:
    """The records of the .jsonl file at `path`, in order: each line that is UTF-8, parses as a JSON object and
    passes `valid`. The other lines are skipped and noted in `damage` (by line number); an unreadable file is noted
    and gives []."""
    name = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        damage.append(f"{name} could not be read ({err.strerror or err}): left out.")
        return []
    lines = data.split(b"\n")
    records, bad = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record = _json_line(line)
        if record is None and number == len(lines) and line.lstrip().startswith(b"{"):
            continue  # no newline after it: a running run's record still being written
        if record is None or not valid(record):
            bad.append(number)
        else:
            records.append(record)
    if bad:
        damage.append(_skipped_note(name, bad))
    return records


def _json_line(line: bytes) -> dict | None:
    try:
        record = json.loads(line.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError and JSONDecodeError are both ValueErrors
        return None
    return record if isinstance(record, dict) else None


def _skipped_note(name: str, lines: list[int]) -> str:
    shown = ", ".join(str(n) for n in lines[:SHOWN_LINES]) + (", ..." if len(lines) > SHOWN_LINES else "")
    count = "1 line that is" if len(lines) == 1 else f"{len(lines)} lines that are"
    return f"{name}: skipped {count} damaged or not of the form posttrain writes (line {shown})."


def read_yaml_mapping(path: str, damage: list[str]) -> dict | None:
    """The mapping at the top of the YAML file at `path`; None, noted in `damage`, where the file cannot be read,
    is not UTF-8, does not parse, or holds something else."""
    import yaml

    name = os.path.basename(path)
    try:
        with open(path, encoding="utf-8") as f:
            loaded = yaml.safe_load(f)
    except OSError as err:
        damage.append(f"{name} could not be read ({err.strerror or err}): left out.")
        return None
    except (UnicodeDecodeError, yaml.YAMLError) as err:
        reason = "is not UTF-8 text" if isinstance(err, UnicodeDecodeError) else "does not parse as YAML"
        damage.append(f"{name} {reason}: left out.")
        return None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        damage.append(f"{name} holds a {type(loaded).__name__}, not a mapping of fields: left out.")
        return None
    return loaded


def read_json_object(path: str) -> dict | None:
    """The JSON object in the file at `path`; None where there is none (missing, unreadable, damaged, not an
    object)."""
    try:
        with open(path, encoding="utf-8") as f:
            loaded = json.load(f)
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None
