"""The best checkpoint as transformers tracks it: metric_for_best_model, greater_is_better, save_strategy="best",
load_best_model_at_end and save_total_limit keeping the best; kept across a resume; the errors a user can cause."""

import os

import pytest
import torch
from conftest import StopAt
from datasets import Dataset
from safetensors.torch import load_file
from test_sft_trainer import TEXTS, sft_config

from posttrain.configs import ConfigError, SFTConfig
from posttrain.sft.trainer import SFTTrainer
from posttrain.testing import tiny_model
from posttrain.training.checkpoint import rotated_away

SCRIPTED = {1: 3.0, 2: 1.0, 3: 2.0, 4: 2.5}  # eval_loss by step: step 2 is the best


def _trainer(tokenizer, tmp_path, scripted=SCRIPTED, callbacks=None, **overrides):
    values = dict(max_steps=4, per_device_train_batch_size=4, eval_strategy="steps", eval_steps=1,
                  save_strategy="steps", save_steps=1)
    values.update(overrides)
    data = Dataset.from_dict({"text": TEXTS})
    trainer = SFTTrainer(tiny_model(tokenizer, hidden=32, layers=1), args=sft_config(tmp_path, **values),
                         train_dataset=data, eval_dataset=data, processing_class=tokenizer, callbacks=callbacks)
    measured = trainer._evaluation_metrics

    def evaluation(dataset, prefix):  # the real metrics, with eval_loss scripted so that the best step is known
        metrics = measured(dataset, prefix)
        return dict(metrics, **{f"{prefix}_loss": scripted[trainer.state.global_step]})

    trainer._evaluation_metrics = evaluation
    return trainer


def _weights(path) -> dict:
    return load_file(os.path.join(path, "model.safetensors"))


def test_the_best_checkpoint_is_recorded_kept_and_loaded_at_the_end(tokenizer, tmp_path):
    trainer = _trainer(tokenizer, tmp_path, load_best_model_at_end=True, save_total_limit=2)
    assert (trainer.args.metric_for_best_model, trainer.args.greater_is_better) == ("loss", False)
    trainer.train()
    out = tmp_path / "out"
    state = trainer.state
    assert (state.best_metric, state.best_global_step) == (1.0, 2)
    assert state.best_model_checkpoint == str(out / "checkpoint-2")
    # the limit of 2 keeps the best and the newest, not the two newest
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint-")) == ["checkpoint-2", "checkpoint-4"]
    best, last = _weights(out / "checkpoint-2"), _weights(out / "checkpoint-4")
    final = _weights(out)
    assert all(torch.equal(final[k], best[k]) for k in best)  # the model saved at the end is the best one
    assert any(not torch.equal(last[k], best[k]) for k in best)


def test_save_strategy_best_saves_only_new_bests(tokenizer, tmp_path):
    trainer = _trainer(tokenizer, tmp_path, save_strategy="best", metric_for_best_model="eval_loss",
                       scripted={1: 3.0, 2: 1.0, 3: 2.0, 4: 0.5})
    trainer.train()
    saved = sorted(p for p in os.listdir(tmp_path / "out") if p.startswith("checkpoint-"))
    assert saved == ["checkpoint-1", "checkpoint-2", "checkpoint-4"]
    assert trainer.state.best_model_checkpoint == str(tmp_path / "out" / "checkpoint-4")


def test_greater_is_better_for_a_metric_not_named_loss(tokenizer, tmp_path):
    trainer = _trainer(tokenizer, tmp_path, metric_for_best_model="mean_token_accuracy")
    assert trainer.args.greater_is_better is True
    trainer.train()
    accuracies = {h["step"]: h["eval_mean_token_accuracy"] for h in trainer.state.log_history
                  if "eval_mean_token_accuracy" in h}
    best_step = max(accuracies, key=lambda s: (accuracies[s], -s))  # the first of equal bests, as transformers
    assert trainer.state.best_global_step == best_step and trainer.state.best_metric == accuracies[best_step]


def test_the_best_survives_a_resume(tokenizer, tmp_path):
    _trainer(tokenizer, tmp_path, load_best_model_at_end=True, callbacks=[StopAt(3)]).train()
    resumed = _trainer(tokenizer, tmp_path, load_best_model_at_end=True, resume_from_checkpoint=True)
    resumed.train()
    assert (resumed.state.best_metric, resumed.state.best_global_step) == (1.0, 2)
    best = _weights(tmp_path / "out" / "checkpoint-2")
    final = _weights(tmp_path / "out")
    assert all(torch.equal(final[k], best[k]) for k in best)


def test_rotation_never_removes_the_best():
    found = [(s, f"c-{s}") for s in (1, 2, 3, 4, 5)]
    assert rotated_away(found, 2, "c-2") == ["c-1", "c-3", "c-4"]
    assert rotated_away(found, 1, "c-2") == ["c-1", "c-3", "c-4"]  # the newest stays beside the best
    assert rotated_away(found, 1, "c-5") == ["c-1", "c-2", "c-3", "c-4"]
    assert rotated_away(found, 3, None) == ["c-1", "c-2"] and rotated_away(found, None, "c-2") == []


def test_the_errors_a_user_can_cause(tokenizer, tmp_path):
    with pytest.raises(ConfigError, match="eval_strategy='no' and save_strategy='steps'"):
        SFTConfig(output_dir=str(tmp_path), load_best_model_at_end=True)
    with pytest.raises(ConfigError, match="save_steps=3 is not a multiple of eval_steps=2"):
        SFTConfig(output_dir=str(tmp_path), load_best_model_at_end=True, eval_strategy="steps", eval_steps=2,
                  save_steps=3)
    with pytest.raises(ConfigError, match="save_strategy='best'.*set metric_for_best_model"):
        SFTConfig(output_dir=str(tmp_path), save_strategy="best", eval_strategy="steps")
    SFTConfig(output_dir=str(tmp_path), load_best_model_at_end=True, eval_strategy="steps", save_strategy="best")
    trainer = _trainer(tokenizer, tmp_path, metric_for_best_model="accuracy")
    with pytest.raises(ConfigError, match="metric_for_best_model='accuracy' is not among the evaluation's metrics"):
        trainer.train()
