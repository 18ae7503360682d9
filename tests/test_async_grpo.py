"""async_generation: rounds sampled ahead by a rollout worker, within max_staleness; bit-identical to synchronous GRPO
at max_staleness 0 (in process and through posttrain serve); failures in the worker stop the run with their sentence;
the queue and its versions travel through checkpoints."""

import threading
import time

import pytest
import torch
from conftest import StopAt, length_reward, tiny_config

from posttrain import GRPOTrainer
from posttrain.configs import ConfigError, GRPOConfig
from posttrain.grpo.async_rollout import AheadRounds, RolloutWorkerError
from posttrain.rewards import RewardError
from posttrain.testing import tiny_model


class Settled:
    """A callback that, before each update's push and after each step, waits until the rollout worker has sampled
    every round it may (grpo/async_rollout.py RolloutWorker.wait_settled): each round is then sampled with the
    oldest weights max_staleness allows, the order a worker faster than the trainer takes, on any machine load."""

    def __init__(self):
        self.trainer = None

    def _settle(self):
        rounds = self.trainer.rounds
        assert isinstance(rounds, AheadRounds), "train() samples through the rollout worker"
        assert rounds.worker.wait_settled(60.0), "the rollout worker did not settle within 60 s"

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._settle()

    def on_step_end(self, args, state, control, **kwargs):
        self._settle()


def _trainer(tokenizer, dataset, out, reward=length_reward, callbacks=None, peft_config=None, **overrides):
    values = dict(max_steps=4, num_iterations=1)
    values.update(overrides)
    trainer = GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), reward, tiny_config(out, **values),
                          train_dataset=dataset, processing_class=tokenizer, callbacks=callbacks,
                          peft_config=peft_config)
    for callback in callbacks or ():
        if isinstance(callback, Settled):
            callback.trainer = trainer
    return trainer


def _worker_running() -> bool:
    return any(t.name == "posttrain-rollout-worker" and t.is_alive() for t in threading.enumerate())


def _records(trainer):
    return [r for r in trainer.state.log_history if "loss" in r]


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}


def _assert_same_run(a, b):
    for x, y in zip(_records(a), _records(b), strict=True):
        for key in ("loss", "reward", "completions/mean_length", "entropy", "num_tokens"):
            assert x.get(key) == y.get(key), (x["step"], key)
    pa, pb = _params(a), _params(b)
    assert all(torch.equal(pa[n], pb[n]) for n in pa), [n for n in pa if not torch.equal(pa[n], pb[n])]


def _async_metrics(trainer, key):
    return [r[key] for r in _records(trainer) if key in r]


def test_staleness_0_is_synchronous_grpo_bit_for_bit(tokenizer, addition_dataset, tmp_path):
    """The worker samples each round from a copy of the policy once the weights of its step are pushed: the same
    completions, rewards, losses and weights as sampling in the training loop; every async/* metric logged."""
    sync = _trainer(tokenizer, addition_dataset, tmp_path / "sync", generation_batch_size=16)
    sync.train()
    ahead = _trainer(tokenizer, addition_dataset, tmp_path / "async", generation_batch_size=16,
                     async_generation=True, max_staleness=0)
    ahead.train()
    _assert_same_run(sync, ahead)
    assert _async_metrics(ahead, "async/staleness_mean") == [0.0, 0.0]  # one round every 2 steps
    assert _async_metrics(ahead, "async/stale_dropped") == [0.0, 0.0]
    for key in ("async/queue_depth", "async/trainer_wait_s", "async/generator_wait_s"):
        assert len(_async_metrics(ahead, key)) == 2, key
    assert not _worker_running()  # the worker stops with train()


