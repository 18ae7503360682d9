"""The trainer surface a TRL user relies on: callbacks and control flags, evaluation during training, the train
summary, saving and the Hub, trackers, schedules and optimizers, and the GRPO fields TRL 1.16 added."""

import json
import math
import os
import sys
import types

import pytest
import torch
from conftest import capture_gradients, last_train_record, length_reward, tiny_config, variable_length_model
from transformers import TrainerCallback, TrainerControl, TrainerState

from posttrain.configs import ConfigError
from posttrain.grpo.trainer import GRPOTrainer
from posttrain.testing import tiny_model


def _trainer(tokenizer, dataset, tmp_path, reward=length_reward, model=None, **overrides):
    return GRPOTrainer(model or tiny_model(tokenizer, hidden=32, layers=1), reward, tiny_config(tmp_path, **overrides),
                       train_dataset=dataset, processing_class=tokenizer)


class Recorder(TrainerCallback):
    def __init__(self):
        self.events = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            def record(args, state, control, **kwargs):
                self.events.append((name, state.global_step))
                assert {"model", "processing_class", "optimizer", "lr_scheduler"} <= set(kwargs)
            return record
        return super().__getattribute__(name)


def test_every_callback_event_in_transformers_order(tokenizer, addition_dataset, tmp_path):
    recorder = Recorder()
    trainer = GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), length_reward,
                          tiny_config(tmp_path, max_steps=2, gradient_accumulation_steps=2, per_device_train_batch_size=4,
                                      eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                                      per_device_eval_batch_size=4),
                          train_dataset=addition_dataset, eval_dataset=addition_dataset.select(range(2)),
                          processing_class=tokenizer, callbacks=[recorder])
    trainer.train()
    names = [e for e, _ in recorder.events]
    assert names[0] == "on_init_end" and names[1:3] == ["on_train_begin", "on_epoch_begin"]
    step1 = ["on_step_begin", "on_substep_end", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end",
             "on_log"]
    assert names[3:9] == step1
    step2 = names[9:]
    assert step2[:6] == step1
    # at step 2: evaluation (a prediction step per eval batch: 2 prompts, one per batch of 4 completions), then
    # the checkpoint, the end of the epoch, the summary
    assert step2[6:] == ["on_prediction_step", "on_prediction_step", "on_log", "on_evaluate", "on_save",
                         "on_epoch_end", "on_log", "on_train_end"]
    assert isinstance(trainer.state, TrainerState) and isinstance(trainer.control, TrainerControl)


def test_control_flags_set_by_a_callback_are_honoured(tokenizer, addition_dataset, tmp_path):
    class Steer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                control.should_save = True
                control.should_evaluate = True
            if state.global_step == 2:
                control.should_log = True
                control.should_training_stop = True

    trainer = GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), length_reward,
                          tiny_config(tmp_path, max_steps=5, logging_steps=10, per_device_eval_batch_size=4),
                          train_dataset=addition_dataset, eval_dataset=addition_dataset.select(range(1)),
                          processing_class=tokenizer, callbacks=[Steer])  # a class is instantiated, as in TRL
    trainer.train()
    out = tmp_path / "out"
    assert os.path.isdir(out / "checkpoint-1") and not os.path.exists(out / "checkpoint-2")
    history = trainer.state.log_history
    assert [r["step"] for r in history if "eval_loss" in r] == [1]
    assert [r["step"] for r in history if "loss" in r] == [2]  # logging_steps=10: only the callback's log
    assert trainer.state.global_step == 2


