"""DPOTrainer on tiny in-process models: metrics, TRL's numbers, the update for any split of a step, the reference
(copy, explicit, LoRA, precomputed, synced, none), exact resume, evaluation, and the errors a user can cause."""

import functools
import json
import math

import pytest
import torch
from conftest import StopAt, assert_any_split_gives_the_same_update, capture_gradients, use_sgd
from datasets import Dataset

from posttrain.configs import ConfigError, DPOConfig
from posttrain.data import DataError
from posttrain.dpo.trainer import DPOTrainer
from posttrain.testing import tiny_model

# pairs of varied lengths, so a wrong normalisation would show in the splits
PAIRS = {"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)],
         "chosen": [str(a + b) * (1 + (a * b) % 3) for a in range(4) for b in range(4)],
         "rejected": [str(a + b + 1) + "x" * (a % 3) for a in range(4) for b in range(4)]}
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy", "num_tokens",
           "grad_norm", "learning_rate")


def dpo_config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=8, learning_rate=1e-2,
                  logging_steps=1, save_strategy="no", gradient_checkpointing=False, use_cpu=True, seed=0,
                  report_to="none")
    values.update(overrides)
    return DPOConfig(**values)


def _train(tokenizer, tmp_path, data=None, capture=False, sgd=False, model=None, callbacks=None, ref_model=None,
           peft_config=None, train=True, **overrides):
    model = model or tiny_model(tokenizer, hidden=32, layers=1)
    dataset = data if data is not None else Dataset.from_dict(PAIRS)
    trainer = DPOTrainer(model, ref_model=ref_model, args=dpo_config(tmp_path, **overrides), train_dataset=dataset,
                         processing_class=tokenizer, callbacks=callbacks, peft_config=peft_config)
    if sgd:  # an update linear in the gradient, so that updates compare to tolerance
        use_sgd(trainer)
    grads = capture_gradients(trainer) if capture else []
    if train:
        trainer.train()
    return trainer, {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}, grads


def _records(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


def test_smoke_metrics_and_the_saved_model(tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer, params, _ = _train(tokenizer, tmp_path, max_steps=4, per_device_train_batch_size=4)
    records = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for key in METRICS:
        assert math.isfinite(records[-1][key]), key
    assert records[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)  # the policy is the reference at step 1
    assert records[0]["rewards/margins"] == 0.0 and records[-1]["rewards/margins"] > 0  # it learns the preference
    tokens = sum(2 * len(p) + len(c) + len(r) + 2 for p, c, r in zip(*PAIRS.values()))
    assert records[-1]["num_tokens"] == tokens
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert all(torch.equal(p, params[n]) for n, p in reloaded.named_parameters())


@pytest.mark.parametrize("options", [{}, {"ld_alpha": 0.5}, {"loss_type": ["sigmoid", "bco_pair", "sft"],
                                                              "loss_weights": [0.8, 0.2, 1.0]}])
def test_numbers_equal_trls(tokenizer, tmp_path, options):
    """TRL 1.16's DPOTrainer and ours, same pairs, weights and optimizer: the same loss, rewards and log-probs at
    steps 1 and 2 (step 2 tests the update too)."""
    trl = pytest.importorskip("trl")
    args = trl.DPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none", max_steps=2,
                         per_device_train_batch_size=8, learning_rate=1e-2, logging_steps=1, save_strategy="no",
                         gradient_checkpointing=False, train_sampling_strategy="sequential", **options)
    theirs = trl.DPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), args=args,
                            ref_model=tiny_model(tokenizer, hidden=32, layers=1),  # TRL reloads it from a path
                            train_dataset=Dataset.from_dict(PAIRS), processing_class=tokenizer)
    theirs.train()
    ours, _, _ = _train(tokenizer, tmp_path, train_sampling_strategy="sequential", **options)
    for a, b in zip(_records(ours), _records(theirs)):
        for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
                    "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy", "num_tokens"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)


