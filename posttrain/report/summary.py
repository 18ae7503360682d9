"""The report's first section: how the run's headline metrics moved (the first logged steps against the last), how
long it ran, and where its outputs are."""

import fnmatch
import os

from posttrain.plotting import FUNCTION_MEAN, function_name, series, sole_reward_function
from posttrain.report.run import checkpoint_dirs, weight_files
from posttrain.registry import TRAINERS, headlines_of
from posttrain.report.tables import change, clock, escape, link, markup_table, number, raw_cell

# each trainer's metrics to watch (as its progress line shows them), then its evaluation's: the registry's
HEADLINES = {title: headlines_of(title)[0] for title in [entry.title for entry in TRAINERS] + [None]}
EVALUATION = {title: headlines_of(title)[1] for title in [entry.title for entry in TRAINERS] + [None]}
LOWER_IS_BETTER = ("loss", "eval_loss")
HIGHER_IS_BETTER = ("reward", FUNCTION_MEAN, "mean_token_accuracy", "rewards/accuracies", "rewards/margins", "accuracy",
                    "margin")
WINDOW = 0.1  # the share of the logged training records averaged at each end (at least one)


def _matching(patterns: tuple, names: set[str]) -> list[str]:
    keys = []
    for pattern in patterns:
        keys += sorted(k for k in names if fnmatch.fnmatchcase(k, pattern) and k not in keys)
    return keys


def _label(key: str, sole: str | None) -> str:
    bare = key.removeprefix("eval_")
    if bare == "reward" and sole is not None:
        return f"{key} ({sole})"  # the one reward function's mean is the reward itself
    if fnmatch.fnmatchcase(bare, FUNCTION_MEAN):
        return f"{key[:len(key) - len(bare)]}reward: {function_name(bare)}"
    return key


def _direction(key: str, first: float, last: float) -> str:
    """better / worse for a metric with a good direction that moved, else ''."""
    bare = key.removeprefix("eval_")
    sign = 1 if any(fnmatch.fnmatchcase(bare, p) for p in HIGHER_IS_BETTER) else -1 if bare in LOWER_IS_BETTER else 0
    if sign == 0 or last == first:
        return ""
    return "better" if (last - first) * sign > 0 else "worse"


def _span(steps: list[int]) -> str:
    return str(steps[0]) if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"


def _mean_over(steps: dict[int, dict], key: str, window: list[int]) -> float | None:
    xs, ys = series({s: steps[s] for s in window}, key)
    return sum(ys) / len(ys) if ys else None


def movements(steps: dict[int, dict], trainer: str | None) -> tuple[list[tuple], str]:
    """[(label, first, last, 'steps' column, key)] for the trainer's headline metrics (the mean of the first and the
    last 10% of the logged training records, at least one each) and its evaluation's (the first and last
    evaluation), and the sentence saying what was averaged."""
    names = {k for record in steps.values() for k in record}
    sole = sole_reward_function([steps])
    skip = {f"rewards/{sole}/mean", f"eval_rewards/{sole}/mean"} if sole else set()
    keys = [k for k in _matching(HEADLINES[trainer], names) if k not in skip]
    rows, note = [], ""
    logged = series(steps, keys[0])[0] if keys else []
    if logged:
        size = max(1, round(len(logged) * WINDOW))
        head, tail = logged[:size], logged[-size:]
        records = "record" if size == 1 else f"{size} records"
        note = (f"First: the mean of the first {records} of the {len(logged)} logged training records (step "
                f"{_span(head)}); last: of the last {records} (step {_span(tail)}); 10% at each end, at least one")
        if len(logged) == 1:
            note = f"One training record is logged (step {logged[0]}): nothing has moved yet"
        for key in keys:
            first, last = _mean_over(steps, key, head), _mean_over(steps, key, tail)
            if first is not None and last is not None:
                window = f"{_span(head)} → {_span(tail)}" if len(logged) > 1 else str(logged[0])
                rows.append((_label(key, sole), first, last, window, key))
    evaluations = [k for k in _matching(EVALUATION[trainer], names) if k not in skip]
    for key in evaluations:
        xs, ys = series(steps, key)
        if xs:
            rows.append((_label(key, sole), ys[0], ys[-1], f"{xs[0]} → {xs[-1]}" if len(xs) > 1 else str(xs[0]), key))
    if evaluations and rows and rows[-1][4] in evaluations:
        note += ("; evaluation: the first evaluation against the last" if note
                 else "Evaluation: the first evaluation against the last")  # each already a mean over its set
    return rows, note + "." if note else ""


def _movement_table(rows: list[tuple]) -> str:
    head = "<th>metric</th><th class=\"num\">first</th><th class=\"num\">last</th><th class=\"num\">change</th>" \
           "<th class=\"num\">steps</th>"
    lines = []
    for i, (label, first, last, window, key) in enumerate(rows):
        direction = _direction(key, first, last)
        moved = escape(change(first, last))
        if direction:
            moved = f"<span class=\"{direction}\">{moved}</span>"
        cells = "".join([raw_cell(escape(label)), raw_cell(escape(number(first)), "num"),
                         raw_cell(escape(number(last)), "num"), raw_cell(moved, "num"),
                         raw_cell(escape(window), "num")])
        lines.append(f"<tr class=\"headline\">{cells}</tr>\n" if i == 0 else f"<tr>{cells}</tr>\n")
    return markup_table(head, "".join(lines), "movement")


