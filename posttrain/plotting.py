"""Curves of a run from its metrics.jsonl alone: `posttrain plot OUTPUT_DIR [OUTPUT_DIR ...] [--out FILE]`.

Each panel holds one kind of metric (reward, KL, entropy, lengths, clip ratios, grad norm, learning rate, step time,
and SFT's and DPO's own); several runs are overlaid, one colour per run, with a legend. A series with more than
`SMOOTH_FROM` points is drawn faint as logged, with its smoothed line over it (an exponential moving average,
debiased at the start, as TensorBoard's). Panels without data in any run are left out, so the same call plots GRPO,
SFT and DPO runs. A metric that holds one value over every logged step (a constant learning rate, a loss of exactly
0) gets no line and, alone in its panel, no panel: `constant_series` names them with their value (the report lists
them). A reward function whose mean is the reward itself (the only one, or the only one not 0) is drawn once, as the
reward, named after the function; other functions are drawn beside the total, which is bold. Works on a finished
run, a running one (a half-written last line is skipped) and a resumed one (steps logged again after resuming replace
the first record of those steps).

    plot_runs(["out/a", "out/b"], "curves.png")      # .png, .svg or .html (one self-contained file, the SVG inline)

matplotlib is the `plot` extra; without it, MissingDependency names the install line.
"""

import fnmatch
import logging
import math
import os
from dataclasses import dataclass

from posttrain.errors import UserError
from posttrain.run_files import read_jsonl

logger = logging.getLogger("posttrain")

SMOOTH_FROM = 12  # points: below this a series is drawn as logged only
SMOOTHING = 0.9  # the moving average's weight on the past
CONSTANT = {"rel_tol": 1e-9, "abs_tol": 1e-12}  # a series whose values all agree this closely is constant
SAME = {"rel_tol": 1e-6, "abs_tol": 1e-9}  # the reward and its one function's mean agree this closely: one series
FUNCTION_MEAN = "rewards/*/mean"  # a reward function's mean (GRPO), not DPO's rewards/chosen etc.
FORMATS = (".png", ".svg", ".html")


class PlotError(UserError, ValueError):
    """Nothing to plot, or an output the plot cannot be written to; the message names it."""


class NothingToDraw(PlotError):
    """The runs logged too little for a curve (no step, or one): not a fault of the run."""


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple  # metric names or fnmatch patterns, in legend order
    log_scale: bool = False


PANELS = (
    Panel("reward", ("reward", FUNCTION_MEAN)),
    Panel("loss", ("loss",)),
    Panel("KL to the reference", ("kl",)),
    Panel("entropy", ("entropy",)),
    Panel("completion length (tokens)", ("completions/mean_length", "completions/min_length",
                                         "completions/max_length")),
    Panel("completions cut at max length", ("completions/clipped_ratio",)),
    Panel("tool calls (per completion; failures per call)", ("tools/call_frequency", "tools/failure_frequency")),
    Panel("dynamic sampling", ("sampling/generation_rounds", "sampling/groups_filtered")),
    Panel("clip ratios", ("clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean",
                          "cispo_clip_ratio")),
    Panel("token accuracy (SFT)", ("mean_token_accuracy",)),
    Panel("DPO / KTO rewards", ("rewards/chosen", "rewards/rejected", "rewards/margins")),
    Panel("DPO accuracy", ("rewards/accuracies",)),
    Panel("DPO / KTO log-probs", ("logps/chosen", "logps/rejected")),
    Panel("reward model: accuracy and margin", ("accuracy", "margin")),
    Panel("reward model: scores", ("min_reward", "mean_reward", "max_reward")),
    Panel("evaluation", ("eval_reward", "eval_loss", "eval_rewards/accuracies", "eval_mean_token_accuracy",
                         "eval_accuracy", "eval_margin", "eval_rewards/margins")),
    Panel("grad norm", ("grad_norm",), log_scale=True),
    Panel("learning rate", ("learning_rate",)),
    Panel("step time (s)", ("step_time",)),
)


