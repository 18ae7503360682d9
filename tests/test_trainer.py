"""GRPOTrainer on tiny in-process models: smoke, invariance of the update to the batch split, options."""

import json
import math

import pytest
import torch
from conftest import (assert_same_updates, capture_gradients, last_train_record, length_reward, tiny_config,
                      train_recording_passes, use_sgd, variable_length_fast_model, variable_length_model)

from posttrain.grpo.trainer import GRPOTrainer
from posttrain.rewards import RewardError
from posttrain.testing import tiny_model


def _run(tokenizer, dataset, tmp_path, reward=length_reward, capture=False, model=None, sgd=False, **overrides):
    """Train; with capture=True, also return the gradients each optimizer step saw.

    sgd=True swaps AdamW for plain SGD, whose update is linear in the gradient: Adam turns noise-level
    gradients (1e-12 of either sign) into full +-lr steps, so its updates cannot be compared to tolerance.
    """
    model = model or tiny_model(tokenizer, hidden=32, layers=1)
    trainer = GRPOTrainer(model, reward, tiny_config(tmp_path, **overrides), train_dataset=dataset,
                          processing_class=tokenizer)
    if sgd:
        use_sgd(trainer)
    grads = capture_gradients(trainer) if capture else []
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    return trainer, params, grads


def test_smoke_finite_loss_params_move_and_outputs(tokenizer, addition_dataset, tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model(tokenizer, hidden=32, layers=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer, after, _ = _run(tokenizer, addition_dataset, tmp_path, model=model, max_steps=3, beta=0.04)
    records = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in ("loss", "grad_norm", "learning_rate", "reward", "reward_std", "rewards/length_reward/mean",
                "frac_reward_zero_std", "kl", "entropy", "clip_ratio/region_mean", "completions/mean_length",
                "completions/clipped_ratio", "step_time"):
        assert key in records[-1] and math.isfinite(records[-1][key]), key
    assert any(not torch.equal(before[n], after[n]) for n in before)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert all(torch.equal(p, after[n]) for n, p in reloaded.named_parameters())
    assert (tmp_path / "out" / "model.safetensors").exists() and trainer.state.global_step == 3
    # num_tokens as TRL logs it: the running total of prompt and completion tokens fed to the model
    (prompt_tokens,) = {len(ids) for ids in trainer.encoder.encode(list(addition_dataset["prompt"]),
                                                                  list(range(len(addition_dataset))))}  # "a+b=": one
    rows = 8  # per_device_train_batch_size, one generation batch per step
    totals = [r["num_tokens"] for r in records]
    fed = [b - a for a, b in zip([0.0, *totals], totals)]
    assert fed == [rows * prompt_tokens + r["completions/mean_length"] * rows for r in records]
    assert trainer.state.num_input_tokens_seen == totals[-1]


@pytest.mark.parametrize("path", ["logits", "chunked"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"])
def test_update_is_the_same_for_any_split_of_the_generation_batch(tokenizer, addition_dataset, tmp_path, loss_type,
                                                                  path):
    """Same gradient and update for 1x8, 2x4 and 8x1, through the logits path and through the chunked output
    layer (with its gradient computed in the forward)."""
    make = variable_length_model if path == "logits" else variable_length_fast_model
    results, lengths = {}, None
    for micro, accum in ((8, 1), (4, 2), (1, 8)):
        trainer, params, grads = _run(tokenizer, addition_dataset, tmp_path / f"{micro}x{accum}", capture=True,
                                      sgd=True, model=make(tokenizer), max_steps=1,
                                      per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
                                      generation_batch_size=8, max_completion_length=10, loss_type=loss_type,
                                      beta=0.04)
        results[(micro, accum)] = (params, grads[0])
        record = last_train_record(trainer)
        lengths = (record["completions/min_length"], record["completions/max_length"])
    assert lengths[0] < lengths[1]  # completions of different lengths: the normalisers really differ
    assert_same_updates(results)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
def test_a_long_micro_batch_runs_as_passes_with_the_same_update(tokenizer, addition_dataset, tmp_path, loss_type):
    """max_completion_tokens_per_pass: an 8-row micro-batch of up to 10 completion tokens a row runs as passes of
    whole rows (as many as TrainingBatch.pass_count says: its prompts, of a few tokens, cap them at 3), with the
    gradients, update and logged metrics of one pass (None), through the chunked output layer and with gradient
    checkpointing (each pass's own recompute)."""
    results, metrics, passes = {}, {}, {}
    for limit, split in ((None, (8, 1)), (40, (4, 2)), (10, (1, 8))):
        trainer = GRPOTrainer(variable_length_fast_model(tokenizer), length_reward,
                              tiny_config(tmp_path / str(limit), max_steps=1, max_completion_length=10,
                                          loss_type=loss_type, beta=0.04, gradient_checkpointing=True,
                                          max_completion_tokens_per_pass=limit),
                              train_dataset=addition_dataset, processing_class=tokenizer)
        passes[limit], results[split] = train_recording_passes(trainer)
        metrics[limit] = last_train_record(trainer)
    assert passes[None] == [8] and len(passes[40]) == 2 and len(passes[10]) == 3, passes
    assert sum(passes[40]) == sum(passes[10]) == 8
    assert_same_updates(results)
    for key in ("loss", "kl", "entropy", "clip_ratio/region_mean", "grad_norm"):
        for limit in (40, 10):
            assert metrics[limit][key] == pytest.approx(metrics[None][key], rel=1e-5, abs=1e-7), (key, limit)


def _rows(prompt_width: int, completion_width: int, prompts: list[int]):
    """A TrainingBatch of one row per entry of `prompts` (the id its prompt repeats), every position real."""
    from posttrain.generation import Rollouts
    from posttrain.grpo.batch import TrainingBatch

    n = len(prompts)
    rollouts = Rollouts(torch.tensor(prompts)[:, None].repeat(1, prompt_width),
                        torch.ones(n, prompt_width, dtype=torch.bool),
                        torch.arange(n)[:, None].repeat(1, completion_width),
                        torch.ones(n, completion_width, dtype=torch.bool), torch.zeros(n, dtype=torch.bool),
                        torch.zeros(n, completion_width))
    return TrainingBatch(rollouts, torch.ones(n), torch.ones(n, completion_width, dtype=torch.bool))


def test_passes_keep_a_prompts_rows_together_and_rerun_few_prompts():
    """8 rows of 100 completion tokens at 200 a pass: 4 passes of 2 rows, each of one prompt; a pass reruns its
    prompts, so a prompt of 100 tokens allows 2 (one pass would run 900 positions, each rerun adds 100: at most 1/8
    more) and one of 400 tokens none."""
    batch = _rows(4, 100, [3, 5] * 4)
    assert batch.pass_count(200) == 4 and batch.pass_count(800) == 1 and batch.pass_count(50) == 8
    parts = batch.in_passes(4)
    assert [p.rollouts.completion_ids[:, 0].tolist() for p in parts] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert all(len(p.rollouts.prompt_ids.unique()) == 1 for p in parts)
    assert _rows(100, 100, [3] * 8).pass_count(200) == 2 and _rows(400, 100, [3] * 8).pass_count(200) == 1
    with pytest.raises(ValueError, match="8 rows cannot run as 9 passes"):
        batch.in_passes(9)


def test_a_micro_batch_runs_whole_where_its_loss_or_an_override_needs_it(tokenizer, addition_dataset, tmp_path):
    """An entropy quantile looks at every token of the micro-batch, and an overridden compute_loss is TRL's override
    point for a micro-batch: neither sees a part of one."""
    class Overridden(GRPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen.append(len(inputs))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    for trainer_class, quantile in ((GRPOTrainer, 0.5), (Overridden, 1.0)):
        seen = []
        trainer = trainer_class(tiny_model(tokenizer, hidden=32, layers=1), length_reward,
                                tiny_config(tmp_path / str(quantile), max_steps=1, max_completion_length=8,
                                            top_entropy_quantile=quantile, max_completion_tokens_per_pass=8),
                                train_dataset=addition_dataset, processing_class=tokenizer)
        step = trainer.training_step
        trainer.training_step = lambda model, batch, n=None: seen.append(len(batch)) or step(model, batch, n)
        trainer.train()
        assert seen[:1] == [8], (trainer_class.__name__, seen)


def test_loss_types_really_differ(tokenizer, addition_dataset, tmp_path):
    grads = {}
    for loss_type in ("grpo", "dapo"):
        _, _, g = _run(tokenizer, addition_dataset, tmp_path / loss_type, capture=True, max_steps=1,
                       model=variable_length_model(tokenizer), max_completion_length=10, loss_type=loss_type)
        grads[loss_type] = g[0]["model.embed_tokens.weight"]
    assert not torch.allclose(grads["grpo"], grads["dapo"])


def test_steps_per_generation_decoupled_from_accumulation(tokenizer, addition_dataset, tmp_path):
    """A 16-completion generation batch consumed as 2 optimizer steps, split 1x8, 2x4 or 4x2 per step."""
    results = []
    for micro, accum in ((8, 1), (4, 2), (2, 4)):
        _, params, grads = _run(tokenizer, addition_dataset, tmp_path / f"{micro}", capture=True, max_steps=2,
                                sgd=True, model=variable_length_model(tokenizer),
                                per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
                                generation_batch_size=16, max_completion_length=10, loss_type="bnpo")
        assert len(grads) == 2
        results.append(params)
    for params in results[1:]:
        for name in params:
            assert torch.allclose(params[name], results[0][name], rtol=1e-4, atol=1e-6), name


def test_num_iterations_uses_old_logprobs_and_clips(tokenizer, addition_dataset, tmp_path):
    trainer, _, grads = _run(tokenizer, addition_dataset, tmp_path, capture=True, max_steps=4, num_iterations=2,
                             learning_rate=5e-2, epsilon=0.01)
    assert trainer.needs_old_logps and len(grads) == 4
    records = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    # the second pass over a batch sees a moved policy: some ratios leave [1 - eps, 1 + eps]
    assert max(r["clip_ratio/region_mean"] for r in records) > 0


def test_conversational_prompts_and_mask_truncated(tokenizer, tmp_path):
    from datasets import Dataset

    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"say {i}"}] for i in range(8)]})
    seen = []

    def reward(prompts, completions, **kw):
        seen.append((prompts[0], completions[0]))
        return [float(len(c[0]["content"])) for c in completions]

    _run(tokenizer, ds, tmp_path, reward=reward, max_steps=1, mask_truncated_completions=True)
    prompt, completion = seen[0]
    assert prompt[0]["role"] == "user" and completion[0]["role"] == "assistant"


