"""RewardTrainer on tiny in-process models: TRL's prepared rows for every preference format, TRL's loss and metrics at
steps 1 and 2, the update for any split of a step, exact resume, LoRA with the score head trained, evaluation, the
errors a user can cause, and the trained model scoring GRPO's and RLOO's completions as transformers loads it."""

import copy
import functools
import json
import math

import pytest
import torch
from conftest import StopAt, assert_any_split_gives_the_same_update, capture_gradients, use_sgd
from datasets import Dataset

from posttrain.configs import ConfigError, RewardConfig
from posttrain.data import DataError
from posttrain.reward.trainer import RewardTrainer
from posttrain.testing import tiny_model, tiny_reward_model

# pairs of varied lengths (chosen longer or shorter than rejected), so a wrong pooling or normalisation would show
PAIRS = {"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)],
         "chosen": [str(a + b) * (1 + (a * b) % 3) for a in range(4) for b in range(4)],
         "rejected": [str(a + b + 1) + "x" * (a % 3) for a in range(4) for b in range(4)]}
METRICS = ("loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens", "grad_norm")


def _conversational(implicit: bool = False) -> dict:
    user = [[{"role": "user", "content": p}] for p in PAIRS["prompt"]]
    answer = {c: [[{"role": "assistant", "content": t}] for t in PAIRS[c]] for c in ("chosen", "rejected")}
    if implicit:
        return {c: [u + a for u, a in zip(user, answer[c])] for c in ("chosen", "rejected")}
    return {"prompt": user, **answer}


def _implicit() -> dict:
    return {c: [p + t for p, t in zip(PAIRS["prompt"], PAIRS[c])] for c in ("chosen", "rejected")}


def reward_config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=8, learning_rate=1e-2,
                  logging_steps=1, save_strategy="no", gradient_checkpointing=False, use_cpu=True, seed=0,
                  report_to="none")
    values.update(overrides)
    return RewardConfig(**values)


def _train(tokenizer, tmp_path, data=None, capture=False, sgd=False, model=None, callbacks=None, peft_config=None,
           train=True, eval_dataset=None, **overrides):
    model = model if model is not None else tiny_reward_model(tokenizer, hidden=32, layers=1)
    dataset = data if data is not None else Dataset.from_dict(PAIRS)
    trainer = RewardTrainer(model, args=reward_config(tmp_path, **overrides), train_dataset=dataset,
                            eval_dataset=eval_dataset, processing_class=tokenizer, callbacks=callbacks,
                            peft_config=peft_config)
    if sgd:  # an update linear in the gradient, so that updates compare to tolerance
        use_sgd(trainer)
    grads = capture_gradients(trainer) if capture else []
    if train:
        trainer.train()
    return trainer, {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}, grads


def _records(trainer):
    return [h for h in trainer.state.log_history if "loss" in h]


def _trl_trainer(tokenizer, tmp_path, data, **options):
    trl = pytest.importorskip("trl")
    options = {"gradient_checkpointing": False, **options}
    args = trl.RewardConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none",
                            max_steps=2, per_device_train_batch_size=8, learning_rate=1e-2, logging_steps=1,
                            save_strategy="no", train_sampling_strategy="sequential", **options)
    return trl.RewardTrainer(tiny_reward_model(tokenizer, hidden=32, layers=1), args=args, train_dataset=data,
                             processing_class=tokenizer)


@pytest.mark.parametrize("case", ["plain", "margin", "center", "pad_is_eos", "conversational", "padding_free",
                                  "checkpointing"])
