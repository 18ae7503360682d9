"""What reward functions log (`log_extra`, `log_metric`) and the completions log (`log_completions`).

Reward functions receive `log_extra(column, values)` (one value per completion of this process) and
`log_metric(name, value)` (a scalar), as in TRL. Metrics are averaged over every call on every process and logged
with the step's metrics; extra columns are gathered across processes and join the completions log.

With `log_completions`, every generation round's completions (all processes) are appended to
output_dir/completions.jsonl, one line each: {"step", "prompt", "completion", "rewards": {function: value},
"advantage", ...extra columns}; at each logging step a sample is printed (`num_completions_to_print`: one line per
completion, above the progress line, model text escaped; completions.jsonl keeps it as generated) and the latest
round goes to the trackers in `report_to` as a table named "completions" (TRL's columns: step, prompt, completion,
each reward function, advantage, then the extra columns; with `log_unique_prompts`, each prompt's first row only).
With `log_multimodal` (TRL's, default True) a row's images (its prompt's, then those its tools returned) are saved
as PNG files in output_dir/completions/, the row's "images" holding their paths, and the trackers' table gets TRL's
"image" column (wandb's or trackio's Images; the paths for TensorBoard).
"""

import json
import math
import os
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from posttrain.completion_rows import as_text, extra_columns
from posttrain.training.distributed import guarded
from posttrain.training.logging import QUIET_LEVELS, terminal_text


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


@dataclass(frozen=True)
class LoggedRound:
    """What the completions log takes of a generation batch: this process's prompts and completion texts, every
    process's [N, F] rewards and [N] advantages (None where the round has none), and the extra columns."""

    prompts: list
    texts: list[str]
    rewards: Any = None
    advantages: Any = None
    extra: dict = field(default_factory=dict)
    images: list | None = None  # this process's rows' images (the prompt's, then the tools'), or None


@dataclass(frozen=True)
class ImageFiles:
    """A table cell of image files: a tracker that shows images shows them (ModuleTracker), others their paths."""

    paths: tuple

    def __str__(self) -> str:
        return ", ".join(self.paths)