def test_staleness_0_through_posttrain_serve_equals_synchronous_serving(tokenizer, addition_dataset, tmp_path):
    from test_serve import running

    from posttrain.serving.engine import TransformersEngine

    runs = []
    for name, extra in (("sync", {}), ("async", {"async_generation": True, "max_staleness": 0})):
        engine = TransformersEngine(tiny_model(tokenizer, seed=9, hidden=32, layers=1), tokenizer, name="tiny")
        with running(engine) as url:
            trainer = _trainer(tokenizer, addition_dataset, tmp_path / name, max_steps=3, use_vllm=True,
                               vllm_mode="server", vllm_server_base_url=url, vllm_server_timeout=10.0, **extra)
            trainer.train()
            trainer.close()
        runs.append(trainer)
    _assert_same_run(*runs)


def test_rounds_run_ahead_within_max_staleness_and_are_corrected(tokenizer, addition_dataset, tmp_path):
    """A worker that samples every round it may before the trainer pushes samples up to max_staleness versions ahead: the rounds are that stale, none is
    dropped, and the importance-sampling correction (the sampler's log-probs the behaviour policy) is logged."""
    trainer = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=5, async_generation=True, max_staleness=2,
                       callbacks=[Settled()])
    trainer.train()
    staleness = _async_metrics(trainer, "async/staleness_mean")
    assert staleness[0] == 0 and max(staleness) == 2 and all(s <= 2 for s in staleness), staleness
    assert sum(_async_metrics(trainer, "async/stale_dropped")) == 0
    ratios = _async_metrics(trainer, "sampling/importance_sampling_ratio/mean")
    assert len(ratios) == 5 and all(0.5 < r < 2 for r in ratios)
    assert trainer.args.corrects_sampling and trainer.needs_old_logps


def test_a_round_staler_than_max_staleness_is_dropped_and_counted(tokenizer, addition_dataset, tmp_path,
                                                                   monkeypatch):
    """A worker that ignores the version gate (here: every round planned for the initial weights) samples rounds
    that are too old by the time they are trained on: each is dropped and counted, none trained on."""
    monkeypatch.setattr(AheadRounds, "plan", lambda self, index: (0, 0))
    trainer = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=3, async_generation=True, max_staleness=0,
                       max_inflight_tasks=64, callbacks=[Settled()])
    trainer.train()
    dropped = sum(_async_metrics(trainer, "async/stale_dropped"))
    assert dropped > 0
    assert _async_metrics(trainer, "async/staleness_mean") == [0.0, 0.0, 0.0]
    assert trainer.rounds_consumed == 3 + dropped


def test_a_reward_function_raising_in_the_worker_stops_the_run_with_its_sentence(tokenizer, addition_dataset,
                                                                                  tmp_path):
    def failing(completions, trainer_state, **kwargs):
        if trainer_state.global_step >= 2:
            raise ValueError("the grader is down")
        return [0.0] * len(completions)

    trainer = _trainer(tokenizer, addition_dataset, tmp_path, reward=failing, async_generation=True,
                       max_staleness=1)
    started = time.monotonic()
    with pytest.raises(RewardError, match="failing.*the grader is down"):
        trainer.train()
    assert time.monotonic() - started < 30
    assert not _worker_running()


def test_a_hung_worker_stops_the_run_after_the_heartbeat(tokenizer, addition_dataset, tmp_path):
    def hanging(completions, trainer_state, **kwargs):
        if trainer_state.global_step >= 2:
            time.sleep(4)
        return [0.0] * len(completions)

    trainer = _trainer(tokenizer, addition_dataset, tmp_path, reward=hanging, async_generation=True,
                       max_staleness=0, heartbeat_stale_after_s=1.0)
    started = time.monotonic()
    with pytest.raises(RolloutWorkerError, match=r"no sign of life for \d+ s \(heartbeat_stale_after_s=1\)"):
        trainer.train()
    assert time.monotonic() - started < 15


