"""SFTTrainer on tiny in-process models: metrics, TRL's step-1 loss, the update for any split of a step, packing,
exact resume, evaluation, options and the errors a user can cause."""

import functools
import json
import math

import pytest
import torch
from conftest import StopAt, assert_any_split_gives_the_same_update, capture_gradients, use_sgd
from datasets import Dataset

from posttrain.configs import ConfigError, SFTConfig
from posttrain.data import DataError
from posttrain.sft.trainer import SFTTrainer
from posttrain.testing import tiny_model

# rows of varied lengths (so that splits normalise differently if they were wrong)
TEXTS = [("ab " * (1 + i % 7)) + str(i) for i in range(16)]
PAIRS = {"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)],
         "completion": [str(a + b) * (1 + (a * b) % 3) for a in range(4) for b in range(4)]}


def sft_config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=8, learning_rate=1e-3,
                  logging_steps=1, save_strategy="no", gradient_checkpointing=False, use_cpu=True, seed=0,
                  report_to="none")
    values.update(overrides)
    return SFTConfig(**values)


def _train(tokenizer, tmp_path, data=None, capture=False, sgd=False, model=None, callbacks=None, **overrides):
    model = model or tiny_model(tokenizer, hidden=32, layers=1)
    dataset = data if data is not None else Dataset.from_dict({"text": TEXTS})
    trainer = SFTTrainer(model, args=sft_config(tmp_path, **overrides), train_dataset=dataset,
                         processing_class=tokenizer, callbacks=callbacks)
    if sgd:  # an update linear in the gradient, so that updates compare to tolerance (see tests/test_trainer.py)
        use_sgd(trainer)
    grads = capture_gradients(trainer) if capture else []
    trainer.train()
    return trainer, {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}, grads


def test_smoke_metrics_and_the_saved_model(tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer, params, _ = _train(tokenizer, tmp_path, max_steps=4, per_device_train_batch_size=4)
    records = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for key in ("loss", "entropy", "mean_token_accuracy", "num_tokens", "learning_rate", "grad_norm"):
        assert math.isfinite(records[-1][key]), key
    tokens = sum(len(t) + 1 for t in TEXTS)  # one token per character, plus the EOS
    assert records[-1]["num_tokens"] == tokens and records[1]["num_tokens"] > records[0]["num_tokens"]
    assert records[-1]["epoch"] == 1.0
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert all(torch.equal(p, params[n]) for n, p in reloaded.named_parameters())


def test_loss_is_the_mean_nll_of_the_steps_targets(tokenizer, tmp_path):
    """Step 1's loss, entropy and accuracy, recomputed from the model's own full logits."""
    model = tiny_model(tokenizer, hidden=32, layers=1)
    before = tiny_model(tokenizer, hidden=32, layers=1)
    trainer, _, _ = _train(tokenizer, tmp_path, model=model, max_steps=1, per_device_train_batch_size=16)
    nll, entropy, correct, n = 0.0, 0.0, 0, 0
    with torch.no_grad():
        for text in TEXTS:
            ids = torch.tensor([tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]])
            logits = before(ids).logits[0, :-1].float()
            logp = logits.log_softmax(-1)
            target = ids[0, 1:]
            nll -= float(logp.gather(-1, target[:, None]).sum())
            entropy += float(-(logp.exp() * logp).sum())
            correct += int((logits.argmax(-1) == target).sum())
            n += len(target)
    record = trainer.state.log_history[0]
    assert record["loss"] == pytest.approx(nll / n, rel=1e-5)
    assert record["entropy"] == pytest.approx(entropy / n, rel=1e-5)
    assert record["mean_token_accuracy"] == pytest.approx(correct / n, abs=1e-9)


@pytest.mark.parametrize("mode", ["padded", "padding_free", "packed", "dft"])
def test_the_update_is_the_same_for_any_split_of_the_step(tokenizer, tmp_path, mode):
    """1x8, 2x4 and 8x1: the same gradient and update (rows of different lengths and label counts)."""
    options = {"padded": {}, "padding_free": {"padding_free": True}, "dft": {"loss_type": "dft"},
               "packed": {"packing": True, "max_length": 24}}[mode]
    train = functools.partial(_train, tokenizer, data=Dataset.from_dict(PAIRS))
    assert_any_split_gives_the_same_update(train, tmp_path, **options)


def test_packed_and_padded_training_give_the_same_first_update(tokenizer, tmp_path):
    """Packing changes the batching, not the loss: one step over all rows, packed or padded, same update."""
    data = Dataset.from_dict(PAIRS)
    _, padded, _ = _train(tokenizer, tmp_path / "padded", data=data, sgd=True, max_steps=1,
                          per_device_train_batch_size=16)
    _, packed, _ = _train(tokenizer, tmp_path / "packed", data=data, sgd=True, max_steps=1,
                          per_device_train_batch_size=16, packing=True, max_length=32)
    for name in padded:
        assert torch.allclose(padded[name], packed[name], rtol=1e-5, atol=1e-7), name