def test_reward_error_during_training_names_function_and_step(tokenizer, addition_dataset, tmp_path):
    calls = []

    def flaky(completions, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise ZeroDivisionError("bad row")
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match="'flaky' raised ZeroDivisionError at step 2"):
        _run(tokenizer, addition_dataset, tmp_path, reward=flaky, max_steps=3)


def test_callbacks_and_epochs(tokenizer, addition_dataset, tmp_path):
    events = []

    class Recorder:
        def on_log(self, args, state, control, logs=None, **kw):
            events.append(("log", state.global_step, logs["step"], "train_runtime" in logs))

        def on_step_end(self, args, state, control, **kw):
            control.should_training_stop = state.global_step >= 2

    trainer = GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), length_reward,
                          tiny_config(tmp_path, max_steps=-1, num_train_epochs=1), train_dataset=addition_dataset,
                          processing_class=tokenizer, callbacks=[Recorder()])
    assert trainer.total_steps == 8  # 16 prompts / 2 per generation batch
    trainer.train()
    # two logging steps, then the end-of-training summary (as transformers logs it)
    assert events == [("log", 1, 1, False), ("log", 2, 2, False), ("log", 2, 2, True)]
    assert trainer.state.global_step == 2


def test_evaluate_reports_rewards(tokenizer, addition_dataset, tmp_path):
    from posttrain.rewards.builtin import accuracy

    trainer = GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), [accuracy, length_reward],
                          tiny_config(tmp_path), train_dataset=addition_dataset, eval_dataset=addition_dataset.select(
                              range(3)), processing_class=tokenizer)
    out = trainer.evaluate()
    assert 0.0 <= out["eval_rewards/accuracy/mean"] <= 1.0 and math.isfinite(out["eval_reward"])


