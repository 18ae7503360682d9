"""The run report (posttrain/report.py): one self-contained HTML page that a real headless browser renders with its
curves, its summary, its completions table and its config, from the output directory alone."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

# Where what a test needs is missing it is skipped, but in CI (CI=true), where .ci/run installs all of it, it fails.
IN_CI = os.environ.get("CI") == "true"


def _missing(message: str, module_level: bool = False):
    """Skip for want of what `message` names, or under CI=true fail with that message."""
    __tracebackhide__ = True  # reported at the caller's line
    if IN_CI:
        pytest.fail(message, pytrace=False)
    pytest.skip(message, allow_module_level=module_level)


if importlib.util.find_spec("matplotlib") is None:
    _missing("matplotlib is not installed (CI installs it with the dev extra: pip install -e '.[dev,peft]').",
             module_level=True)
pytestmark = pytest.mark.plots

CHROMIUM = os.environ.get("POSTTRAIN_TEST_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def _run_dir(tmp_path):
    """An output_dir as a GRPO run with log_completions leaves it: 6 logged steps (one reward function, a constant
    learning rate), completions at each, a config, the end-of-training summary, the model and a checkpoint; one
    completion holds HTML and a conversation."""
    out = tmp_path / "my-run"
    (out / "checkpoint-3").mkdir(parents=True)
    (out / "checkpoint-3" / "trainer_state.json").write_text(json.dumps({"global_step": 3, "model_path": "org/tiny"}))
    (out / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]}}).encode()
    (out / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(48))
    with open(out / "metrics.jsonl", "w") as f:
        for step in range(1, 7):
            f.write(json.dumps({"step": step, "epoch": step / 6, "loss": 0.1 / step, "reward": 0.1 * step,
                                "rewards/accuracy/mean": 0.1 * step, "kl": 0.01 * step, "entropy": 2.0 - 0.1 * step,
                                "completions/mean_length": 3.0, "grad_norm": 0.5, "learning_rate": 1e-3,
                                "step_time": 0.1}) + "\n")
        f.write(json.dumps({"step": 6, "train_runtime": 1.5, "train_loss": 0.04}) + "\n")
    with open(out / "completions.jsonl", "w") as f:
        for step in range(1, 7):
            for i in range(4):
                completion = "<b>not bold</b> & 7" if (step, i) == (1, 0) else f"{step + i}"
                prompt = [{"role": "user", "content": f"{step}+{i}="}] if i == 3 else f"{step}+{i}="
                f.write(json.dumps({"step": step, "prompt": prompt, "completion": completion,
                                    "rewards": {"accuracy": float(i % 2)}, "advantage": 0.5 - i % 2,
                                    "golden": str(step + i)}) + "\n")
    (out / "all_results.json").write_text(json.dumps({"train_runtime": 1.5, "train_loss": 0.04, "epoch": 1.0}))
    (out / "posttrain_config.yaml").write_text("learning_rate: 0.001\nnum_generations: 4\nloss_type: dapo\n")
    return out


def test_the_report_holds_every_piece_escaped(tmp_path):
    from posttrain.report import chosen_steps, write_report

    out = _run_dir(tmp_path)
    path = write_report(str(out))
    assert path == str(out / "report.html")
    page = open(path, encoding="utf-8").read()
    assert page.count("<svg") == 1  # the curves inline
    assert not any(tag in page for tag in ("<script", "<link", "<img", "src=", "href=\"http"))  # nothing to fetch
    assert "&lt;b&gt;not bold&lt;/b&gt; &amp; 7" in page and "<b>not bold</b>" not in page
    assert "user: 6+3=" in page  # a conversation as role: content
    assert [f"<h3>Step {s} " in page for s in (1, 4, 6)] == [True, True, True]  # first, middle, last
    assert "loss_type" in page and "dapo" in page and "train_runtime" in page
    assert chosen_steps([1, 2, 3], [2, 9]) == [2] and chosen_steps([5], None) == [5] and chosen_steps([], None) == []


def test_a_run_without_completions_or_summary_says_so(tmp_path):
    from posttrain.report import write_report

    out = tmp_path / "running"
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n{\"step\": 2, \"lo")  # half-written
    page = open(write_report(str(out)), encoding="utf-8").read()
    assert "No completions.jsonl: set log_completions=True" in page
    assert "No all_results.json: the run has not finished." in page
    assert "No posttrain_config.yaml" in page and page.count("<svg") == 0  # one logged step: no curve
    assert "Only step 1 is logged in" in page and "so there is no curve to draw" in page


def test_the_report_command(tmp_path):
    out = _run_dir(tmp_path)
    run = subprocess.run([sys.executable, "-m", "posttrain.cli", "report", str(out), "--steps", "2", "5", "--rows",
                          "2", "--out", str(tmp_path / "r.html")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"posttrain: wrote {tmp_path / 'r.html'}"
    page = open(tmp_path / "r.html", encoding="utf-8").read()
    assert "<h3>Step 2 (2 of 4 completions, of 4 prompts)</h3>" in page and "<h3>Step 5 (2 of 4 completions, of 4 prompts)</h3>" in page
    assert "<h3>Step 1 " not in page


def test_a_headless_browser_renders_the_curves_and_the_tables(tmp_path):
    """Opened from disk (file://, no server) in headless Chromium: the curves are drawn (an SVG with its panels'
    lines and titles, of real size), the completions tables show their rows (with the HTML in a completion shown
    as text), the summary is visible and the config opens on a click, and the page fetched nothing."""
    if CHROMIUM is None:
        _missing("No Chromium found (POSTTRAIN_TEST_CHROMIUM, or `chromium` or `chromium-browser` on PATH): CI "
                 "installs Debian's `chromium` with apt-get, or else Playwright's own (`python -m playwright install "
                 "chromium`), in .ci/run.")
    try:
        import playwright.sync_api as playwright
    except ImportError:
        playwright = None
    if playwright is None:
        _missing("The playwright package is not installed (CI installs it with the dev extra: "
                 "pip install -e '.[dev,peft]').")
    from posttrain.report import write_report

    path = write_report(str(_run_dir(tmp_path)))
    requests = []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.on("request", lambda request: requests.append(request.url))
        page.goto(f"file://{path}")
        svg = page.locator("svg").first.bounding_box()
        assert svg is not None and svg["width"] > 600 and svg["height"] > 200
        assert page.locator("svg path").count() > 20  # the panels' lines, axes and ticks
        titles = page.locator("svg text").all_text_contents()
        assert {"reward", "KL to the reference", "entropy"} <= {t.strip() for t in titles}
        tables = page.locator("table.completions")
        assert tables.count() == 3
        first = tables.first
        assert first.locator("tbody tr").count() == 4 and first.is_visible()
        cells = first.locator("tbody tr").first.locator("td").all_inner_texts()
        assert cells[:3] == ["1+0=", "<b>not bold</b> & 7", "0"]
        assert first.locator("th").all_inner_texts() == ["prompt", "completion", "accuracy", "advantage", "golden"]
        box = first.locator("tbody tr").first.bounding_box()
        assert box is not None and box["height"] > 5 and box["width"] > 100
        assert page.locator("table.summary").is_visible() and not page.locator("table.config").is_visible()
        page.locator("details summary").click()  # the config, folded away, opens
        assert page.locator("table.config").is_visible()
        assert page.locator("table.config tbody tr").count() == 3
        page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        _the_summary_first_on_a_styled_self_contained_page(page, tmp_path / "my-run")
        browser.close()
    assert requests == [f"file://{path}"]  # the page itself only
    assert os.path.getsize(tmp_path / "report.png") > 20_000


def _the_summary_first_on_a_styled_self_contained_page(page, out):
    """The page's own stylesheet and nothing to fetch; the summary first (how the reward moved, where the outputs
    are) and in view; a centred column narrower than a wide window; numbers right-aligned; dark when asked."""
    assert page.locator("head > style").count() == 1  # (the SVG has its own)
    targets = page.eval_on_selector_all("[src], [href]", "els => els.map(e => e.getAttribute('src') ?? "
                                                         "e.getAttribute('href'))")
    assert targets and not [t for t in targets if re.match(r"(https?:)?//|[a-z]+:", t)]  # local, relative links
    first = page.locator("main > section").first
    assert first.get_attribute("id") == "summary"
    text = first.inner_text()
    assert "reward (accuracy) 0.1 → 0.6 (+0.5)" in text  # the first 10% of the steps (one) against the last
    for path in (out, out / "model.safetensors", out / "checkpoint-3", out / "metrics.jsonl", out / "completions.jsonl"):
        assert str(path) in text
    page.set_viewport_size({"width": 1600, "height": 900})
    column = page.locator("main").bounding_box()
    assert column is not None and 700 < column["width"] < 1300
    assert abs(column["x"] - (1600 - column["x"] - column["width"])) <= 2  # centred
    headline = page.locator("p.headline").bounding_box()
    assert headline is not None and headline["y"] + headline["height"] < 900  # in the first screen
    cell = page.locator("table.movement tbody td.num").first
    assert cell.evaluate("e => getComputedStyle(e).textAlign") == "right"
    assert page.evaluate("getComputedStyle(document.body).fontFamily").startswith("system-ui")
    page.emulate_media(color_scheme="dark")
    assert page.evaluate("getComputedStyle(document.body).backgroundColor") == "rgb(13, 17, 23)"


def test_the_summary_comes_first_with_how_the_run_moved_how_long_and_where_its_outputs_are(tmp_path):
    from posttrain.report import write_report

    out = _run_dir(tmp_path)
    page = open(write_report(str(out)), encoding="utf-8").read()
    assert re.findall(r"<section id=\"(\w+)\">", page) == ["summary", "curves", "completions", "details"]
    header = page[page.index("<header>"):page.index("</header>")]
    assert "<h1>my-run</h1>" in header and "<dt>trainer</dt><dd>GRPO</dd>" in header
    assert "<dd>org/tiny (Qwen2ForCausalLM, 12 parameters)</dd>" in header  # the checkpoint's source, the weights
    summary = page[page.index("<section id=\"summary\">"):page.index("</section>")]
    assert "reward (accuracy) <strong>0.1 → 0.6</strong>" in summary
    assert "rewards/accuracy/mean" not in summary  # the one function is the reward: one row
    assert ('<td>kl</td><td class="num">0.01</td><td class="num">0.06</td><td class="num">+0.05</td>'
            '<td class="num">1 → 6</td>') in summary
    assert "the first record of the 6 logged training records (step 1); last: of the last record (step 6)" in summary
    assert "6 steps · 1 epoch · 1.5 s wall time" in summary
    assert 'href="checkpoint-3"' in summary and 'href="model.safetensors"' in summary  # relative: nothing fetched
    assert "train_runtime" not in summary and "train_runtime" in page  # the summary record in the details
    curves = page[page.index("<section id=\"curves\">"):]
    assert "<code>learning_rate</code> = 0.001" in curves[:curves.index("</section>")]  # constant: said, not drawn


def test_first_and_last_are_a_tenth_of_the_logged_records_at_each_end():
    from posttrain.report.run import trainer_of
    from posttrain.report.summary import movements

    steps = {s: {"step": s, "loss": float(s), "mean_token_accuracy": s / 20} for s in range(1, 21)}
    steps[10]["eval_loss"], steps[20]["eval_loss"] = 5.0, 4.0
    rows, note = movements(steps, "SFT")
    assert [row[:4] for row in rows] == [("loss", 1.5, 19.5, "1-2 → 19-20"),
                                         ("mean_token_accuracy", pytest.approx(0.075), pytest.approx(0.975),
                                          "1-2 → 19-20"), ("eval_loss", 5.0, 4.0, "10 → 20")]
    assert note == ("First: the mean of the first 2 records of the 20 logged training records (step 1-2); last: of "
                    "the last 2 records (step 19-20); 10% at each end, at least one; evaluation: the first "
                    "evaluation against the last.")
    dpo = {s: {"step": s, "loss": 0.7 - s / 10, "rewards/accuracies": s / 4, "rewards/margins": s / 2,
               "rewards/chosen": 0.1} for s in (1, 2, 3)}
    assert trainer_of(None, set(dpo[1])) == "DPO" and trainer_of({"num_generations": 8}, set(dpo[1])) == "GRPO"
    rows, _ = movements(dpo, "DPO")
    assert [row[:3] for row in rows] == [("loss", pytest.approx(0.6), pytest.approx(0.4)),
                                         ("rewards/accuracies", 0.25, 0.75), ("rewards/margins", 0.5, 1.5)]
    rows, note = movements({7: {"step": 7, "loss": 2.0}}, "SFT")
    assert rows == [("loss", 2.0, 2.0, "7", "loss")]
    assert note == "One training record is logged (step 7): nothing has moved yet."


# each way a run's file can be damaged (a crash, a full disk, an editor): the file, and a change of its lines
DAMAGE = {
    "metrics: not UTF-8": ("metrics.jsonl", lambda lines: lines[:1] + [b'{"step": 2, "loss": "\xff\xfe"}'] + lines[2:]),
    "metrics: a line cut short": ("metrics.jsonl", lambda lines: lines[:1] + [lines[1][:30]] + lines[2:]),
    "metrics: not objects, steps not whole numbers": (
        "metrics.jsonl", lambda lines: lines[:1] + [b"[1, 2]", b"null", b'{"step": "two"}', b'{"step": 2.5}',
                                                    b'{"loss": 1.0}', b'{"step": -1}'] + lines[2:]),
    "completions: not UTF-8, cut short, fields of other types": (
        "completions.jsonl", lambda lines: lines[:1] + [b'{"step": 1, "prompt": "\xff"}', lines[1][:25], b"[1]",
                                                        b'{"step": 1, "prompt": 5}', b'{"step": 1, "rewards": "x"}',
                                                        b'{"step": 1, "rewards": {"f": "z"}}',
                                                        b'{"step": 1, "advantage": "y"}'] + lines[2:]),
    "completions: binary": ("completions.jsonl", lambda lines: [bytes(range(256))]),
    "config: not YAML": ("posttrain_config.yaml", lambda lines: [b"learning_rate: [1, 2", b"  b: {"]),
    "config: not UTF-8": ("posttrain_config.yaml", lambda lines: [b"\xff\xfe\x00"]),
    "config: a list": ("posttrain_config.yaml", lambda lines: [b"- 1", b"- 2"]),
    "summary, state, model header damaged": ("model.safetensors", lambda lines: [
        (40).to_bytes(8, "little") + b'{"w": {"shape": "ab", "dtype": 5}}     ']),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_run_files_are_skipped_and_named_and_the_rest_drawn(damage, tmp_path, capfd, caplog):
    """`posttrain plot` and `posttrain report` on a run whose file is damaged: exit 0, the intact steps drawn, each
    skipped part named in one warning per command (and on the report's page); the files only the report reads (the
    summary, a checkpoint's state, config.json, a weight file's header) damaged beside it are left out quietly."""
    from conftest import run_posttrain

    from posttrain.report.tables import escape

    out = _run_dir(tmp_path)
    name, change = DAMAGE[damage]
    lines = (out / name).read_bytes().split(b"\n")[:-1]
    (out / name).write_bytes(b"\n".join(change(lines)) + b"\n")
    if damage.startswith("summary"):
        (out / "all_results.json").write_bytes(b'{"train_runtime": 1.')
        (out / "checkpoint-3" / "trainer_state.json").write_bytes(b"[1, 2]")
        (out / "config.json").write_bytes(b'{"architectures": 5}')
    with caplog.at_level("WARNING", logger="posttrain"):
        plot = run_posttrain(["plot", str(out), "--out", str(tmp_path / "p.svg")], capfd)
        plot_said = [r.getMessage() for r in caplog.records]
        caplog.clear()
        report = run_posttrain(["report", str(out)], capfd)
        report_said = [r.getMessage() for r in caplog.records]
    assert plot.returncode == 0 and report.returncode == 0, plot.stderr + report.stderr
    assert "reward" in (tmp_path / "p.svg").read_text()
    page = (out / "report.html").read_text(encoding="utf-8")
    assert page.count("<svg") == 1  # the intact steps' curves
    kind = damage.split(":")[0]
    expected = {"metrics": "metrics.jsonl: skipped", "completions": "completions.jsonl: skipped",
                "config": "posttrain_config.yaml "}.get(kind)
    if kind == "metrics":  # the plot reads metrics.jsonl only
        assert len(plot_said) == 1 and plot_said[0].startswith(f"{out}: {expected}"), plot_said
    else:
        assert plot_said == []
    if expected is None:
        assert report_said == [] and "Qwen2ForCausalLM" not in page
        return
    assert len(report_said) == 1 and report_said[0].startswith(f"{out}: {expected}"), report_said
    note = report_said[0].split(": ", 1)[1]
    assert note.endswith(".") and escape(note) in page
    if kind == "completions" and not damage.endswith("binary"):
        assert "<h3>Step 1 (3 of 3 completions, of 3 prompts)</h3>" in page  # step 1 rows but the one cut short


def test_a_steps_completions_are_shown_a_prompt_at_a_time():
    """Eight completions of each of four prompts (GRPO's groups): the table's 8 rows show every prompt twice, not one
    prompt's group."""
    from posttrain.report.sections import spread_over_prompts

    logged = [{"prompt": f"p{p}", "completion": f"c{p}{g}"} for p in range(4) for g in range(8)]
    shown, prompts = spread_over_prompts(logged, 8)
    assert prompts == 4 and [r["completion"] for r in shown] == ["c00", "c10", "c20", "c30", "c01", "c11", "c21", "c31"]
    assert spread_over_prompts(logged[:3], 8) == (logged[:3], 1)


def test_a_scripts_before_and_after_figures_head_the_summary(tmp_path):
    """The demo saves its sampled accuracy into all_results.json: the report's summary opens with it."""
    from posttrain.report import write_report

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in (1, 2)))
    (tmp_path / "all_results.json").write_text(json.dumps({"sampled_accuracy_before": 0.03,
                                                           "sampled_accuracy_after": 0.74, "train_runtime": 9.0}))
    page = open(write_report(str(tmp_path)), encoding="utf-8").read()
    summary = page[page.index("<h2>Summary</h2>"):]
    assert summary.index("sampled accuracy <strong>0.03 → 0.74</strong>") < summary.index("reward")


def test_the_report_without_matplotlib_says_so_in_place_of_the_curves(tmp_path, monkeypatch):
    import importlib

    from posttrain.report import write_report

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1 / s}) + "\n" for s in (1, 2, 3)))
    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name, *a: (_ for _ in ()).throw(ImportError(name))
                        if name == "matplotlib" else real(name, *a))
    page = open(write_report(str(tmp_path)), encoding="utf-8").read()
    assert "The curves are drawn with matplotlib, which is not installed: pip install matplotlib." in page
    assert "<h2>Summary</h2>" in page and "<svg" not in page
