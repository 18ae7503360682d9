"""What the report reads of a run's output directory besides metrics.jsonl: its config, final summary, trainer,
model, checkpoints and files. Each reader returns None (or nothing) for what the run has not written."""

import glob
import json
import math
import os
import re

from posttrain.registry import IDENTIFYING_FIELDS, IDENTIFYING_METRICS
from posttrain.run_files import read_json_object, read_yaml_mapping

SUMMARY_FILES = ("all_results.json", "train_results.json")  # the end-of-training summary (all: with evaluation's)
CONFIG_FILE = "posttrain_config.yaml"
WEIGHT_FILES = ("model.safetensors", "model-*-of-*.safetensors", "adapter_model.safetensors", "pytorch_model*.bin",
                "adapter_model.bin")
CHECKPOINT = re.compile(r"checkpoint-(\d+)$")


def checkpoint_dirs(output_dir: str) -> list[str]:
    """output_dir's checkpoint-N folders, by step."""
    found = [(int(m.group(1)), os.path.join(output_dir, name)) for name in os.listdir(output_dir)
             if (m := CHECKPOINT.match(name)) and os.path.isdir(os.path.join(output_dir, name))]
    return [path for _, path in sorted(found)]


def config_path(output_dir: str) -> str | None:
    """posttrain_config.yaml of the saved model, else of the latest checkpoint (a run that has not finished)."""
    for folder in [output_dir, *reversed(checkpoint_dirs(output_dir))]:
        path = os.path.join(folder, CONFIG_FILE)
        if os.path.isfile(path):
            return path
    return None


def read_config(output_dir: str, damage: list[str]) -> dict | None:
    """The run's config (config_path); None where there is none yet, or it is damaged (then noted in `damage`)."""
    path = config_path(output_dir)
    return None if path is None else read_yaml_mapping(path, damage)


def final_summary(output_dir: str) -> tuple[str | None, dict]:
    """(file name, values) of the end-of-training summary; (None, {}) before the run has finished."""
    for name in SUMMARY_FILES:
        values = read_json_object(os.path.join(output_dir, name))
        if isinstance(values, dict):
            return name, values
    return None, {}


def trainer_of(config: dict | None, metric_names: set[str]) -> str | None:
    """The title of the trainer that wrote the run (posttrain/registry.py's): from the config's own fields, else from
    the metrics logged; None where neither says."""
    for trainer, field in IDENTIFYING_FIELDS:
        if config and field in config:
            return trainer
    for trainer, metric in IDENTIFYING_METRICS:
        if metric in metric_names:
            return trainer
    return None


def weight_files(folder: str) -> list[str]:
    """The model's (or adapter's) weight files in `folder`."""
    names = []
    for pattern in WEIGHT_FILES:
        names += sorted(os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(folder), pattern)))
    return [os.path.join(folder, n) for n in dict.fromkeys(names)]


def _safetensors_elements(path: str) -> int | None:
    """The number of values in a .safetensors file, from its header alone; None where the header is damaged."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size < 100_000_000:
                return None
            header = json.loads(f.read(size))
    except (OSError, ValueError):
        return None
    if not isinstance(header, dict):
        return None
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            return None
        total += math.prod(shape)
    return total


def parameter_count(files: list[str]) -> int | None:
    counts = [_safetensors_elements(p) for p in files if p.endswith(".safetensors")]
    return sum(counts) if counts and None not in counts else None


def describe_model(output_dir: str) -> str | None:
    """The model trained: where it was loaded from (the latest checkpoint records it; a LoRA adapter its base), its
    architecture (config.json) and its parameter count (the weight files' headers)."""
    checkpoints = checkpoint_dirs(output_dir)
    state = read_json_object(os.path.join(checkpoints[-1], "trainer_state.json")) if checkpoints else None
    adapter = read_json_object(os.path.join(output_dir, "adapter_config.json"))
    source = (state or {}).get("model_path") or (adapter or {}).get("base_model_name_or_path")
    architectures = (read_json_object(os.path.join(output_dir, "config.json")) or {}).get("architectures")
    architectures = architectures if isinstance(architectures, list) else []
    files = weight_files(output_dir)
    count = parameter_count(files)
    details = [str(a) for a in architectures[:1]]
    if count is not None:
        kind = "adapter parameters" if any("adapter_model" in p for p in files) else "parameters"
        details.append(f"{short_count(count)} {kind}")
    if adapter is not None:
        details.append("LoRA adapter")
    text = ", ".join(details)
    if source:
        return f"{source} ({text})" if text else str(source)
    return text or None


def short_count(count: int) -> str:
    """1234567 -> 1.23M."""
    for size, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= size:
            return f"{count / size:.3g}{suffix}"
    return str(count)
