"""Metrics: averaged over each logging window, written as JSON lines, shown on a progress bar.

Only the main process writes. `metrics.jsonl` in the output directory gets one line per logging step;
trackers named in `report_to` (wandb, trackio) get the same numbers.
"""

import json
import math
import os
import sys

from posttrain._optional import require


class MetricsLogger:
    """Collects per-step metrics and emits their mean every `logging_steps` steps.

    Args:
        output_dir: where metrics.jsonl goes.
        total_steps: for the progress bar.
        logging_steps: window length.
        report_to: tracker names.
        enabled: False on non-main processes.
        run_config: the config dict sent to trackers.
    """

    SHOWN = ("reward", "loss", "kl")

    def __init__(self, output_dir: str, total_steps: int, logging_steps: int, report_to=(), enabled: bool = True,
                 run_config: dict | None = None, append: bool = False, start_step: int = 0):
        self.enabled = enabled
        self.logging_steps = logging_steps
        self.total_steps = total_steps
        self.window: dict[str, list[float]] = {}
        self.history: list[dict] = []
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.trackers = []
        self.progress = None
        # Without a terminal, a plain line per logging step, at most about 50 lines in a run.
        self.print_every = max(logging_steps, -(-total_steps // 50))
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        if append:  # resuming: keep the lines up to the checkpoint, drop any written after it
            self._truncate_after(start_step)
        else:
            open(self.path, "w").close()
        for name in report_to:
            module = require(name, f"report_to={name}")
            module.init(project=os.environ.get("WANDB_PROJECT", "posttrain"), config=run_config)
            self.trackers.append(module)
        if sys.stderr.isatty():
            self._start_progress()
            self.progress.update(self.task, completed=start_step)

    def _start_progress(self):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn("[bold]GRPO"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                 TextColumn("{task.description}"), transient=False)
        self.progress.start()
        self.task = self.progress.add_task("", total=self.total_steps)

    def _truncate_after(self, step: int) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            kept = [line for line in f if json.loads(line).get("step", 0) <= step]
        with open(self.path, "w") as f:
            f.writelines(kept)

    def add(self, metrics: dict) -> None:
        for key, value in metrics.items():
            if value is not None and not (isinstance(value, float) and math.isnan(value)):
                self.window.setdefault(key, []).append(float(value))

    def step_done(self, step: int, epoch: float) -> dict | None:
        """Advance the bar; every `logging_steps` (and at the last step) write the window's means."""
        if self.progress is not None:
            self.progress.advance(self.task)
        if step % self.logging_steps and step != self.total_steps:
            return None
        record = {"step": step, "epoch": round(epoch, 4)}
        record.update({k: sum(v) / len(v) for k, v in sorted(self.window.items())})
        self.window = {}
        self.history.append(record)
        if self.enabled:
            self.write(record)
            for tracker in self.trackers:
                tracker.log(record, step=step)
            self._show(record)
        return record

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def _show(self, record: dict):
        text = "  ".join(f"{k}={record[k]:.4g}" for k in self.SHOWN if k in record)
        if self.progress is not None:
            self.progress.update(self.task, description=text)
        elif record["step"] % self.print_every == 0 or record["step"] == self.total_steps:
            print(f"step {record['step']}/{self.total_steps}  {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
