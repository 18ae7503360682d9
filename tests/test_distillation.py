"""DistillationTrainer on tiny in-process models (a student of 1 layer, a wider teacher of 2 over the same
vocabulary): the loss, entropy and gradient equal TRL 1.16's DistillationTrainer._compute_loss called on the same
sampled completions; the update for any split of a step; exact resume; evaluation; the teacher's checks; the errors a
user can cause."""

import functools
import inspect
import json
import math
import types

import pytest
import torch
from conftest import StopAt, capture_gradients, use_sgd
from datasets import Dataset

from posttrain.configs import ConfigError, DistillationConfig
from posttrain.distillation.trainer import DistillationTrainer
from posttrain.testing import tiny_model

PROMPTS = {"prompt": [f"{a}+{b}=" for a in range(4) for b in range(4)]}


def _student(tokenizer):
    return tiny_model(tokenizer, hidden=32, layers=1)


def _teacher(tokenizer):
    return tiny_model(tokenizer, seed=7, hidden=64, layers=2)


def distill_config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=8,
                  max_completion_length=6, learning_rate=1e-2, logging_steps=1, save_strategy="no",
                  gradient_checkpointing=False, use_cpu=True, seed=0, report_to="none")
    values.update(overrides)
    return DistillationConfig(**values)


def _trainer(tokenizer, tmp_path, teacher=None, data=None, callbacks=None, **overrides):
    return DistillationTrainer(_student(tokenizer), teacher if teacher is not None else _teacher(tokenizer),
                               args=distill_config(tmp_path, **overrides),
                               train_dataset=data if data is not None else Dataset.from_dict(PROMPTS),
                               processing_class=tokenizer, callbacks=callbacks)


def _records(trainer):
    return [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]


def _trl_loss(trainer, batch, beta, temperature):
    """TRL 1.16's DistillationTrainer._compute_loss on the batch (with its rows' multimodal inputs, for a
    vision-language student), called with a stand-in for the trainer (the attributes the method reads; its own
    _get_last_hidden_state)."""
    trl = pytest.importorskip("trl")
    student, teacher = trainer.policy, trainer.teacher_model
    r = batch.rollouts
    stand_in = types.SimpleNamespace(_is_vlm=r.model_inputs is not None, teacher_model=teacher, beta=beta,
                                     temperature=temperature,
                                     model_kwarg_keys=inspect.signature(student.forward).parameters.keys(),
                                     accelerator=types.SimpleNamespace(unwrap_model=lambda m: m, is_main_process=True),
                                     _forward_redirection=lambda wrapper, plain, fn, *a, **k: fn(*a, **k))
    stand_in._get_last_hidden_state = functools.partial(trl.DistillationTrainer._get_last_hidden_state, stand_in)
    inputs = {"prompt_ids": r.prompt_ids, "prompt_mask": r.prompt_mask, "completion_ids": r.completion_ids,
              "completion_mask": r.completion_mask, **r.forward_inputs()}
    return trl.DistillationTrainer._compute_loss(stand_in, student, inputs, r.completion_mask.sum())


def assert_loss_entropy_and_gradient_equal_trls(trainer, batch):
    """The divergence's loss, entropy and gradient on `batch` equal TRL's _compute_loss on the same completions."""
    params = [p for p in trainer.policy.parameters() if p.requires_grad]
    loss, entropy_sum, valid = _trl_loss(trainer, batch, trainer.args.beta, trainer.args.temperature)
    theirs = torch.autograd.grad(loss, params, allow_unused=True)
    divergence, entropy = trainer.rollout.divergence(trainer.model, batch)
    ours_loss = divergence.sum() / batch.loss_mask.sum()
    ours = torch.autograd.grad(ours_loss, params, allow_unused=True)
    assert int(valid) == divergence.numel() == int(batch.loss_mask.sum())
    assert float(ours_loss) == pytest.approx(float(loss), rel=1e-5)
    assert float(entropy.sum()) == pytest.approx(float(entropy_sum), rel=1e-5)
    for a, b in zip(ours, theirs):
        assert (a is None) == (b is None)
        if a is not None:  # float32's rounding of sums scales with the largest term: 1e-5 of the tensor's largest
            assert torch.allclose(a, b, rtol=1e-4, atol=max(1e-7, 1e-5 * float(b.abs().max())))


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_loss_entropy_and_gradient_equal_trls_on_the_same_completions(tokenizer, tmp_path, beta, temperature):
    trainer = _trainer(tokenizer, tmp_path, beta=beta, temperature=temperature)
    batch = trainer.rollout.scored_batch(trainer.rounds, 1).batch
    assert 0 < int(batch.loss_mask.sum()) < batch.loss_mask.numel()  # completions of different lengths
    assert_loss_entropy_and_gradient_equal_trls(trainer, batch)


