"""The table and plot of bench/time_to_accuracy.py's runs (issue 38, item 2).

Usage: python bench/tta_table.py RESULTS_DIR [--plot docs/img/time_to_accuracy.png]

Reads RESULTS_DIR/{trl,posttrain}-seed*.json. Prints a markdown table, one row per side: the seconds (and step) at
which the moving average of the sampled accuracy first reached 50% and 70%, per seed and their median ("never" when
a run did not, which counts as above every time for the median), the accuracy over the last 10% of steps (mean +- sd
over the seeds), the demo's end-of-training sampled accuracy (mean), and the median steady seconds per step. With
--plot, draws the moving average against wall-clock seconds, one line per seed, TRL's and posttrain's in two colours.
"""

import argparse
import glob
import json
import math
import os
import statistics

SIDES = ("trl", "posttrain")
COLOURS = {"trl": "tab:orange", "posttrain": "tab:blue"}
LABELS = {"trl": "TRL 1.16", "posttrain": "posttrain"}


def load(results_dir: str) -> dict:
    """{side: [run, ...] sorted by seed}."""
    runs = {side: [] for side in SIDES}
    for path in glob.glob(os.path.join(results_dir, "*-seed*.json")):
        with open(path) as f:
            run = json.load(f)
        runs.setdefault(run["impl"], []).append(run)
    return {side: sorted(rs, key=lambda r: r["seed"]) for side, rs in runs.items() if rs}


def median_time(values: list) -> float | None:
    """The median with None (never reached) as +infinity; None if the median itself is never."""
    m = statistics.median(math.inf if v is None else v for v in values)
    return None if math.isinf(m) else m


def fmt_time(t: float | None, step: int | None = None) -> str:
    if t is None:
        return "never"
    return f"{t:.0f} s" if step is None else f"{t:.0f} s ({step})"


def mean_sd(values: list[float]) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} +- {sd:.3f}"


def row(side: str, rs: list[dict]) -> str:
    """One markdown row of the table."""
    cells = [LABELS.get(side, side), ", ".join(str(r["seed"]) for r in rs)]
    for x in (50, 70):
        per_seed = ", ".join(fmt_time(r[f"t{x}_s"], r[f"step{x}"]) for r in rs)
        cells += [per_seed, fmt_time(median_time([r[f"t{x}_s"] for r in rs]))]
    cells += [mean_sd([r["acc_end"] for r in rs]), mean_sd([r.get("final_sampled_accuracy") for r in rs]),
              f"{statistics.median(r['s_per_step'] for r in rs):.3f}"]
    return "| " + " | ".join(cells) + " |"


def table(runs: dict) -> str:
    first = next(iter(runs.values()))[0]
    head = (f"| side | seeds | 50%: seconds (step) per seed | median | 70%: seconds (step) per seed | median | "
            f"accuracy, last 10% of {first['steps']} steps | sampled accuracy after | s/step |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    lines += [row(side, rs) for side, rs in runs.items()]
    lines.append(f"\nMoving average over {first['window']} steps; {first['threads']} torch threads.")
    return "\n".join(lines)


def plot(runs: dict, path: str) -> None:
    """The moving-average accuracy against wall-clock seconds, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for side, rs in runs.items():
        for i, r in enumerate(rs):
            ax.plot([p["time_s"] for p in r["series"]], [p["accuracy_ma"] for p in r["series"]],
                    color=COLOURS.get(side), alpha=0.85, linewidth=1.2,
                    label=LABELS.get(side, side) if i == 0 else None)
    for y in (0.5, 0.7):
        ax.axhline(y, color="grey", linestyle=":", linewidth=0.8)
    first = next(iter(runs.values()))[0]
    ax.set_xlabel("wall-clock seconds since train()")
    ax.set_ylabel(f"sampled accuracy ({first['window']}-step moving average)")
    ax.set_title(f"posttrain demo's task, {first['steps']} steps, one line per seed")
    ax.set_ylim(0, 1)
    ax.set_xlim(left=0)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results_dir")
    ap.add_argument("--plot", default=None, metavar="FILE.png")
    args = ap.parse_args()
    runs = load(args.results_dir)
    if not runs:
        raise SystemExit(f"no runs in {args.results_dir}")
    print(table(runs))
    if args.plot:
        plot(runs, args.plot)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
