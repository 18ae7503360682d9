"""What a run shows on the terminal: the progress line at any width, the completions table (escaped, one line per
completion, above the line), the files named at the end of train(), and no third-party noise in a normal run."""

import io
import logging
import re
import types
import warnings

import pytest
from conftest import length_reward, tiny_config

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _console(width: int, height: int = 25):
    from rich.console import Console

    return Console(width=width, height=height, file=io.StringIO(), force_terminal=True, color_system="standard")


def _metrics_logger(tmp_path, console, total=1200, **args):
    from posttrain.training.logging import MetricsLogger

    values = dict(output_dir=str(tmp_path), report_to=[], disable_tqdm=None, log_level="passive")
    values.update(args)
    return MetricsLogger(types.SimpleNamespace(**values), total, title="GRPO", console=console,
                         shown=("reward", "entropy", "completions/mean_length"))


@pytest.mark.parametrize("width", [80, 60])
def test_the_progress_line_stays_one_line_and_keeps_the_headline_and_the_time_left(tmp_path, width):
    console = _console(width)
    log = _metrics_logger(tmp_path, console)
    log.start_time -= 3 * 3600 + 505  # hours elapsed: the longest clocks
    for _ in range(1198):
        log.advance()
    log.emit({"step": 1198, "epoch": 1.0, "reward": 0.75, "entropy": 0.01153, "completions/mean_length": 3.0})
    log.live.refresh()
    log.close()
    output = console.file.getvalue()
    assert "\x1b[1A" not in output  # never redrawn over more than one line: no cursor-up
    lines = [ANSI.sub("", line) for line in output.replace("\r", "\n").splitlines() if ANSI.sub("", line).strip()]
    assert lines and all(len(line) <= width for line in lines)
    last = lines[-1]
    assert re.search(r"1198/1200 .*\d:\d\d left reward=0\.75", last), last
    if width == 80:
        assert "elapsed" in last and "(avg" in last and "━" in last  # room for the bar and the moving average


def test_the_progress_line_leaves_out_what_does_not_fit_in_order(tmp_path):
    from posttrain.training.logging import ProgressLine

    log = _metrics_logger(tmp_path, None, disable_tqdm=True)
    assert log.live is None
    log.step = 10
    log.emit({"step": 10, "epoch": 0.1, "reward": 0.5, "entropy": 2.5, "completions/mean_length": 7.0})
    line = ProgressLine(log)
    full = line.render(200).plain
    assert "entropy=2.5  length=7" in full and "elapsed" in full and "━" * 40 in full
    for width in (100, 80, 60, 45, 38, 25):
        text = line.render(width).plain
        assert len(text) <= width and "10/1200" in text, (width, text)
        assert ("left" in text and "reward=0.5" in text) or width < 30, (width, text)
    assert "length" not in line.render(80).plain and "elapsed" not in line.render(60).plain
    assert "━" not in line.render(45).plain and "(avg" not in line.render(38).plain


def test_terminal_text_escapes_control_characters_only():
    from posttrain.training.logging import terminal_text

    assert terminal_text("a\x1b[2Jb\rc\x07\x9bd\x00") == "a\\x1b[2Jb\\x0dc\\x07\\x9bd\\x00"
    assert terminal_text("line\n\tindented ✓ é 中") == "line\n\tindented ✓ é 中"
    from posttrain.grpo.completions import _one_line

    assert _one_line("a\r\nb\nc\td\re") == "a↵b↵c d\\x0de"  # a table cell: one line


def _completion_log(tmp_path, rows, to_print=None, log_level="passive"):
    from posttrain.grpo.completions import CompletionLog

    args = types.SimpleNamespace(output_dir=str(tmp_path), num_completions_to_print=to_print, log_completions=True,
                                 log_unique_prompts=False, log_level=log_level)
    log = CompletionLog(args, types.SimpleNamespace(is_main_process=True), ["accuracy", "format_reward"])
    log.last = rows
    return log


def _rows(n: int) -> list[dict]:
    hostile = "[b]x[/b]\x1b[31mred\x1b[0m \x1b]0;title\x07 then\na second line " + "x" * 200
    return [{"step": 3, "prompt": f"{i}+{i}= [link=http://e.x]p[/link]", "completion": hostile,
             "rewards": {"accuracy": 1.0, "format_reward": None}, "advantage": 0.123456, "source": f"set {i}"}
            for i in range(n)]


def test_the_completions_table_is_escaped_one_line_a_row_and_within_the_width(tmp_path):
    console = _console(80)
    log = _metrics_logger(tmp_path, console)
    _completion_log(tmp_path, _rows(16), to_print=5).show(3, log)
    log.close()
    output = console.file.getvalue()
    text = ANSI.sub("", output.replace("\r", "\n"))
    assert "\x1b]" not in output and "\x07" not in output and "\x1b[31m" not in output  # the model's bytes, escaped
    rows = [line for line in text.splitlines() if re.search(r"\d+\+\d+= ", line)]
    assert len(rows) == 5  # num_completions_to_print, one line each
    assert all(len(line) <= 80 for line in text.splitlines())
    assert "[b]x[/b]\\x1b[31m" in text and "[l" in text  # escaped, and markup printed as written
    assert all(re.search(r"1\.00 +- +0\.12 ", line) for line in rows)  # rewards (None: -), advantage: 2 decimals
    assert "source" in text and "Completions at step 3" in text
    assert text.rstrip().splitlines()[-1].startswith("GRPO")  # the progress line stays at the bottom


