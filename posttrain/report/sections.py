"""The report's sections after the summary: the curves (and the metrics that held one value, not drawn), sampled
completions, and the detailed numbers (the final summary record, the last logged step, the config)."""

import os

from posttrain._optional import MissingDependency
from posttrain.completion_rows import as_text, extra_columns
from posttrain.plotting import PlotError, constant_series, figure_svg, reward_twins, sole_reward_function
from posttrain.report.tables import escape, number, table
from posttrain.run_files import read_jsonl

DEFAULT_ROWS = 8  # completions shown per chosen step


def curves(output_dir: str, steps: dict[int, dict], drawn: str | None = None) -> str:
    """The curves of the logged `steps` as inline SVG (`drawn`: already drawn so), and a line naming what is not
    drawn: metrics constant over the run (with their value) and the reward function that is the reward itself."""
    try:
        figure = f"<div class=\"curves\">{drawn or figure_svg([output_dir], [steps])}</div>"
    except PlotError as err:
        figure = f"<p class=\"note\">{escape(err)}</p>"
    except MissingDependency:  # the rest of the report needs no matplotlib
        figure = ("<p class=\"note\">The curves are drawn with matplotlib, which is not installed: pip install "
                  "matplotlib.</p>")
    notes = []
    constant = constant_series([steps]) if steps else {}
    if constant:
        values = ", ".join(f"<code>{escape(k)}</code> = {escape(number(v))}" for k, v in constant.items())
        notes.append(f"Constant over the run, so not drawn: {values}.")
    sole = sole_reward_function([steps]) if steps else None
    if sole is not None:
        notes.append(f"The one reward function, <code>{escape(sole)}</code>, is the reward itself: drawn once, "
                     "under its name.")
    elif twins := (reward_twins([steps]) if steps else []):
        names = ", ".join(f"<code>{escape(name)}</code>" for name in twins)
        notes.append(f"The mean of {names} equals the reward at every logged step: drawn once, as the total.")
    return "\n".join([figure, *(f"<p class=\"note\">{n}</p>" for n in notes)])


def completion_rows(output_dir: str, damage: list[str]) -> dict[int, list[dict]]:
    """{step: its rows} of output_dir/completions.jsonl (empty without it); rows not of the form its writer gives
    (grpo/completions.py) are skipped and noted in `damage`."""
    path = os.path.join(output_dir, "completions.jsonl")
    by_step: dict[int, list[dict]] = {}
    if not os.path.exists(path):
        return by_step
    for row in read_jsonl(path, damage, valid=_is_completion_row):
        by_step.setdefault(row["step"], []).append(row)
    return by_step


def _is_completion_row(row: dict) -> bool:
    """A whole-number step, a prompt and completion as text or messages, rewards a mapping of numbers (or None: a
    function that did not score the row), an advantage a number."""
    step, rewards = row.get("step"), row.get("rewards", {})
    return (isinstance(step, int) and not isinstance(step, bool) and step >= 0
            and all(isinstance(row.get(k, ""), (str, list)) for k in ("prompt", "completion"))
            and isinstance(rewards, dict) and all(v is None or _is_real(v) for v in rewards.values())
            and (row.get("advantage") is None or _is_real(row["advantage"])))


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def chosen_steps(available: list[int], wanted: list[int] | None) -> list[int]:
    """The steps whose completions are shown: `wanted` where logged, else the first, middle and last."""
    if wanted:
        return [s for s in wanted if s in available]
    if not available:
        return []
    ordered = sorted(available)
    return sorted({ordered[0], ordered[len(ordered) // 2], ordered[-1]})


def spread_over_prompts(logged: list[dict], rows: int) -> tuple[list[dict], int]:
    """(`rows` of a step's completions, taken a prompt at a time: each prompt's first completion, then each one's
    second, ..., so that a table shows as many prompts as it can rather than one prompt's group; how many distinct
    prompts the step has)."""
    groups: dict[str, list[dict]] = {}
    for row in logged:
        groups.setdefault(as_text(row.get("prompt")), []).append(row)
    shown, depth = [], 0
    while len(shown) < min(rows, len(logged)):
        shown += [group[depth] for group in groups.values() if depth < len(group)][:rows - len(shown)]
        depth += 1
    return shown, len(groups)


def completions(by_step: dict[int, list[dict]], steps: list[int] | None, rows: int) -> str:
    """Tables of `rows` completions (completion_rows) at each chosen step."""
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
        shown, prompts = spread_over_prompts(logged, rows)
        body = [[as_text(r.get("prompt")), as_text(r.get("completion")),
                 *(r.get("rewards", {}).get(n) for n in functions), r.get("advantage"), *(r.get(k) for k in extra)]
                for r in shown]
        of_prompts = f", of {prompts} prompts" if prompts > 1 else ""
        parts.append(f"<h3>Step {step} ({len(shown)} of {len(logged)} completions{of_prompts})</h3>")
        parts.append(table(["prompt", "completion", *functions, "advantage", *extra], body, "completions"))
    return "\n".join(parts)


def details(output_dir: str, steps: dict[int, dict], run: dict) -> str:
    """The final summary record (all_results.json: runtime, FLOPs, train_loss ...), the last logged step's metrics
    and the config, folded."""
    parts = ["<h3>Final summary</h3>"]
    if run["summary"]:
        parts += [f"<p class=\"note\">{escape(run['summary_file'])}, written at the end of training.</p>",
                  table(["", "value"], list(run["summary"].items()), "summary", numeric=(1,))]
    else:
        parts.append("<p class=\"note\">No all_results.json: the run has not finished.</p>")
    if steps:
        last = max(steps)
        parts.append(f"<h3>Step {last} (the last logged)</h3>")
        parts.append(table(["metric", "value"], [[k, v] for k, v in sorted(steps[last].items()) if k != "step"],
                           "last-step", numeric=(1,)))
    parts.append("<h3>Config</h3>")
    config = run["config"]
    if config is None:
        parts.append("<p class=\"note\">No posttrain_config.yaml (written when the model or a checkpoint is "
                     "saved).</p>")
    else:
        where = os.path.relpath(run["config_path"], output_dir)
        parts.append(f"<details><summary>{len(config)} fields of {escape(where)} (click to show)</summary>\n"
                     + table(["field", "value"], [[k, v] for k, v in config.items()], "config") + "\n</details>")
    return "\n".join(parts)