def test_a_run_trains_logs_and_saves(tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = _trainer(tokenizer, tmp_path, max_steps=4, per_device_train_batch_size=4, beta=0.5,
                       log_completions=True)
    trainer.train()
    logged = [json.loads(line) for line in open(tmp_path / "out" / "completions.jsonl")]
    assert len(logged) == 16 and all(row["prompt"] in PROMPTS["prompt"] and row["rewards"] == {} for row in logged)
    records = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for key in ("loss", "entropy", "grad_norm", "learning_rate", "num_tokens", "completions/mean_length"):
        assert math.isfinite(records[-1][key]), key
    assert records[-1]["loss"] < records[0]["loss"]  # the student moves towards the teacher
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert all(torch.equal(p, dict(trainer.policy.named_parameters())[n]) for n, p in reloaded.named_parameters())
    assert all(not p.requires_grad for p in trainer.teacher_model.parameters())


def test_any_split_of_a_step_gives_the_same_update(tokenizer, tmp_path):
    """8 prompts as 1 x 8, 2 x 4 or 4 x 2 micro-batches, or one micro-batch run as passes of whole rows of at most 6
    completion tokens (max_completion_tokens_per_pass): the same completions, gradient and update."""
    results, passes = {}, {}
    for micro, accum, per_pass in ((8, 1, None), (4, 2, None), (2, 4, None), (8, 1, 6)):
        trainer = _trainer(tokenizer, tmp_path / f"{micro}x{accum}-{per_pass}", max_steps=1,
                           per_device_train_batch_size=micro, gradient_accumulation_steps=accum,
                           max_completion_tokens_per_pass=per_pass)
        use_sgd(trainer)
        grads = capture_gradients(trainer)
        rows, step = [], trainer.training_step
        trainer.training_step = lambda model, batch, n=None: rows.append(len(batch)) or step(model, batch, n)
        trainer.train()
        passes[(micro, accum, per_pass)] = rows
        results[(micro, accum, per_pass)] = ({n: p.detach().clone() for n, p in trainer.policy.named_parameters()},
                                             grads[0], _records(trainer)[0])
    assert len(passes[(8, 1, 6)]) > 1 and sum(passes[(8, 1, 6)]) == 8 and passes[(8, 1, None)] == [8]
    ref_params, ref_grads, ref_record = results[(8, 1, None)]
    for split, (params, grads, record) in results.items():
        for key in ("loss", "entropy", "completions/mean_length"):
            assert record[key] == pytest.approx(ref_record[key], rel=1e-5), (split, key)
        for name in ref_grads:
            assert torch.allclose(grads[name], ref_grads[name], rtol=1e-4, atol=1e-7), (split, name)
            assert torch.allclose(params[name], ref_params[name], rtol=1e-5, atol=1e-7), (split, name)


def test_resume_continues_bit_for_bit(tokenizer, tmp_path):
    common = dict(max_steps=4, per_device_train_batch_size=4, gradient_accumulation_steps=2, save_strategy="steps",
                  save_steps=2)
    straight = _trainer(tokenizer, tmp_path / "straight", **common)
    straight.train()
    _trainer(tokenizer, tmp_path / "cut", callbacks=[StopAt(2)], **common).train()
    resumed = _trainer(tokenizer, tmp_path / "cut", **common)
    resumed.train(resume_from_checkpoint=True)
    by_step = {r["step"]: r for r in _records(resumed)}
    for record in _records(straight)[2:]:
        assert record["loss"] == by_step[record["step"]]["loss"]
    for (name, a), b in zip(straight.policy.named_parameters(), resumed.policy.parameters()):
        assert torch.equal(a, b), name


def test_evaluation_is_the_mean_divergence_over_the_eval_tokens(tokenizer, tmp_path):
    trainer = _trainer(tokenizer, tmp_path, max_steps=1, per_device_eval_batch_size=5)
    metrics = trainer.evaluate(Dataset.from_dict(PROMPTS))
    assert {"eval_loss", "eval_entropy", "eval_completions/mean_length", "eval_runtime"} <= set(metrics)
    assert metrics["eval_loss"] > 0 and math.isfinite(metrics["eval_entropy"])


def test_a_teacher_from_its_path_and_the_teachers_checks(tokenizer, tmp_path):
    from posttrain.testing import save_tiny, tiny_tokenizer

    path = save_tiny(str(tmp_path / "teacher"), tokenizer, seed=7, hidden=64, layers=2)
    trainer = DistillationTrainer(_student(tokenizer), args=distill_config(
        tmp_path, teacher_model_name_or_path=path, teacher_model_init_kwargs={"dtype": "float32"}),
        train_dataset=Dataset.from_dict(PROMPTS), processing_class=tokenizer)
    assert trainer.teacher_model.config.hidden_size == 64
    with pytest.raises(ConfigError, match="needs a teacher"):
        DistillationTrainer(_student(tokenizer), args=distill_config(tmp_path), train_dataset=Dataset.from_dict(
            PROMPTS), processing_class=tokenizer)
    other = tiny_model(tiny_tokenizer(), hidden=32, layers=1)  # the full byte alphabet: another vocab_size
    with pytest.raises(ConfigError, match=r"The student's vocab_size is \d+ and the teacher's \d+"):
        _trainer(tokenizer, tmp_path, teacher=other)
    with pytest.raises(ConfigError, match="teacher_model_init_kwargs is set, and the teacher is a model"):
        _trainer(tokenizer, tmp_path, teacher_model_init_kwargs={"dtype": "float32"})


def test_the_student_itself_as_the_teacher_is_refused(tokenizer, tmp_path):
    student = _student(tokenizer)
    with pytest.raises(ConfigError, match=r"^The teacher is the student model itself \(the same object\): the "
                                          r"divergence between them is 0 and nothing trains; "):
        DistillationTrainer(student, student, args=distill_config(tmp_path), train_dataset=Dataset.from_dict(PROMPTS),
                            processing_class=tokenizer)


def test_a_teacher_that_cannot_teach_as_given_is_warned_about(tokenizer, tmp_path, caplog):
    """The student's own weights as the teacher (a divergence of 0: nothing trains), and a teacher whose context is
    shorter than the student's rollouts (it would score past its positions): one warning each, at construction."""
    import logging

    short = tiny_model(tokenizer, seed=7, hidden=64, layers=2, max_positions=8)
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        _trainer(tokenizer, tmp_path, teacher=_student(tokenizer))  # a copy of the student
        _trainer(tokenizer, tmp_path, teacher=short, max_prompt_length=6)
        _trainer(tokenizer, tmp_path)  # neither
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("The teacher")]
    assert said[:1] == ["The teacher has the student's own weights, so the divergence between them is 0 and nothing "
                        "trains: give a different (usually larger or fine-tuned) teacher."]
    assert said[1:] == ["The teacher's context is 8 positions, and the student's rollouts reach 12 (max_prompt_length "
                        "+ max_completion_length, within the student's context): the teacher would score tokens past "
                        "its positions; give a teacher with a longer context, or lower max_completion_length."]