def test_numbers_equal_trls(tokenizer, tmp_path, case):
    """TRL 1.16's RewardTrainer and ours, same pairs, weights and optimizer (AdamW): the same loss and metrics at
    steps 1 and 2 (step 2 tests the update too). pad_is_eos: the reward is read before the EOS that ends each
    sequence, where transformers pools; padding_free: posttrain's packed rows score as TRL's padded ones;
    checkpointing: activation checkpointing on, TRL's default."""
    columns = _conversational() if case == "conversational" else dict(PAIRS)
    if case == "margin":
        columns["margin"] = [0.1 * (i % 5) - 0.2 for i in range(16)]
    options = {"center": {"center_rewards_coefficient": 0.01},
               "checkpointing": {"gradient_checkpointing": True}}.get(case, {})  # TRL's default: checkpointing on
    if case == "pad_is_eos":
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.pad_token = tokenizer.eos_token
    theirs = _trl_trainer(tokenizer, tmp_path, Dataset.from_dict(columns), **options)
    theirs.train()
    ours_options = dict(options, padding_free=True) if case == "padding_free" else options
    ours, _, _ = _train(tokenizer, tmp_path, data=Dataset.from_dict(columns), train_sampling_strategy="sequential",
                        **ours_options)
    assert len(_records(ours)) == len(_records(theirs)) == 2
    for a, b in zip(_records(ours), _records(theirs)):
        for key in METRICS:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)


@pytest.mark.parametrize("fmt", ["standard", "implicit", "conversational", "conversational_implicit", "tokenized",
                                 "legacy_tokenized", "margin", "max_length"])
def test_prepared_rows_equal_trls(tokenizer, tmp_path, fmt):
    """Each of TRL's preference formats prepared by TRL's own RewardTrainer._prepare_dataset and by posttrain: the
    same chosen_ids, rejected_ids (and margins), the same pairs dropped by max_length."""
    columns = {"standard": dict(PAIRS), "implicit": _implicit(), "conversational": _conversational(),
               "conversational_implicit": _conversational(implicit=True), "margin": dict(PAIRS),
               "max_length": dict(PAIRS)}.get(fmt)
    if fmt.endswith("tokenized"):
        ids = {c: [tokenizer(p + t + tokenizer.eos_token)["input_ids"] for p, t in zip(PAIRS["prompt"], PAIRS[c])]
               for c in ("chosen", "rejected")}
        prefix = "" if fmt == "tokenized" else "_input"
        columns = {f"chosen{prefix}_ids": ids["chosen"], f"rejected{prefix}_ids": ids["rejected"]}
    if fmt == "margin":
        columns["margin"] = [float(i) for i in range(16)]
    options = {"max_length": 7} if fmt == "max_length" else {}
    theirs = _trl_trainer(tokenizer, tmp_path, Dataset.from_dict(columns), **options)
    ours, _, _ = _train(tokenizer, tmp_path, data=Dataset.from_dict(columns), train=False, **options)
    expected, prepared = theirs.train_dataset, ours.train_dataset
    assert prepared["chosen_ids"] == expected["chosen_ids"] and prepared["rejected_ids"] == expected["rejected_ids"]
    if fmt == "margin":
        assert prepared["margin"] == expected["margin"]
    if fmt == "max_length":
        assert 0 < len(prepared) < 16


@pytest.mark.parametrize("options", [{}, {"center_rewards_coefficient": 0.05}, {"padding_free": True}, {"margin": True}])
def test_any_split_of_a_step_gives_the_same_update(tokenizer, tmp_path, options):
    """8 pairs as 1 x 8, 2 x 4 or 8 x 1 micro-batches: the same gradient and update."""
    options = dict(options)
    columns = dict(PAIRS)
    if options.pop("margin", False):
        columns["margin"] = [0.25 * (i % 4) for i in range(16)]
    train = functools.partial(_train, tokenizer, data=Dataset.from_dict(columns))
    ref_grads = assert_any_split_gives_the_same_update(train, tmp_path, **options)
    assert ref_grads["score.weight"].abs().sum() > 0


@pytest.mark.parametrize("iterable", [False, True])
def test_resume_continues_bit_for_bit(tokenizer, tmp_path, iterable):
    def data():
        dataset = Dataset.from_dict(PAIRS)
        return dataset.to_iterable_dataset() if iterable else dataset

    common = dict(max_steps=6, per_device_train_batch_size=3, save_strategy="steps", save_steps=3,
                  train_sampling_strategy="random")
    _, straight, _ = _train(tokenizer, tmp_path / "straight", data=data(), **common)
    _train(tokenizer, tmp_path / "cut", data=data(), callbacks=[StopAt(3)], **common)
    _, resumed, _ = _train(tokenizer, tmp_path / "cut", data=data(), resume_from_checkpoint=True, **common)
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)


