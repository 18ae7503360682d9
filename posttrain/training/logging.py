"""Metrics: averaged over each logging window, written as JSON lines, sent to trackers, shown on a progress bar.

Only the main process writes. `metrics.jsonl` in the output directory gets one line per record (a training window,
an evaluation, the end-of-training summary); trackers named in `report_to` (wandb, trackio, tensorboard) get the same
numbers, and tables (GRPO's completions with log_completions: a wandb or trackio Table, a Markdown table in
TensorBoard's text tab).

The terminal shows each trainer's metrics to watch (`shown`; its first, the headline, with its moving average
beside the window's value: GRPO's reward, SFT's and DPO's loss), the elapsed time and an ETA from this run's own
pace (steps done since it started, not a short recent window): on a progress bar on a terminal, else one line per
logging step (about 50 in a run). With log_level error or critical, nothing per step. The bar is one line at any
width: what does not fit is left out (ProgressLine), and tables (GRPO's completions) are printed above it.
Model text reaches the terminal through `terminal_text`, its control characters escaped; files keep it as it is.
"""

import datetime
import importlib.util
import json
import logging
import math
import os
import socket
import sys
import time
import unicodedata

from posttrain._optional import require
from posttrain.errors import storage_error

KNOWN_TRACKERS = ("wandb", "trackio", "tensorboard")
QUIET_LEVELS = ("error", "critical")  # log levels at which nothing is printed per step


def terminal_text(text: str) -> str:
    """`text` safe to print on a terminal: its control characters (Unicode category Cc: ESC, carriage return, the C1
    controls, ...) but newline and tab written as escapes (\\x1b), so that model output cannot move the cursor, clear
    the screen or restyle the terminal. Rich markup is left to the caller: print the result as a rich Text."""
    if text.isprintable():
        return text
    return "".join(f"\\x{ord(ch):02x}" if unicodedata.category(ch) == "Cc" and ch not in "\n\t" else ch
                   for ch in text)


def hide_deepspeed_cpu_notice() -> None:
    """accelerate imports DeepSpeed whenever it is installed (unwrap_model checks for its engine), and DeepSpeed's
    import warns "Setting accelerator to CPU" on any machine without a GPU, in runs that do not use it: that one
    line is dropped (a filter on DeepSpeed's logger, which its own setup keeps); its other messages pass."""
    ds_logger = logging.getLogger("DeepSpeed")
    if _drop_cpu_notice not in ds_logger.filters:
        ds_logger.addFilter(_drop_cpu_notice)


def _drop_cpu_notice(record) -> bool:
    return not str(record.msg).startswith("Setting accelerator to CPU")