def test_step_one_loss_equals_trls(tokenizer, tmp_path):
    """TRL 1.16's SFTTrainer and ours, same rows and weights: the same step-1 loss (text and completion-only)."""
    trl = pytest.importorskip("trl")
    for data in ({"text": TEXTS}, PAIRS):
        args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none",
                             max_steps=1, per_device_train_batch_size=16, logging_steps=1, save_strategy="no",
                             gradient_checkpointing=False, train_sampling_strategy="sequential")
        theirs = trl.SFTTrainer(tiny_model(tokenizer, hidden=32, layers=1), args=args,
                                train_dataset=Dataset.from_dict(data), processing_class=tokenizer)
        theirs.train()
        ours, _, _ = _train(tokenizer, tmp_path, data=Dataset.from_dict(data), max_steps=1,
                            per_device_train_batch_size=16, train_sampling_strategy="sequential")
        trl_loss = [h for h in theirs.state.log_history if "loss" in h][0]["loss"]
        assert ours.state.log_history[0]["loss"] == pytest.approx(trl_loss, rel=1e-5)


@pytest.mark.parametrize("options", [{}, {"packing": True, "max_length": 20, "train_sampling_strategy": "random"},
                                     {"iterable": True}])
def test_resume_continues_bit_for_bit(tokenizer, tmp_path, options):
    options = dict(options)
    iterable = options.pop("iterable", False)

    def data():
        dataset = Dataset.from_dict({"text": TEXTS})
        return dataset.to_iterable_dataset() if iterable else dataset

    common = dict(max_steps=6, per_device_train_batch_size=3, save_strategy="steps", save_steps=3, **options)
    _, straight, _ = _train(tokenizer, tmp_path / "straight", data=data(), **common)
    _train(tokenizer, tmp_path / "cut", data=data(), callbacks=[StopAt(3)], **common)
    _, resumed, _ = _train(tokenizer, tmp_path / "cut", data=data(), resume_from_checkpoint=True, **common)
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name


def test_resume_refuses_other_data(tokenizer, tmp_path):
    from posttrain.training.checkpoint import CheckpointError

    _train(tokenizer, tmp_path, max_steps=2, per_device_train_batch_size=4, save_strategy="steps", save_steps=2)
    other = Dataset.from_dict({"text": [t + "!" for t in TEXTS]})
    with pytest.raises(CheckpointError, match="the training rows differ from the checkpoint's"):
        _train(tokenizer, tmp_path, data=other, max_steps=4, per_device_train_batch_size=4,
               resume_from_checkpoint=True)


def test_epochs_cover_every_row_once(tokenizer, tmp_path):
    trainer, _, _ = _train(tokenizer, tmp_path, max_steps=-1, num_train_epochs=2, per_device_train_batch_size=5)
    assert trainer.state.global_step == 8  # ceil(16 / 5) = 4 steps per epoch, the last of one row
    assert trainer.state.log_history[-2]["num_tokens"] == 2 * sum(len(t) + 1 for t in TEXTS)


def test_evaluation_loss(tokenizer, tmp_path):
    eval_data = Dataset.from_dict({"text": TEXTS[:5]})
    model = tiny_model(tokenizer, hidden=32, layers=1)
    trainer = SFTTrainer(model, args=sft_config(tmp_path, eval_strategy="steps", eval_steps=1, max_steps=1,
                                                per_device_eval_batch_size=2),
                         train_dataset=Dataset.from_dict({"text": TEXTS}), eval_dataset=eval_data,
                         processing_class=tokenizer)
    metrics = trainer.evaluate()
    nll, n = 0.0, 0
    with torch.no_grad():
        for text in TEXTS[:5]:
            ids = torch.tensor([tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]])
            logp = trainer.policy(ids).logits[0, :-1].float().log_softmax(-1)
            nll -= float(logp.gather(-1, ids[0, 1:, None]).sum())
            n += ids.size(1) - 1
    assert metrics["eval_loss"] == pytest.approx(nll / n, rel=1e-5)
    trainer.train()
    assert any("eval_loss" in h for h in trainer.state.log_history)


def test_neftune_noise_in_training_only(tokenizer, tmp_path):
    _, plain, _ = _train(tokenizer, tmp_path / "a", max_steps=1)
    trainer, noisy, _ = _train(tokenizer, tmp_path / "b", max_steps=1, neftune_noise_alpha=5.0)
    assert any(not torch.equal(plain[n], noisy[n]) for n in plain)
    trainer.policy.eval()
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(trainer.policy(ids).logits, trainer.policy(ids).logits)