def test_a_run_from_a_causal_lm_path_learns_and_saves_a_reward_model(tokenizer, tmp_path, tiny_model_dir):
    """A causal LM's path becomes a sequence classifier with a new score head (seeded, as TRL's from the same path),
    learns the preference, and saves a model that AutoModelForSequenceClassification loads with its pad token."""
    from transformers import AutoModelForSequenceClassification

    trainer, params, _ = _train(tokenizer, tmp_path, model=tiny_model_dir, max_steps=8, per_device_train_batch_size=4,
                                learning_rate=3e-3, eval_strategy="steps", eval_steps=4, per_device_eval_batch_size=4,
                                eval_dataset=Dataset.from_dict(PAIRS))
    records = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 9)) and all(math.isfinite(r["loss"]) for r in train)
    assert [r["step"] for r in records if "eval_accuracy" in r] == [4, 8]
    assert train[-1]["accuracy"] >= 0.75 and train[-1]["loss"] < train[0]["loss"]
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")
    assert reloaded.config.num_labels == 1 and reloaded.config.pad_token_id == tokenizer.pad_token_id
    assert all(torch.equal(p, params[n]) for n, p in reloaded.named_parameters())
    evaluation = trainer.evaluate()
    assert {"eval_loss", "eval_accuracy", "eval_margin", "eval_min_reward", "eval_mean_reward",
            "eval_max_reward"} <= set(evaluation)
    # `posttrain plot` and the report show the reward model's metrics
    from posttrain.plotting import panels_with_data, read_runs
    from posttrain.report.run import read_config, trainer_of
    from posttrain.report.summary import HEADLINES

    drawn = {key for _, keys in panels_with_data(read_runs([str(tmp_path / "out")])) for key in keys}
    assert {"accuracy", "margin", "min_reward", "mean_reward", "max_reward", "eval_accuracy", "eval_margin"} <= drawn
    assert trainer_of(read_config(str(tmp_path / "out"), []), set()) == "Reward"
    assert trainer_of(None, {"loss", "max_reward"}) == "Reward" and HEADLINES["Reward"] == ("loss", "accuracy", "margin")


