"""docs/config.md, generated from the dataclasses and the TRL field table (a test keeps the file current):

    python -m posttrain.configs > docs/config.md
"""

import dataclasses

from posttrain.configs.grpo import GRPOConfig, GRPOObjectiveConfig, SamplingConfig
from posttrain.configs.fields import (CheckpointConfig, DeviceConfig, EvaluationConfig, LoggingConfig, ModelConfig,
                                      TrainingLoopConfig)
from posttrain.configs.script import LoraArguments, ScriptArguments
from posttrain.configs.trl_compat import BY_NAME, SAME, UNSUPPORTED, trl_snapshot

GROUPS = [("Training loop", TrainingLoopConfig), ("Model", ModelConfig), ("Devices and precision", DeviceConfig),
          ("Logging", LoggingConfig), ("Evaluation", EvaluationConfig), ("Checkpoints and the Hub", CheckpointConfig),
          ("Sampling", SamplingConfig), ("GRPO objective", GRPOObjectiveConfig),
          ("Command-line script", ScriptArguments), ("LoRA (command line)", LoraArguments)]

# Defaults of implemented TRL fields that differ from TRL 1.16's, and why.
DEFAULT_DIFFERENCES = {
    "output_dir": "TRL's None becomes `trainer_output` (or `<model>-GRPO` when no args are given); posttrain writes "
                  "`trainer_output` either way",
    "bf16": "TRL 1.16 turns bf16 on everywhere, CPU included; posttrain's None turns it on only on a CUDA device that "
            "supports it (bf16 autocast on CPU is slower and changes the numbers)",
}

IMPLEMENTED = "implemented"


def trl_field_status(name: str) -> tuple[str, str]:
    """(status, note) of TRL field `name` in posttrain: implemented, same behaviour or not supported."""
    if name in BY_NAME:
        c = BY_NAME[name]
        accepted = "" if c.status == SAME and c.accepts == "any value" else f" Accepted: {c.accepted_text()}."
        return c.status, f"{c.why}.{accepted}"
    if name in {f.name for f in dataclasses.fields(GRPOConfig)}:
        return IMPLEMENTED, DEFAULT_DIFFERENCES.get(name, "")
    return "missing", ""


def trl_table() -> list[str]:
    snapshot = trl_snapshot()
    counts = {IMPLEMENTED: 0, SAME: 0, UNSUPPORTED: 0}
    rows = []
    for f in snapshot["fields"]:
        status, note = trl_field_status(f["name"])
        counts[status] = counts.get(status, 0) + 1
        rows.append(f"| `{f['name']}` | `{f['default']}` | {status} | {note} |")
    head = [f"## Every field of TRL {snapshot['trl']}'s GRPOConfig", "",
            f"TRL {snapshot['trl']}'s `GRPOConfig` (with transformers {snapshot['transformers']}'s `TrainingArguments`) "
            f"has {len(rows)} fields: {counts[IMPLEMENTED]} are implemented with TRL's name, default and meaning, "
            f"{counts[SAME]} are accepted because posttrain does what TRL does for the values accepted, and "
            f"{counts[UNSUPPORTED]} are not supported: they accept only the listed values, and any other value stops "
            "with one sentence saying why. No TRL field is an unknown argument. The list is checked against the "
            "installed TRL by tests/test_trl_fields.py (against the committed snapshot "
            "`posttrain/configs/trl_grpo_fields.json` when TRL is not installed).", "",
            "| TRL field | TRL default | posttrain | notes |", "|---|---|---|---|"]
    return head + rows + [""]


def config_reference() -> str:
    """Markdown tables of every field: name, default, meaning, grouped as the dataclasses are."""
    lines = ["# Configuration reference", "",
             "Generated from `posttrain/configs/` by `python -m posttrain.configs > docs/config.md`.",
             "`GRPOConfig` holds every group but the last two (flat, as TRL's). On the command line every field is a "
             "flag (`--name value`) and a YAML key. A step interval (`logging_steps`, `save_steps`, `eval_steps`, "
             "`warmup_steps`) may be a fraction in (0, 1) of the run's total steps. Every number has the range shown, "
             "checked when the config is built: a value outside it stops with one sentence.", ""]
    for title, cls in GROUPS:
        lines += [f"## {title}", "", "| field | default | range | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            bounds = f.metadata.get("range")
            shown = "" if bounds is None else bounds.text() + (f" ({bounds.note})" if bounds.note else "")
            lines.append(f"| `{f.name}` | `{default!r}` | {shown} | {f.metadata.get('help', '')} |")
        lines.append("")
    return "\n".join(lines + trl_table())