@pytest.mark.parametrize("options", [
    dict(importance_sampling_level="sequence", loss_type="grpo", num_iterations=2),
    dict(top_entropy_quantile=0.5),
    dict(delta=2.0, num_iterations=2, epsilon_high=0.28),
    dict(scale_rewards="batch", loss_type="dr_grpo"),
    dict(scale_rewards="none", loss_type="cispo", epsilon_high=5.0),
    dict(multi_objective_aggregation="normalize_then_sum", reward_weights=[1.0, 0.5]),
    dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
    dict(lr_scheduler_type="cosine", warmup_ratio=0.5, weight_decay=0.1, max_grad_norm=0.0),
    dict(gradient_checkpointing=True, beta=0.04),
])
def test_option_paths_train(tokenizer, addition_dataset, tmp_path, options):
    from posttrain.rewards.builtin import accuracy

    rewards = [length_reward, accuracy] if "reward_weights" in options else length_reward
    trainer, _, _ = _run(tokenizer, addition_dataset, tmp_path, reward=rewards, max_steps=2, **options)
    last = last_train_record(trainer)
    assert math.isfinite(last["loss"]) and math.isfinite(last["grad_norm"]) and last["step"] == 2


def test_top_entropy_quantile_masks_low_entropy_tokens():
    from posttrain.grpo.losses import entropy_quantile_mask

    entropy = torch.tensor([[0.1, 0.9, 0.5, 0.7], [0.2, 0.3, 0.8, 0.0]])
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])
    kept = entropy_quantile_mask(entropy, mask, 0.25)
    # 7 valid tokens; the 0.75 quantile of their entropies is 0.75 (interpolated): keep 0.8 and 0.9 only
    assert kept.tolist() == [[False, True, False, False], [False, False, True, False]]


