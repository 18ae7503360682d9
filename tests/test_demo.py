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