def test_evaluation_during_training(tokenizer, addition_dataset, tmp_path):
    from posttrain.rewards.builtin import accuracy

    evaluations = []

    class Seen(TrainerCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            evaluations.append((state.global_step, sorted(metrics)))

    trainer = GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), [accuracy, length_reward],
                          tiny_config(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=0.5, eval_on_start=True,
                                      per_device_eval_batch_size=6, num_generations_eval=3, beta=0.04),
                          train_dataset=addition_dataset, eval_dataset=addition_dataset.select(range(5)),
                          processing_class=tokenizer, callbacks=[Seen()])
    trainer.train()
    assert [step for step, _ in evaluations] == [0, 2, 4]  # on start, then every 0.5 * 4 steps
    record = [r for r in trainer.state.log_history if "eval_loss" in r][-1]
    for key in ("eval_loss", "eval_reward", "eval_reward_std", "eval_rewards/accuracy/mean",
                "eval_rewards/length_reward/std", "eval_completions/mean_length", "eval_entropy", "eval_kl",
                "eval_frac_reward_zero_std", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second"):
        assert key in record and math.isfinite(record[key]), key
    # 5 prompts x 3 completions in batches of 6: 2 prompts per batch, 3 batches (the last with one prompt)
    assert record["eval_samples_per_second"] > 0 and 0.0 <= record["eval_rewards/accuracy/mean"] <= 1.0
    lines = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in lines if "eval_loss" in r] == [0, 2, 4]
    both = trainer.evaluate({"small": addition_dataset.select(range(2)), "big": addition_dataset.select(range(4))})
    assert "eval_small_reward" in both and "eval_big_loss" in both


def test_train_summary_and_the_transformers_helpers(tokenizer, addition_dataset, tmp_path, capsys):
    trainer = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=2)
    result = trainer.train()
    summary = trainer.state.log_history[-1]
    for key in ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "total_flos"):
        assert key in summary and key in result.metrics, key
    assert result.global_step == 2 and summary["step"] == 2 and summary["total_flos"] > 0
    steps = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert result.training_loss == pytest.approx(sum(steps) / 2)
    out = tmp_path / "out"
    assert json.load(open(out / "train_results.json"))["train_loss"] == pytest.approx(result.training_loss)
    trainer.log_metrics("train", result.metrics)
    assert "***** train metrics *****" in capsys.readouterr().out
    trainer.save_metrics("eval", {"eval_reward": 0.5})
    assert json.load(open(out / "all_results.json"))["eval_reward"] == 0.5
    trainer.save_state()
    assert json.load(open(out / "trainer_state.json"))["global_step"] == 2
    os.remove(out / "model.safetensors")
    trainer.save_model()  # no argument: args.output_dir
    assert os.path.exists(out / "model.safetensors") and trainer.processing_class is tokenizer


def test_the_summary_carries_the_last_logging_window(tokenizer, addition_dataset, tmp_path):
    """As TRL merges its metrics into the record it logs at the end of training, where its users read them
    (`state.log_history[-1]["reward"]`): 3 steps, logging every 2 (posttrain also logs the last step)."""
    trainer = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=3, logging_steps=2)
    trainer.train()
    summary, last_step = trainer.state.log_history[-1], trainer.state.log_history[-2]
    assert "train_runtime" in summary and summary["step"] == last_step["step"] == 3
    for key in ("reward", "reward_std", "rewards/length_reward/mean", "completions/mean_length", "entropy"):
        assert key in summary and summary[key] == last_step[key], key
    assert "loss" not in summary and "loss" in last_step  # transformers' per-step loss: the summary has train_loss
    lines = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in lines] == [2, 3]  # the summary goes to train_results.json


def test_push_to_hub_needs_a_token_and_uploads_output_dir(tokenizer, addition_dataset, tmp_path, monkeypatch):
    import huggingface_hub

    from posttrain.training.hub import HubError

    trainer = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=1, hub_model_id="me/run")
    trainer.train()
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    with pytest.raises(HubError, match="needs a Hugging Face token and network access"):
        trainer.push_to_hub()
    calls = []

    class FakeApi:
        def create_repo(self, name, **kw):
            calls.append(("create", name, kw["private"]))
            return type("Repo", (), {"repo_id": name})()

        def upload_folder(self, **kw):
            calls.append(("upload", kw["repo_id"], sorted(os.listdir(kw["folder_path"])), kw["ignore_patterns"]))
            return "https://huggingface.co/me/run/commit/1"

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    trainer.args.hub_token = "hf_x"
    assert trainer.push_to_hub(commit_message="done") == "https://huggingface.co/me/run/commit/1"
    assert calls[0] == ("create", "me/run", None) and calls[1][1] == "me/run"
    assert "model.safetensors" in calls[1][2] and "checkpoint-*" in calls[1][3]

    class Offline(FakeApi):
        def create_repo(self, name, **kw):
            raise ConnectionError("no route")

    monkeypatch.setattr(huggingface_hub, "HfApi", Offline)
    with pytest.raises(HubError, match="could not reach the Hub .*network access"):
        trainer.push_to_hub()


