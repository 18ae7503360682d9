"""The rows of completions.jsonl, as their writer (grpo/completions.py, with log_completions) and their reader (the
run report, report.py) both see them: which keys are log_extra columns, and a prompt or completion as text. Imports
nothing of posttrain, so the report (which the training loop writes at the end of a run) needs no trainer package."""

import json

# every row's own keys (`images`: the files of its images, with log_multimodal); the rest: log_extra columns
FIXED_KEYS = ("step", "prompt", "completion", "rewards", "advantage", "images")


def extra_columns(row: dict) -> list[str]:
    """A completions.jsonl row's log_extra columns: every key but the fixed ones."""
    return [key for key in row if key not in FIXED_KEYS]


def as_text(value) -> str:
    """A prompt or completion as text: a conversation as one `role: content` line per message."""
    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in value)
    return value if isinstance(value, str) else json.dumps(value, default=str)