def _headline(rows: list[tuple]) -> str:
    label, first, last, window, key = rows[0]
    if "→" not in window:  # one record logged
        return f"<p class=\"headline\">{escape(label)} <strong>{escape(number(last))}</strong> " \
               f"<span class=\"note\">at step {escape(window)}, the only one logged</span></p>"
    direction = _direction(key, first, last)
    moved = f" <span class=\"{direction or 'note'}\">({escape(change(first, last))})</span>"
    averaged = "-" in window.split(" → ")[0]  # several records at each end
    where = ("first evaluation vs last" if key.startswith("eval_") else
             "first 10% of logged steps vs last 10%" if averaged else "first logged step vs last")
    figures = f"{escape(number(first))} → {escape(number(last))}"
    return (f"<p class=\"headline\">{escape(label)} <strong>{figures}</strong>{moved} "
            f"<span class=\"note\">{where}</span></p>")


def _tokens(steps: dict[int, dict], trainer: str | None) -> str | None:
    """num_tokens, a running total in every trainer (its last value): GRPO's counts the prompts and completions fed
    to the model (TRL's num_input_tokens_seen), SFT's and DPO's the tokens trained on."""
    xs, ys = series(steps, "num_tokens")
    if not xs:
        return None
    return f"{number(int(ys[-1]))} tokens {'fed to the model' if trainer in ('GRPO', 'RLOO') else 'trained on'}"


def _length(steps: dict[int, dict], config: dict | None, summary: dict, trainer: str | None) -> str:
    """Steps (of max_steps), epochs, wall time and tokens, as one line."""
    parts = []
    if steps:
        last, max_steps = max(steps), (config or {}).get("max_steps")
        parts.append(f"{last:,} of {max_steps:,} steps" if isinstance(max_steps, int) and max_steps > 0
                     else f"{last:,} steps")
    epochs = series(steps, "epoch")[1]
    if epochs:
        parts.append(f"{number(max(epochs))} epoch{'' if max(epochs) == 1 else 's'}")
    runtime = summary.get("train_runtime")
    parts.append(f"{clock(runtime)} wall time" if isinstance(runtime, (int, float))
                 else "not finished (no all_results.json yet)")
    tokens = _tokens(steps, trainer)
    if tokens:
        parts.append(tokens)
    return f"<p class=\"length\">{' · '.join(escape(p) for p in parts)}</p>"


def _size(path: str) -> str:
    size = float(os.path.getsize(path))
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return ""


LISTED = 5  # checkpoints and weight files listed by name; the rest counted
OUTPUT_FILES = (("metrics", "metrics.jsonl"), ("curves", "plots.png"), ("completions", "completions.jsonl"),
                ("config", "posttrain_config.yaml"), ("final summary", "all_results.json"))


def _outputs(output_dir: str, page_dir: str) -> str:
    """Where the run's outputs are: the output dir, the model's files, the checkpoints and the logs, as links."""
    none = "<span class=\"note\">{}</span>"
    weights = weight_files(output_dir)
    model = "<br>".join(f"{link(p, page_dir)} ({_size(p)})" for p in weights[:LISTED]) or none.format(
        "not saved yet (saved at the end of training)")
    if len(weights) > LISTED:
        model += f"<br>and {len(weights) - LISTED} more"
    checkpoints = checkpoint_dirs(output_dir)
    saved = "<br>".join(link(p, page_dir) for p in checkpoints[-LISTED:]) or none.format("none")
    if len(checkpoints) > LISTED:
        saved = f"{len(checkpoints) - LISTED} earlier, then<br>" + saved
    rows = [("output dir", link(output_dir, page_dir)), ("model", model), ("checkpoints", saved)]
    for what, name in OUTPUT_FILES:
        path = os.path.join(output_dir, name)
        if os.path.exists(path):
            rows.append((what, link(path, page_dir)))
        elif name == "plots.png":
            rows.append((what, none.format(f"not drawn (posttrain plot {escape(output_dir)})")))
    lines = "".join(f"<tr><th>{escape(what)}</th>{raw_cell(where, 'path')}</tr>\n" for what, where in rows)
    return markup_table("<th>output</th><th>path</th>", lines, "outputs")


def _before_and_after(summary: dict) -> list[str]:
    """A headline for each `<name>_before` / `<name>_after` pair of numbers a script saved into the final summary
    (trainer.save_metrics; the demo saves its sampled accuracy so): what the run was for, before the curves' view."""
    lines = []
    for key in sorted(summary):
        if not key.endswith("_before"):
            continue
        name = key.removesuffix("_before")
        before, after = summary[key], summary.get(f"{name}_after")
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (before, after)):
            lines.append(f"<p class=\"headline\">{escape(name.replace('_', ' '))} <strong>{escape(number(before))} "
                         f"→ {escape(number(after))}</strong> <span class=\"note\">before training vs after</span></p>")
    return lines


def summary_section(output_dir: str, page_dir: str, steps: dict[int, dict], run: dict) -> str:
    """The summary: the headline movement, the table of movements and what was averaged, the run's length, and its
    outputs. `run`: trainer, config and final summary (write_report reads them)."""
    rows, note = movements(steps, run["trainer"])
    parts = ["<section id=\"summary\">", "<h2>Summary</h2>", *_before_and_after(run["summary"])]
    if rows:
        parts += [_headline(rows), _movement_table(rows), f"<p class=\"note\">{escape(note)}</p>"]
    elif not steps:
        parts.append("<p class=\"note\">No training step is logged yet (metrics.jsonl): nothing has moved.</p>")
    parts += ["<h3>Length</h3>", _length(steps, run["config"], run["summary"], run["trainer"]),
              "<h3>Outputs</h3>", _outputs(output_dir, page_dir), "</section>"]
    return "\n".join(parts)