def test_num_completions_to_print_means_what_it_means_in_trl_and_the_table_keeps_the_line_in_view(tmp_path):
    from posttrain.grpo.completions import completions_table

    def printed(to_print, height=100, log_level="passive"):
        console = _console(100, height)
        log = _metrics_logger(tmp_path, console, log_level=log_level)
        _completion_log(tmp_path, _rows(16), to_print, log_level).show(3, log)
        log.close()
        return ANSI.sub("", console.file.getvalue().replace("\r", "\n"))

    assert len(re.findall(r"\d+\+\d+= ", printed(None))) == 16  # None: all of them
    assert len(re.findall(r"\d+\+\d+= ", printed(40))) == 16
    assert "Completions" not in printed(0)  # 0: none
    assert "Completions" not in printed(None, log_level="error")  # --quiet: nothing per step
    small = printed(None, height=12)  # 10 lines of room: title, header, rule, 6 rows and how many more
    assert len(re.findall(r"\d+\+\d+= ", small)) == 6 and "10 more of this step in" in small
    narrow, wide = _console(60), _console(400)
    for console in (narrow, wide):
        console.print(completions_table(3, _rows(2), ["accuracy", "format_reward"], "completions.jsonl"))
    assert all(len(line) <= 60 for line in ANSI.sub("", narrow.file.getvalue()).splitlines())
    rows = [line for line in ANSI.sub("", wide.file.getvalue()).splitlines() if "+" in line]
    assert len(rows) == 2 and all("[b]x[/b]\\x1b[31mred\\x1b[0m \\x1b]0;title\\x07 then↵a second" in r for r in rows)
    assert "[link=http://e.x]p[/link]" in rows[0] and "\x07" not in wide.file.getvalue()


def test_the_end_of_train_names_the_files_written_and_only_those(tmp_path):
    from posttrain.training.outputs import outputs_summary

    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    (tmp_path / "report.html").write_text("")
    lines = outputs_summary(str(tmp_path)).splitlines()
    assert lines[0] == f"posttrain: training done; the run's files are in {tmp_path}"
    assert [line.split()[0] for line in lines[1:]] == ["adapter_model.safetensors", "metrics.jsonl", "report.html"]
    (tmp_path / "merged").mkdir()
    (tmp_path / "plots.png").write_bytes(b"")
    names = [line.split()[0] for line in outputs_summary(str(tmp_path)).splitlines()[1:]]
    assert names == ["adapter_model.safetensors", "merged/", "metrics.jsonl", "plots.png", "report.html"]


def test_a_tiny_run_says_where_its_files_are_and_warns_of_nothing(tokenizer, addition_dataset, tmp_path, capsys):
    from posttrain.grpo.trainer import GRPOTrainer
    from posttrain.testing import tiny_model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), length_reward,
                              tiny_config(tmp_path, max_steps=1, disable_tqdm=True), train_dataset=addition_dataset,
                              processing_class=tokenizer)
        trainer.train()
    assert not [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))], [
        f"{w.filename}:{w.lineno}: {w.message}" for w in caught]
    out = capsys.readouterr().out.splitlines()
    start = out.index(f"posttrain: training done; the run's files are in {tmp_path / 'out'}")
    assert [line.split()[0] for line in out[start + 1:]] == ["model.safetensors", "metrics.jsonl"]
    trainer.args.log_level = "error"  # --quiet
    trainer._print_outputs()
    assert capsys.readouterr().out == ""


def test_a_lora_run_with_checkpointing_warns_of_nothing(tokenizer, addition_dataset, tmp_path):
    peft = pytest.importorskip("peft")
    from posttrain.grpo.trainer import GRPOTrainer
    from posttrain.testing import tiny_model

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), length_reward,
                    tiny_config(tmp_path, max_steps=1, disable_tqdm=True, gradient_checkpointing=True),
                    train_dataset=addition_dataset, processing_class=tokenizer,
                    peft_config=peft.LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM")).train()
    assert not [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))], [
        f"{w.filename}:{w.lineno}: {w.message}" for w in caught]


def test_deepspeeds_cpu_notice_is_dropped_and_its_other_messages_pass():
    from posttrain.training.logging import hide_deepspeed_cpu_notice

    ds_logger = logging.getLogger("DeepSpeed")
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    ds_logger.addHandler(handler)
    try:
        hide_deepspeed_cpu_notice()
        hide_deepspeed_cpu_notice()  # once is enough, twice adds nothing
        ds_logger.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to "
                          "detect it.")
        ds_logger.warning("Something else")
    finally:
        ds_logger.removeHandler(handler)
    assert seen == ["Something else"]
    assert sum(getattr(f, "__name__", "") == "_drop_cpu_notice" for f in ds_logger.filters) == 1