class ModuleTracker:
    """wandb or trackio: a module with init / log / finish."""

    def __init__(self, name: str, args, run_config: dict):
        self.module = require(name, f"report_to={name}")
        kwargs = dict(project=os.environ.get("WANDB_PROJECT", args.project) if name == "wandb" else args.project,
                      name=args.run_name or os.path.basename(os.path.normpath(args.output_dir)), config=run_config)
        if name == "trackio" and args.trackio_space_id:
            kwargs["space_id"] = args.trackio_space_id
        self.module.init(**kwargs)

    def log(self, record: dict, step: int) -> None:
        self.module.log(record, step=step)

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        """A table; a cell of image files (anything with `paths`) as a list of the tracker's Images."""
        def shown(value):
            paths = getattr(value, "paths", None)
            return value if paths is None else [self.module.Image(path) for path in paths]

        data = [[shown(value) for value in row] for row in rows]
        self.module.log({name: self.module.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self.module.finish()


def tensorboard_dir(args) -> str:
    """args.logging_dir, else $TENSORBOARD_LOGGING_DIR, else output_dir/runs/<date>_<host> (transformers' default)."""
    chosen = args.logging_dir or os.environ.get("TENSORBOARD_LOGGING_DIR")
    if chosen:
        return os.path.expanduser(chosen)
    stamp = datetime.datetime.now().strftime("%b%d_%H-%M-%S")
    return os.path.join(args.output_dir, "runs", f"{stamp}_{socket.gethostname()}")


class TensorBoardTracker:
    """Scalars (and the config as text) through torch's SummaryWriter; needs the tensorboard package."""

    def __init__(self, args, run_config: dict):
        require("tensorboard", "report_to=tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = tensorboard_dir(args)
        self.writer = SummaryWriter(log_dir=self.log_dir)
        self.writer.add_text("args", json.dumps(run_config, indent=2, default=str))

    def log(self, record: dict, step: int) -> None:
        for key, value in record.items():
            if key == "step" or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)
            elif isinstance(value, str):
                self.writer.add_text(key, value, step)
        self.writer.flush()

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        self.writer.add_text(name, markdown_table(columns, rows), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def markdown_table(columns: list[str], rows: list[list]) -> str:
    """A Markdown table (TensorBoard's text tab renders one); `|` and line breaks inside a cell escaped."""
    def cell(value) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else "" if value is None else str(value)
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", "<br>")

    lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


class ProgressLine:
    """The progress line, as rich draws it at each refresh: title, bar, steps done, time, the shown metrics. It never
    wraps: at the terminal's width what does not fit is left out, in this order: the metrics after the headline
    (from the last), the elapsed time, the bar, the headline's moving average, the title; the steps, the time left
    and the headline's value stay (cut with an ellipsis only on a terminal too narrow even for them)."""

    BAR_WIDTHS = (10, 40)  # the bar's narrowest and widest

    def __init__(self, metrics_logger):
        self.logger = metrics_logger

    def __rich_console__(self, console, options):
        yield self.render(options.max_width)

    def render(self, width: int):
        """The line at `width` columns: a rich Text, one line."""
        from rich.text import Text

        log = self.logger
        counts = f"{log.step:>{len(str(log.total_steps))}}/{log.total_steps}"
        timing = log.timing()
        time_left = timing.split(", ")[-1]  # "0:01 left", or once done "8:25 elapsed"
        headline, rest = log.parts[:1], log.parts[1:]
        bare = [part.split(" (avg ")[0] for part in headline]
        layouts = [(log.title, True, timing, headline + rest[:n]) for n in range(len(rest), -1, -1)]
        layouts += [(log.title, True, time_left, headline), (log.title, False, time_left, headline),
                    (log.title, False, time_left, bare), ("", False, time_left, bare)]
        for title, with_bar, clock, parts in layouts:
            words = [w for w in (title, counts, clock, "  ".join(parts)) if w]
            length = sum(len(w) for w in words) + len(words) - 1
            if length + (self.BAR_WIDTHS[0] + 1 if with_bar else 0) <= width:
                break
        bar = self._bar(min(self.BAR_WIDTHS[1], width - length - 1)) if with_bar else None
        pieces = [(title, "bold"), bar, (counts, "progress.download"), (clock, "progress.remaining"),
                  "  ".join(parts)]
        line = Text(no_wrap=True, overflow="ellipsis")
        for piece in pieces:
            text, style = piece if isinstance(piece, tuple) else (piece, None)
            if text:
                line.append(" " if line else "")
                line.append(text, style=style)
        line.truncate(width, overflow="ellipsis")
        return line

    def _bar(self, width: int):
        from rich.text import Text

        log = self.logger
        if log.step >= log.total_steps:
            return Text("━" * width, style="bar.finished")
        done = width * log.step // max(log.total_steps, 1)
        return Text.assemble(("━" * done, "bar.complete"), ("━" * (width - done), "bar.back"))


def make_trackers(args, run_config: dict) -> list:
    names = list(args.report_to)
    if names == ["all"]:
        names = [n for n in KNOWN_TRACKERS if importlib.util.find_spec(n) is not None]
    return [TensorBoardTracker(args, run_config) if n == "tensorboard" else ModuleTracker(n, args, run_config)
            for n in names]


class MetricsLogger:
    """Collects per-step metrics; `flush` emits their means as one record.

    Args:
        args: the trainer config (output_dir, report_to, run_name, project, disable_tqdm, ...).
        cumulative: metric names that are running totals: a window reports the last value instead of the mean.
        total_steps: for the progress bar.
        enabled: False on non-main processes.
        run_config: the config dict sent to trackers.
        append: resuming: keep metrics.jsonl up to `start_step` instead of starting it afresh.
        console: a rich Console to draw the progress line on (default: stderr, when it is a terminal).
    """

    LABELS = {"completions/mean_length": "length", "mean_token_accuracy": "accuracy",
              "rewards/accuracies": "accuracy", "rewards/margins": "margin"}
    AVERAGING = 0.9  # the headline's moving average: weight on the past (debiased, as the plots' smoothing)

    def __init__(self, args, total_steps: int, *, enabled: bool = True, run_config: dict | None = None,
                 append: bool = False, start_step: int = 0, title: str = "GRPO", cumulative: tuple = (),
                 shown: tuple = ("loss",), console=None):
        self.enabled = enabled
        self.shown = shown
        self.average, self.averaged = 0.0, 0  # the headline's moving average, and how many values it holds
        self.start_time, self.start_step, self.step = time.time(), start_step, start_step
        self.quiet = getattr(args, "log_level", "passive") in QUIET_LEVELS
        self.cumulative = set(cumulative)  # running totals (e.g. num_tokens seen): a window reports its last value
        self.total_steps = total_steps
        self.window: dict[str, list[float]] = {}
        self.last_window: dict = {}  # the last logged window's means (the end-of-training summary carries them)
        self.path = os.path.join(args.output_dir, "metrics.jsonl")
        self.trackers = []
        self.title = title
        self.parts: list[str] = []  # the shown metrics of the latest record, as the progress line shows them
        self.live = None  # the progress line (rich's Live) on a terminal
        # Without a terminal, a plain line per logging step, at most about 50 lines in a run.
        self.print_every = max(1, -(-total_steps // 50))
        if not enabled:
            return
        os.makedirs(args.output_dir, exist_ok=True)
        if append:  # resuming: keep the lines up to the checkpoint, drop any written after it
            self._truncate_after(start_step)
        else:
            open(self.path, "w").close()
        self.trackers = make_trackers(args, run_config or {})
        show_bar = sys.stderr.isatty() if args.disable_tqdm is None else not args.disable_tqdm
        if (show_bar or console is not None) and not self.quiet:
            self._start_live(console)

    def _start_live(self, console=None) -> None:
        """The progress line on stderr (as transformers' and TRL's bars), redrawn four times a second; what is printed
        meanwhile (print_above, logging, and print() when stdout is the terminal too) goes above it."""
        from rich.console import Console
        from rich.live import Live

        self.live = Live(ProgressLine(self), console=console or Console(stderr=True), refresh_per_second=4,
                         transient=False, redirect_stdout=sys.stdout.isatty())
        self.live.start()

    def _truncate_after(self, step: int) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            kept = [line for line in f if json.loads(line).get("step", 0) <= step]
        with open(self.path, "w") as f:
            f.writelines(kept)

    def add(self, metrics: dict) -> None:
        """One optimizer step's metrics; None and NaN are left out of the window's means."""
        for key, value in metrics.items():
            if value is not None and not (isinstance(value, float) and math.isnan(value)):
                self.window.setdefault(key, []).append(float(value))

    def advance(self) -> None:
        self.step += 1

    def timing(self) -> str:
        """Elapsed time, and the time left at this run's average pace so far."""
        elapsed = time.time() - self.start_time
        done, left = self.step - self.start_step, self.total_steps - self.step
        eta = _clock(elapsed / done * left) if done > 0 else "?"
        return f"{_clock(elapsed)} elapsed, {eta} left" if left > 0 else f"{_clock(elapsed)} elapsed"

    def flush(self) -> dict:
        """The window's means (a new window starts); the last non-empty one stays readable as `last_window`."""
        record = {k: v[-1] if k in self.cumulative else sum(v) / len(v) for k, v in sorted(self.window.items())}
        self.window = {}
        if record:
            self.last_window = record
        return record

    def emit(self, record: dict, to_file: bool = True) -> None:
        """Send a complete record (with step and epoch) to metrics.jsonl (unless to_file is False) and the trackers,
        and show it."""
        if not self.enabled:
            return
        if to_file:
            self.write(record)
        for tracker in self.trackers:
            tracker.log(record, step=record["step"])
        self._show(record)

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        """A table (one list per row, in `columns` order) to every tracker, at `step`."""
        if self.enabled:
            for tracker in self.trackers:
                tracker.log_table(name, columns, rows, step)

    def write(self, record: dict) -> None:
        if self.enabled:
            try:
                with open(self.path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as err:
                raise storage_error(err, "write", self.path) from err

    def print_above(self, renderable) -> None:
        """Print `renderable` (a rich Table, a Text) above the progress line, which stays at the bottom; without a
        progress line, on stderr. Nothing with log_level error or critical."""
        if self.quiet:
            return
        if self.live is not None:
            self.live.console.print(renderable)
        else:
            from rich.console import Console

            Console(stderr=True).print(renderable)

    def room_above(self) -> int | None:
        """How many lines a table printed above the progress line may take and leave the line and the table's
        start on one screen; None without a progress line (nothing to keep in view)."""
        return None if self.live is None else max(4, self.live.console.height - 2)

    def _show(self, record: dict):
        parts = self._shown_parts(record)
        if not parts or self.quiet:
            return
        self.parts = parts
        if self.live is None and (record["step"] % self.print_every == 0 or record["step"] == self.total_steps):
            print(f"step {record['step']}/{self.total_steps}  {'  '.join(parts)}  {self.timing()}", file=sys.stderr,
                  flush=True)

    def describe(self, record: dict) -> str:
        """The shown metrics of a training record; the headline with its moving average over the records so far."""
        return "  ".join(self._shown_parts(record))

    def _shown_parts(self, record: dict) -> list[str]:
        parts = []
        for i, key in enumerate(self.shown):
            value = record.get(key)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            part = f"{self.LABELS.get(key, key)}={value:.4g}"
            if i == 0 and math.isfinite(value):
                self.averaged += 1
                self.average = self.AVERAGING * self.average + (1 - self.AVERAGING) * value
                part += f" (avg {self.average / (1 - self.AVERAGING ** self.averaged):.4g})"
            parts.append(part)
        return parts

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


def _clock(seconds: float) -> str:
    """h:mm:ss, or m:ss under an hour."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"
