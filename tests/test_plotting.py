"""posttrain plot: the curves of one or more runs from metrics.jsonl alone (posttrain/plotting.py)."""

import json
import subprocess
import sys

import pytest

from posttrain.plotting import (PlotError, constant_series, line_names, panels_with_data, plot_runs, read_metrics,
                                smooth)

# _run_dir scales each float by (1 + step / steps): none of these is constant (a 0.0 would be, and is not drawn)
GRPO = {"reward": 0.5, "rewards/accuracy/mean": 0.5, "rewards/accuracy/std": 0.1, "loss": 0.001, "kl": 0.01,
        "entropy": 2.0, "completions/mean_length": 7.0, "completions/min_length": 2.0, "completions/max_length": 9.0,
        "completions/clipped_ratio": 0.1, "clip_ratio/region_mean": 0.02, "grad_norm": 0.3, "learning_rate": 1e-3,
        "step_time": 0.02}
SFT = {"loss": 2.0, "mean_token_accuracy": 0.4, "entropy": 3.0, "num_tokens": 100, "grad_norm": 1.0,
       "learning_rate": 2e-5, "step_time": 0.01}
DPO = {"loss": 0.69, "rewards/chosen": 0.1, "rewards/rejected": -0.1, "rewards/margins": 0.2,
       "rewards/accuracies": 0.6, "logps/chosen": -20.0, "logps/rejected": -22.0, "grad_norm": 1.0,
       "learning_rate": 1e-6, "step_time": 0.05}


def _run_dir(path, metrics: dict, steps: int = 20, extra_lines: tuple = ()):
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            f.write(json.dumps({"step": step, "epoch": step / steps,
                                **{k: v * (1 + step / steps) if isinstance(v, float) else v
                                   for k, v in metrics.items()}}) + "\n")
        for line in extra_lines:
            f.write(line)
    return path