def test_a_server_that_fails_stops_the_run_with_one_sentence(tokenizer, addition_dataset, tmp_path):
    from test_serve import running

    from posttrain.generation import GenerationError
    from posttrain.serving.engine import TransformersEngine

    class Dying(TransformersEngine):
        calls = 0

        def generate(self, *args, **kwargs):
            Dying.calls += 1
            if Dying.calls > 2:
                raise RuntimeError("out of memory")
            return super().generate(*args, **kwargs)

    engine = Dying(tiny_model(tokenizer, seed=9, hidden=32, layers=1), tokenizer, name="tiny")
    with running(engine) as url:
        trainer = _trainer(tokenizer, addition_dataset, tmp_path, use_vllm=True, vllm_mode="server",
                           vllm_server_base_url=url, vllm_server_timeout=10.0, async_generation=True, max_staleness=1)
        with pytest.raises(GenerationError, match="answered POST /v1/completions with 500"):
            trainer.train()
        trainer.close()


@pytest.mark.parametrize("staleness", [0, 1])
def test_resume_equals_the_uninterrupted_run(tokenizer, addition_dataset, tmp_path, staleness):
    """The checkpoint holds the worker's queue (rounds sampled ahead, with their versions) and its sampler's state:
    the resumed run takes the same rounds and ends with the same weights, bit for bit (the worker settles before each
    push and after each step, so each round's weights and the queue the checkpoint holds are known on any load)."""
    values = dict(max_steps=4, save_strategy="steps", save_steps=2, async_generation=True, max_staleness=staleness)
    straight = _trainer(tokenizer, addition_dataset, tmp_path / "a", callbacks=[Settled()], **values)
    straight.train()
    first = _trainer(tokenizer, addition_dataset, tmp_path / "b", callbacks=[StopAt(2), Settled()], **values)
    first.train()
    from safetensors.torch import load_file

    from posttrain.grpo.async_rollout import queue_from_tensors

    queued = queue_from_tensors(load_file(tmp_path / "b" / "out" / "checkpoint-2" / "buffer_0.safetensors"))
    assert [(r.index, r.version) for r in queued] == ([(2, 2 - staleness)])
    resumed = _trainer(tokenizer, addition_dataset, tmp_path / "b", callbacks=[Settled()], **values)
    resumed.train(resume_from_checkpoint=True)
    def tail(trainer):
        return [r for r in _records(trainer) if r["step"] > 2]

    for x, y in zip(tail(straight), tail(resumed), strict=True):
        for key in ("loss", "reward", "completions/mean_length", "num_tokens", "async/staleness_mean"):
            assert x[key] == y[key], (x["step"], key)
    pa, pb = _params(straight), _params(resumed)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)


def test_dynamic_sampling_draws_its_extra_rounds_from_the_queue(tokenizer, addition_dataset, tmp_path):
    def coarse(completions, **kwargs):  # many groups have one reward: dynamic sampling needs more rounds
        return [float(len(c) > 6) for c in completions]

    trainer = _trainer(tokenizer, addition_dataset, tmp_path, reward=coarse, max_steps=3, async_generation=True,
                       max_staleness=1, dynamic_sampling=True, dynamic_sampling_max_rounds=20)
    trainer.train()
    rounds = [r["sampling/generation_rounds"] for r in _records(trainer)]
    assert trainer.rounds_consumed == sum(rounds) + sum(_async_metrics(trainer, "async/stale_dropped"))
    assert all(s <= 1 for s in _async_metrics(trainer, "async/staleness_mean"))


@pytest.mark.peft
def test_a_lora_policy_is_sampled_through_its_merged_copy(tokenizer, addition_dataset, tmp_path):
    from peft import LoraConfig

    from posttrain.weights import export_weights

    trainer = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=2, async_generation=True, max_staleness=0,
                       peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                              init_lora_weights=False))
    trainer.train()
    copy = trainer.generator.model.state_dict()
    for name, tensor in export_weights(trainer.policy):  # the copy holds the merged weights of the last push
        assert torch.equal(copy[name], tensor), name
    assert not any("lora" in name for name in copy)