def test_a_trained_reward_model_scores_grpo_and_rloo_completions_as_transformers_loads_it(tokenizer, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from posttrain import GRPOConfig, RLOOConfig, RLOOTrainer
    from posttrain.rewards import _model_scores
    from posttrain.rewards.resolving import resolve_reward_funcs

    trainer, _, _ = _train(tokenizer, tmp_path, max_steps=4, per_device_train_batch_size=4)
    path = str(tmp_path / "out")
    prompts, completions = ["1+2=", "3+3=", "0+1="], ["3", "66", "2x"]
    model, tok = AutoModelForSequenceClassification.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    encoded = tok([p + c for p, c in zip(prompts, completions)], return_tensors="pt", padding=True,
                  add_special_tokens=False)
    with torch.no_grad():
        expected = model(**encoded).logits[:, 0].tolist()
    grpo_reward = resolve_reward_funcs([path], GRPOConfig(output_dir=str(tmp_path / "g")))[0]
    assert _model_scores(grpo_reward, prompts, completions) == pytest.approx(expected, abs=1e-6)
    rloo = RLOOTrainer(tiny_model(tokenizer, hidden=32, layers=1), reward_funcs=path, processing_class=tokenizer,
                       args=RLOOConfig(output_dir=str(tmp_path / "r"), use_cpu=True, report_to="none", max_steps=1,
                                       per_device_train_batch_size=4, max_completion_length=4),
                       train_dataset=Dataset.from_dict({"prompt": prompts + ["2+2="]}))
    assert _model_scores(rloo.reward_funcs[0], prompts, completions) == pytest.approx(expected, abs=1e-6)
    assert len({round(x, 6) for x in expected}) == 3  # the trained head tells the three apart
    # the trained model object itself, with its tokenizer as reward_processing_classes (TRL's arguments)
    as_object = resolve_reward_funcs([trainer.policy], GRPOConfig(output_dir=str(tmp_path / "o")),
                                     processing_classes=[tokenizer])[0]
    assert _model_scores(as_object, prompts, completions) == pytest.approx(expected, abs=1e-6)


@pytest.mark.peft
def test_lora_trains_the_score_head_and_saves_it(tokenizer, tmp_path):
    from peft import LoraConfig

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer, params, _ = _train(tokenizer, tmp_path, peft_config=config, max_steps=2)
    head = [n for n in params if "score" in n and "modules_to_save" in n]
    assert head and any(p.requires_grad for n, p in trainer.policy.named_parameters() if n in head)
    initial = tiny_reward_model(tokenizer, hidden=32, layers=1).score.weight
    assert not torch.equal(params[head[0]], initial)  # the head moved
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    assert any("score" in k for k in saved)
    with pytest.raises(ConfigError, match=r"^peft_config has task_type='CAUSAL_LM', and a reward model is a sequence "
                                          r"classifier: set task_type='SEQ_CLS'"):
        _train(tokenizer, tmp_path / "causal", train=False, peft_config=LoraConfig(r=4, target_modules=["q_proj"],
                                                                                     task_type="CAUSAL_LM"))


@pytest.mark.parametrize("batched", [False, True])
def test_compute_metrics_gets_the_scores_trls_gives_it(tokenizer, tmp_path, batched):
    """TRL's RewardTrainer feeds compute_metrics its eval loop's predictions: per eval batch, the chosen scores then the
    rejected ones ([2P, 1]), and no labels (label_ids ()); posttrain's the same, on the same model and data (and with
    batch_eval_metrics, batch by batch). Its metrics are logged with eval_."""
    from trl import RewardConfig as TRLConfig
    from trl import RewardTrainer as TRLTrainer

    seen = {"trl": [], "ours": []}

    def recorder(name):
        def compute_metrics(prediction, compute_result=True):
            seen[name].append((torch.as_tensor(prediction.predictions).float(), prediction.label_ids))
            return {"spread": float(torch.as_tensor(prediction.predictions).std())}
        return compute_metrics

    options = dict(per_device_eval_batch_size=4, report_to="none", use_cpu=True, batch_eval_metrics=batched)
    # batches of 4 pairs: on a last batch of fewer, TRL's evaluation loop keeps as many rows as that batch has pairs
    # (gather_for_metrics counts rows as examples), losing rejected scores; posttrain gives every score
    data = Dataset.from_dict({k: v[:8] for k, v in PAIRS.items()})
    theirs = TRLTrainer(tiny_reward_model(tokenizer, hidden=32, layers=1),
                        args=TRLConfig(output_dir=str(tmp_path / "trl"), bf16=False, **options), train_dataset=data,
                        processing_class=tokenizer, compute_metrics=recorder("trl"))
    trl_metrics = theirs.evaluate(data)
    ours = RewardTrainer(tiny_reward_model(tokenizer, hidden=32, layers=1),
                         args=RewardConfig(output_dir=str(tmp_path / "ours"), **options), train_dataset=data,
                         processing_class=tokenizer, compute_metrics=recorder("ours"))
    metrics = ours.evaluate(data)
    assert len(seen["ours"]) == len(seen["trl"]) == (2 if batched else 1)
    for (mine, no_labels), (trls, trl_labels) in zip(seen["ours"], seen["trl"]):
        assert mine.shape == trls.shape and torch.allclose(mine, trls, atol=1e-5)
        assert len(no_labels) == len(trl_labels) == 0
    assert metrics["eval_spread"] == pytest.approx(trl_metrics["eval_spread"], abs=1e-5)


def test_errors_a_user_can_cause(tokenizer, tmp_path):
    with pytest.raises(ConfigError, match=r"^The model has num_labels=2, and a reward model gives one score per "):
        model = tiny_reward_model(tokenizer, hidden=32, layers=1)
        model.config.num_labels = 2
        _train(tokenizer, tmp_path, model=model, train=False)
    with pytest.raises(DataError, match=r"is in no preference format: its columns are prompt, completion; .* "
                                        r"\(prompt/completion is an SFT dataset"):
        _train(tokenizer, tmp_path, data=Dataset.from_dict({"prompt": ["a"], "completion": ["b"]}), train=False)
    with pytest.raises(DataError, match=r"has no pair left: every one of its 16 pairs has a chosen or rejected "
                                        r"sequence longer than max_length=2"):
        _train(tokenizer, tmp_path, max_length=2, train=False)
    with pytest.raises(DataError, match=r"Row 1 of train_dataset has margin None: every row's margin must be a "
                                        r"finite number"):
        _train(tokenizer, tmp_path, data=Dataset.from_dict({**{k: v[:2] for k, v in PAIRS.items()},
                                                            "margin": [0.5, None]}), train=False)
    with pytest.raises(ConfigError, match=r"^compute_metrics <lambda>\(\) cannot be called as the evaluation calls "):
        RewardTrainer(tiny_reward_model(tokenizer, hidden=32, layers=1), args=reward_config(tmp_path),
                      train_dataset=Dataset.from_dict(PAIRS), processing_class=tokenizer,
                      compute_metrics=lambda: {})
    with pytest.raises(ConfigError, match=r"^label_smoothing_factor=0.1 is not supported: the reward loss has no "
                                          r"labels to smooth"):
        reward_config(tmp_path, label_smoothing_factor=0.1)


def test_pairs_that_score_one_sequence_twice_are_dropped_and_counted_as_dpo_drops_them(tokenizer, tmp_path, caplog):
    """chosen == rejected (both empty included) gives a loss of log 2 and no gradient to learn from: dropped with
    one warning naming how many and where (the shared pair check DPO uses), the rest trained."""
    import logging

    data = {k: list(v[:4]) for k, v in PAIRS.items()}
    data["rejected"][1], data["chosen"][3], data["rejected"][3] = data["chosen"][1], "", ""
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        trainer, _, _ = _train(tokenizer, tmp_path, data=Dataset.from_dict(data), train=False)
    assert len(trainer.batches.rows) == 2
    said = [r.getMessage() for r in caplog.records if "whose chosen and rejected are the same" in r.getMessage()]
    assert said == ["train_dataset: dropped 2 pairs of 4 whose chosen and rejected are the same tokens, which "
                    "teach nothing (every model gives both the same score); remove them from the dataset."]


def test_posttrain_reward_from_yaml_and_flags(tmp_path, tiny_model_dir, capfd):
    """`posttrain reward` as TRL's `trl reward`: a causal LM's directory and a preference file in, a reward model out
    (AutoModelForSequenceClassification loads it), TRL's metrics logged."""
    import yaml
    from conftest import run_posttrain
    from transformers import AutoModelForSequenceClassification

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(dict(zip(PAIRS, row))) + "\n" for row in zip(*PAIRS.values())))
    config = tmp_path / "run.yaml"
    config.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset_name: {data}\nper_device_train_batch_size: 4\n"
                      "gradient_checkpointing: false\nuse_cpu: true\ncenter_rewards_coefficient: 0.01\n")
    run = run_posttrain(["reward", "--config", str(config), "--output_dir", str(tmp_path / "out"), "--max_steps", "2",
                         "--logging_steps", "1", "--learning_rate", "1e-3"], capfd)
    assert run.returncode == 0, run.stderr[-2000:]
    records = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2]
    assert all({"loss", "accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens"} <= set(r)
               for r in records)
    written = yaml.safe_load((tmp_path / "out" / "posttrain_config.yaml").read_text())
    assert (written["learning_rate"], written["center_rewards_coefficient"]) == (1e-3, 0.01)
    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").config.num_labels == 1