class CompletionLog:
    """completions.jsonl and the printed sample (main process only)."""

    def __init__(self, args, accelerator, reward_names: list[str]):
        self.path = os.path.join(args.output_dir, "completions.jsonl")
        self.folder = os.path.dirname(self.path) or "."  # output_dir: the images' paths are relative to it
        self.accelerator = accelerator
        self.names = reward_names
        self.to_print = args.num_completions_to_print
        self.enabled = args.log_completions
        self.unique_prompts = args.log_unique_prompts
        self.multimodal = getattr(args, "log_multimodal", True)
        self.quiet = args.log_level in QUIET_LEVELS
        self.last: list[dict] = []

    def add_round(self, step: int, logged: "LoggedRound") -> None:
        """A generation batch's completions (its `logged()`), with log_completions."""
        if self.enabled:
            self.add(step, logged.prompts, logged.texts, logged.rewards, logged.advantages, logged.extra,
                     logged.images if self.multimodal else None)

    def add(self, step: int, prompts: list, texts: list[str], rewards, advantages, extra: dict,
            images: list | None = None) -> None:
        """Append a generation round: this process's prompts and texts, the gathered [N, F] rewards and [N]
        advantages (None for a round with neither: distillation's), extra columns, and this process's rows' images
        (None: none logged)."""
        from accelerate.utils import gather_object

        prompts, texts = gather_object(prompts), gather_object(texts)
        # every process joins the gather (a collective) when any has images
        has_images = gather_object([images is not None and any(images)])
        images = gather_object(images if images is not None else [[]] * len(texts)) if any(has_images) else None
        with guarded(self.accelerator, writing=self.path):  # the main process writes; every process learns
            if self.accelerator.is_main_process:
                self._write(step, prompts, texts, rewards, advantages, extra, images)

    def _write(self, step: int, prompts: list, texts: list[str], rewards, advantages, extra: dict,
               images: list | None = None) -> None:
        rows = []
        for i, (prompt, text) in enumerate(zip(prompts, texts)):
            row = {"step": step, "prompt": prompt, "completion": text, "rewards": {} if rewards is None else
                   {n: None if math.isnan(v) else v for n, v in zip(self.names, rewards[i].tolist())}}
            if advantages is not None:
                row["advantage"] = float(advantages[i])
            if images is not None:
                row["images"] = self._saved(step, i, images[i])
            row.update({column: values[i] if i < len(values) else None for column, values in extra.items()})
            rows.append(row)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a") as f:
            f.writelines(json.dumps(row, default=str) + "\n" for row in rows)
        self.last = rows

    def _saved(self, step: int, row: int, images: list) -> list[str]:
        """Row `row`'s images written as PNG files in output_dir/completions/; their paths, relative to output_dir."""
        os.makedirs(os.path.join(self.folder, "completions"), exist_ok=True)
        paths = []
        for k, image in enumerate(images or []):
            name = os.path.join("completions", f"step{step:06d}-row{row:04d}-{k}.png")
            image.save(os.path.join(self.folder, name))
            paths.append(name)
        return paths

    def table(self) -> tuple[list[str], list[list]]:
        """The latest round as a table: its columns and one list per row (conversational prompts as role: content
        lines); with log_unique_prompts each prompt's first row only; rows with images get TRL's "image" column."""
        extra = extra_columns(self.last[0]) if self.last else []
        advantage = ["advantage"] if self.last and "advantage" in self.last[0] else []
        image = ["image"] if self.last and "images" in self.last[0] else []
        columns = ["step", "prompt", "completion", *self.names, *advantage, *extra, *image]
        rows, seen = [], set()
        for row in self.last:
            prompt = as_text(row["prompt"])
            if self.unique_prompts and prompt in seen:
                continue
            seen.add(prompt)
            rows.append([row["step"], prompt, as_text(row["completion"]), *row["rewards"].values(),
                         *(row[c] for c in advantage), *(row[c] for c in extra),
                         *([ImageFiles(tuple(os.path.join(self.folder, p) for p in row["images"]))] if image else [])])
        return columns, rows

    def to_trackers(self, metrics_logger, step: int) -> None:
        """The latest round's table to the trackers (main process; nothing without log_completions)."""
        if self.enabled and self.last and self.accelerator.is_main_process:
            metrics_logger.log_table("completions", *self.table(), step)

    def show(self, step: int, metrics_logger=None) -> None:
        """Print the latest round's completions as a table, one line each, above the progress line of `metrics_logger`
        (the trainer's, during train()): num_completions_to_print of them, as in TRL (None: all; 0: none; else a
        random sample, drawn by a generator of its own seeded with the step). Nothing with log_level error or
        critical."""
        if not (self.enabled and self.last and self.accelerator.is_main_process) or self.quiet:
            return
        rows = self.last
        if self.to_print is not None and self.to_print < len(rows):
            rows = [rows[i] for i in sorted(random.Random(step).sample(range(len(rows)), self.to_print))]
        if not rows:
            return
        if metrics_logger is None:  # trainer.log called outside train()
            from rich.console import Console

            Console(stderr=True).print(completions_table(step, rows, self.names, self.path))
        else:
            room = metrics_logger.room_above()
            metrics_logger.print_above(completions_table(step, rows, self.names, self.path, room))


def completions_table(step: int, rows: list[dict], names: list[str], path: str, room: int | None = None):
    """completions.jsonl rows as a rich Table of one line per row, TRL's columns (prompt, completion, each reward,
    advantage, the log_extra columns; numbers to 2 decimals): long text cut with an ellipsis to the terminal's width,
    line breaks shown as ↵, control characters escaped and rich markup printed as written (terminal_text). Within
    `room` lines: the rows that fit, and a line saying how many more are in `path`."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    extra = extra_columns(rows[0])
    shown = rows if room is None or len(rows) + 3 <= room else rows[:max(1, room - 4)]
    table = Table(title=f"Completions at step {step}", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                  expand=True)
    table.add_column("prompt", ratio=1, no_wrap=True, overflow="ellipsis", style="bright_yellow")
    table.add_column("completion", ratio=2, no_wrap=True, overflow="ellipsis", style="bright_green")
    advantage = ["advantage"] if "advantage" in rows[0] else []
    for name in [*names, *advantage]:
        table.add_column(name, justify="right", no_wrap=True, style="bold cyan")
    for column in extra:
        table.add_column(column, ratio=1, no_wrap=True, overflow="ellipsis")
    for row in shown:
        numbers = [*row["rewards"].values(), *(row[c] for c in advantage)]
        table.add_row(Text(_one_line(as_text(row["prompt"]))), Text(_one_line(as_text(row["completion"]))),
                      *("-" if v is None else f"{v:.2f}" for v in numbers),
                      *(Text(_one_line(as_text(row[c]) if row[c] is not None else "-")) for c in extra))
    if len(shown) < len(rows):
        table.caption = Text(f"{len(rows) - len(shown)} more of this step in {path}", no_wrap=True,
                             overflow="ellipsis")
        table.caption_justify = "left"
    return table


def _one_line(text: str) -> str:
    """Model text for a table cell: control characters escaped, line breaks as ↵, tabs as a space."""
    return terminal_text(text.replace("\r\n", "\n")).replace("\n", "↵").replace("\t", " ")
