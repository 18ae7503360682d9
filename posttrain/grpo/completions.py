"""What reward functions log (`log_extra`, `log_metric`) and the completions log (`log_completions`).

Reward functions receive `log_extra(column, values)` (one value per completion of this process) and
`log_metric(name, value)` (a scalar), as in TRL. Metrics are averaged over every call on every process and logged
with the step's metrics; extra columns are gathered across processes and join the completions log.

With `log_completions`, every generation round's completions (all processes) are appended to
output_dir/completions.jsonl, one line each: {"step", "prompt", "completion", "rewards": {function: value},
"advantage", ...extra columns}; at each logging step a sample is printed (`num_completions_to_print`) and the latest
round goes to the trackers in `report_to` as a table named "completions" (TRL's columns: step, prompt, completion,
each reward function, advantage, then the extra columns; with `log_unique_prompts`, each prompt's first row only).
"""

import json
import math
import os
from collections import defaultdict

from posttrain.completion_rows import as_text, extra_columns
from posttrain.training.distributed import guarded


class RewardLogs:
    """Collects one generation round's log_extra / log_metric calls on this process."""

    def __init__(self):
        self.extra: dict[str, list] = {}
        self.metrics: dict[str, list[float]] = defaultdict(list)

    def loggers(self) -> dict:
        """The keyword arguments reward functions receive."""
        return {"log_extra": self._log_extra, "log_metric": self._log_metric}

    def _log_extra(self, column: str, values) -> None:
        self.extra.setdefault(column, []).extend(list(values))

    def _log_metric(self, name: str, value) -> None:
        self.metrics[name].append(float(value))

    def reduced_metrics(self, accelerator) -> dict:
        """Each logged metric's mean over all calls on all processes (names from every process)."""
        import torch
        from accelerate.utils import gather_object

        names = sorted(set(gather_object(list(self.metrics))))
        out = {}
        for name in names:
            values = self.metrics.get(name, [])
            local = torch.tensor([sum(values), len(values)], dtype=torch.float32, device=accelerator.device)
            total, count = accelerator.gather(local).view(-1, 2).sum(0).tolist()
            out[name] = total / count if count else math.nan
        return out

    def gathered_extra(self, accelerator, n_local: int) -> dict:
        """Each extra column over all processes' completions (None where a process logged nothing for it)."""
        from accelerate.utils import gather_object

        columns = sorted(set(gather_object(list(self.extra))))
        return {c: gather_object(self.extra.get(c, [None] * n_local)) for c in columns}


class CompletionLog:
    """completions.jsonl and the printed sample (main process only)."""

    def __init__(self, args, accelerator, reward_names: list[str]):
        self.path = os.path.join(args.output_dir, "completions.jsonl")
        self.accelerator = accelerator
        self.names = reward_names
        self.to_print = args.num_completions_to_print
        self.enabled = args.log_completions
        self.unique_prompts = args.log_unique_prompts
        self.last: list[dict] = []

    def add(self, step: int, prompts: list, texts: list[str], rewards, advantages, extra: dict) -> None:
        """Append a generation round: this process's prompts and texts, the gathered [N, F] rewards, [N] advantages
        and extra columns."""
        from accelerate.utils import gather_object

        prompts, texts = gather_object(prompts), gather_object(texts)
        with guarded(self.accelerator, writing=self.path):  # the main process writes; every process learns
            if self.accelerator.is_main_process:
                self._write(step, prompts, texts, rewards, advantages, extra)

    def _write(self, step: int, prompts: list, texts: list[str], rewards, advantages, extra: dict) -> None:
        rows = []
        for i, (prompt, text) in enumerate(zip(prompts, texts)):
            row = {"step": step, "prompt": prompt, "completion": text,
                   "rewards": {n: None if math.isnan(v) else v for n, v in zip(self.names, rewards[i].tolist())},
                   "advantage": float(advantages[i])}
            row.update({column: values[i] if i < len(values) else None for column, values in extra.items()})
            rows.append(row)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a") as f:
            f.writelines(json.dumps(row, default=str) + "\n" for row in rows)
        self.last = rows

    def table(self) -> tuple[list[str], list[list]]:
        """The latest round as a table: its columns and one list per row (conversational prompts as role: content
        lines); with log_unique_prompts each prompt's first row only."""
        extra = extra_columns(self.last[0]) if self.last else []
        columns = ["step", "prompt", "completion", *self.names, "advantage", *extra]
        rows, seen = [], set()
        for row in self.last:
            prompt = as_text(row["prompt"])
            if self.unique_prompts and prompt in seen:
                continue
            seen.add(prompt)
            rows.append([row["step"], prompt, as_text(row["completion"]), *row["rewards"].values(), row["advantage"],
                         *(row[c] for c in extra)])
        return columns, rows

    def to_trackers(self, metrics_logger, step: int) -> None:
        """The latest round's table to the trackers (main process; nothing without log_completions)."""
        if self.enabled and self.last and self.accelerator.is_main_process:
            metrics_logger.log_table("completions", *self.table(), step)

    def show(self, step: int) -> None:
        """Print the latest round's completions (the first num_completions_to_print of them) as a table."""
        if not (self.enabled and self.last and self.accelerator.is_main_process):
            return
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"Completions at step {step}", show_lines=True)
        for column in ("prompt", "completion", *self.names, "advantage"):
            table.add_column(column)
        rows = self.last if self.to_print is None else self.last[:self.to_print]
        for row in rows:
            rewards = [f"{v:.3g}" if v is not None else "-" for v in row["rewards"].values()]
            table.add_row(str(row["prompt"]), row["completion"], *rewards, f"{row['advantage']:.3g}")
        Console(stderr=True).print(table)