def read_metrics(output_dir: str, damage: list[str] | None = None) -> dict[int, dict]:
    """{step: the step's metrics} from output_dir/metrics.jsonl. Records of one step merge (training and evaluation
    log separately), and a later record of a step replaces an earlier one's values (a resumed run logs again the steps
    after its checkpoint). A script's summary line is read past. A line that is damaged (not UTF-8, not a JSON object,
    no whole-number step) is skipped and noted in `damage` (posttrain/run_files.py); a running run's half-written last line is skipped silently."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise PlotError(f"{output_dir} has no metrics.jsonl: give the output_dir of a posttrain run.")
    steps: dict[int, dict] = {}
    for record in read_jsonl(path, [] if damage is None else damage, valid=_is_metrics_record):
        if "step" in record:  # the other kind is a script's {"summary": ...} (the demo's), which has no curve
            steps.setdefault(record["step"], {}).update(record)
    return dict(sorted(steps.items()))


def _is_metrics_record(record: dict) -> bool:
    """A step's record, or the {"summary": {...}} line a script appends (posttrain demo's before/after figures)."""
    return _has_step(record) or (set(record) == {"summary"} and isinstance(record["summary"], dict))


def _has_step(record: dict) -> bool:
    step = record.get("step")
    return isinstance(step, int) and not isinstance(step, bool) and step >= 0


def read_runs(output_dirs: list[str]) -> list[dict[int, dict]]:
    """read_metrics of each run; what was skipped as damaged is logged as one warning per file."""
    runs = []
    for output_dir in output_dirs:
        damage: list[str] = []
        runs.append(read_metrics(output_dir, damage))
        for note in damage:
            logger.warning("%s: %s", output_dir, note)
    return runs


def series(steps: dict[int, dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, where it is a finite number."""
    xs, ys = [], []
    for step, record in steps.items():
        value = record.get(key)
        if _is_number(value):
            xs.append(step)
            ys.append(float(value))
    return xs, ys