def test_skipping_zero_advantage_rows_leaves_the_update_unchanged(tokenizer, tmp_path):
    """Groups with constant reward have advantage 0: skipping their rows must not change the gradient."""
    from datasets import Dataset

    ds = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)],
                            "flat": [i % 2 == 0 for i in range(16)]})

    def half_flat(completions, flat, **kw):  # constant reward for "flat" prompts: zero-std groups
        return [0.5 if f else len(c) / 10 for c, f in zip(completions, flat)]

    grads = []
    for skip in (True, False):
        trainer = GRPOTrainer(variable_length_model(tokenizer), half_flat,
                              tiny_config(tmp_path / str(skip), max_steps=1, per_device_train_batch_size=4,
                                          gradient_accumulation_steps=4, max_completion_length=10,
                                          loss_type="grpo"),
                              train_dataset=ds, processing_class=tokenizer)
        assert trainer.skip_zero_advantage_rows
        trainer.skip_zero_advantage_rows = skip
        steps = capture_gradients(trainer)
        trainer.train()
        grads.append(steps[0])
        assert last_train_record(trainer)["frac_reward_zero_std"] > 0
    for name in grads[1]:
        assert torch.allclose(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-7), name


def test_bf16_mixed_precision_trains(tokenizer, addition_dataset, tmp_path):
    """bf16=True (the default on CUDA devices with bf16) runs the whole step under autocast; here on CPU."""
    trainer, _, _ = _run(tokenizer, addition_dataset, tmp_path, max_steps=2, bf16=True, beta=0.04)
    assert trainer.accelerator.mixed_precision == "bf16"
    last = last_train_record(trainer)
    assert all(math.isfinite(last[k]) for k in ("loss", "grad_norm", "kl", "entropy"))


def test_bfloat16_weights_train(tokenizer, addition_dataset, tmp_path):
    """A model loaded in bfloat16 (model_init_kwargs dtype) trains; the output layer math is float32."""
    model = tiny_model(tokenizer, hidden=32, layers=1).to(torch.bfloat16)
    trainer, after, _ = _run(tokenizer, addition_dataset, tmp_path, model=model, max_steps=2, beta=0.04)
    last = last_train_record(trainer)
    assert all(math.isfinite(last[k]) for k in ("loss", "grad_norm", "kl"))
    assert all(p.dtype == torch.bfloat16 for p in after.values())