def test_the_rlhf_pipeline_example_runs_end_to_end(tmp_path, capsys):
    """examples/rlhf_pipeline.py, shortened: `posttrain sft`, `posttrain reward` from its directory (evaluated on the
    held-out pairs before and after), `posttrain rloo` from the SFT directory against the reward model; each stage's
    plot written (docs/reward.md shows a full run)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "examples" / "rlhf_pipeline.py"
    spec = importlib.util.spec_from_file_location("rlhf_pipeline", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = tmp_path / "pipeline"
    result = example.main(["--output-dir", str(out), "--sft-steps", "4", "--reward-steps", "6", "--rloo-steps", "3"])
    assert all(0.0 <= a <= 1.0 for a in result["reward_model_held_out_accuracy"])
    assert all(math.isfinite(r) for r in result["policy_reward"])
    for stage in ("sft", "reward", "rloo"):  # each run's own report; curves where it logged more than one step
        assert (out / stage / "report.html").stat().st_size > 0
    assert (out / "rloo" / "plots.png").stat().st_size > 0  # 3 steps logged
    assert not (out / "sft" / "plots.png").exists()  # 4 steps logged every 10: one point, no curve
    assert "Only step 4 is logged in" in (out / "sft" / "report.html").read_text()
    assert "reward model, held-out accuracy" in capsys.readouterr().out
    from transformers import AutoConfig, AutoTokenizer

    config, tokenizer = AutoConfig.from_pretrained(out / "reward"), AutoTokenizer.from_pretrained(out / "reward")
    assert config.num_labels == 1 and config.pad_token_id == tokenizer.eos_token_id  # --pad_token <|im_end|>


@pytest.mark.parametrize("max_grad_norm", [1.0, 1e-3])
def test_the_embedding_rows_update_is_dense_adamw(tokenizer, tmp_path, max_grad_norm):
    """The input embedding's sparse gradient, updated row by row (reward/sparse_rows.py), against torch's dense
    AdamW on the same run: 6 steps over batches that touch different rows (a row touched once keeps moving on its
    moments), clipped (1e-3 clips every step) or not; the same weights, moments and gradient norms to rounding
    (AdamW turns rounding-level differences of a near-zero gradient, such as k_proj's bias, whose gradient is zero
    but for rounding, into full steps of either sign: 3e-6 on that bias here, 1e-7 elsewhere)."""
    runs = {}
    for sparse in (True, False):
        trainer, _, _ = _train(tokenizer, tmp_path / str(sparse), train=False, max_steps=6,
                               per_device_train_batch_size=3, learning_rate=1e-2, max_grad_norm=max_grad_norm,
                               train_sampling_strategy="sequential")
        if not sparse:
            trainer._update.rows.release()
            trainer._update = None  # the dense update, as the shared loop makes it
        else:
            assert trainer.policy.get_input_embeddings().sparse
        trainer.train()
        weight = trainer.policy.get_input_embeddings().weight
        params = [p for group in trainer.optimizer.optimizer.param_groups for p in group["params"]]
        index = next(i for i, p in enumerate(params) if p is weight)
        state = trainer.optimizer.state_dict()["state"][index]  # the compact moments shown whole
        runs[sparse] = ({n: p.detach().clone() for n, p in trainer.policy.named_parameters()},
                        state["exp_avg"].clone(), state["exp_avg_sq"].clone(), float(state["step"]),
                        [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h])
    (rows, m, v, step, norms), (dense, m_dense, v_dense, step_dense, norms_dense) = runs[True], runs[False]
    assert step == step_dense == 6 and norms == pytest.approx(norms_dense, rel=1e-5)
    assert torch.allclose(m, m_dense, rtol=1e-4, atol=1e-7) and torch.allclose(v, v_dense, rtol=1e-4, atol=1e-10)
    moved = (m != 0).any(1).sum()
    assert 0 < moved < m.size(0)  # some rows moved, most never did
    for name in dense:
        assert torch.allclose(rows[name], dense[name], rtol=1e-5, atol=1e-5), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sixteen_bit_embedding_rows_update_as_torchs_fused_adamw(dtype):
    """A 16-bit embedding: the row-wise update computes in float32 and stores its moments in the weight's dtype, as
    torch's fused AdamW (the default optimizer) does, so eps=1e-8 is not 0 and an element without gradient stays
    finite (in float16, 0 / (0 + 0) was NaN at step 1). The same weights and moments as the fused kernel's."""
    from posttrain.reward.sparse_rows import SparseRows

    torch.manual_seed(0)
    sparse, dense = torch.nn.Embedding(12, 8, sparse=True).to(dtype), torch.nn.Embedding(12, 8).to(dtype)
    dense.weight.data.copy_(sparse.weight.data)
    fused = torch.optim.AdamW(dense.parameters(), lr=0.1, weight_decay=0.0, fused=True)
    optimizer = torch.optim.AdamW([sparse.weight], lr=0.1, weight_decay=0.0)
    rows = SparseRows(sparse, optimizer)
    for ids in ([1, 2], [2, 5], [7], [1, 7]):
        ids = torch.tensor(ids)
        for embedding in (sparse, dense):
            (embedding(ids).float() * torch.arange(8.0)).sum().backward()
        rows.step(lambda: None)
        fused.step()
        sparse.zero_grad(), dense.zero_grad()
    assert rows.finite and torch.isfinite(sparse.weight).all()
    assert torch.equal(sparse.weight, dense.weight)
    state = optimizer.state_dict()["state"][0]
    assert state["exp_avg"].dtype == dtype and torch.equal(state["exp_avg"], fused.state[dense.weight]["exp_avg"])
    assert torch.equal(state["exp_avg_sq"], fused.state[dense.weight]["exp_avg_sq"])