def test_report_to_tensorboard_writes_the_metrics(tokenizer, addition_dataset, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "tb"
    _trainer(tokenizer, addition_dataset, tmp_path, max_steps=2, report_to="tensorboard",
             logging_dir=str(logdir)).train()
    events = EventAccumulator(str(logdir))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"loss", "reward", "learning_rate", "train_runtime"} <= set(tags)
    assert [e.step for e in events.Scalars("reward")] == [1, 2]


@pytest.mark.parametrize("name,kwargs", [("cosine_with_min_lr", {"min_lr_rate": 0.1}),
                                         ("warmup_stable_decay", {"num_decay_steps": 2}),
                                         ("polynomial", {"power": 2.0}), ("inverse_sqrt", None)])
def test_schedules_are_transformers_own(tokenizer, addition_dataset, tmp_path, name, kwargs):
    from transformers import get_scheduler

    trainer = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=6, warmup_steps=0.3, lr_scheduler_type=name,
                       lr_scheduler_kwargs=kwargs)
    trainer.train()
    lrs = [r["learning_rate"] for r in trainer.state.log_history if "learning_rate" in r]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    reference = get_scheduler(name, opt, num_warmup_steps=2, num_training_steps=6, scheduler_specific_kwargs=kwargs)
    expected = []
    for _ in range(6):
        opt.step()
        reference.step()
        expected.append(reference.get_last_lr()[0])
    assert lrs == pytest.approx(expected)  # warmup_steps 0.3 of 6 steps = 2


@pytest.mark.parametrize("optim,cls", [("adamw_torch", "AdamW"), ("sgd", "SGD"), ("adafactor", "Adafactor"),
                                       ("rmsprop", "RMSprop")])
def test_optimizers_by_transformers_name(tokenizer, addition_dataset, tmp_path, optim, cls):
    trainer = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=1, optim=optim,
                       optim_args="momentum=0.5" if optim == "sgd" else None, weight_decay=0.1)
    inner = trainer.optimizer.optimizer
    assert type(inner).__name__ == cls
    if optim == "sgd":
        assert inner.param_groups[0]["momentum"] == 0.5
    assert [g["weight_decay"] for g in inner.param_groups] == [0.1, 0.0]  # none on biases and norms
    trainer.train()


def test_an_optimizer_of_a_missing_package_names_the_install(tokenizer, addition_dataset, tmp_path, monkeypatch):
    import transformers.trainer_optimizer as table

    from posttrain._optional import MissingDependency

    monkeypatch.setattr(table, "is_bitsandbytes_available", lambda: False)
    with pytest.raises(MissingDependency, match="optim='adamw_8bit' needs the package 'bitsandbytes'"):
        _trainer(tokenizer, addition_dataset, tmp_path, optim="adamw_8bit")


def test_fractional_logging_and_save_steps(tokenizer, addition_dataset, tmp_path):
    trainer = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=4, logging_steps=0.5, save_strategy="steps",
                       save_steps=0.25, save_total_limit=2)
    trainer.train()
    assert [r["step"] for r in trainer.state.log_history if "loss" in r] == [2, 4]
    assert sorted(os.listdir(tmp_path / "out" / "")).count("checkpoint-4") == 1
    assert not os.path.exists(tmp_path / "out" / "checkpoint-2")  # save_total_limit=2 kept 3 and 4
    assert (trainer.state.logging_steps, trainer.state.save_steps) == (2, 1)


def test_logging_strategy_epoch_and_first_step(tokenizer, addition_dataset, tmp_path):
    # 16 prompts, 2 per generation batch: 8 steps an epoch
    trainer = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=10, logging_strategy="epoch",
                       logging_first_step=True)
    trainer.train()
    assert [r["step"] for r in trainer.state.log_history if "loss" in r] == [1, 8, 10]
    assert trainer.state.epoch == pytest.approx(1.25)


