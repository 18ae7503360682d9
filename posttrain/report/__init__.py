"""The run report: `posttrain report OUTPUT_DIR [--out FILE] [--steps N ...] [--rows N]`, and output_dir/report.html
at the end of a run (with plot_on_end).

One self-contained HTML page, readable in a browser with no server (its stylesheet inline, no script, nothing
fetched): a header (the run, its trainer and model), then the summary first (how the headline metrics moved from the
first logged steps to the last, the run's length, where its outputs are), its curves (posttrain/plotting.py's
figure, inline SVG), sampled completions with their rewards and advantages at chosen steps (from completions.jsonl,
written with log_completions), and the detailed numbers (the final summary record, the last logged step, the config).
Every piece is read from the output directory alone, so it works on a finished, a running and a resumed run; a piece
the run did not write is left out with a line saying why.

    write_report("out/run")                          # out/run/report.html

Modules: summary.py (the first section), sections.py (the others), run.py (what the output directory holds),
tables.py (HTML pieces), style.py (the stylesheet).
"""

import datetime
import logging
import os

from posttrain.plotting import PlotError, read_metrics
from posttrain.report.run import config_path, describe_model, final_summary, read_config, trainer_of
from posttrain.report.sections import DEFAULT_ROWS, chosen_steps, completion_rows, completions, curves, details
from posttrain.report.style import STYLE
from posttrain.report.summary import summary_section
from posttrain.report.tables import escape

__all__ = ["DEFAULT_ROWS", "REPORT", "chosen_steps", "write_report"]

REPORT = "report.html"
logger = logging.getLogger("posttrain")


def write_report(output_dir: str, out: str | None = None, steps: list[int] | None = None,
                 rows: int = DEFAULT_ROWS, curves_svg: str | None = None) -> str:
    """Write the report of the run in `output_dir` to `out` (default output_dir/report.html); returns its path.

    Args:
        steps: the steps whose completions are shown (default: the first, middle and last logged ones).
        rows: completions shown per step.
        curves_svg: the run's curves as plotting.figure_svg draws them, already drawn (None: drawn here).
    """
    if not os.path.isdir(output_dir):
        raise PlotError(f"{output_dir!r} is not a directory: give a run's output_dir.")
    out = out or os.path.join(output_dir, REPORT)
    page = _page(os.path.abspath(output_dir), os.path.dirname(os.path.abspath(out)), steps, rows, curves_svg)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as err:
        from posttrain.errors import storage_error

        raise storage_error(err, "write the report to", out, fix="choose another --out") from err
    return out


def _read_run(output_dir: str) -> tuple[dict[int, dict], dict]:
    """(the logged steps, what the sections read of the run: config, final summary, trainer, completions, and the
    notes on what was skipped as damaged). A directory without metrics.jsonl is no run's output_dir: PlotError says
    so."""
    damage: list[str] = []
    logged = read_metrics(output_dir, damage)
    config = read_config(output_dir, damage)
    completions_by_step = completion_rows(output_dir, damage)
    summary_file, summary = final_summary(output_dir)
    names = {k for record in logged.values() for k in record}
    for note in damage:
        logger.warning("%s: %s", output_dir, note)
    return logged, {"config": config, "config_path": config_path(output_dir), "summary": summary,
                    "summary_file": summary_file, "trainer": trainer_of(config, names),
                    "completions": completions_by_step, "damage": damage}


def _page(output_dir: str, page_dir: str, steps: list[int] | None, rows: int, curves_svg: str | None) -> str:
    logged, run = _read_run(output_dir)
    name = (run["config"] or {}).get("run_name") or os.path.basename(os.path.normpath(output_dir))
    parts = ["<main>", _header(name, output_dir, run),
             summary_section(output_dir, page_dir, logged, run),
             "<section id=\"curves\">", "<h2>Curves</h2>", curves(output_dir, logged, curves_svg), "</section>",
             "<section id=\"completions\">", "<h2>Completions</h2>", completions(run["completions"], steps, rows),
             "</section>",
             "<section id=\"details\">", "<h2>Details</h2>", details(output_dir, logged, run), "</section>",
             "</main>"]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{escape(name)}: posttrain report</title><style>{STYLE}</style></head>\n<body>\n"
            + "\n".join(parts) + "\n</body></html>\n")


def _header(name: str, output_dir: str, run: dict) -> str:
    """The run's name, then its trainer, model, output dir and when the report was written."""
    trainer = run["trainer"] or "unknown (no posttrain_config.yaml yet, and no metric of its own logged)"
    model = describe_model(output_dir) or "unknown (no config.json or weights saved yet)"
    facts = [("trainer", trainer), ("model", model), ("output dir", output_dir),
             ("written", datetime.datetime.now().strftime("%Y-%m-%d %H:%M"))]
    items = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in facts)
    damage = "".join(f"<p class=\"note\">{escape(note)}</p>" for note in run["damage"])
    return f"<header><h1>{escape(name)}</h1>\n<dl class=\"facts\">{items}</dl>{damage}</header>"