def test_records_of_a_step_merge_and_a_resumed_runs_later_records_replace_earlier_ones(tmp_path):
    lines = [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}, {"step": 2, "eval_loss": 5.0},
             {"step": 3, "loss": 3.0},  # the run was killed after step 3; resumed from checkpoint-2:
             {"step": 3, "loss": 30.0}, {"step": 4, "loss": 4.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 5, "lo')
    steps = read_metrics(str(tmp_path))
    assert list(steps) == [1, 2, 3, 4]  # the running run's half-written line skipped
    assert steps[2] == {"step": 2, "loss": 2.0, "eval_loss": 5.0}
    assert steps[3]["loss"] == 30.0


def test_a_scripts_summary_line_is_read_past_and_a_damaged_line_is_noted(tmp_path):
    """posttrain demo appends {"summary": {...}} to metrics.jsonl: no curve, and no note calling it damaged (before:
    the demo's own report said it skipped a damaged line); a line of another form is still noted."""
    lines = [json.dumps({"step": 1, "loss": 1.0}), json.dumps({"summary": {"reward_gain": 0.6}}),
             json.dumps({"loss": 2.0}), json.dumps({"step": 2, "loss": 2.0})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    damage = []
    steps = read_metrics(str(tmp_path), damage)
    assert list(steps) == [1, 2]
    assert damage == ["metrics.jsonl: skipped 1 line that is damaged or not of the form posttrain writes (line 3)."]


def test_each_trainers_panels_are_drawn_and_no_empty_one(tmp_path):
    titles = {name: [panel.title for panel, _ in panels_with_data([read_metrics(str(_run_dir(tmp_path / name, m)))])]
              for name, m in (("grpo", GRPO), ("sft", SFT), ("dpo", DPO))}
    assert titles["grpo"] == ["reward", "loss", "KL to the reference", "entropy", "completion length (tokens)",
                              "completions cut at max length", "clip ratios", "grad norm", "learning rate",
                              "step time (s)"]
    assert titles["sft"] == ["loss", "entropy", "token accuracy (SFT)", "grad norm", "learning rate", "step time (s)"]
    assert titles["dpo"] == ["loss", "DPO / KTO rewards", "DPO accuracy", "DPO / KTO log-probs", "grad norm", "learning rate",
                             "step time (s)"]
    keys = dict((panel.title, keys) for panel, keys in panels_with_data([read_metrics(str(tmp_path / "grpo"))]))
    assert keys["reward"] == ["reward"]  # its one function's mean is the reward itself: one series (not the std)
    two = {**GRPO, "reward": 0.8, "rewards/accuracy/mean": 0.5, "rewards/format/mean": 0.3, "rewards/format/std": 0.1}
    keys = dict((panel.title, keys) for panel, keys in panels_with_data([read_metrics(str(_run_dir(tmp_path / "two",
                                                                                                    two)))]))
    assert keys["reward"] == ["reward", "rewards/accuracy/mean", "rewards/format/mean"]  # the means, not their std


def _reward_panel(run) -> tuple[list[str], list[float], int]:
    """The reward panel as drawn: its legend's labels, their lines' widths, and how many lines it holds."""
    pytest.importorskip("matplotlib")
    from posttrain.plotting import _close, _figure

    figure = _figure([str(run)], [read_metrics(str(run))])
    try:
        ax = next(ax for ax in figure.axes if ax.get_title() == "reward")
        handles, labels = ax.get_legend_handles_labels()
        return labels, [h.get_linewidth() for h in handles], len(ax.lines)
    finally:
        _close(figure)


def test_one_reward_function_is_drawn_once_under_its_name(tmp_path):
    run = _run_dir(tmp_path / "one", {"reward": 0.5, "rewards/accuracy/mean": 0.5})  # the same at every step
    assert line_names([read_metrics(str(run))], ["reward"]) == {"reward": "accuracy"}
    labels, _, lines = _reward_panel(run)
    assert labels == ["accuracy"] and lines == 2  # one series: as logged (faint) and smoothed (20 points)


def test_several_reward_functions_are_drawn_beside_the_total_in_bold(tmp_path):
    two = {"reward": 0.8, "rewards/accuracy/mean": 0.5, "rewards/format/mean": 0.3}
    labels, widths, lines = _reward_panel(_run_dir(tmp_path / "two", two))
    assert labels == ["reward (total)", "accuracy", "format"] and lines == 6
    assert widths[0] > widths[1] == widths[2]
    # a function at 0 throughout leaves the other equal to the total: drawn once, as the total (the 0 not at all)
    zero = {"reward": 0.8, "rewards/accuracy/mean": 0.0, "rewards/format/mean": 0.8}
    run = _run_dir(tmp_path / "zero", zero)
    labels, _, lines = _reward_panel(run)
    assert labels == ["reward (total) = format"] and lines == 2
    assert constant_series([read_metrics(str(run))])["rewards/accuracy/mean"] == 0.0


def test_a_constant_series_gets_no_line_and_alone_no_panel(tmp_path):
    run = tmp_path / "constant-lr"
    run.mkdir()
    records = [{"step": s, "loss": 2.0 - 0.1 * s, "grad_norm": 1.0 + s, "learning_rate": 1e-3, "step_time": 0.5,
                "mean_token_accuracy": 0.25} for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    steps = read_metrics(str(run))
    assert [panel.title for panel, _ in panels_with_data([steps])] == ["loss", "grad norm"]
    assert constant_series([steps]) == {"mean_token_accuracy": 0.25, "learning_rate": 1e-3, "step_time": 0.5}
    pytest.importorskip("matplotlib")
    text = open(plot_runs([str(run)], str(tmp_path / "c.svg")), encoding="utf-8").read()
    assert text.count("<g id=\"axes_") == 2 and "learning rate" not in text
    # one logged step is no constant (each panel shows its point); two runs at two constant rates are compared
    assert len(panels_with_data([{1: records[0]}])) == 5
    other = {s: {**r, "learning_rate": 2e-3} for s, r in steps.items()}
    assert "learning rate" in [panel.title for panel, _ in panels_with_data([steps, other])]
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in (1, 2)))
    with pytest.raises(PlotError, match=r"Every metric logged in .*flat holds one value over its steps: there is no "
                                        r"curve to draw \(`posttrain report` lists the values\)\.$"):
        plot_runs([str(flat)], str(tmp_path / "f.png"))


def test_the_smoothed_line_starts_at_the_data_and_follows_it():
    assert smooth([5.0]) == [5.0]  # debiased: not pulled toward 0
    values = smooth([1.0] * 50 + [3.0] * 200)
    assert values[49] == pytest.approx(1.0) and values[-1] == pytest.approx(3.0)
    assert 1.0 < values[55] < 3.0


@pytest.mark.parametrize("extension", [".png", ".svg", ".html"])
def test_several_runs_are_drawn_into_each_format(tmp_path, extension):
    pytest.importorskip("matplotlib")
    runs = [str(_run_dir(tmp_path / name, GRPO)) for name in ("a", "b")]
    out = tmp_path / "plots" / f"curves{extension}"
    assert plot_runs(runs, str(out)) == str(out)
    data = out.read_bytes()
    if extension == ".png":
        assert data.startswith(b"\x89PNG")
    else:
        text = data.decode()
        assert "<svg" in text and text.count("<g id=\"axes_") == 10  # the ten GRPO panels
        # each run in the legend (SVG text is kept as text), the one reward function under its name
        assert "a: accuracy" in text and "b: accuracy" in text and "a: completions/mean_length" in text
    if extension == ".html":  # one self-contained page: nothing fetched from elsewhere
        assert text.startswith("<!DOCTYPE html>") and "<?xml" not in text
        assert "src=" not in text and "<link" not in text


def test_what_cannot_be_plotted_is_one_sentence(tmp_path, monkeypatch):
    with pytest.raises(PlotError, match=r"has no metrics.jsonl: give the output_dir of a posttrain run\.$"):
        plot_runs([str(tmp_path / "nothing")], str(tmp_path / "p.png"))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    with pytest.raises(PlotError, match=r"No step is logged yet in .*empty: plot again after the first logging step\."):
        plot_runs([str(empty)], str(tmp_path / "p.png"))
    run = str(_run_dir(tmp_path / "run", SFT))
    with pytest.raises(PlotError, match=r"--out '.*p.jpg': the plot is written as .png, .svg, .html; end the name"):
        plot_runs([run], str(tmp_path / "p.jpg"))
    import importlib

    from posttrain._optional import MissingDependency

    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module",
                        lambda name, *a: (_ for _ in ()).throw(ImportError(name)) if name == "matplotlib"
                        else real(name, *a))
    with pytest.raises(MissingDependency) as err:
        plot_runs([run], str(tmp_path / "p.png"))
    assert str(err.value) == ("posttrain plot needs the optional package 'matplotlib': install it with "
                              "`pip install matplotlib`.")


