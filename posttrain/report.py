"""The run report: `posttrain report OUTPUT_DIR [--out FILE] [--steps N ...] [--rows N]`, and output_dir/report.html
at the end of a run (with plot_on_end).

One self-contained HTML page, readable in a browser with no server (no script, nothing fetched): the run's final
summary, its curves (posttrain/plotting.py's figure, inline SVG), sampled completions with their rewards and
advantages at chosen steps (from completions.jsonl, written with log_completions), and its config
(posttrain_config.yaml). Every piece is read from the output directory alone, so it works on a finished, a running
and a resumed run; a piece the run did not write is left out with a line saying why.

    write_report("out/run")                          # out/run/report.html
"""

import datetime
import html
import json
import os

from posttrain.completion_rows import as_text, extra_columns
from posttrain.plotting import PlotError, figure_svg, read_metrics

REPORT = "report.html"
DEFAULT_ROWS = 8  # completions shown per chosen step
SUMMARY_FILES = ("all_results.json", "train_results.json")
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1400px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.text { white-space: pre-wrap; font-family: ui-monospace, monospace; max-width: 40em; }
.note { color: #666; } svg { max-width: 100%; height: auto; }
"""


def write_report(output_dir: str, out: str | None = None, steps: list[int] | None = None,
                 rows: int = DEFAULT_ROWS) -> str:
    """Write the report of the run in `output_dir` to `out` (default output_dir/report.html); returns its path.

    Args:
        steps: the steps whose completions are shown (default: the first, middle and last logged ones).
        rows: completions shown per step.
    """
    if not os.path.isdir(output_dir):
        raise PlotError(f"{output_dir!r} is not a directory: give a run's output_dir.")
    out = out or os.path.join(output_dir, REPORT)
    name = os.path.basename(os.path.normpath(output_dir))
    parts = [f"<h1>posttrain run report: {_e(name)}</h1>",
             f"<p class=\"note\">{_e(os.path.abspath(output_dir))}, written "
             f"{datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}</p>",
             "<h2>Summary</h2>", _summary(output_dir),
             "<h2>Curves</h2>", _curves(output_dir),
             "<h2>Completions</h2>", _completions(output_dir, steps, rows),
             "<h2>Config</h2>", _config(output_dir)]
    page = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>posttrain report: {_e(name)}</title><style>{STYLE}</style></head>\n<body>\n"
            + "\n".join(parts) + "\n</body></html>\n")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as err:
        from posttrain.errors import storage_error

        raise storage_error(err, "write the report to", out, fix="choose another --out") from err
    return out


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _cell(value) -> str:
    if isinstance(value, bool) or value is None:
        return f"<td>{_e('-' if value is None else value)}</td>"
    if isinstance(value, (int, float)):
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return f"<td class=\"num\">{_e(text)}</td>"
    if not isinstance(value, str):
        value = json.dumps(value, default=str)
    return f"<td class=\"text\">{_e(value)}</td>"


def _table(header: list[str], body: list[list], css_class: str = "") -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    lines = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>\n" for row in body)
    attribute = f" class=\"{css_class}\"" if css_class else ""
    return f"<table{attribute}><thead><tr>{head}</tr></thead>\n<tbody>\n{lines}</tbody></table>"


def _summary(output_dir: str) -> str:
    """The end-of-training summary (all_results.json) and the last logged step's metrics."""
    values: dict = {}
    for name in SUMMARY_FILES:
        path = os.path.join(output_dir, name)
        if os.path.exists(path):
            with open(path) as f:
                values.update(json.load(f))
            break
    steps = read_metrics(output_dir)
    parts = []
    if values:
        parts.append(_table(["", "value"], [[k, v] for k, v in values.items()], "summary"))
    else:
        parts.append("<p class=\"note\">No all_results.json: the run has not finished.</p>")
    if steps:
        last = max(steps)
        parts.append(f"<p>Step {last} (the last logged):</p>")
        parts.append(_table(["metric", "value"], [[k, v] for k, v in sorted(steps[last].items()) if k != "step"],
                            "last-step"))
    return "\n".join(parts)


def _curves(output_dir: str) -> str:
    try:
        return figure_svg([output_dir])
    except PlotError as err:
        return f"<p class=\"note\">{_e(err)}</p>"


def _completion_rows(output_dir: str) -> dict[int, list[dict]]:
    path = os.path.join(output_dir, "completions.jsonl")
    by_step: dict[int, list[dict]] = {}
    if not os.path.exists(path):
        return by_step
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a running run's half-written last line
                continue
            by_step.setdefault(int(row.get("step", 0)), []).append(row)
    return by_step


def chosen_steps(available: list[int], wanted: list[int] | None) -> list[int]:
    """The steps whose completions are shown: `wanted` where logged, else the first, middle and last."""
    if wanted:
        return [s for s in wanted if s in available]
    if not available:
        return []
    ordered = sorted(available)
    return sorted({ordered[0], ordered[len(ordered) // 2], ordered[-1]})


def _completions(output_dir: str, steps: list[int] | None, rows: int) -> str:
    by_step = _completion_rows(output_dir)
    if not by_step:
        return ("<p class=\"note\">No completions.jsonl: set log_completions=True to log each step's prompts, "
                "completions, rewards and advantages.</p>")
    chosen = chosen_steps(list(by_step), steps)
    if not chosen:
        return f"<p class=\"note\">None of the steps {steps} has logged completions (logged: {sorted(by_step)}).</p>"
    parts = []
    for step in chosen:
        logged = by_step[step]
        functions = list(logged[0].get("rewards", {}))
        extra = extra_columns(logged[0])
        body = [[as_text(r.get("prompt")), as_text(r.get("completion")), *(r.get("rewards", {}).get(n) for n in functions),
                 r.get("advantage"), *(r.get(k) for k in extra)] for r in logged[:rows]]
        parts.append(f"<h3>Step {step} ({min(rows, len(logged))} of {len(logged)} completions)</h3>")
        parts.append(_table(["prompt", "completion", *functions, "advantage", *extra], body, "completions"))
    return "\n".join(parts)


def _config(output_dir: str) -> str:
    path = os.path.join(output_dir, "posttrain_config.yaml")
    if not os.path.exists(path):
        return "<p class=\"note\">No posttrain_config.yaml (written when the model is saved).</p>"
    import yaml

    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f) or {}
    return (f"<details><summary>{len(config)} fields (click to show)</summary>\n"
            + _table(["field", "value"], [[k, v] for k, v in config.items()], "config") + "\n</details>")
