"""docs/config.md, generated from the dataclasses and the TRL field tables (a test keeps the file current):

    python -m posttrain.configs > docs/config.md
"""

import dataclasses

from posttrain.configs.base import field_range
from posttrain.configs.fields import (CheckpointConfig, DeviceConfig, EvaluationConfig, LoggingConfig, ModelConfig,
                                      TrainingLoopConfig)
from posttrain.configs.script import LoraArguments, ScriptArguments
from posttrain.configs.rloo import GRPO_ONLY
from posttrain.configs.trl_compat import SAME, UNSUPPORTED, trl_snapshot
from posttrain.registry import TRAINERS as ENTRIES
from posttrain.registry import load

SHARED_GROUPS = [("Training loop", TrainingLoopConfig), ("Model", ModelConfig),
                 ("Devices and precision", DeviceConfig), ("Logging", LoggingConfig), ("Evaluation", EvaluationConfig),
                 ("Checkpoints and the Hub", CheckpointConfig)]
SCRIPT_GROUPS = [("Command-line script", ScriptArguments), ("LoRA (command line)", LoraArguments)]
GROUPS = (SHARED_GROUPS + [(title, load(path)) for entry in ENTRIES for title, path in entry.groups] + SCRIPT_GROUPS)

# Defaults of implemented TRL fields that differ from TRL 1.16's, and why.
DEFAULT_DIFFERENCES = {
    "output_dir": "TRL's None becomes `trainer_output` (or `<model>-GRPO` / `<model>-RLOO` / `<model>-SFT` / "
                  "`<model>-DPO` / `<model>-Reward` / `<model>-KTO` / `<model>-Distillation` / `<model>-AsyncGRPO` when no args are given); posttrain writes `trainer_output` either way",
    "bf16": "TRL 1.16 turns bf16 on everywhere, CPU included; posttrain's None turns it on only on a CUDA device that "
            "supports it (bf16 autocast on CPU is slower and changes the numbers)",
    "ignore_data_skip": "AsyncGRPOConfig: TRL's True (its live queue cannot be replayed, so a resumed run restarts the "
                        "data); posttrain checkpoints the rollout worker's queue and resumes exactly, so False, as in "
                        "every other config",
}
# What each trainer's config is, and the TRL table it answers for.
TRAINERS = {entry.name: (load(entry.config), load(entry.compat)) for entry in ENTRIES}

IMPLEMENTED = "implemented"


def trl_field_status(name: str, trainer: str = "grpo") -> tuple[str, str]:
    """(status, note) of TRL field `name` in posttrain's config for `trainer`: implemented, same behaviour or not
    supported."""
    config, table = TRAINERS[trainer]
    by_name = {c.name: c for c in table}
    if name in by_name:
        c = by_name[name]
        accepted = "" if c.status == SAME and c.accepts == "any value" else f" Accepted: {c.accepted_text()}."
        return c.status, f"{c.why}.{accepted}"
    if name in {f.name for f in dataclasses.fields(config)}:
        return IMPLEMENTED, DEFAULT_DIFFERENCES.get(name, "")
    return "missing", ""


def trl_table(trainer: str = "grpo") -> list[str]:
    snapshot = trl_snapshot(trainer)
    name = TRAINERS[trainer][0].__name__
    counts = {IMPLEMENTED: 0, SAME: 0, UNSUPPORTED: 0}
    rows = []
    for f in snapshot["fields"]:
        status, note = trl_field_status(f["name"], trainer)
        counts[status] = counts.get(status, 0) + 1
        rows.append(f"| `{f['name']}` | `{f['default']}` | {status} | {note} |")
    head = [f"## Every field of TRL {snapshot['trl']}'s {name}", "",
            f"TRL {snapshot['trl']}'s `{name}` (with transformers {snapshot['transformers']}'s `TrainingArguments`) "
            f"has {len(rows)} fields: {counts[IMPLEMENTED]} are implemented with TRL's name, default and meaning, "
            f"{counts[SAME]} are accepted because posttrain does what TRL does for the values accepted, and "
            f"{counts[UNSUPPORTED]} are not supported: they accept only the listed values, and any other value stops "
            "with one sentence saying why. No TRL field is an unknown argument. The list is checked against the "
            "installed TRL by tests/test_trl_fields.py (against the committed snapshot "
            f"`posttrain/configs/trl_{trainer}_fields.json` when TRL is not installed).", "",
            "| TRL field | TRL default | posttrain | notes |", "|---|---|---|---|"]
    return head + rows + [""]


def _group_table(title: str, cls) -> list[str]:
    lines = [f"## {title}", "", "| field | default | range | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        bounds = field_range(f)
        shown = "" if bounds is None else bounds.text() + (f" ({bounds.note})" if bounds.note else "")
        lines.append(f"| `{f.name}` | `{default!r}` | {shown} | {f.metadata.get('help', '')} |")
    return lines + [""]


def config_reference() -> str:
    """Markdown tables of every field: name, default, meaning, grouped as the dataclasses are."""
    lines = ["# Configuration reference", "",
             "Generated from `posttrain/configs/` by `python -m posttrain.configs > docs/config.md`.",
             "`GRPOConfig` is the shared groups plus the GRPO ones, `SFTConfig` the shared groups plus the SFT ones, "
             "`DPOConfig` the shared groups plus the DPO ones (flat, as TRL's), `RLOOConfig` GRPOConfig's fields with "
             "the RLOO group's (its own defaults for `num_generations` and `beta`; GRPOConfig's objective fields that "
             f"TRL's RLOOConfig lacks, {', '.join(f'`{n}`' for n in GRPO_ONLY[:3])} and the rest, are refused at any "
             "value but their default); the command-line groups are the script's. SFTConfig's `learning_rate` defaults to 2e-5 (TRL's SFT default), GRPOConfig's and "
             "DPOConfig's to 1e-6, RewardConfig's to 1e-4; DPOConfig's and RewardConfig's `disable_dropout` to True (TRL's "
             "defaults). `RewardConfig` is the shared groups plus the Reward ones; `KTOConfig` the shared groups, DPO's "
             "reference group and the KTO ones (learning_rate 1e-6, disable_dropout True, train_sampling_strategy "
             "sequential: TRL's KTO defaults); `DistillationConfig` GRPOConfig's fields with the teacher's and `beta` the "
             "divergence (1.0, reverse KL), one completion per prompt (GRPOConfig's objective fields refused at any "
             "value but their default, as for RLOOConfig); `AsyncGRPOConfig` GRPOConfig's fields with `async_generation` on, "
             "generation through the server at `vllm_server_base_url` and TRL's AsyncGRPOConfig defaults "
             "(learning_rate 1e-6, lr_scheduler_type constant, logging_steps 1, max_completion_length 2048, dtype "
             "float32). On the command line every field is a flag "
             "(`--name value`) and a YAML key. A step interval (`logging_steps`, `save_steps`, `eval_steps`, "
             "`warmup_steps`) may be a fraction in (0, 1) of the run's total steps. Every number has the range shown, "
             "checked when the config is built: a value outside it stops with one sentence.", ""]
    for title, cls in GROUPS:
        lines += _group_table(title, cls)
    return "\n".join(lines + [line for entry in ENTRIES for line in trl_table(entry.name)])