@pytest.mark.parametrize("options", [{}, {"loss_type": "ipo"}, {"ld_alpha": 0.5}, {"use_weighting": True},
                                     {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
                                     {"padding_free": True}, {"label_smoothing": 0.2}])
def test_any_split_of_a_step_gives_the_same_update(tokenizer, tmp_path, options):
    """8 pairs as 1 x 8, 2 x 4 or 8 x 1 micro-batches: the same gradient and update (aot and aot_unpaired sort
    within a micro-batch and are batch-dependent by definition, so they are not in this list)."""
    assert_any_split_gives_the_same_update(functools.partial(_train, tokenizer), tmp_path, **options)


def test_loss_recomputed_from_full_logits(tokenizer, tmp_path):
    """Step 2's logged numbers, recomputed by hand from the models' own full logits (policy after step 1, and the
    initial model as reference): sigmoid loss, rewards and log-probs."""
    trainer, _, _ = _train(tokenizer, tmp_path, max_steps=1, train_sampling_strategy="sequential", beta=0.3)
    reference = tiny_model(tokenizer, hidden=32, layers=1)
    metrics = trainer.evaluate(Dataset.from_dict(PAIRS))

    def seq_logp(model, prompt, completion):
        p = tokenizer(prompt)["input_ids"]
        ids = tokenizer(prompt + completion + tokenizer.eos_token)["input_ids"]
        with torch.no_grad():
            logp = model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
        targets = torch.tensor(ids[1:])
        return float(logp.gather(-1, targets[:, None]).squeeze(1)[len(p) - 1:].sum())

    losses, margins, chosen = [], [], []
    for p, c, r in zip(*PAIRS.values()):
        lc = seq_logp(trainer.policy, p, c) - seq_logp(reference, p, c)
        lr = seq_logp(trainer.policy, p, r) - seq_logp(reference, p, r)
        losses.append(-math.log(1 / (1 + math.exp(-0.3 * (lc - lr)))))
        margins.append(0.3 * (lc - lr))
        chosen.append(seq_logp(trainer.policy, p, c))
    assert metrics["eval_loss"] == pytest.approx(sum(losses) / 16, rel=1e-5)
    assert metrics["eval_rewards/margins"] == pytest.approx(sum(margins) / 16, rel=1e-4, abs=1e-6)
    assert metrics["eval_logps/chosen"] == pytest.approx(sum(chosen) / 16, rel=1e-5)


def test_precomputed_reference_trains_the_same_and_is_cached(tokenizer, tmp_path, monkeypatch, caplog):
    import logging

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger="posttrain")
    _, live, _ = _train(tokenizer, tmp_path / "live", max_steps=2, per_device_train_batch_size=4)
    trainer, pre, _ = _train(tokenizer, tmp_path / "pre", max_steps=2, per_device_train_batch_size=4,
                             precompute_ref_log_probs=True, precompute_ref_batch_size=3)
    assert trainer.ref_model is None  # no reference kept
    for name in live:
        assert torch.allclose(live[name], pre[name], rtol=1e-5, atol=1e-6), name
    assert "computed in" in caplog.text and len(list((tmp_path / "cache" / "ref_logps").iterdir())) == 1
    prepared = trainer.train_dataset
    assert {"prompt_ids", "chosen_ids", "rejected_ids", "ref_chosen_logps", "ref_rejected_logps"} <= set(
        prepared.column_names)
    caplog.clear()
    _train(tokenizer, tmp_path / "again", max_steps=1, per_device_train_batch_size=4, precompute_ref_log_probs=True)
    assert "read from the cache" in caplog.text
    caplog.clear()  # another ld_alpha is another key
    _train(tokenizer, tmp_path / "ld", max_steps=1, per_device_train_batch_size=4, precompute_ref_log_probs=True,
           ld_alpha=0.5)
    assert "computed in" in caplog.text


@pytest.mark.parametrize("options", [{}, {"precompute_ref_log_probs": True, "train_sampling_strategy": "random"},
                                     {"iterable": True}, {"sync_ref_model": True, "ref_model_sync_steps": 2}])