def test_eos_and_pad_tokens_are_set_on_the_model(tokenizer, tmp_path):
    import copy

    tok = copy.deepcopy(tokenizer)
    trainer, _, _ = _train(tok, tmp_path, max_steps=1, eos_token="<|endoftext|>", pad_token="<|pad|>")
    assert tok.eos_token == "<|endoftext|>" and trainer.policy.config.eos_token_id == tok.eos_token_id
    assert tok.eos_token_id in trainer.policy.generation_config.eos_token_id
    with pytest.raises(ConfigError, match=r"eos_token='<\|nope\|>' is not in the tokenizer's vocabulary"):
        _train(copy.deepcopy(tokenizer), tmp_path, eos_token="<|nope|>")


def test_arguments_posttrain_does_not_take_say_why(tokenizer, tmp_path):
    with pytest.raises(ConfigError, match=r"SFTTrainer\(data_collator=\.\.\.\) is not supported: posttrain builds"):
        SFTTrainer(tiny_model(tokenizer, hidden=32, layers=1), args=sft_config(tmp_path),
                   train_dataset=Dataset.from_dict({"text": TEXTS}), data_collator=lambda rows: rows)


def test_every_row_lost_to_truncation_is_one_sentence(tokenizer, tmp_path):
    data = Dataset.from_dict({"prompt": ["a long prompt here"], "completion": ["x"]})
    with pytest.raises(DataError, match="no token left to train on after truncation to max_length=5"):
        _train(tokenizer, tmp_path, data=data, max_length=5)


def test_token_ids_are_checked_against_the_models_embedding_rows(tokenizer, tmp_path):
    """The model's embedding (128 rows, padded past the tokenizer's 100 tokens, as Qwen's are) decides: id 127 trains,
    id 128 stops with one sentence when the rows are prepared, never at the first step."""
    from posttrain.data import vocabulary_rows

    model = tiny_model(tokenizer, hidden=32, layers=1, vocab_size=128)
    assert vocabulary_rows(model) == 128 > len(tokenizer)
    eos = tokenizer.eos_token_id
    _train(tokenizer, tmp_path, data=Dataset.from_dict({"input_ids": [[5, 127, eos]] * 2}), model=model, max_steps=1)
    with pytest.raises(DataError, match=r"Row 1 of train_dataset has token id 128 at position 1 of its input_ids, "
                                        r"outside the model's vocabulary of 128 ids"):
        _train(tokenizer, tmp_path, data=Dataset.from_dict({"input_ids": [[5, 6, eos], [5, 128, eos]]}),
               model=tiny_model(tokenizer, hidden=32, layers=1, vocab_size=128), max_steps=1)


def test_what_max_length_cuts_is_said_once_per_dataset(tokenizer, tmp_path, caplog):
    import logging

    data = Dataset.from_dict({"text": TEXTS})
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        trainer, _, _ = _train(tokenizer, tmp_path, data=data, packing=True, max_length=8, max_steps=1)
        trainer.evaluate(data)
    cuts = [r.getMessage() for r in caplog.records if "were longer than max_length=8" in r.getMessage()]
    longer = sum(len(t) + 1 > 8 for t in TEXTS)
    assert [c.split(":")[0] for c in cuts] == ["train_dataset", "eval_dataset"]
    assert all(f": {longer} of {len(TEXTS)} rows (" in c and "packing_strategy='bfd_split' keeps them" in c
               for c in cuts)


def test_the_prepared_rows_are_visible_as_trls_train_dataset(tokenizer, tmp_path):
    trainer, _, _ = _train(tokenizer, tmp_path, data=Dataset.from_dict(PAIRS), max_steps=1)
    prepared = trainer.train_dataset
    assert {"input_ids", "labels"} <= set(prepared.column_names) and len(prepared) == 16
    ids, labels = prepared[0]["input_ids"], prepared[0]["labels"]
    assert tokenizer.decode([t for t, lab in zip(ids, labels) if lab != -100]) == "0<|im_end|>"


@pytest.mark.peft
def test_lora_trains_the_adapter_and_saves_it(tokenizer, tmp_path):
    from peft import LoraConfig

    model = tiny_model(tokenizer, hidden=32, layers=1)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = SFTTrainer(model, args=sft_config(tmp_path, max_steps=2, gradient_checkpointing=True),
                         train_dataset=Dataset.from_dict(PAIRS), processing_class=tokenizer,
                         peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    trainer.train()
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()
    moved = [n for n, p in trainer.policy.named_parameters() if "lora_" in n and p.requires_grad]
    assert moved and all("lora_" in n or torch.equal(p, base[n.replace("base_model.model.", "").replace(
        ".base_layer", "")]) for n, p in trainer.policy.named_parameters() if "lora_" not in n)