def test_sync_ref_model_mixes_the_policy_into_the_reference(tokenizer, addition_dataset, tmp_path):
    trainer = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=2, beta=0.04, sync_ref_model=True,
                       ref_model_mixup_alpha=0.25, ref_model_sync_steps=2)
    initial = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    policy = dict(trainer.policy.named_parameters())
    for name, ref in trainer.ref_model.named_parameters():
        assert torch.allclose(ref, 0.25 * policy[name] + 0.75 * initial[name], atol=1e-6), name
    assert any(not torch.equal(ref, initial[n]) for n, ref in trainer.ref_model.named_parameters())


def test_sync_ref_model_is_refused_with_lora(tokenizer, addition_dataset, tmp_path):
    peft = pytest.importorskip("peft")
    with pytest.raises(ConfigError, match="sync_ref_model=True needs a separate reference model"):
        GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), length_reward,
                    tiny_config(tmp_path, beta=0.04, sync_ref_model=True), train_dataset=addition_dataset,
                    processing_class=tokenizer, peft_config=peft.LoraConfig(r=4, target_modules=["q_proj"]))


def test_cast_lm_head_to_fp32(tokenizer, addition_dataset, tmp_path):
    model = tiny_model(tokenizer, hidden=32, layers=1).to(torch.bfloat16)
    trainer = _trainer(tokenizer, addition_dataset, tmp_path, model=model, max_steps=2, beta=0.04,
                       cast_lm_head_to_fp32=True, bf16=True)
    head = trainer.policy.get_output_embeddings()
    assert head.weight.dtype == torch.float32
    assert trainer.policy.get_input_embeddings().weight is head.weight  # still tied
    ids = torch.tensor([[5, 6, 7]])
    with trainer.accelerator.autocast():
        out = trainer.policy(input_ids=ids)
        assert out.logits.dtype == torch.float32
        assert trainer.policy.get_input_embeddings()(ids).dtype == torch.bfloat16  # the body stays in bf16
    trainer.train()
    assert math.isfinite(last_train_record(trainer)["loss"])


def test_pad_to_multiple_of_changes_shapes_not_numbers(tokenizer, addition_dataset, tmp_path, monkeypatch):
    from posttrain.grpo import rollout

    widths = []
    original = rollout.token_logprobs

    def recording(model, prompt_ids, prompt_mask, completion_ids, *args, **kwargs):
        widths.append((prompt_ids.size(1), completion_ids.size(1)))
        return original(model, prompt_ids, prompt_mask, completion_ids, *args, **kwargs)

    monkeypatch.setattr(rollout, "token_logprobs", recording)  # every GRPO forward: training and no-gradient
    grads = []
    for multiple in (None, 16):
        trainer = _trainer(tokenizer, addition_dataset, tmp_path / str(multiple), model=variable_length_model(tokenizer),
                           max_steps=1, max_completion_length=10, beta=0.04, pad_to_multiple_of=multiple)
        step = capture_gradients(trainer)
        widths.clear()
        trainer.train()
        if multiple:
            assert widths and all(p % 16 == 0 and c % 16 == 0 for p, c in widths)
        grads.append(step[0])
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6), name


def test_reward_functions_get_trainer_state_log_extra_and_log_metric(tokenizer, addition_dataset, tmp_path):
    seen = []

    def reward(completions, answer, trainer_state, log_extra=None, log_metric=None, **kwargs):
        seen.append(type(trainer_state).__name__)
        log_extra("golden", list(answer))
        log_metric("my_accuracy", 0.25)
        return [float(len(c)) for c in completions]

    trainer = _trainer(tokenizer, addition_dataset, tmp_path, reward=reward, max_steps=2, log_completions=True,
                       num_completions_to_print=2)
    trainer.train()
    assert seen == ["TrainerState", "TrainerState"]
    assert last_train_record(trainer)["my_accuracy"] == 0.25
    rows = [json.loads(line) for line in open(tmp_path / "out" / "completions.jsonl")]
    assert len(rows) == 16 and {"step", "prompt", "completion", "rewards", "advantage", "golden"} <= set(rows[0])
    assert rows[0]["golden"] == [r for r in addition_dataset if r["prompt"] == rows[0]["prompt"]][0]["answer"]


