"""ORPOTrainer (posttrain/orpo.py) on tiny in-process models: the odds-ratio loss and the per-completion log-probs
against TRL's own ORPOTrainer code on the same tensors, the loss recomputed from full logits, the update for any split
of a step, exact resume, the CLI, and TRL's metric names."""

import dataclasses
import functools
import math
import types
import warnings

import pytest
import torch
from conftest import StopAt, assert_any_split_gives_the_same_update, capture_gradients, use_sgd
from datasets import Dataset

from posttrain import ORPOConfig, ORPOTrainer
from posttrain.configs import ConfigError
from posttrain.orpo import odds_ratio_terms
from posttrain.testing import tiny_model

PAIRS = {"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)],
         "chosen": [str(a + b) * (1 + (a * b) % 3) for a in range(4) for b in range(4)],
         "rejected": [str(a + b + 1) + "x" * (a % 3) for a in range(4) for b in range(4)]}
TRL_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/rejected",
               "logps/chosen", "logits/rejected", "logits/chosen", "nll_loss", "log_odds_ratio", "log_odds_chosen")


def _trl_orpo():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.orpo.orpo_trainer import ORPOTrainer as TRLORPOTrainer
    return TRLORPOTrainer


def _train(tokenizer, tmp_path, data=None, capture=False, sgd=False, callbacks=None, train=True, **overrides):
    values = dict(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=8, learning_rate=1e-2,
                  logging_steps=1, save_strategy="no", gradient_checkpointing=False, use_cpu=True, seed=0,
                  report_to="none")
    values.update(overrides)
    trainer = ORPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), args=ORPOConfig(**values),
                          train_dataset=data if data is not None else Dataset.from_dict(PAIRS),
                          processing_class=tokenizer, callbacks=callbacks)
    if sgd:
        use_sgd(trainer)
    grads = capture_gradients(trainer) if capture else []
    if train:
        trainer.train()
    return trainer, {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}, grads


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_the_odds_ratio_term_is_trls_on_the_same_log_probs(beta):
    trl = pytest.importorskip("trl")
    del trl
    chosen = -torch.tensor([0.01, 0.3, 0.69, 0.7, 2.0, 9.0], dtype=torch.float64)
    rejected = -torch.tensor([0.02, 1.5, 0.7, 0.69, 0.5, 12.0], dtype=torch.float64)
    fake = types.SimpleNamespace(beta=beta, accelerator=types.SimpleNamespace(device="cpu"))
    losses, chosen_rewards, rejected_rewards, ratio, log_odds = _trl_orpo().odds_ratio_loss(fake, chosen, rejected)
    ours, our_log_odds = odds_ratio_terms(chosen, rejected, beta)
    assert torch.allclose(ours, losses, rtol=1e-6, atol=1e-7)
    assert float(our_log_odds.mean()) == pytest.approx(float(log_odds), rel=1e-6)
    assert float((ours / beta).mean()) == pytest.approx(float(ratio), rel=1e-6)