def test_on_bad_reward_skip_zeroes_the_group_and_counts_it(tokenizer, addition_dataset, tmp_path):
    calls = []

    def sometimes_inf(completions, **kw):
        calls.append(1)
        out = [len(c) / 10 for c in completions]
        out[1] = float("inf")  # one completion of the first group
        return out

    trainer = GRPOTrainer(variable_length_model(tokenizer), sometimes_inf,
                          tiny_config(tmp_path, max_steps=2, on_bad_reward="skip"), train_dataset=addition_dataset,
                          processing_class=tokenizer)
    scored = trainer.rollout.scored_batch(trainer.rounds, step=1)
    assert scored.batch.advantages[:4].tolist() == [0.0] * 4 and scored.batch.advantages[4:].abs().sum() > 0
    assert scored.metrics["rewards/skipped_groups"] == 1
    with pytest.raises(RewardError, match="returned inf for completion 1 at step 1.*on_bad_reward=skip"):
        GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), sometimes_inf, tiny_config(tmp_path / "stop"),
                    train_dataset=addition_dataset, processing_class=tokenizer).train()


@pytest.mark.parametrize("options", [
    dict(loss_type="grpo"), dict(loss_type="bnpo", beta=0.04), dict(loss_type="dr_grpo"),
    dict(loss_type="dapo", beta=0.04, num_iterations=2), dict(loss_type="cispo", beta=0.04),
    dict(loss_type="dapo", delta=1.5, epsilon_high=0.28, num_iterations=2),
    dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
    dict(loss_type="grpo", importance_sampling_level="sequence", num_iterations=2),
    dict(loss_type="dapo", top_entropy_quantile=0.5),
])
def test_output_layer_gradient_from_the_forward_equals_the_backward(tokenizer, addition_dataset, tmp_path,
                                                                   monkeypatch, options):
    """The output layer's gradient computed in the forward from the predicted loss gradient (models/chunked.py)
    equals the plain recomputing backward, and where the loss is token-local nothing is recomputed."""
    from posttrain.models import chunked
    from posttrain.models.chunked_check import fast_path_available

    recomputed = []
    original = chunked._recompute_into
    monkeypatch.setattr(chunked, "_recompute_into", lambda *a: recomputed.append(a[6].numel()) or original(*a))
    runs = []
    for predict in (True, False):
        model = variable_length_fast_model(tokenizer)
        assert fast_path_available(model)
        trainer = GRPOTrainer(model, length_reward, tiny_config(tmp_path / str(predict), max_completion_length=10,
                                                                **options),
                              train_dataset=addition_dataset, processing_class=tokenizer)
        if not predict:
            monkeypatch.setattr(trainer, "_loss_gradient", lambda mb, norm, bonus=0.0: None)
        use_sgd(trainer)
        steps = capture_gradients(trainer)
        recomputed.clear()
        trainer.train()
        sequence = options.get("importance_sampling_level") == "sequence"
        # a sequence-level ratio on stored old log-probs, or weighting the KL (use_bias_correction_kl, TRL's
        # default), ties each token's loss to the rest of its sequence
        token_local = options.get("top_entropy_quantile", 1.0) == 1.0 and not (
            sequence and (options.get("num_iterations", 1) > 1 or options.get("beta", 0.0) > 0))
        assert recomputed and (sum(recomputed) == 0) == (predict and token_local), recomputed
        runs.append(steps)
    lengths = trainer.state.log_history[0]
    assert lengths["completions/min_length"] < lengths["completions/max_length"]
    for step_a, step_b in zip(*runs):
        for name in step_b:
            assert torch.allclose(step_a[name], step_b[name], rtol=1e-4, atol=1e-7), name


def _hang_until(release, signalled: list) -> None:
    """What a function that never returns does here: SIGINT to this process 0.2 s into the wait (as a Ctrl-C),
    the time it is sent noted, then wait until released (or 5 s: a run the signal does not stop fails, not hangs)."""
    import os
    import signal
    import threading
    import time

    def send():
        signalled.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    threading.Timer(0.2, send).start()
    release.wait(5.0)