def test_resume_continues_bit_for_bit(tokenizer, tmp_path, monkeypatch, options):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    options = dict(options)
    iterable = options.pop("iterable", False)

    def data():
        dataset = Dataset.from_dict(PAIRS)
        return dataset.to_iterable_dataset() if iterable else dataset

    common = dict(max_steps=6, per_device_train_batch_size=3, save_strategy="steps", save_steps=3, **options)
    straight, straight_params, _ = _train(tokenizer, tmp_path / "straight", data=data(), **common)
    _train(tokenizer, tmp_path / "cut", data=data(), callbacks=[StopAt(3)], **common)
    resumed, resumed_params, _ = _train(tokenizer, tmp_path / "cut", data=data(), resume_from_checkpoint=True,
                                        **common)
    for name in straight_params:
        assert torch.equal(straight_params[name], resumed_params[name]), name
    if options.get("sync_ref_model"):
        for a, b in zip(straight.ref_model.parameters(), resumed.ref_model.parameters()):
            assert torch.equal(a, b)


def test_resume_uses_the_checkpoints_reference_logps(tokenizer, tmp_path, monkeypatch):
    """The reference log-probs a run trained against are in its checkpoints, and a resumed run trains against them,
    whatever the cache now holds."""
    from posttrain.training.reference import save_cached

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    common = dict(max_steps=4, per_device_train_batch_size=4, save_strategy="steps", save_steps=2,
                  precompute_ref_log_probs=True)
    first, _, _ = _train(tokenizer, tmp_path, callbacks=[StopAt(2)], **common)
    saved = first.batches.rows.ref.copy()
    (cached,) = (tmp_path / "cache" / "ref_logps").iterdir()
    save_cached(cached.stem, saved - 1.0)  # a stale cache entry under the same key, with its digest
    resumed, _, _ = _train(tokenizer, tmp_path, train=False, **common)
    assert (resumed.batches.rows.ref == saved - 1.0).all()
    resumed.train(resume_from_checkpoint=True)
    assert (resumed.batches.rows.ref == saved).all()


def test_the_reference_cache_is_keyed_by_every_weight(tokenizer, tmp_path, monkeypatch):
    """A model that differs from a cached one in one weight element outside model_fingerprint's sample gets its own
    reference log-probs: with learning rate 0 its first step's rewards are 0 (it is its own reference)."""
    from posttrain.training.checkpoint import model_fingerprint

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    common = dict(max_steps=1, per_device_train_batch_size=16, precompute_ref_log_probs=True, learning_rate=0.0)
    first, _, _ = _train(tokenizer, tmp_path / "a", **common)
    other = tiny_model(tokenizer, hidden=32, layers=1)
    weight = other.get_input_embeddings().weight  # [100, 32]: the sample takes every 3rd element, never the 2nd
    with torch.no_grad():
        weight.view(-1)[1] += 5.0
    assert model_fingerprint(other) == model_fingerprint(tiny_model(tokenizer, hidden=32, layers=1))
    second, _, _ = _train(tokenizer, tmp_path / "b", model=other, **common)
    assert len(list((tmp_path / "cache" / "ref_logps").iterdir())) == 2
    assert not (first.batches.rows.ref == second.batches.rows.ref).any()
    for trainer in (first, second):
        record = _records(trainer)[0]
        assert record["rewards/chosen"] == record["rewards/rejected"] == record["rewards/margins"] == 0.0


def test_a_cached_file_changed_after_writing_is_recomputed(tokenizer, tmp_path, monkeypatch, caplog):
    import numpy as np

    from posttrain.training.reference import load_cached, save_cached

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    common = dict(max_steps=1, per_device_train_batch_size=4, precompute_ref_log_probs=True, train=False)
    first, _, _ = _train(tokenizer, tmp_path, **common)
    right = first.batches.rows.ref.copy()
    (path,) = (tmp_path / "cache" / "ref_logps").iterdir()
    with np.load(path) as stored:  # the right shape, other values, the digest of the right ones
        np.savez(path, ref=stored["ref"] - 8.0, sha256=stored["sha256"])
    caplog.clear()
    again, _, _ = _train(tokenizer, tmp_path, **common)
    assert (again.batches.rows.ref == right).all()
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"The cached reference log-probs at {path} do not match the digest stored with them (the file was changed "
        "after it was written): computing them again."]
    assert (load_cached(path.stem, (len(right), 2)) == right).all()  # rewritten whole
    path.write_bytes(path.read_bytes()[:-10])  # cut short
    assert load_cached(path.stem, (len(right), 2)) is None and "cannot be read" in caplog.records[-1].getMessage()
    save_cached(path.stem, right)
    assert load_cached(path.stem, (len(right) + 1, 2)) is None
    assert f"are a {len(right)} x 2 array, not the {len(right) + 1} x 2 this data needs: computing them again." in \
        caplog.records[-1].getMessage()
    nan = right.copy()
    nan[0, 1] = float("nan")
    save_cached(path.stem, nan)
    assert load_cached(path.stem, (len(right), 2)) is None
    assert f"hold values that are not finite (NaN or infinite: 1 of {nan.size}): computing them again." in \
        caplog.records[-1].getMessage()