def test_a_float16_reward_model_trains_as_trls(tokenizer, tmp_path, tiny_model_dir):
    """TRL's float16 test: RewardTrainer loaded in float16 (model_init_kwargs) trains with finite weights, as TRL's
    does on the same inputs; posttrain used to stop at step 1 at any learning rate (its row-wise embedding AdamW
    divided 0 by eps=1e-8, which is 0 in float16). At learning_rate 0.1 both runs' float16 AdamW blow the weights up
    within a few steps: TRL trains on to NaN weights, posttrain stops at the first NaN loss (docs/compatibility.md)."""
    from trl import RewardConfig as TRLConfig
    from trl import RewardTrainer as TRLTrainer

    options = dict(max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3, report_to="none", use_cpu=True,
                   save_strategy="no", model_init_kwargs={"dtype": torch.float16})
    theirs = TRLTrainer(tiny_model_dir, args=TRLConfig(output_dir=str(tmp_path / "trl"), **options),
                        train_dataset=Dataset.from_dict(PAIRS), processing_class=tokenizer)
    theirs.train()
    ours = RewardTrainer(tiny_model_dir, args=RewardConfig(output_dir=str(tmp_path / "ours"), **options),
                         train_dataset=Dataset.from_dict(PAIRS), processing_class=tokenizer)
    assert ours.policy.get_input_embeddings().sparse and ours.policy.dtype == torch.float16  # the path under test
    ours.train()
    assert ours.state.global_step == theirs.state.global_step == 3
    for model in (theirs.model, ours.policy):
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_embedding_rows_written_non_finite_stop_the_run(tokenizer, tmp_path):
    """The row-wise update checks the rows it writes (the rest of the embedding did not change): a learning rate
    that overflows float32 makes them infinite, and the run's weight check names the embedding."""
    from posttrain.reward.sparse_rows import SparseRows
    from posttrain.training.step import TrainingError

    embedding = torch.nn.Embedding(10, 4)
    optimizer = torch.optim.AdamW(embedding.parameters(), lr=1e39, weight_decay=0.0)
    rows = SparseRows(embedding, optimizer)
    embedding(torch.tensor([1, 2])).sum().backward()
    rows.step(optimizer.step)
    assert not rows.finite and not torch.isfinite(embedding.weight[1:3]).all()
    assert torch.isfinite(embedding.weight[3:]).all()  # rows never looked up are untouched

    trainer, _, _ = _train(tokenizer, tmp_path, train=False)
    trainer._update.rows.finite = False
    with pytest.raises(TrainingError, match=r"non-finite \(first: model\.embed_tokens\.weight\)"):
        trainer._check_weights_finite()