@pytest.mark.parametrize("where", ["reward", "async reward", "filter", "callback"])
def test_a_signal_while_waiting_on_user_code_stops_at_once_naming_it(tokenizer, addition_dataset, tmp_path, where):
    """User code that never returns at step 2 (a reward function, an async one awaiting a thread, a
    dynamic_sampling_filter, a callback): the first SIGINT stops the run within a second with one sentence naming
    it and the newest checkpoint, rather than being noted for a step end that never comes."""
    import asyncio
    import threading
    import time

    from posttrain.training.interrupts import Interrupted

    release, signalled, filtered = threading.Event(), [], []

    def stuck(completions, trainer_state, **kwargs):
        if trainer_state.global_step == 1:
            _hang_until(release, signalled)
        return length_reward(completions)

    async def stuck_async(completions, trainer_state, **kwargs):
        if trainer_state.global_step == 1:
            await asyncio.to_thread(_hang_until, release, signalled)
        return length_reward(completions)

    def keep(rewards):  # 2 groups a round: its third call is in step 2
        filtered.append(1)
        if len(filtered) == 3:
            _hang_until(release, signalled)
        return True

    class Hang:
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                _hang_until(release, signalled)

    reward = {"reward": stuck, "async reward": stuck_async}.get(where, length_reward)
    options = {"dynamic_sampling": True, "dynamic_sampling_filter": keep} if where == "filter" else {}
    trainer = GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), reward,
                          tiny_config(tmp_path, max_steps=3, save_strategy="steps", save_steps=1, **options),
                          train_dataset=addition_dataset, processing_class=tokenizer,
                          callbacks=[Hang()] if where == "callback" else None)
    try:
        with pytest.raises(Interrupted) as stopped:
            trainer.train()
        took = time.monotonic() - signalled[0]
    finally:
        release.set()  # the threads still waiting (the async function's) end
    waited = {"reward": "reward function 'stuck'", "async reward": "reward function 'stuck_async'",
              "filter": "dynamic_sampling_filter 'keep'", "callback": "callback Hang.on_step_end"}[where]
    step = 2 if where == "callback" else 1  # the callback hangs after step 2's update, before its checkpoint
    assert str(stopped.value) == (f"Interrupted (SIGINT) at step {step} of 3 while waiting on {waited}; the newest "
                                  f"checkpoint is {tmp_path}/out/checkpoint-1: resume with "
                                  "resume_from_checkpoint=true.")
    assert stopped.value.exit_code == 130 and took < 1.0, took
    assert [r["step"] for r in trainer.state.log_history if "loss" in r] == list(range(1, step + 1))


@pytest.mark.parametrize("case", ["top_k=1", "constant reward, beta > 0"])
def test_rewards_that_never_differ_within_a_group_are_warned_about_once(tokenizer, addition_dataset, tmp_path,
                                                                       monkeypatch, caplog, case):
    """frac_reward_zero_std at 1 for FLAT_BATCHES generation batches in a row (here 2 of a 3-step run): one warning,
    after the second batch, naming the cause and what still trains."""
    from posttrain.grpo import flat_rewards

    monkeypatch.setattr(flat_rewards, "FLAT_BATCHES", 2)

    def constant(completions, **kwargs):
        return [1.0] * len(completions)

    warned = []  # (step, message)

    class Steps:
        def on_step_end(self, args, state, control, **kwargs):
            warned.extend((state.global_step, r.message) for r in caplog.records if "frac_reward_zero_std" in r.message)
            caplog.clear()

    options = {"top_k": 1} if case == "top_k=1" else {"beta": 0.1}
    trainer = GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), constant if "constant" in case else length_reward,
                          tiny_config(tmp_path, max_steps=3, **options), train_dataset=addition_dataset,
                          processing_class=tokenizer, callbacks=[Steps()])
    with caplog.at_level("WARNING", logger="posttrain"):
        trainer.train()
    assert [r["frac_reward_zero_std"] for r in trainer.state.log_history if "loss" in r] == [1.0, 1.0, 1.0]
    assert [step for step, _ in warned] == [2]  # once, at the second flat batch
    message = warned[0][1]
    assert message.startswith("frac_reward_zero_std has been 1 for 2 generation batches in a row: every completion of "
                              "each prompt got the same reward, so every advantage is 0: ")
    if case == "top_k=1":
        assert "top_k=1 samples greedily" in message and "set top_k=0 (off) or larger" in message
        assert "the policy loss has no gradient" in message
    else:
        assert "reward function 'constant' returned 1 for every completion" in message
        assert ("the rewards carry no signal, and the only gradient left comes from the KL term (beta=0.1), which "
                "only pulls the model back towards the reference" in message)
