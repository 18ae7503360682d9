"""evaluate() as transformers' Trainer takes it: an IterableDataset (read once, to its end) or a dict of them gives
the metrics of the same rows as a map-style Dataset, for SFT and DPO (GRPO: the same rows and batches; its
completions are sampled anew at each evaluation)."""

import pytest
from conftest import tiny_config
from datasets import Dataset, IterableDataset
from test_dpo_trainer import PAIRS as PREFERENCES
from test_dpo_trainer import dpo_config
from test_sft_trainer import TEXTS, sft_config

from posttrain.data import DataError
from posttrain.dpo.trainer import DPOTrainer
from posttrain.grpo.trainer import GRPOTrainer
from posttrain.sft.trainer import SFTTrainer
from posttrain.testing import tiny_model

SPEED = ("_runtime", "_samples_per_second", "_steps_per_second")


def _no_rows():
    yield from ()


def _same_metrics(a: dict, b: dict):
    quality = {k: v for k, v in a.items() if not k.endswith(SPEED)}
    assert quality and quality == pytest.approx({k: v for k, v in b.items() if not k.endswith(SPEED)})


def _sft(tokenizer, tmp_path):
    return SFTTrainer(tiny_model(tokenizer, hidden=32, layers=1), args=sft_config(tmp_path),
                      train_dataset=Dataset.from_dict({"text": TEXTS}), processing_class=tokenizer)


def test_sft_evaluates_an_iterable_dataset_and_a_dict_of_them(tokenizer, tmp_path):
    trainer = _sft(tokenizer, tmp_path)
    rows = Dataset.from_dict({"text": TEXTS[:10]})
    _same_metrics(trainer.evaluate(rows.to_iterable_dataset()), trainer.evaluate(rows))
    both = trainer.evaluate({"a": rows.to_iterable_dataset(), "b": rows.select(range(4)).to_iterable_dataset()})
    assert both["eval_a_loss"] == pytest.approx(trainer.evaluate(rows)["eval_loss"])
    assert both["eval_b_loss"] == pytest.approx(trainer.evaluate(rows.select(range(4)))["eval_loss"])
    with pytest.raises(DataError, match="has no rows"):
        trainer.evaluate(IterableDataset.from_generator(_no_rows))


def test_sft_evaluates_an_iterable_eval_dataset_during_training(tokenizer, tmp_path):
    rows = Dataset.from_dict({"text": TEXTS[:10]})
    trainer = SFTTrainer(tiny_model(tokenizer, hidden=32, layers=1),
                         args=sft_config(tmp_path, eval_strategy="steps", eval_steps=1),
                         train_dataset=Dataset.from_dict({"text": TEXTS}), eval_dataset=rows.to_iterable_dataset(),
                         processing_class=tokenizer)
    trainer.train()
    assert len([h for h in trainer.state.log_history if "eval_loss" in h]) == 2


def test_dpo_evaluates_an_iterable_dataset(tokenizer, tmp_path):
    trainer = DPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), args=dpo_config(tmp_path),
                         train_dataset=Dataset.from_dict(PREFERENCES), processing_class=tokenizer)
    rows = Dataset.from_dict(PREFERENCES).select(range(6))
    _same_metrics(trainer.evaluate(rows.to_iterable_dataset()), trainer.evaluate(rows))


def test_grpo_evaluates_an_iterable_dataset(tokenizer, addition_dataset, tmp_path):
    from posttrain.rewards.builtin import accuracy

    trainer = GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), accuracy, tiny_config(tmp_path),
                          train_dataset=addition_dataset, processing_class=tokenizer)
    rows = addition_dataset.select(range(4))
    steps = []
    trainer._call = lambda event, **kw: steps.append(event) if event == "on_prediction_step" else None
    streamed = trainer.evaluate(rows.to_iterable_dataset())
    batches = len(steps)
    whole = trainer.evaluate(rows)  # sampled again (other completions): the same rows, batches and metrics' names
    assert sorted(streamed) == sorted(whole) and batches == len(steps) - batches > 0
    assert 0.0 <= streamed["eval_rewards/accuracy/mean"] <= 1.0