def smooth(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Exponential moving average, debiased so the first points are not pulled toward 0."""
    out, average = [], 0.0
    for i, value in enumerate(values, 1):
        average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight ** i))
    return out


def _present(runs: list[dict[int, dict]]) -> set[str]:
    return set().union(*(record.keys() for steps in runs for record in steps.values()))


def _keys(panel: Panel, runs: list[dict[int, dict]]) -> list[str]:
    """The panel's metrics present in any run, in the panel's order."""
    present = _present(runs)
    keys = []
    for pattern in panel.keys:
        keys += sorted(k for k in present if fnmatch.fnmatchcase(k, pattern) and k not in keys)
    return keys


def function_name(key: str) -> str:
    """`rewards/<name>/mean` -> name."""
    return key[len("rewards/"):-len("/mean")]


def reward_twins(runs: list[dict[int, dict]]) -> list[str]:
    """The reward functions whose mean is the reward itself at every logged step (a sole function of weight 1, or
    the one that is not 0 throughout): drawn once, as the reward."""
    means = [k for k in sorted(_present(runs)) if fnmatch.fnmatchcase(k, FUNCTION_MEAN)]
    twins = []
    for key in means:
        pairs = [(record["reward"], record[key]) for steps in runs for record in steps.values()
                 if _is_number(record.get("reward")) and _is_number(record.get(key))]
        if pairs and all(math.isclose(total, mean, **SAME) for total, mean in pairs):
            twins.append(function_name(key))
    return twins


def sole_reward_function(runs: list[dict[int, dict]]) -> str | None:
    """The name of the runs' one reward function where its mean is the reward itself; None where there are several,
    none, or they differ."""
    means = [k for k in _present(runs) if fnmatch.fnmatchcase(k, FUNCTION_MEAN)]
    twins = reward_twins(runs)
    return twins[0] if len(means) == 1 and twins else None


def constant_series(runs: list[dict[int, dict]]) -> dict[str, float]:
    """{metric: its value} for the panels' metrics that hold one value over every run's logged steps (two or more):
    they are not drawn."""
    constant = {}
    for panel in PANELS:
        for key in _keys(panel, runs):
            values = [v for steps in runs for v in series(steps, key)[1]]
            if len(values) >= 2 and all(math.isclose(v, values[0], **CONSTANT) for v in values):
                constant[key] = values[0]
    return constant


def panels_with_data(runs: list[dict[int, dict]]) -> list[tuple[Panel, list[str]]]:
    """The panels some run has a changing metric of, each with the metrics it draws (a reward function that is the
    reward itself drawn once, as `reward`)."""
    skipped = set(constant_series(runs)) | {f"rewards/{name}/mean" for name in reward_twins(runs)}
    return [(panel, keys) for panel in PANELS if (keys := [k for k in _keys(panel, runs) if k not in skipped])]


def line_names(runs: list[dict[int, dict]], keys: list[str]) -> dict[str, str]:
    """What the legend calls the metrics it renames: a reward function by its name; the reward by its one function's
    name, or as the total (and the function it equals) beside others."""
    names = {k: function_name(k) for k in keys if fnmatch.fnmatchcase(k, FUNCTION_MEAN)}
    if "reward" in keys:
        sole, twins = sole_reward_function(runs), reward_twins(runs)
        if sole is not None:
            names["reward"] = sole
        elif twins or names:
            names["reward"] = "reward (total)" + "".join(f" = {name}" for name in twins)
    return names


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _labels(output_dirs: list[str]) -> list[str]:
    """Each run's name in the legend: its directory's name, or its path where two names are the same."""
    names = [os.path.basename(os.path.normpath(d)) for d in output_dirs]
    return [n if names.count(n) == 1 else os.path.normpath(d) for n, d in zip(names, output_dirs)]


def plot_runs(output_dirs: list[str], out: str) -> str:
    """Draw every panel with data for the runs in `output_dirs` into `out` (.png, .svg or .html). Returns `out`."""
    _draw_into(output_dirs, out, inline=False)
    return out


def plot_runs_with_svg(output_dirs: list[str], out: str) -> str:
    """plot_runs(output_dirs, out), and the same figure as figure_svg gives it, drawn once (the end of a run writes
    both: plots.png and the report's curves)."""
    return _draw_into(output_dirs, out, inline=True)


def _draw_into(output_dirs: list[str], out: str, inline: bool) -> str | None:
    """The runs' figure saved to `out`; with `inline`, also returned as figure_svg's text."""
    extension = os.path.splitext(out)[1].lower()
    if extension not in FORMATS:
        raise PlotError(f"--out {out!r}: the plot is written as {', '.join(FORMATS)}; end the name with one of them.")
    figure = _figure(output_dirs, read_runs(output_dirs))
    try:
        _save(figure, out, extension)
        return _svg_text(figure) if inline else None
    finally:
        _close(figure)


def figure_svg(output_dirs: list[str], runs: list[dict[int, dict]]) -> str:
    """The panels of the runs in `output_dirs` (their read_metrics, `runs`) as one inline <svg> element (text kept
    as text), for an HTML page."""
    figure = _figure(output_dirs, runs)
    text = _svg_text(figure)
    _close(figure)
    return text


def _svg_text(figure) -> str:
    import io

    svg = io.StringIO()
    figure.savefig(svg, format="svg")
    text = svg.getvalue()
    return text[text.index("<svg"):]  # inline: no XML prologue inside HTML


def _close(figure) -> None:
    import matplotlib.pyplot as plt

    plt.close(figure)


def _figure(output_dirs: list[str], runs: list[dict[int, dict]]):
    """A matplotlib figure of every panel with data for the runs in `output_dirs` (their read_metrics, `runs`)."""
    from posttrain._optional import require

    if not any(runs):
        raise NothingToDraw(f"No step is logged yet in {', '.join(output_dirs)}: plot again after the first logging "
                            "step.")
    if all(len(steps) < 2 for steps in runs):  # one point a panel is no curve
        logged = sorted({step for steps in runs for step in steps})
        raise NothingToDraw(f"Only step {logged[0]} is logged in {', '.join(output_dirs)}, so there is no curve to "
                            "draw (a shorter logging_steps logs more steps); its numbers are in the report's details.")
    panels = panels_with_data(runs)
    if not panels:
        raise PlotError(f"Every metric logged in {', '.join(output_dirs)} holds one value over its steps: there is no "
                        "curve to draw (`posttrain report` lists the values).")
    require("matplotlib", "posttrain plot")
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    matplotlib.rcParams["svg.fonttype"] = "none"  # SVG text stays text: searchable, and smaller
    import matplotlib.pyplot as plt

    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 3.4 * rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (panel, keys) in zip(axes.flat, panels):
        _draw(ax, panel, keys, runs, _labels(output_dirs), colours)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    figure.tight_layout()
    return figure


STYLES = ["-", "--", ":", "-."]  # one per metric of a panel (the colour is the run's)


def _draw(ax, panel: Panel, keys: list[str], runs: list, labels: list[str], colours: list) -> None:
    names = line_names(runs, keys)
    for r, (steps, label) in enumerate(zip(runs, labels)):
        colour = colours[r % len(colours)]
        for k, key in enumerate(keys):
            xs, ys = series(steps, key)
            if not xs:
                continue
            shown = names.get(key, key)
            alone = len(panel.keys) == 1 and key not in names  # the panel's title names it
            name = label if alone else f"{label}: {shown}" if len(runs) > 1 else shown
            style = STYLES[k % len(STYLES)]
            bold = 1.6 if names.get(key, "").startswith("reward (total)") else 1.0  # the total over its functions
            if len(xs) >= SMOOTH_FROM:
                ax.plot(xs, ys, style, color=colour, alpha=0.25, linewidth=1)
                ax.plot(xs, smooth(ys), style, color=colour, linewidth=1.8 * bold, label=name)
            else:
                ax.plot(xs, ys, style, color=colour, marker="o", markersize=3, linewidth=1.5 * bold, label=name)
    ax.ticklabel_format(axis="y", useOffset=False)  # a learning rate reads 0.001, not 1e-15 + 1e-3
    ax.set_title(panel.title)
    ax.set_xlabel("step")
    if panel.log_scale and all(v > 0 for steps in runs for key in keys for v in series(steps, key)[1]):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _save(figure, out: str, extension: str) -> None:
    directory = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(directory, exist_ok=True)
        if extension != ".html":
            figure.savefig(out, dpi=110)
            return
        body = _svg_text(figure)
        with open(out, "w", encoding="utf-8") as f:
            f.write("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>posttrain curves</title></head>\n"
                    f"<body>\n{body}\n</body></html>\n")
    except OSError as err:
        from posttrain.errors import storage_error

        raise storage_error(err, "write the plot to", out, fix="choose another --out") from err