def test_the_command_writes_next_to_the_first_run(tmp_path):
    pytest.importorskip("matplotlib")
    run = _run_dir(tmp_path / "run", DPO)
    done = subprocess.run([sys.executable, "-m", "posttrain.cli", "plot", str(run)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"posttrain: wrote {run / 'plots.png'}"
    assert (run / "plots.png").read_bytes().startswith(b"\x89PNG")
    done = subprocess.run([sys.executable, "-m", "posttrain.cli", "plot", str(tmp_path / "missing")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        f"posttrain: error: {tmp_path / 'missing'} has no metrics.jsonl: give the output_dir of a posttrain run.")


@pytest.mark.plots
@pytest.mark.parametrize("plot_on_end", [None, False])
def test_a_run_draws_its_curves_at_the_end_unless_told_not_to(tokenizer, addition_dataset, tmp_path, plot_on_end):
    pytest.importorskip("matplotlib")
    from posttrain import GRPOConfig, GRPOTrainer
    from posttrain.testing import tiny_model

    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=4, logging_steps=1, report_to="none",
                      plot_on_end=plot_on_end, use_cpu=True)
    GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), reward_funcs=lambda completions, **kw: [1.0] * len(
        completions), args=args, train_dataset=addition_dataset, processing_class=tokenizer).train()
    assert (tmp_path / "out" / "plots.png").exists() == (plot_on_end is None)
