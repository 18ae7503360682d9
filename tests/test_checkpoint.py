"""Resume gives bit-identical results; partial or corrupt checkpoints are never loaded."""

import dataclasses
import os
import shutil

import pytest
import torch
from conftest import StopAt, length_reward, tiny_config

from posttrain.grpo.trainer import GRPOTrainer
from posttrain.testing import tiny_model
from posttrain.training.checkpoint import CheckpointError, checkpoints


def _trainer(tokenizer, dataset, out, peft_config=None, callbacks=None, **overrides):
    values = dict(max_steps=4, save_strategy="steps", save_steps=2, beta=0.04, num_iterations=1)
    values.update(overrides)
    return GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), length_reward, tiny_config(out, **values),
                       train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config,
                       callbacks=callbacks)


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}


def _straight_vs_resumed(tokenizer, dataset, tmp_path, stop, peft_config=None, **overrides):
    straight = _trainer(tokenizer, dataset, tmp_path / "a", peft_config, save_strategy="no", **overrides)
    straight.train()
    first = _trainer(tokenizer, dataset, tmp_path / "b", peft_config, callbacks=[StopAt(stop)], **overrides)
    first.train()
    assert first.state.global_step == stop
    resumed = _trainer(tokenizer, dataset, tmp_path / "b", peft_config, **overrides)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == straight.state.global_step
    a, b = _params(straight), _params(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a), [n for n in a if not torch.equal(a[n], b[n])]
    assert [r["step"] for r in resumed.state.log_history] == [r["step"] for r in straight.state.log_history]
    # the running totals go on from the checkpoint's
    assert [r.get("num_tokens") for r in resumed.state.log_history] == [
        r.get("num_tokens") for r in straight.state.log_history]
    assert resumed.state.num_input_tokens_seen == straight.state.num_input_tokens_seen > 0
    return straight, resumed


def test_resume_is_bit_exact_full_finetuning(tokenizer, addition_dataset, tmp_path):
    _straight_vs_resumed(tokenizer, addition_dataset, tmp_path, stop=2)


def test_resume_in_the_middle_of_a_generation_buffer(tokenizer, addition_dataset, tmp_path):
    # 16 completions per generation, 8 per step: the checkpoint at step 1 holds half a generation batch
    _, resumed = _straight_vs_resumed(tokenizer, addition_dataset, tmp_path, stop=1, save_steps=1,
                                      generation_batch_size=16)
    from safetensors.torch import load_file

    buffered = load_file(tmp_path / "b" / "out" / "checkpoint-1" / "buffer_0.safetensors")
    assert {key.split(".")[0] for key in buffered} == {"0"}  # one micro-batch was waiting to be trained on


def test_resume_is_bit_exact_with_a_synced_reference_and_adaptive_entropy(tokenizer, addition_dataset, tmp_path):
    """The TR-DPO reference (mixed at step 2, before the checkpoint) and the entropy coefficient travel with the
    checkpoint."""
    straight, resumed = _straight_vs_resumed(tokenizer, addition_dataset, tmp_path, stop=2, sync_ref_model=True,
                                             ref_model_sync_steps=2, ref_model_mixup_alpha=0.5, entropy_coef=0.01,
                                             use_adaptive_entropy=True, entropy_target=100.0)
    for (name, a), b in zip(straight.ref_model.named_parameters(), resumed.ref_model.parameters()):
        assert torch.equal(a, b), name
    assert resumed.entropy_control.coef == straight.entropy_control.coef == pytest.approx(0.01 + 4 * 0.005)


def test_save_only_model_checkpoints_cannot_be_resumed(tokenizer, addition_dataset, tmp_path):
    _trainer(tokenizer, addition_dataset, tmp_path, max_steps=2, save_only_model=True).train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / "model.safetensors").exists() and not (checkpoint / "optimizer.pt").exists()
    with pytest.raises(CheckpointError, match="written with save_only_model=True: it holds the model but no"):
        _trainer(tokenizer, addition_dataset, tmp_path, max_steps=4).train(resume_from_checkpoint=True)


