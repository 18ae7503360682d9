"""KTOTrainer on tiny in-process models: metrics, TRL 1.16's numbers at steps 1 and 2, the update for any split of a
step, the reference (copy, explicit, LoRA, precomputed, synced), exact resume, evaluation, and the errors a user can
cause."""

import json
import math

import pytest
import torch
from conftest import StopAt, capture_gradients, use_sgd
from datasets import Dataset

from posttrain.configs import ConfigError, KTOConfig
from posttrain.kto.trainer import KTOTrainer
from posttrain.testing import tiny_model

# unpaired examples of varied lengths and both labels, so a wrong normalisation or pairing would show
UNPAIRED = {"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)],
            "completion": [str(a + b) * (1 + (a * b) % 3) for a in range(4) for b in range(4)],
            "label": [(a + 2 * b) % 3 != 0 for a in range(4) for b in range(4)]}
PAIRED = {"prompt": [f"{a}*{b}=" for a in range(3) for b in range(3)],
          "chosen": [str(a * b) for a in range(3) for b in range(3)],
          "rejected": [str(a * b + 1) + "x" * (a % 2) for a in range(3) for b in range(3)]}
COMPARED = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
            "logits/chosen", "logits/rejected", "entropy", "num_tokens")


def kto_config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=8, learning_rate=1e-2,
                  logging_steps=1, save_strategy="no", gradient_checkpointing=False, use_cpu=True, seed=0,
                  report_to="none")
    values.update(overrides)
    return KTOConfig(**values)


def _model(tokenizer, seed=0):
    return tiny_model(tokenizer, seed=seed, hidden=32, layers=1)


def _train(tokenizer, tmp_path, data=None, capture=False, sgd=False, model=None, callbacks=None, ref_model=None,
           peft_config=None, train=True, eval_dataset=None, **overrides):
    dataset = data if data is not None else Dataset.from_dict(UNPAIRED)
    trainer = KTOTrainer(model or _model(tokenizer), ref_model=ref_model, args=kto_config(tmp_path, **overrides),
                         train_dataset=dataset, eval_dataset=eval_dataset, processing_class=tokenizer,
                         callbacks=callbacks, peft_config=peft_config)
    if sgd:  # an update linear in the gradient, so that updates compare to tolerance
        use_sgd(trainer)
    grads = capture_gradients(trainer) if capture else []
    if train:
        trainer.train()
    return trainer, {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}, grads


def _records(trainer):
    return [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]


def _trl(tokenizer, tmp_path, data, **options):
    trl = pytest.importorskip("trl")
    args = trl.KTOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none", max_steps=2,
                         per_device_train_batch_size=8, learning_rate=1e-2, logging_steps=1, save_strategy="no",
                         gradient_checkpointing=False, **options)
    trainer = trl.KTOTrainer(_model(tokenizer), args=args, ref_model=_model(tokenizer), train_dataset=data,
                             processing_class=tokenizer)
    trainer.train()
    return trainer


@pytest.mark.parametrize("options", [{}, {"loss_type": "apo_zero_unpaired"},
                                     {"desirable_weight": 1.5, "undesirable_weight": 0.5, "beta": 0.3},
                                     {"max_length": 6}, {"data": "paired"}])
def test_numbers_equal_trls(tokenizer, tmp_path, options):
    """TRL 1.16's KTOTrainer and ours, same examples, weights and optimizer (one micro-batch a step, sequential, as
    TRL's defaults): the same loss, KL reference point, rewards, log-probs, logits, entropy and token count at steps
    1 and 2 (step 2 tests the update too)."""
    options = dict(options)
    data = Dataset.from_dict(PAIRED if options.pop("data", None) == "paired" else UNPAIRED)
    theirs = _trl(tokenizer, tmp_path, data, **options)
    ours, _, _ = _train(tokenizer, tmp_path, data=data, **options)
    records, trl_records = _records(ours), _records(theirs)
    assert len(records) == len(trl_records) == 2
    for a, b in zip(records, trl_records):
        assert set(COMPARED) & set(a) == set(COMPARED) & set(b), a["step"]  # those of a missing class left out alike
        for key in set(COMPARED) & set(a):
            if key == "kl" and options.get("loss_type") == "apo_zero_unpaired":
                assert a[key] == b[key] == 0.0
                continue
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)
    assert records[1]["kl"] > 0 or options.get("loss_type") == "apo_zero_unpaired"  # z0 is live at step 2