def test_a_reference_of_another_vocabulary_is_refused(tokenizer, tmp_path):
    """Fewer embedding rows than the tokenizer's tokens, or a tokenizer saved beside the reference that gives an id
    another token: refused when the trainer is built. A padded embedding is the same vocabulary and trains."""
    import string

    from transformers import AutoModelForCausalLM

    from posttrain.testing import save_tiny, tiny_tokenizer

    digits = tiny_tokenizer(string.digits, all_bytes=False)
    with pytest.raises(ConfigError, match=r"^ref_model's embedding has 14 rows and the tokenizer \(processing_class\) "
                                          r"has 100 tokens, so ref_model was built for another vocabulary: pass a "
                                          r"ref_model that uses the policy's tokenizer, or omit ref_model"):
        _train(tokenizer, tmp_path, ref_model=tiny_model(digits, hidden=32, layers=1), train=False)
    shuffled = tiny_tokenizer(string.ascii_letters + string.digits + string.punctuation + " \n", all_bytes=False)
    other = save_tiny(str(tmp_path / "other"), shuffled, hidden=32, layers=1)  # as many tokens, other ids
    message = (r"^ref_model's tokenizer \(.*other\) gives id 4 to 'a' where the processing_class gives it to '0', so "
               r"the reference would score other tokens than the policy: pass a ref_model")
    for ref in (other, AutoModelForCausalLM.from_pretrained(other)):  # a path, or a model loaded from one
        with pytest.raises(ConfigError, match=message):
            _train(tokenizer, tmp_path, ref_model=ref, train=False)
    same = save_tiny(str(tmp_path / "same"), tokenizer, hidden=32, layers=1, vocab_size=128)  # padded: accepted
    padded = tiny_model(tokenizer, hidden=32, layers=1, seed=3)
    padded.resize_token_embeddings(len(tokenizer) + 1, pad_to_multiple_of=64)  # 128 rows
    for ref in (same, padded):
        trainer, _, _ = _train(tokenizer, tmp_path, ref_model=ref, max_steps=1)
        assert trainer.ref_model.get_input_embeddings().num_embeddings == 128
        assert math.isfinite(_records(trainer)[0]["loss"])
    with pytest.raises(ConfigError, match=r"^sync_ref_model=True mixes the policy's weights into ref_model's, and "
                                          r"ref_model's model.embed_tokens.weight is \(128, 32\) where the policy's is "
                                          r"\(100, 32\)"):
        _train(tokenizer, tmp_path, ref_model=padded, sync_ref_model=True, train=False)


def test_sync_ref_model_moves_the_reference(tokenizer, tmp_path):
    trainer, params, _ = _train(tokenizer, tmp_path, max_steps=2, per_device_train_batch_size=8,
                                sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=1.0)
    for name, p in trainer.ref_model.named_parameters():
        assert torch.equal(p, params[name]), name  # alpha 1: the reference is the policy after each step


def test_explicit_reference_model(tokenizer, tmp_path):
    ref = tiny_model(tokenizer, hidden=32, layers=1, seed=3)
    trainer, _, _ = _train(tokenizer, tmp_path, max_steps=1, ref_model=ref)
    assert trainer.ref_model is ref and _records(trainer)[0]["rewards/margins"] != 0.0
    model = tiny_model(tokenizer, hidden=32, layers=1)
    with pytest.raises(ConfigError, match="model and ref_model are the same object"):
        _train(tokenizer, tmp_path, model=model, ref_model=model)


def test_reference_free(tokenizer, tmp_path):
    trainer, _, _ = _train(tokenizer, tmp_path, max_steps=1, reference_free=True, beta=0.5)
    first = _records(trainer)[0]
    assert trainer.ref_model is None
    assert first["rewards/chosen"] == pytest.approx(0.5 * first["logps/chosen"], rel=1e-6)