def test_ignore_data_skip_restarts_the_data_but_keeps_the_state(tokenizer, addition_dataset, tmp_path):
    seen = {}

    def recording(prompts, completions, **kwargs):
        seen.setdefault(kwargs["trainer_state"].global_step, prompts[0])
        return [len(c) / 10 for c in completions]

    def make(**overrides):
        return GRPOTrainer(tiny_model(tokenizer, hidden=32, layers=1), recording,
                           tiny_config(tmp_path, save_strategy="steps", save_steps=2, **overrides),
                           train_dataset=addition_dataset, processing_class=tokenizer)

    make(max_steps=2).train()
    first_prompt = seen[0]
    seen.clear()
    resumed = make(max_steps=3, ignore_data_skip=True)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3 and seen[2] == first_prompt  # step 3 trains on round 1's prompts again


@pytest.mark.peft
def test_resume_is_bit_exact_lora(tokenizer, addition_dataset, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    _straight_vs_resumed(tokenizer, addition_dataset, tmp_path, stop=2, peft_config=lora, learning_rate=1e-2)


def test_partial_checkpoints_are_skipped_and_limit_kept(tokenizer, addition_dataset, tmp_path):
    trainer = _trainer(tokenizer, addition_dataset, tmp_path, save_steps=1, save_total_limit=2)
    trainer.train()
    out = tmp_path / "out"
    assert [step for step, _ in checkpoints(out)] == [3, 4]
    # a save killed before its rename leaves only a .tmp directory; one killed mid-write lacks the state file
    shutil.copytree(out / "checkpoint-4", out / "checkpoint-5.tmp")
    shutil.copytree(out / "checkpoint-4", out / "checkpoint-6")
    os.remove(out / "checkpoint-6" / "trainer_state.json")
    assert checkpoints(out)[-1][0] == 4
    with pytest.raises(CheckpointError, match="checkpoint-6 is not a complete checkpoint"):
        _trainer(tokenizer, addition_dataset, tmp_path, save_steps=1).train(str(out / "checkpoint-6"))


def test_corrupt_checkpoint_is_reported_by_name(tokenizer, addition_dataset, tmp_path):
    trainer = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=2)
    trainer.train()
    os.remove(tmp_path / "out" / "checkpoint-2" / "optimizer.pt")
    with pytest.raises(CheckpointError, match="checkpoint-2 is corrupt: optimizer.pt is missing"):
        _trainer(tokenizer, addition_dataset, tmp_path, max_steps=4).train(resume_from_checkpoint=True)


def test_resume_refuses_a_run_whose_batches_mean_something_else(tokenizer, addition_dataset, tmp_path):
    _trainer(tokenizer, addition_dataset, tmp_path, max_steps=2).train()
    other = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=4, num_generations=2,
                     per_device_train_batch_size=4)
    with pytest.raises(CheckpointError, match=r"per_device_train_batch_size: checkpoint 8, now 4.*num_generations: "
                                              r"checkpoint 4, now 2"):
        other.train(resume_from_checkpoint=True)


KILL_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from pathlib import Path
import torch
from conftest import length_reward, tiny_config
from datasets import Dataset
from posttrain.grpo.trainer import GRPOTrainer
from posttrain.testing import tiny_model, tiny_tokenizer
import posttrain.training.checkpoint as ck

where = sys.argv[2]
if where == "before_rename":  # everything of checkpoint-2 written, killed before it is renamed into place
    real = ck.os.replace
    ck.os.replace = lambda a, b: os.kill(os.getpid(), signal.SIGKILL) if b.endswith("checkpoint-2") else real(a, b)
else:  # killed while writing checkpoint-2's optimizer state
    real_save = ck.torch.save
    def save(obj, path):
        if "checkpoint-2" in str(path) and str(path).endswith("optimizer.pt"):
            with open(path, "wb") as f:
                f.write(b"partial")
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(obj, path)
    ck.torch.save = save
