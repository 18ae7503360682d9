"""evaluate() as transformers' Trainer takes it: an IterableDataset (read once, to its end) or a dict of them gives
the metrics of the same rows as a map-style Dataset, for SFT and DPO (GRPO: the same rows and batches; its
completions are sampled anew at each evaluation)."""

import pytest
import torch
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


def _labels_of(tokenizer, texts):
    """The tokens of whole-text rows: the text and its EOS (TRL's labels, every token trained on)."""
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    return ids


@pytest.mark.parametrize("batched", [False, True])
def test_sft_compute_metrics_gets_trls_logits_and_labels(tokenizer, tmp_path, batched):
    """compute_metrics receives what TRL's evaluation loop gives it: the model's own logits of every row and the
    labels (the tokens trained on, -100 on padding), batches concatenated with -100 padding; its metrics are prefixed;
    preprocess_logits_for_metrics runs per batch."""
    from transformers import EvalPrediction

    rows = Dataset.from_dict({"text": TEXTS[:6]})
    seen, preprocessed = [], []

    def compute_metrics(prediction: EvalPrediction, compute_result: bool = True):
        seen.append(prediction)
        return {"my_metric": 0.123, "eval_already": 1.0}

    def preprocess(logits, labels):
        preprocessed.append(logits.shape)
        return logits.argmax(-1)

    model = tiny_model(tokenizer, hidden=32, layers=1)
    trainer = SFTTrainer(model, args=sft_config(tmp_path, per_device_eval_batch_size=4, batch_eval_metrics=batched,
                                                include_for_metrics=["inputs"]),
                         train_dataset=Dataset.from_dict({"text": TEXTS}), processing_class=tokenizer,
                         compute_metrics=compute_metrics, preprocess_logits_for_metrics=preprocess)
    metrics = trainer.evaluate(rows)
    assert metrics["eval_my_metric"] == 0.123 and metrics["eval_already"] == 1.0
    assert len(preprocessed) == 2 and len(seen) == (2 if batched else 1)
    predictions = torch.cat([torch.as_tensor(p.predictions) for p in seen]) if not batched else None
    if batched:
        return
    prediction = seen[0]
    expected = _labels_of(tokenizer, TEXTS[:6])
    width = max(map(len, expected))
    assert prediction.label_ids.shape == predictions.shape == (6, width)
    model.eval()
    for row, ids in enumerate(expected):
        n = len(ids)
        labels = prediction.label_ids[row]
        assert list(labels[:n]) == ids and (labels[n:] == -100).all()
        assert list(prediction.inputs[row][:n]) == ids
        with torch.no_grad():
            own = model(input_ids=torch.tensor([ids])).logits[0].argmax(-1)
        assert torch.equal(predictions[row, :n], own)


def test_dpo_compute_metrics_and_prediction_loss_only(tokenizer, tmp_path):
    rows = Dataset.from_dict(PREFERENCES).select(range(4))
    seen = []

    def compute_metrics(prediction):
        seen.append(prediction)
        return {"my_metric": 0.5}

    trainer = DPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), args=dpo_config(tmp_path),
                         train_dataset=Dataset.from_dict(PREFERENCES), processing_class=tokenizer,
                         compute_metrics=compute_metrics)
    metrics = trainer.evaluate(rows)
    assert metrics["eval_my_metric"] == 0.5
    prediction = seen[0]
    # chosen rows first, then rejected, as TRL concatenates them; labels are the input ids
    assert prediction.predictions.shape[:2] == prediction.label_ids.shape and len(prediction.label_ids) == 8
    first = PREFERENCES["prompt"][0] + PREFERENCES["chosen"][0]
    ids = tokenizer(first, add_special_tokens=False)["input_ids"]
    assert list(prediction.label_ids[0][:len(ids)]) == ids
    trainer.args.prediction_loss_only = True
    assert "eval_my_metric" not in trainer.evaluate(rows)


def test_eval_dataset_shows_the_prepared_rows_as_trl_does(tokenizer, tmp_path, addition_dataset):
    """trainer.eval_dataset holds TRL's prepared columns (SFT: input_ids, labels; DPO: prompt_ids, chosen_ids,
    rejected_ids) for a dataset, an IterableDataset or a dict of them; GRPO's is the dataset as given."""
    from posttrain.rewards.builtin import accuracy

    rows = Dataset.from_dict({"text": TEXTS})
    sft = SFTTrainer(tiny_model(tokenizer, hidden=32, layers=1), args=sft_config(tmp_path), train_dataset=rows,
                     eval_dataset={"a": rows, "b": rows.to_iterable_dataset()}, processing_class=tokenizer)
    assert set(sft.eval_dataset) == {"a", "b"}
    for view in sft.eval_dataset.values():
        assert view["input_ids"] == sft.train_dataset["input_ids"] and view["labels"] == sft.train_dataset["labels"]
    pairs = Dataset.from_dict(PREFERENCES)
    dpo = DPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), args=dpo_config(tmp_path / "dpo"),
                     train_dataset=pairs, eval_dataset=pairs.to_iterable_dataset(), processing_class=tokenizer)
    assert dpo.eval_dataset.column_names[:3] == ["prompt_ids", "chosen_ids", "rejected_ids"]
    assert dpo.eval_dataset["chosen_ids"] == dpo.train_dataset["chosen_ids"]
    grpo = GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), accuracy, tiny_config(tmp_path / "grpo"),
                       train_dataset=addition_dataset, eval_dataset=addition_dataset, processing_class=tokenizer)
    assert grpo.eval_dataset is addition_dataset and grpo.train_dataset is addition_dataset
    sft.eval_dataset = None
    assert sft.eval_dataset is None