def test_rpo_alpha_adds_the_chosen_nll(tokenizer, tmp_path):
    trainer, _, _ = _train(tokenizer, tmp_path, max_steps=1, rpo_alpha=0.5, per_device_train_batch_size=16)
    assert trainer.args.loss_type == ["sigmoid", "sft"]
    first = _records(trainer)[0]
    chosen_tokens = sum(len(c) + 1 for c in PAIRS["chosen"])
    assert first["loss"] == pytest.approx(math.log(2) - 0.5 * first["logps/chosen"] * 16 / chosen_tokens, rel=1e-5)


@pytest.mark.peft
def test_lora_reference_is_the_policy_with_adapters_off(tokenizer, tmp_path):
    from peft import LoraConfig

    trainer, params, _ = _train(tokenizer, tmp_path, max_steps=2, peft_config=LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    assert trainer.ref_model is None
    first, last = _records(trainer)
    assert first["loss"] == pytest.approx(math.log(2), rel=1e-6) and last["rewards/margins"] != 0.0
    base = tiny_model(tokenizer, hidden=32, layers=1)
    with trainer.policy.disable_adapter():  # the reference: adapters off is the untouched base model
        for name, p in base.named_parameters():
            assert torch.equal(trainer.policy.get_base_model().get_parameter(name), p), name
    _, precomputed, _ = _train(tokenizer, tmp_path / "pre", max_steps=2, precompute_ref_log_probs=True,
                               peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      task_type="CAUSAL_LM"))
    for name in params:  # the reference log-probs computed up front with adapters off: the same training
        assert torch.allclose(params[name], precomputed[name], rtol=1e-5, atol=1e-6), name


@pytest.mark.peft
def test_a_model_that_comes_with_an_adapter_is_trained_against_a_frozen_copy_of_it(tokenizer, tmp_path):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(tokenizer, hidden=32, layers=1),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    trainer, _, _ = _train(tokenizer, tmp_path, model=model, max_steps=2)
    first, last = _records(trainer)
    assert first["loss"] == pytest.approx(math.log(2), rel=1e-6)  # the reference is the adapter as it came
    assert trainer.reference_adapter is not None and last["rewards/margins"] != 0.0


def test_evaluation_metrics(tokenizer, tmp_path):
    trainer, _, _ = _train(tokenizer, tmp_path, max_steps=2, eval_strategy="steps", eval_steps=1,
                           per_device_eval_batch_size=3, train=False, eval_on_start=True)
    trainer.eval_dataset = Dataset.from_dict({k: v[:5] for k, v in PAIRS.items()})
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert len(evals) == 3 and evals[0]["eval_loss"] == pytest.approx(math.log(2), rel=1e-6)
    for key in ("eval_rewards/margins", "eval_logps/chosen", "eval_logits/rejected", "eval_mean_token_accuracy"):
        assert math.isfinite(evals[-1][key]), key


def test_errors_a_user_can_cause(tokenizer, tmp_path):
    with pytest.raises(ConfigError, match="DPOTrainer\\(data_collator=...\\) is not supported"):
        DPOTrainer(tiny_model(tokenizer), args=dpo_config(tmp_path), data_collator=object(),
                   train_dataset=Dataset.from_dict(PAIRS), processing_class=tokenizer)
    with pytest.raises(ConfigError, match="precompute_ref_log_probs=True needs every pair up front"):
        _train(tokenizer, tmp_path, data=Dataset.from_dict(PAIRS).to_iterable_dataset(), train=False,
               precompute_ref_log_probs=True)
    with pytest.raises(DataError, match="Row 2 of train_dataset has an empty rejected completion"):
        bad = dict(PAIRS, rejected=PAIRS["rejected"][:2] + [""] + PAIRS["rejected"][3:])
        _train(tokenizer, tmp_path, data=Dataset.from_dict(bad), train=False)
    with pytest.raises(DataError, match="DPO needs prompt \\+ chosen \\+ rejected"):
        _train(tokenizer, tmp_path, data=Dataset.from_dict({"text": ["a", "b"]}), train=False)