def test_one_batchs_log_probs_and_loss_are_trls_on_the_same_model(tokenizer, tmp_path):
    """A micro-batch of 4 pairs through posttrain's forward (chunked output layer, completion targets only) against
    TRL's get_batch_logps (average_log_prob) and odds_ratio_loss on the model's full logits, float32, 1e-5; the NLL
    is CrossEntropyLoss over the chosen completions' tokens (the ORPO paper's; TRL's adds the prompt's)."""
    pytest.importorskip("trl")
    trainer, _, _ = _train(tokenizer, tmp_path, train=False, beta=0.2)
    batch = trainer._collate(trainer.batches.rows.select(torch.arange(4).numpy())).to("cpu")
    nll, odds, stats, _ = trainer._micro_loss(batch, grad=False)
    s = batch.sequences
    with torch.no_grad():
        logits = trainer.policy(s.input_ids, attention_mask=s.attention_mask).logits.float()
    completion = torch.zeros_like(s.source_mask)
    completion[:, 1:] = s.source_mask[:, :-1]  # a completion token: the one its position's predecessor predicts
    labels = torch.where(completion, s.input_ids, -100)
    TRL = _trl_orpo()
    means = TRL.get_batch_logps(logits, labels, average_log_prob=True)
    fake = types.SimpleNamespace(beta=0.2, accelerator=types.SimpleNamespace(device="cpu"))
    losses, *_ = TRL.odds_ratio_loss(fake, means[0::2], means[1::2])
    assert stats.chosen_logps == pytest.approx(float(means[0::2].sum()), rel=1e-5)
    assert stats.rejected_logps == pytest.approx(float(means[1::2].sum()), rel=1e-5)
    assert float(odds) == pytest.approx(float(losses.sum()), rel=1e-5)
    chosen_nll = torch.nn.CrossEntropyLoss()(logits[0::2, :-1].flatten(0, 1), labels[0::2, 1:].flatten())
    assert float(nll) / stats.chosen_tokens == pytest.approx(float(chosen_nll), rel=1e-5)
    trl_loss = chosen_nll - losses.mean()  # TRL's "full ORPO loss" on these terms
    assert stats.metrics()["loss"] == pytest.approx(float(trl_loss), rel=1e-5)


def test_a_run_logs_trls_metrics_and_learns_its_preferences(tokenizer, tmp_path):
    trainer, _, _ = _train(tokenizer, tmp_path, max_steps=12, per_device_train_batch_size=16, learning_rate=5e-2,
                           beta=1.0)
    records = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    assert len(records) == 12 and all(math.isfinite(r[k]) for r in records for k in ("loss", *TRL_METRICS))
    assert records[0]["log_odds_chosen"] < 0.1 < 1.0 < records[-1]["log_odds_chosen"]  # the chosen grow likelier
    late = sum(r["rewards/accuracies"] for r in records[-3:]) / 3
    assert late > max(records[0]["rewards/accuracies"], 0.75) and records[-1]["loss"] < records[0]["loss"] / 2
    metrics = trainer.evaluate(Dataset.from_dict(PAIRS))
    assert all(f"eval_{k}" in metrics for k in TRL_METRICS) and math.isfinite(metrics["eval_loss"])
    from posttrain.report.run import trainer_of  # the run report names the trainer, and shows its metrics first
    from posttrain.report.summary import HEADLINES

    assert trainer_of(dataclasses.asdict(trainer.args), set(records[-1])) == "ORPO"
    assert HEADLINES["ORPO"] == trainer._shown_metrics


@pytest.mark.parametrize("options", [{}, {"padding_free": True}])
def test_any_split_of_a_step_gives_the_same_update(tokenizer, tmp_path, options):
    assert_any_split_gives_the_same_update(functools.partial(_train, tokenizer), tmp_path, **options)


def test_resume_continues_bit_for_bit(tokenizer, tmp_path):
    common = dict(max_steps=6, per_device_train_batch_size=3, save_strategy="steps", save_steps=3)
    _, straight, _ = _train(tokenizer, tmp_path / "straight", **common)
    _train(tokenizer, tmp_path / "cut", callbacks=[StopAt(3)], **common)
    _, resumed, _ = _train(tokenizer, tmp_path / "cut", resume_from_checkpoint=True, **common)
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)


def test_the_cli_takes_trls_orpo_fields_and_refuses_what_it_would_not_honour():
    from posttrain.cli import parse_command

    script, _, config, _ = parse_command("orpo", ["--model_name_or_path", "m", "--dataset_name", "d", "--beta", "0.3",
                                               "--max_completion_length", "64"])
    assert (config.beta, config.max_completion_length, config.learning_rate, config.disable_dropout) == (
        0.3, 64, 1e-6, True)
    with pytest.raises(ConfigError, match=r"^generate_during_eval=True is not supported"):
        ORPOConfig(output_dir="x", generate_during_eval=True)
    with pytest.raises(ConfigError, match=r"^ORPOTrainer\(model_init=\.\.\.\) is not supported"):
        ORPOTrainer("m", args=ORPOConfig(output_dir="x"), model_init=lambda: None)
