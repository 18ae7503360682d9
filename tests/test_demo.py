import json


def test_demo_learns(tmp_path, monkeypatch):
    """The acceptance of `posttrain demo`'s training: last-10% mean reward at least 0.3 above the first 10%, and
    sampled accuracy 0.3 higher after than before, within the first 400 of the demo's 1200 steps (the same model,
    task, config and seed: the learning shows by then, at a third of the time; the README's first command runs
    all 1200)."""
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    from posttrain.demo import run_demo

    summary = run_demo(str(tmp_path / "demo"), max_steps=400, seed=0)
    assert summary["reward_last_10pct"] - summary["reward_first_10pct"] >= 0.3
    # judged afresh after training, on all 25 prompts, with samples the training never saw
    assert summary["sampled_accuracy_after"] - summary["sampled_accuracy_before"] >= 0.3
    lines = [json.loads(line) for line in open(tmp_path / "demo" / "metrics.jsonl")]
    assert lines[-1]["summary"] == summary and len(lines) == 401
    assert (tmp_path / "cache" / "demo-model-v2" / "model.safetensors").exists()
    report = (tmp_path / "demo" / "report.html").read_text()  # the report opens with the demo's own figure
    before, after = (f"{summary[f'sampled_accuracy_{k}']:.4g}" for k in ("before", "after"))
    assert f"sampled accuracy <strong>{before} → {after}</strong>" in report


def test_an_unwritable_cache_builds_the_demo_model_for_the_run_and_says_so(tmp_path, monkeypatch, capsys):
    """A read-only or full HOME (here the cache's parent is a file) does not stop the demo: its model is built in a
    temporary directory, with one line naming the cause and POSTTRAIN_CACHE."""
    import os
    import shutil

    from posttrain.demo import demo_model_path

    (tmp_path / "home").write_text("a file, not a directory")
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "home" / "cache"))
    path = demo_model_path()
    try:
        assert os.path.exists(os.path.join(path, "model.safetensors")) and not path.startswith(str(tmp_path))
        line = capsys.readouterr().out.strip().splitlines()[-1]  # (after DeepSpeed's accelerator line, on first import)
        assert line == (f"posttrain: Could not cache the demo's model at {tmp_path / 'home' / 'cache'}: a part of the "
                        f"path is a file, not a directory; built it in {path} for this run (set POSTTRAIN_CACHE to a "
                        "writable directory to keep it).")
    finally:
        shutil.rmtree(path, ignore_errors=True)