def test_completions_reach_the_trackers_as_tables(tokenizer, addition_dataset, tmp_path, monkeypatch):
    """log_completions with report_to: each logging step's round as a table named "completions", TRL's columns (then
    the log_extra columns): a Table through wandb's (and trackio's) API, and a Markdown table in TensorBoard's text
    tab; log_unique_prompts keeps each prompt's first row."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged = []

    class Table:  # wandb's and trackio's Table(columns=..., data=...)
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    wandb = types.SimpleNamespace(init=lambda **kw: None, finish=lambda: None, Table=Table,
                                  log=lambda record, step: logged.append((step, record)))
    monkeypatch.setitem(sys.modules, "wandb", wandb)

    def reward(completions, answer, log_extra=None, **kwargs):
        log_extra("golden", list(answer))
        return [float(len(c)) for c in completions]

    for unique in (False, True):
        logged.clear()
        out = tmp_path / f"unique-{unique}"
        trainer = _trainer(tokenizer, addition_dataset, out, reward=reward, max_steps=2, log_completions=True,
                           report_to=["wandb", "tensorboard"], logging_dir=str(out / "tb"),
                           log_unique_prompts=unique)
        trainer.train()
        tables = [(step, record["completions"]) for step, record in logged if "completions" in record]
        assert [step for step, _ in tables] == [1, 2]
        table = tables[-1][1]
        assert table.columns == ["step", "prompt", "completion", "reward", "advantage", "golden"]
        rounds = [json.loads(line) for line in open(out / "out" / "completions.jsonl")]
        last = [r for r in rounds if r["step"] == 2]
        prompts = [r["prompt"] for r in last]
        expected = [r for i, r in enumerate(last) if not unique or r["prompt"] not in prompts[:i]]
        assert len(table.data) == len(expected) == (len(set(prompts)) if unique else len(last))
        for row, r in zip(table.data, expected):
            assert row == [2, r["prompt"], r["completion"], r["rewards"]["reward"], r["advantage"], r["golden"]]
        events = EventAccumulator(str(out / "tb"), size_guidance={"tensors": 0})
        events.Reload()
        text = [e for e in events.Tensors("completions/text_summary")]
        assert [e.step for e in text] == [1, 2]
        markdown = text[-1].tensor_proto.string_val[0].decode()
        assert markdown.splitlines()[0] == "| step | prompt | completion | reward | advantage | golden |"
        assert len(markdown.splitlines()) == 2 + len(expected)


def test_remove_unused_columns_hides_the_columns_from_rewards(tokenizer, addition_dataset, tmp_path):
    from posttrain.data import DataError

    keys = []
    trainer = _trainer(tokenizer, addition_dataset, tmp_path, reward=lambda completions, **kw: keys.append(
        sorted(kw)) or [0.0] * len(completions), max_steps=1, remove_unused_columns=True)
    trainer.train()
    assert keys[0] == ["completion_ids", "log_extra", "log_metric", "prompts", "trainer_state"]

    def needs_answer(completions, answer, **kw):
        return [0.0] * len(completions)

    with pytest.raises(DataError, match="requires the argument 'answer'"):
        _trainer(tokenizer, addition_dataset, tmp_path, reward=needs_answer, remove_unused_columns=True)


def test_reward_processing_classes_tokenize_for_the_reward_model(tokenizer, addition_dataset, tmp_path):
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    reward_model = AutoModelForSequenceClassification.from_config(cfg)
    calls = []

    class Counting(type(tokenizer)):
        def __call__(self, *args, **kwargs):
            calls.append(1)
            return super().__call__(*args, **kwargs)

    counting = Counting(tokenizer_object=tokenizer.backend_tokenizer, pad_token="<|pad|>", eos_token="<|im_end|>")
    trainer = GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), [reward_model, length_reward],
                          tiny_config(tmp_path, max_steps=1), train_dataset=addition_dataset,
                          processing_class=tokenizer, reward_processing_classes=[counting, None])
    trainer.train()
    assert calls and trainer.reward_funcs[0].tokenizer is counting
    with pytest.raises(ConfigError, match="reward_processing_classes has 1 entries for 2 reward functions"):
        GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), [reward_model, length_reward],
                    tiny_config(tmp_path), train_dataset=addition_dataset, processing_class=tokenizer,
                    reward_processing_classes=[counting])


def test_entropy_bonus_trains_and_logs_its_coefficient(tokenizer, addition_dataset, tmp_path):
    trainer = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=3, entropy_coef=0.01,
                       use_adaptive_entropy=True, entropy_target=100.0, entropy_coef_delta=0.002)
    trainer.train()
    records = [r for r in trainer.state.log_history if "loss" in r]
    assert [r["entropy_coef"] for r in records] == pytest.approx([0.012, 0.014, 0.016])  # entropy below target
    assert all(math.isfinite(r["policy_loss"]) for r in records)


def test_fp16_trains_on_cpu(tokenizer, addition_dataset, tmp_path):
    trainer = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=2, fp16=True)
    assert trainer.accelerator.mixed_precision == "fp16"
    trainer.train()
    assert math.isfinite(last_train_record(trainer)["loss"])


def _with_cpu_grad_scaler(make_accelerator, init_scale: float):
    """make_accelerator with fp16 as a GPU runs it: float16 autocast, and accelerate's GradScaler (a CPU one here)
    scaling the loss and unscaling the gradients before clipping."""
    def made(args, precision):
        accelerator = make_accelerator(args, precision)
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1000)
        return accelerator

    return made


def test_an_fp16_overflow_is_skipped_by_the_loss_scaler_and_the_run_goes_on(tokenizer, addition_dataset, tmp_path,
                                                                           monkeypatch):
    """fp16 as a GPU runs it, imitated on the CPU: float16 autocast and accelerate's GradScaler (a CPU one) starting at
    2^40, so the first updates overflow in float16. The scaler skips them and halves its scale, the schedule waits, the weights
    stay, and the run trains on once the scale fits (before: it stopped at step 1, grad_norm inf)."""
    import posttrain.training.trainer as loop

    monkeypatch.setattr(loop, "make_accelerator", _with_cpu_grad_scaler(loop.make_accelerator, 2.0 ** 40))
    trainer = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=32, fp16=True, learning_rate=1e-3,
                       lr_scheduler_type="linear")
    start = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    rates = []

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            rates.append(trainer.lr_scheduler.get_last_lr()[0])

    trainer.add_callback(Watch())
    trainer.train()
    skipped = 40 - int(math.log2(trainer.accelerator.scaler.get_scale()))  # each skip halved the scale
    assert 0 < skipped < 32 and trainer.state.global_step == 32
    # the skipped steps' gradient norms are not finite (left out of the logged means), the applied ones are
    norms = [r["grad_norm"] for r in trainer.state.log_history if "grad_norm" in r]
    assert len(norms) == 32 - skipped and all(math.isfinite(n) for n in norms)
    assert rates[0] == 1e-3  # the first update overflowed: skipped, the schedule waited
    assert rates[-1] == pytest.approx(1e-3 * skipped / 32)  # linear: it advanced once per applied update only
    assert any(not torch.equal(p, start[n]) for n, p in trainer.policy.named_parameters())


def test_gradients_that_overflow_at_every_scale_stop_the_run_in_one_sentence(tokenizer, addition_dataset, tmp_path,
                                                                            monkeypatch):
    import posttrain.training.trainer as loop
    from posttrain.training.step import MAX_SCALER_SKIPS, TrainingError

    from datasets import Dataset

    from posttrain import SFTConfig, SFTTrainer

    monkeypatch.setattr(loop, "make_accelerator", _with_cpu_grad_scaler(loop.make_accelerator, 2.0 ** 127))
    data = Dataset.from_dict({"prompt": ["1+1=", "2+2="] * 4, "completion": ["2", "4"] * 4})
    config = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=MAX_SCALER_SKIPS + 2, fp16=True, use_cpu=True,
                       per_device_train_batch_size=2, save_strategy="no", report_to="none")
    trainer = SFTTrainer(tiny_model(tokenizer, hidden=32, layers=1), args=config, train_dataset=data,
                         processing_class=tokenizer)
    with pytest.raises(TrainingError, match=rf"^Step {MAX_SCALER_SKIPS}: the fp16 loss scaler skipped the last "
                                            rf"{MAX_SCALER_SKIPS} updates in a row for non-finite gradients .* Lower "
                                            r"the learning_rate, check the data, or train in bf16\.$"):
        trainer.train()


def test_default_args_name_the_output_dir_after_the_model(tokenizer, addition_dataset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = tiny_model(tokenizer, hidden=32, layers=1, max_positions=1024)  # room for TRL's 512 new tokens
    model.config._name_or_path = "Org/Tiny-0.5B"
    trainer = GRPOTrainer(model, length_reward, train_dataset=addition_dataset, processing_class=tokenizer)
    assert trainer.args.output_dir == "Tiny-0.5B-GRPO" and trainer.args.num_generations == 8


def test_should_epoch_stop_skips_the_rest_of_the_epochs_prompts(tokenizer, addition_dataset, tmp_path):
    epochs = []

    class StopEpoch(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_epoch_stop = state.global_step == 1

        def on_epoch_end(self, args, state, control, **kwargs):
            epochs.append((state.global_step, state.epoch))

    # 16 prompts, 2 per generation batch: 8 steps an epoch; stopping the first epoch after step 1
    trainer = GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), length_reward,
                          tiny_config(tmp_path, max_steps=3), train_dataset=addition_dataset,
                          processing_class=tokenizer, callbacks=[StopEpoch()])
    trainer.train()
    assert epochs[0] == (1, 1.0)  # the first epoch ended at step 1, its other 7 rounds skipped
    assert trainer.rounds_consumed == 10 and trainer.state.epoch == pytest.approx(1.25)


def test_an_eval_dataset_without_the_training_columns_is_refused(tokenizer, addition_dataset, tmp_path):
    from datasets import Dataset

    from posttrain.data import DataError

    with pytest.raises(DataError, match=r"eval_dataset lacks the column\(s\) answer that the training data has"):
        GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), length_reward, tiny_config(tmp_path),
                    train_dataset=addition_dataset, eval_dataset=Dataset.from_dict({"prompt": ["1+1="]}),
                    processing_class=tokenizer)


@pytest.mark.parametrize("trainer_name", ["sft", "dpo", "grpo"])
def test_transformers_training_arguments_are_converted_as_trl_converts_them(tokenizer, tmp_path, trainer_name):
    """TRL's trainers take a plain transformers TrainingArguments and convert it to their config (to_dict, the
    trainer's own fields at their defaults); accelerator_config at transformers' defaults is accepted."""
    from datasets import Dataset
    from transformers import TrainingArguments

    from posttrain.configs import ConfigError, DPOConfig, GRPOConfig, SFTConfig
    from posttrain.dpo.trainer import DPOTrainer
    from posttrain.grpo.trainer import GRPOTrainer
    from posttrain.sft.trainer import SFTTrainer
    from posttrain.testing import tiny_model

    args = TrainingArguments(output_dir=str(tmp_path / "out"), learning_rate=3e-3, max_steps=1, report_to="none",
                             per_device_train_batch_size=8, use_cpu=True, save_strategy="no")
    model = tiny_model(tokenizer, hidden=32, layers=1, max_positions=1024)  # GRPO's default completions: 512 tokens
    if trainer_name == "sft":
        trainer = SFTTrainer(model, args=args, train_dataset=Dataset.from_dict({"text": ["ab"] * 8}),
                             processing_class=tokenizer)
        config = SFTConfig
    elif trainer_name == "dpo":
        trainer = DPOTrainer(model, args=args, processing_class=tokenizer,
                             train_dataset=Dataset.from_dict({"prompt": ["a"] * 8, "chosen": ["b"] * 8,
                                                              "rejected": ["c"] * 8}))
        config = DPOConfig
    else:
        trainer = GRPOTrainer(model, lambda completions, **kw: [0.0] * len(completions), args=args,
                              processing_class=tokenizer, train_dataset=Dataset.from_dict({"prompt": ["a"] * 8}))
        config = GRPOConfig
    assert type(trainer.args) is config
    assert (trainer.args.learning_rate, trainer.args.max_steps, trainer.args.output_dir) == (3e-3, 1, args.output_dir)
    assert trainer.args.gradient_checkpointing is False  # TrainingArguments' default, as TRL's conversion keeps it
    with pytest.raises(ConfigError, match="args is a dict: pass a"):
        type(trainer)(model, args={"learning_rate": 1.0})


def test_training_step_is_the_override_point_for_each_micro_batch(tokenizer, tmp_path):
    """transformers' training_step(model, inputs, num_items_in_batch): called once per micro-batch with the
    trainer's micro-batch, it returns the loss it backpropagated (the micro-batch's share: they add up to the step's
    loss); an override that does not call super() stops in one sentence; the DataLoader getters say why not."""
    from datasets import Dataset

    from posttrain.configs import SFTConfig
    from posttrain.errors import UserError
    from posttrain.sequences.collate import SequenceBatch
    from posttrain.sft.trainer import SFTTrainer

    calls = []

    class Counting(SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            calls.append((type(inputs), float(loss)))
            return loss

    args = SFTConfig(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2,
                     gradient_accumulation_steps=3, logging_steps=1, save_strategy="no", use_cpu=True,
                     gradient_checkpointing=False, report_to="none")
    data = Dataset.from_dict({"text": ["ab " * (1 + i % 5) for i in range(12)]})
    trainer = Counting(tiny_model(tokenizer, hidden=32, layers=1), args=args, train_dataset=data,
                       processing_class=tokenizer)
    trainer.train()
    assert len(calls) == 6 and all(kind is SequenceBatch for kind, _ in calls)
    records = [h for h in trainer.state.log_history if "loss" in h and "step" in h][:2]
    for step, record in enumerate(records):
        assert sum(loss for _, loss in calls[3 * step:3 * step + 3]) == pytest.approx(record["loss"], rel=1e-5)
    assert [type(batch) for batch in trainer.get_train_dataloader()] == [SequenceBatch] * 6  # what training_step got

    class Forgetful(SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            return torch.zeros(())

    args.output_dir = str(tmp_path / "forgetful")
    with pytest.raises(UserError, match="Forgetful.training_step returned without calling super"):
        Forgetful(tiny_model(tokenizer, hidden=32, layers=1), args=args, train_dataset=data,
                  processing_class=tokenizer).train()


def test_documented_override_points_run_in_a_grpo_subclass(tokenizer, addition_dataset, tmp_path):
    """log, evaluate, save_model and training_step, overridden as a TRL user overrides them, are what the loop calls
    (training/overrides.py lists them)."""
    seen = {"log": 0, "evaluate": 0, "save_model": [], "training_step": 0}

    class Custom(GRPOTrainer):
        def log(self, logs, start_time=None):
            seen["log"] += 1
            super().log(logs, start_time)

        def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
            seen["evaluate"] += 1
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

        def save_model(self, output_dir=None, _internal_call=False):
            seen["save_model"].append(output_dir)
            super().save_model(output_dir, _internal_call)

        def training_step(self, model, inputs, num_items_in_batch=None):
            seen["training_step"] += 1
            return super().training_step(model, inputs, num_items_in_batch)

    config = tiny_config(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8)
    trainer = Custom(variable_length_model(tokenizer), length_reward, config, train_dataset=addition_dataset,
                     eval_dataset=addition_dataset.select(range(4)), processing_class=tokenizer)
    trainer.train()
    micro_per_step = config.gradient_accumulation_steps
    assert seen["training_step"] == 2 * micro_per_step and seen["evaluate"] == 1
    assert seen["log"] == len(trainer.state.log_history) >= 3  # steps, the evaluation, the summary
    assert seen["save_model"] == [config.output_dir]
    assert os.path.exists(os.path.join(config.output_dir, "model.safetensors"))


@pytest.mark.parametrize("method,advice", [
    ("_compute_loss", "override compute_loss"), ("_generate_and_score_completions", "reward_funcs"),
    ("create_optimizer", "optimizers=\\(optimizer, lr_scheduler\\)"), ("get_train_dataloader", "prepares and batches"),
    ("prediction_step", "compute_metrics"),
])
def test_an_override_posttrain_never_calls_stops_at_construction(tokenizer, addition_dataset, tmp_path, method,
                                                                advice):
    from posttrain.errors import UserError

    Custom = type("Custom", (GRPOTrainer,), {method: lambda self, *a, **k: None})
    with pytest.raises(UserError, match=f"Custom.{method} overrides a transformers/TRL method that posttrain's "
                                        f"GRPOTrainer never calls, so the override would be ignored: .*{advice}"):
        Custom(tiny_model(tokenizer, hidden=32, layers=1), length_reward, tiny_config(tmp_path),
               train_dataset=addition_dataset, processing_class=tokenizer)