@pytest.mark.parametrize("overrides, message", [
    (dict(use_vllm=True, vllm_mode="colocate"), "set vllm_mode='server'"),
    (dict(max_inflight_tasks=0), "max_inflight_tasks=0 leaves the rollout worker nothing"),
    (dict(max_staleness=-1), "max_staleness=-1 must be >= 0"),
    (dict(weight_sync_steps=0), "weight_sync_steps=0 must be a positive integer"),
])
def test_async_settings_that_cannot_work_are_refused(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        GRPOConfig(output_dir=str(tmp_path), async_generation=True, **overrides)


def test_the_correction_applies_when_the_sampler_may_be_older(tmp_path):
    def config(**kw):
        return GRPOConfig(output_dir=str(tmp_path), **kw)

    assert not config().corrects_sampling
    assert not config(async_generation=True, max_staleness=0).corrects_sampling  # the sampler's weights are current
    assert config(async_generation=True, max_staleness=1).corrects_sampling
    assert not config(async_generation=True, vllm_importance_sampling_correction=False).corrects_sampling
    assert config(async_generation=True).rounds_ahead(8, 1) == 4  # auto: max_staleness x 8 completions a step
    assert config(async_generation=True, max_inflight_tasks=20).rounds_ahead(8, 1) == 2
    assert config(async_generation=True, queue_maxsize=4).rounds_ahead(8, 1) == 1


def test_against_a_vllm_server_the_weights_go_every_weight_sync_steps(tokenizer, addition_dataset, tmp_path):
    """Through vLLM's routes and NCCL transfer (the manifest's double, a stand-in server): one push at the start, then
    one every weight_sync_steps; the worker's requests carry the sampler's seeds; a round's version is the one its
    generation started with."""
    pytest.importorskip("fastapi")
    from test_vllm_adapters import FakeVLLMServer, serving
    from vllm_double import fake_vllm

    fake = FakeVLLMServer()
    with fake_vllm(), serving(fake) as url:
        trainer = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=4, use_vllm=True, vllm_mode="server",
                           vllm_server_base_url=url, vllm_server_timeout=10.0, async_generation=True,
                           max_staleness=1, weight_sync_steps=2, max_completion_length=2)
        trainer.train()
        trainer.close()
    finishes = [body["weight_version"] for path, body in fake.calls if path == "/finish_weight_update"]
    assert len(finishes) == 1 + 4 // 2
    assert len([p for p, _ in fake.calls if p == "/v1/completions"]) >= 4 * 2  # 2 prompts a round, one request each
    assert all(s <= 1 for s in _async_metrics(trainer, "async/staleness_mean"))