tok = tiny_tokenizer(all_bytes=False)
ds = Dataset.from_dict({{"prompt": [f"{{a}}+{{b}}=" for a in range(4) for b in range(4)]}})
cfg = tiny_config(Path(sys.argv[1]), max_steps=4, save_strategy="steps", save_steps=1, beta=0.04)
GRPOTrainer(tiny_model(tok, hidden=32, layers=1), length_reward, cfg, train_dataset=ds, processing_class=tok).train()
"""


@pytest.mark.parametrize("where", ["before_rename", "mid_write"])
def test_sigkill_during_save_leaves_the_previous_checkpoint(tokenizer, addition_dataset, tmp_path, where):
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", KILL_SCRIPT.format(tests=tests), str(tmp_path), where],
                         capture_output=True, text=True)
    assert out.returncode == -9, out.stderr[-2000:]  # killed by SIGKILL during the save of checkpoint-2
    assert [step for step, _ in checkpoints(tmp_path / "out")] == [1]
    assert (tmp_path / "out" / "checkpoint-2.tmp").exists()
    resumed = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=4, save_steps=1)
    resumed.train(resume_from_checkpoint=True)  # picks checkpoint-1, the newest complete one
    assert resumed.state.global_step == 4 and [s for s, _ in checkpoints(tmp_path / "out")][-1] == 4
    assert not list((tmp_path / "out").glob("*.tmp"))  # the killed save's leftovers were removed
    straight = _trainer(tokenizer, addition_dataset, tmp_path / "straight", max_steps=4, save_strategy="no")
    straight.train()
    a, b = _params(straight), _params(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)  # the killed run, resumed, ends where an unbroken one does


def test_non_finite_loss_stops_before_the_update_and_saves_the_last_good_state(tokenizer, addition_dataset, tmp_path):
    from posttrain.grpo.trainer import TrainingError

    trainer = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=4)
    good = trainer.loss_fn.aggregate

    def poisoned(loss, mask, norm, params):  # the loss table entry's aggregation, NaN at the third optimizer step
        out = good(loss, mask, norm, params)
        return out * float("nan") if trainer.state.global_step == 2 else out

    trainer.loss_fn = dataclasses.replace(trainer.loss_fn, aggregate=poisoned)
    with pytest.raises(TrainingError, match=r"Step 3: loss is nan; the update was not applied and the last good "
                                            r"state is saved in .*emergency-checkpoint-2"):
        trainer.train()
    saved = _params(trainer)
    assert all(torch.isfinite(p).all() for p in saved.values())
    emergency = tmp_path / "out" / "emergency-checkpoint-2"
    assert (emergency / "trainer_state.json").exists()
    assert [step for step, _ in checkpoints(tmp_path / "out")] == [2]  # `true` would not pick the emergency one
    resumed = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=4)
    resumed.train(resume_from_checkpoint=str(emergency))
    assert resumed.state.global_step == 4


@pytest.mark.parametrize("damage", ["truncated weights", "empty state", "garbled optimizer"])
def test_a_damaged_checkpoint_is_named_and_resume_falls_back_to_an_intact_one(tokenizer, addition_dataset, tmp_path,
                                                                           damage, caplog):
    _trainer(tokenizer, addition_dataset, tmp_path, max_steps=2, save_steps=1).train()
    out = tmp_path / "out"
    newest = out / "checkpoint-2"
    if damage == "truncated weights":
        data = (newest / "model.safetensors").read_bytes()
        (newest / "model.safetensors").write_bytes(data[: len(data) // 2])
        problem = "model.safetensors does not match the checksum written with it"
    elif damage == "empty state":
        (newest / "trainer_state.json").write_text("")
        problem = "its trainer_state.json cannot be read"
    else:
        (newest / "optimizer.pt").write_bytes(b"\x00" * 64)
        problem = "optimizer.pt does not match the checksum"
    with pytest.raises(CheckpointError, match=f"checkpoint-2 is corrupt: {problem}"):
        _trainer(tokenizer, addition_dataset, tmp_path, max_steps=3).train(resume_from_checkpoint=str(newest))
    resumed = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=3, save_steps=1)
    with caplog.at_level("WARNING", logger="posttrain"):
        resumed.train(resume_from_checkpoint=True)
    assert f"checkpoint-2 is corrupt: {problem}" in caplog.text and "Resuming from" in caplog.text
    assert resumed.state.global_step == 3 and [r["step"] for r in resumed.state.log_history if "loss" in r] == [1, 2, 3]


def test_an_update_that_makes_weights_non_finite_is_never_saved_as_good(tokenizer, addition_dataset, tmp_path):
    """Step 2's loss and gradient are finite, its update is not (as with an extreme learning rate): the run stops
    at step 2 naming the weight, and the poisoned weights are never saved as a good state."""
    from posttrain.grpo.trainer import TrainingError

    trainer = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=3, save_steps=1)
    real_step = trainer.optimizer.step

    def poisoning_step(*args, **kwargs):
        out = real_step(*args, **kwargs)
        if trainer.state.global_step == 1:
            with torch.no_grad():
                trainer.policy.model.norm.weight[0] = float("inf")
        return out

    trainer.optimizer.step = poisoning_step
    with pytest.raises(TrainingError, match=r"Step 2: the update made weights non-finite \(first: model\.norm\.weight\), "
                                            r"so they are not saved; the newest checkpoint is .*checkpoint-1\. Lower"):
        trainer.train()
    assert [step for step, _ in checkpoints(tmp_path / "out")] == [1]
    assert not list((tmp_path / "out").glob("emergency-*"))


def test_resume_identifies_the_model_by_what_it_is_not_how_its_path_is_spelled(tokenizer, addition_dataset, tmp_path):
    from posttrain.testing import save_tiny

    model_dir = save_tiny(str(tmp_path / "models" / "tiny"), tokenizer, hidden=32, layers=1)
    config = tiny_config(tmp_path, max_steps=2, save_strategy="steps", save_steps=1)
    GRPOTrainer(model_dir, length_reward, config, train_dataset=addition_dataset).train()
    # the same model, by a relative path with a trailing slash, through a symlink, and after a move
    os.symlink(tmp_path / "models", tmp_path / "link")
    spellings = [os.path.relpath(model_dir) + "/", str(tmp_path / "link" / "tiny")]
    shutil.move(model_dir, tmp_path / "moved")
    spellings = [s.replace("models/tiny", "moved") if "link" not in s else str(tmp_path / "moved")
                 for s in spellings] + [str(tmp_path / "moved")]
    for spelling in spellings:
        resumed = GRPOTrainer(spelling, length_reward, tiny_config(tmp_path, max_steps=3, save_strategy="no"),
                              train_dataset=addition_dataset)
        resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
        assert resumed.state.global_step == 3, spelling
    other = save_tiny(str(tmp_path / "other"), tokenizer, seed=1, hidden=32, layers=1)  # same config, other weights
    with pytest.raises(CheckpointError, match=r"it was written for another model \(its config or weights differ"):
        GRPOTrainer(other, length_reward, tiny_config(tmp_path, max_steps=3), train_dataset=addition_dataset).train(
            resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))


def test_a_final_save_on_a_full_disk_says_the_weights_are_unsaved_and_a_retry_writes_them(tokenizer, addition_dataset,
                                                                                          tmp_path):
    """Without checkpoints the error says that nothing holds the trained weights; the failed save leaves no partial
    files, and trainer.save_model() writes them once the disk has room (the trainer still holds them)."""
    from bad_inputs import _DiskFullAtTheFinalSave

    from posttrain.errors import StorageError

    full = _DiskFullAtTheFinalSave()
    trainer = _trainer(tokenizer, addition_dataset, tmp_path, max_steps=2, save_strategy="no",
                       callbacks=[full])
    try:
        with pytest.raises(StorageError, match=r"the disk is full\. .* The weights of step 2 are not saved and no "
                                               r"checkpoint holds them \(from Python, trainer\.save_model\(\) writes "
                                               r"them once there is space\)\.$"):
            trainer.train()
    finally:
        full.restore()
    out = tmp_path / "out"
    assert not (out / ".final.tmp").exists() and not (out / "model.safetensors").exists()
    trainer.save_model()
    reloaded = type(trainer.policy).from_pretrained(str(out))
    assert all(torch.equal(p, reloaded.state_dict()[n]) for n, p in trainer.policy.state_dict().items())