def test_smoke_metrics_and_the_saved_model(tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer, params, _ = _train(tokenizer, tmp_path, max_steps=6, per_device_train_batch_size=4,
                                train_sampling_strategy="random")
    records = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for key in COMPARED + ("grad_norm", "learning_rate"):
        assert math.isfinite(records[-1][key]), key
    assert records[0]["loss"] == pytest.approx(0.5, rel=1e-6)  # the policy is the reference at step 1: 1 - s(0)
    assert records[0]["kl"] == 0.0 and records[0]["rewards/margins"] == 0.0
    assert records[-1]["rewards/margins"] > 0  # it learns the labels
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert all(torch.equal(p, params[n]) for n, p in reloaded.named_parameters())


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_any_split_of_a_step_gives_the_same_update(tokenizer, tmp_path, loss_type):
    """16 examples as 1 x 16, 4 x 4 or 8 x 2 micro-batches: the same KL pairs, z0, gradient and update."""
    results = {}
    for micro, accum in ((16, 1), (4, 4), (2, 8)):
        trainer, params, grads = _train(tokenizer, tmp_path / f"{micro}x{accum}", capture=True, sgd=True,
                                        max_steps=2, per_device_train_batch_size=micro,
                                        gradient_accumulation_steps=accum, loss_type=loss_type,
                                        train_sampling_strategy="random")
        results[(micro, accum)] = (params, grads[1], _records(trainer)[1])
    ref_params, ref_grads, ref_record = results[(16, 1)]
    assert ref_record["kl"] > 0 or loss_type != "kto"
    for split, (params, grads, record) in results.items():
        for key in ("loss", "kl", "rewards/margins", "logps/chosen"):
            assert record[key] == pytest.approx(ref_record[key], rel=1e-5, abs=1e-7), (split, key)
        for name in ref_grads:
            assert torch.allclose(grads[name], ref_grads[name], rtol=1e-4, atol=1e-7), (split, name)
            assert torch.allclose(params[name], ref_params[name], rtol=1e-5, atol=1e-7), (split, name)


def test_loss_recomputed_from_full_logits(tokenizer, tmp_path):
    """An evaluation's numbers recomputed by hand from the models' own full logits (the policy after one step, the
    initial model as reference): z0 from the rotated pairs of the eval batch, then the loss and the rewards."""
    data = Dataset.from_dict(UNPAIRED)
    trainer, _, _ = _train(tokenizer, tmp_path, max_steps=1, beta=0.3, per_device_eval_batch_size=16)
    reference = _model(tokenizer)
    metrics = trainer.evaluate(data)
    eos = tokenizer.eos_token

    def seq_logp(model, prompt, completion):
        p = tokenizer(prompt)["input_ids"]
        ids = tokenizer(prompt + completion + eos)["input_ids"]
        with torch.no_grad():
            logp = model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
        return float(logp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(1)[len(p) - 1:].sum())

    prompts, completions, labels = UNPAIRED["prompt"], UNPAIRED["completion"], UNPAIRED["label"]
    shifted = [completions[-1]] + completions[:-1]
    z0 = max(0.0, sum(seq_logp(trainer.policy, p, c) - seq_logp(reference, p, c)
                      for p, c in zip(prompts, shifted)) / 16)
    losses, chosen = [], []
    for p, c, good in zip(prompts, completions, labels):
        lr = seq_logp(trainer.policy, p, c) - seq_logp(reference, p, c)
        losses.append(1 - 1 / (1 + math.exp(-0.3 * ((lr - z0) if good else (z0 - lr)))))
        if good:
            chosen.append(0.3 * lr)
    assert metrics["eval_kl"] == pytest.approx(z0, rel=1e-4, abs=1e-6)
    assert metrics["eval_loss"] == pytest.approx(sum(losses) / 16, rel=1e-5)
    assert metrics["eval_rewards/chosen"] == pytest.approx(sum(chosen) / len(chosen), rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_precomputed_reference_trains_the_same_and_is_cached(tokenizer, tmp_path, monkeypatch, caplog, loss_type):
    import logging

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger="posttrain")
    options = dict(max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2, loss_type=loss_type)
    live, live_params, _ = _train(tokenizer, tmp_path / "live", **options)
    first, first_params, _ = _train(tokenizer, tmp_path / "pre", precompute_ref_log_probs=True, **options)
    assert "computed in" in caplog.text and first.ref_model is None
    caplog.clear()
    second, _, _ = _train(tokenizer, tmp_path / "again", precompute_ref_log_probs=True, train=False, **options)
    assert "read from the cache" in caplog.text
    assert (second.batches.rows.ref == first.batches.rows.ref).all()
    for a, b in zip(_records(live), _records(first)):
        for key in ("loss", "kl", "rewards/margins"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    for name, p in live_params.items():
        assert torch.allclose(p, first_params[name], rtol=1e-5, atol=1e-7), name


@pytest.mark.peft
def test_lora_reference_is_the_base_and_a_given_reference_is_used(tokenizer, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer, _, _ = _train(tokenizer, tmp_path / "lora", peft_config=lora, max_steps=2, learning_rate=0.05)
    assert trainer.ref_model is None
    records = _records(trainer)
    assert records[0]["kl"] == 0.0 and records[1]["rewards/margins"] != 0.0
    other = _model(tokenizer, seed=1)  # a reference unlike the policy: step 1's rewards are not 0
    trainer, _, _ = _train(tokenizer, tmp_path / "given", ref_model=other, max_steps=1)
    assert trainer.ref_model is other and _records(trainer)[0]["rewards/chosen"] != 0.0


def test_synced_reference_moves_towards_the_policy(tokenizer, tmp_path):
    trainer, params, _ = _train(tokenizer, tmp_path, max_steps=2, sync_ref_model=True, ref_model_sync_steps=1,
                                ref_model_mixup_alpha=1.0)
    for name, p in trainer.ref_model.named_parameters():  # alpha 1: the reference is the policy after each sync
        assert torch.equal(p, params[name]), name


@pytest.mark.parametrize("options", [{"train_sampling_strategy": "random"}, {"precompute_ref_log_probs": True},
                                     {"iterable": True}, {"sync_ref_model": True, "ref_model_sync_steps": 2}])
def test_resume_continues_bit_for_bit(tokenizer, tmp_path, monkeypatch, options):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    options = dict(options)
    iterable = options.pop("iterable", False)

    def data():
        dataset = Dataset.from_dict(UNPAIRED)
        return dataset.to_iterable_dataset() if iterable else dataset

    common = dict(max_steps=6, per_device_train_batch_size=3, save_strategy="steps", save_steps=3, **options)
    straight, straight_params, _ = _train(tokenizer, tmp_path / "straight", data=data(), **common)
    _train(tokenizer, tmp_path / "cut", data=data(), callbacks=[StopAt(3)], **common)
    resumed, resumed_params, _ = _train(tokenizer, tmp_path / "cut", data=data(), resume_from_checkpoint=True,
                                        **common)
    by_step = {r["step"]: r for r in _records(resumed)}
    for record in _records(straight)[3:]:
        assert (record["loss"], record["kl"]) == (by_step[record["step"]]["loss"], by_step[record["step"]]["kl"])
    for name in straight_params:
        assert torch.equal(straight_params[name], resumed_params[name]), name
    if options.get("sync_ref_model"):
        for a, b in zip(straight.ref_model.parameters(), resumed.ref_model.parameters()):
            assert torch.equal(a, b)


def test_a_stream_trains_like_the_dataset(tokenizer, tmp_path):
    data = Dataset.from_dict(UNPAIRED)
    mapped, mapped_params, _ = _train(tokenizer, tmp_path / "map", data=data, max_steps=2,
                                      per_device_train_batch_size=4, gradient_accumulation_steps=2)
    streamed, streamed_params, _ = _train(tokenizer, tmp_path / "stream", data=data.to_iterable_dataset(),
                                          max_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    for a, b in zip(_records(mapped), _records(streamed)):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["kl"] == pytest.approx(b["kl"], rel=1e-6)
    for name, p in streamed_params.items():
        assert torch.allclose(p, mapped_params[name], rtol=1e-6, atol=1e-8), name


@pytest.mark.parametrize("stream", [False, True], ids=["map", "stream"])
def test_a_step_of_one_example_takes_its_kl_completion_from_the_example_before(tokenizer, tmp_path, stream):
    """Three examples, two a step: the epoch's last step holds one example, whose KL completion is the one before it
    in the epoch (paired with its own, its loss would stay at 0.5), read from a dataset or a stream alike."""
    data = Dataset.from_dict({k: v[:3] for k, v in UNPAIRED.items()})
    trainer, _, _ = _train(tokenizer, tmp_path, data=data.to_iterable_dataset() if stream else data, train=False,
                           per_device_train_batch_size=2, train_sampling_strategy="sequential")
    trainer.batches.next_step()
    (first,) = trainer.batches.step_predecessors()
    (lone,) = trainer.batches.next_step()
    (before,) = trainer.batches.step_predecessors()
    assert list(first.index) == [1, 0] and list(lone.index) == [2] and list(before.index) == [1]


@pytest.mark.parametrize("overrides,message", [
    (dict(per_device_train_batch_size=1), "a step of one example would pair it with its own"),
    (dict(precompute_ref_log_probs=True, train_sampling_strategy="random"),
     "needs train_sampling_strategy='sequential'"),
])
def test_settings_the_kl_point_cannot_use_are_one_sentence(tokenizer, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _train(tokenizer, tmp_path, train=False, **overrides)
    _train(tokenizer, tmp_path / "apo", train=False, loss_type="apo_zero_unpaired", **overrides)  # no z0: accepted


@pytest.mark.parametrize("kwargs,message", [
    (dict(loss_type="bco"), "loss_type='bco' is not one of"),
    (dict(beta=0.0), "beta=0 makes the KTO loss a constant"),
    (dict(desirable_weight=0.0, undesirable_weight=0.0), "both 0"),
    (dict(neftune_noise_alpha=5.0), "NEFTune noise is for supervised fine-tuning"),
])
def test_config_errors_are_one_sentence(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        KTOConfig(output_dir="unused", **kwargs)


def test_the_class_balance_advice_is_logged(tokenizer, tmp_path, caplog):
    import logging

    caplog.set_level(logging.WARNING, logger="posttrain")
    data = dict(UNPAIRED, label=[i % 4 == 0 for i in range(16)])  # 4 desirable, 12 undesirable
    _train(tokenizer, tmp_path, data=Dataset.from_dict(data), train=False)
    assert "4 desirable and 12 undesirable" in caplog.text


@pytest.mark.plots
def test_posttrain_kto_from_yaml_and_flags(tmp_path, tiny_model_dir, capfd):
    """`posttrain kto` as TRL's `trl kto`: a model directory and a preference file in (unpaired as TRL unpairs it),
    TRL's metrics logged, an evaluation, the curves and the report written with KTO's panels and headlines."""
    import yaml
    from conftest import run_posttrain

    from datasets import DatasetDict

    data = tmp_path / "pairs"
    DatasetDict(train=Dataset.from_dict(PAIRED), test=Dataset.from_dict(PAIRED).select(range(4))).save_to_disk(data)
    config = tmp_path / "run.yaml"
    config.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset_name: {data}\nper_device_train_batch_size: 3\n"
                      "gradient_accumulation_steps: 2\ngradient_checkpointing: false\nuse_cpu: true\n"
                      "desirable_weight: 1.2\neval_strategy: steps\neval_steps: 2\n")
    run = run_posttrain(["kto", "--config", str(config), "--output_dir", str(tmp_path / "out"), "--max_steps", "2",
                         "--logging_steps", "1", "--learning_rate", "1e-3"], capfd)
    assert run.returncode == 0, run.stderr[-2000:]
    records = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all({"loss", "kl", "logps/chosen", "entropy", "num_tokens"} <= set(r) for r in train)
    assert any("eval_loss" in r and "eval_kl" in r for r in records)
    written = yaml.safe_load((tmp_path / "out" / "posttrain_config.yaml").read_text())
    assert (written["learning_rate"], written["desirable_weight"]) == (1e-3, 1.2)
    report = (tmp_path / "out" / "report.html").read_text()
    assert "KTO" in report and "rewards/margins" in report
    assert (tmp_path / "out" / "plots.png").stat().st_size > 0


def test_compute_metrics_gets_the_examples_logits_and_input_ids(tokenizer, tmp_path):
    """compute_metrics as TRL's KTOTrainer feeds it (deprecated there, as here): the eval examples' logits and, as
    labels, their input ids; prediction_loss_only leaves it out."""
    seen = []

    def compute_metrics(prediction):
        seen.append(prediction)
        return {"my_metric": 0.25}

    rows = Dataset.from_dict(UNPAIRED).select(range(6))
    trainer = KTOTrainer(_model(tokenizer), args=kto_config(tmp_path), train_dataset=Dataset.from_dict(UNPAIRED),
                         processing_class=tokenizer, compute_metrics=compute_metrics)
    metrics = trainer.evaluate(rows)
    assert metrics["eval_my_metric"] == 0.25 and math.isfinite(metrics["eval_loss"])
    prediction = seen[0]
    assert prediction.predictions.shape[:2] == prediction.label_ids.shape and len(prediction.label_ids) == 6
    first = tokenizer(UNPAIRED["prompt"][0] + UNPAIRED["completion"][0] + tokenizer.eos_token)["input_ids"]
    assert list(prediction.label_ids[0][:len(first)]) == first
    trainer.args.prediction_loss_only = True
    assert "eval_my_metric" not in trainer.evaluate(rows)