@pytest.mark.multiproc
def test_two_processes_sample_ahead_through_one_server(tmp_path, tiny_model_dir):
    """`posttrain grpo --async_generation true` on 2 processes (gloo) through one `posttrain serve`: each process's
    worker samples its share; at max_staleness 0 the run equals the one-process run, and at 1 both processes agree on
    each round's staleness (logged within the bound)."""
    import json
    import subprocess
    import sys

    from test_cli import _env, _write_data
    from test_serve import serve_process

    common = ["--model_name_or_path", tiny_model_dir, "--dataset_name", str(_write_data(tmp_path)),
              "--reward_funcs", "length", "--num_generations", "4", "--max_completion_length", "6",
              "--logging_steps", "1", "--save_strategy", "no", "--gradient_checkpointing", "false", "--use_cpu",
              "true", "--use_vllm", "true", "--vllm_mode", "server", "--async_generation", "true", "--max_steps", "3"]
    two = ["--per_device_train_batch_size", "8", "--accelerate_config", "multi_gpu", "--num_processes", "2"]

    def records(name):
        return [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl") if '"loss"' in line]

    with serve_process(tiny_model_dir) as url:
        for name, layout, staleness in (("two", two, "0"), ("one", ["--per_device_train_batch_size", "16"], "0"),
                                        ("two-ahead", two, "1")):
            out = subprocess.run([sys.executable, "-m", "posttrain.cli", "grpo", *common, *layout, "--max_staleness",
                                  staleness, "--vllm_server_base_url", url, "--vllm_server_timeout", "30",
                                  "--output_dir", str(tmp_path / name)], capture_output=True, text=True, env=_env(),
                                 timeout=300)
            assert out.returncode == 0, out.stderr[-3000:]
    for a, b in zip(records("one"), records("two"), strict=True):
        for key in ("reward", "completions/mean_length", "async/staleness_mean"):
            assert a[key] == b[key], (a["step"], key)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
    ahead = records("two-ahead")
    assert [r["step"] for r in ahead] == [1, 2, 3] and all(r["async/staleness_mean"] <= 1 for r in ahead)


@pytest.mark.parametrize("config", ["RLOOConfig", "DistillationConfig"])
def test_rloo_and_distillation_refuse_async_generation(tmp_path, config):
    """Neither TRL trainer has it, and neither loss corrects for a sampler older than the policy (RLOO has no
    importance-sampling correction in TRL; distillation's divergence is on the student's own completions)."""
    import posttrain.configs as configs

    with pytest.raises(ConfigError, match="async_generation=True is a GRPOConfig field that TRL's"):
        getattr(configs, config)(output_dir=str(tmp_path), async_generation=True)


def test_evaluation_pauses_the_worker_and_samples_the_current_weights(tokenizer, addition_dataset, tmp_path):
    trainer = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=4, async_generation=True, max_staleness=1,
                       eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8)
    trainer.eval_dataset = addition_dataset.select(range(4))
    trainer.train()
    evals = [r for r in trainer.state.log_history if "eval_reward" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(s <= 1 for s in _async_metrics(trainer, "async/staleness_mean"))


def test_a_callback_ending_the_epoch_drops_the_rounds_sampled_for_its_rest(tokenizer, addition_dataset, tmp_path):
    """should_epoch_stop at step 1 (one round a step, 2 rounds an epoch): the round the worker sampled for step 2 is
    dropped with the epoch's rest, and step 2 trains on the next epoch's first round."""

    class EndEpoch:
        def on_step_end(self, args, state, control, **kwargs):
            control.should_epoch_stop = state.global_step == 1

    trainer = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=3, async_generation=True, max_staleness=2,
                       per_device_train_batch_size=32, callbacks=[EndEpoch(), Settled()])
    assert trainer.prompts.rounds_per_epoch == 2
    trainer.train()
    assert trainer.rounds_consumed == 4  # rounds 0 and 1 (dropped), then 2 and 3


def test_the_tool_loop_runs_in_the_worker_as_in_synchronous_grpo(tmp_path):
    """Multi-turn rollouts with tools (the agents' loop: later turns within the round, the results masked) sampled by
    the worker at max_staleness 0 train exactly as synchronous GRPO's."""
    from test_agents_grpo import _tokenizer, _tool_trainer

    tokenizer = _tokenizer("qwen2_5")
    runs = []
    for name, extra in (("sync", {}), ("async", {"async_generation": True, "max_staleness": 0})):
        trainer = _tool_trainer(tmp_path / name, tokenizer, save_strategy="no", **extra)
        trainer.train()
        runs.append(trainer)
    for a, b in zip(_records(runs[0]), _records(runs[1]), strict=True):
        for key in ("loss", "tools/call_frequency", "tools/failure_frequency", "completions/mean_length"):
            assert a.get(key) == b.get(key), (a["step"], key)
    pa, pb = _params(runs[0]), _params(runs[1])
    assert all(torch.equal(pa[n], pb[n]) for n in pa)


def test_a_worker_thread_gone_without_a_round_or_an_error_is_said_in_one_sentence():
    import threading

    from posttrain.grpo.async_rollout import RolloutWorker

    worker = RolloutWorker(draw=lambda: None, sample=lambda *a: None, plan=lambda index: (0, 0), ahead=1,
                           heartbeat_s=5.0)
    worker._thread = threading.Thread(target=lambda: None)  # a thread that ended without handing anything over
    worker._thread.start()
    worker._thread.join()
    started = time.monotonic()
    with pytest.raises(RolloutWorkerError, match=r"^The rollout worker \(async_generation\) stopped without a round "
                                                 r"or an error: restart the run from its newest checkpoint\.$"):
        worker.take()
    assert time.monotonic() - started < 2