@pytest.mark.parametrize("kwargs,message", [
    (dict(loss_type="grpo"), "loss_type='grpo' is a GRPOConfig field that TRL's DistillationConfig does not have"),
    (dict(num_generations=4), "num_generations=4: on-policy distillation samples one completion per prompt"),
    (dict(steps_per_generation=4), "distillation generates once per optimizer step"),
    (dict(beta=1.5), "beta=1.5"),
])
def test_config_errors_are_one_sentence(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        DistillationConfig(output_dir="unused", **kwargs)


def test_with_tools_the_results_carry_no_loss(tmp_path):
    """tools= as TRL's DistillationTrainer takes them: the student's multi-turn rollouts (scripted, as in
    tests/test_agents_grpo.py) with the tool results' tokens masked out of the divergence, TRL's tool metrics."""
    from pathlib import Path

    trl = pytest.importorskip("trl")
    from agent_script import TOOLS, Script, ScriptedEngine

    from posttrain.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    prompts = [[{"role": "user", "content": f"Please help. case:{case}"}] for case in ("one", "none", "parallel",
                                                                                       "iterate")]
    config = distill_config(tmp_path, max_steps=1, per_device_train_batch_size=4, max_completion_length=1000,
                            max_tool_calling_iterations=2, shuffle_dataset=False)
    trainer = DistillationTrainer(tiny_model(tokenizer, hidden=32, layers=1, max_positions=4096),
                                  tiny_model(tokenizer, seed=7, hidden=64, layers=1, max_positions=4096), args=config,
                                  train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer,
                                  tools=TOOLS)
    trainer.generator = ScriptedEngine(Script(tokenizer), tokenizer.pad_token_id, [tokenizer.eos_token_id], 1000,
                                       vary=True)
    scored = trainer.rollout.scored_batch(trainer.rounds, 1)
    batch = scored.batch
    assert not bool(batch.rollouts.tool_mask.all())
    assert torch.equal(batch.loss_mask, batch.rollouts.completion_mask & batch.rollouts.tool_mask)
    divergence, _ = trainer.rollout.divergence(trainer.model, batch)
    assert divergence.numel() == int(batch.loss_mask.sum())
    assert scored.metrics["tools/call_frequency"] == pytest.approx(8 / 4)
    trainer.train()
    logged = _records(trainer)[0]
    assert logged["tools/call_frequency"] > 0 and math.isfinite(logged["loss"])


@pytest.mark.plots
def test_posttrain_distillation_from_yaml_and_flags(tmp_path, tiny_model_dir, capfd, tokenizer):
    """`posttrain distillation` as TRL's `trl distillation`: the student's and the teacher's directories and a prompt
    file in, TRL's metrics logged, an evaluation, the curves and the report written with the run's headlines."""
    from conftest import run_posttrain
    from datasets import DatasetDict

    from posttrain.testing import save_tiny

    teacher = save_tiny(str(tmp_path / "teacher"), tokenizer, seed=7, hidden=64, layers=2)
    data = tmp_path / "prompts"
    DatasetDict(train=Dataset.from_dict(PROMPTS), test=Dataset.from_dict(PROMPTS).select(range(4))).save_to_disk(data)
    config = tmp_path / "run.yaml"
    config.write_text(f"model_name_or_path: {tiny_model_dir}\nteacher_model_name_or_path: {teacher}\n"
                      f"dataset_name: {data}\nper_device_train_batch_size: 4\nmax_completion_length: 6\n"
                      "gradient_checkpointing: false\nuse_cpu: true\nbeta: 0.5\neval_strategy: steps\neval_steps: 2\n")
    run = run_posttrain(["distillation", "--config", str(config), "--output_dir", str(tmp_path / "out"),
                         "--max_steps", "2", "--logging_steps", "1", "--learning_rate", "1e-3"], capfd)
    assert run.returncode == 0, run.stderr[-2000:]
    records = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert any("eval_loss" in r and "eval_entropy" in r for r in records)
    report = (tmp_path / "out" / "report.html").read_text()
    assert "Distillation" in report and "entropy" in report
    with pytest.raises(ConfigError, match="Unknown argument '--loss_type'"):
        from posttrain.cli import parse_command

        parse_command("distillation", ["--loss_type", "grpo"])


@pytest.mark.plots
def test_the_example_runs_end_to_end(tmp_path, capsys, monkeypatch):
    """examples/distil_addition.py, shortened: the teacher's SFT, the distillation, the before/after line, the plot
    (docs/distillation.md shows a full run)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).parent.parent / "examples" / "distil_addition.py"
    spec = importlib.util.spec_from_file_location("distil_addition", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.setattr(sys, "argv", ["distil_addition.py", "--output-dir", str(tmp_path), "--steps", "10",
                                      "--teacher-steps", "10"])
    example.main()
    line = [out for out in capsys.readouterr().out.splitlines() if out.startswith("held-out sums:")]
    assert len(line) == 1 and "agreement with the teacher" in line[0]
    assert (tmp_path / "distil_addition.png").stat().st_size > 0


def test_the_student_samples_through_posttrain_serve_as_in_process(tokenizer, tmp_path):
    """GRPO's generation paths are the student's: through a `posttrain serve` server (the student's weights pushed
    and verified before every round) the same seed gives the same completions, losses and final weights as the
    in-process sampler."""
    from test_serve import running

    from posttrain.serving.engine import TransformersEngine

    local = _trainer(tokenizer, tmp_path / "local", max_steps=2)
    local.train()
    engine = TransformersEngine(tiny_model(tokenizer, seed=9, hidden=32, layers=1), tokenizer, name="tiny")
    with running(engine) as url:
        served = _trainer(tokenizer, tmp_path / "served", max_steps=2, use_vllm=True, vllm_mode="server",
                          vllm_server_base_url=url, vllm_server_timeout=10.0)
        served.train()
    for a, b in zip(_records(local), _records(served)):
        for key in ("loss", "entropy", "completions/mean_length"):
            assert a[key] == b[key], (a["step"], key)
    for (name, p), (_, q) in zip(local.policy.named_parameters(), served.policy.named_parameters()):
        assert torch.equal(p, q), name
