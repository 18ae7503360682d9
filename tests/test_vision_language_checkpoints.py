"""Checkpoints that are vision-language models in name, trained on text (Qwen3.5 ships
`Qwen3_5ForConditionalGeneration` from 0.8B up): loaded by path as TRL 1.16 loads them (create_model_from_path:
`config.architectures[0]`), trained through their language model in every trainer, saved whole; the reward trainer
takes what AutoModelForSequenceClassification has for them, and says in one sentence when it has nothing."""

import json
import subprocess
import sys

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

from posttrain import (DistillationConfig, DistillationTrainer, DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer,
                       KTOConfig, KTOTrainer, RewardConfig, RewardTrainer, RLOOConfig, RLOOTrainer, SFTConfig,
                       SFTTrainer)
from posttrain.models.loading import ModelLoadError, load_causal_lm, load_sequence_classifier, load_tokenizer
from posttrain.testing import VISION_LANGUAGE, tiny_model, tiny_vision_language


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer):
    """Each family's tiny vision-language checkpoint, saved with the tokenizer: {family: path}."""
    paths = {}
    for family in VISION_LANGUAGE:
        path = str(tmp_path_factory.mktemp(family))
        tiny_vision_language(family, tokenizer).save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[family] = path
    return paths


@pytest.mark.parametrize("family", VISION_LANGUAGE)
def test_a_vision_language_checkpoint_loads_as_trl_loads_it(checkpoints, family):
    from trl.trainer.utils import create_model_from_path

    ours = load_causal_lm(checkpoints[family], {"dtype": "float32"})
    trls = create_model_from_path(checkpoints[family], dtype="float32")
    assert type(ours) is type(trls) and type(ours).__name__.endswith("ForConditionalGeneration")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(ours(input_ids=ids).logits, trls(input_ids=ids).logits)


def test_a_text_checkpoint_still_loads_as_a_causal_lm(tiny_model_dir):
    assert type(load_causal_lm(tiny_model_dir)).__name__ == "Qwen2ForCausalLM"


def _common(tmp_path) -> dict:
    return dict(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4, learning_rate=1e-2,
                logging_steps=1, save_strategy="no", gradient_checkpointing=False, use_cpu=True, report_to="none")


def _grpo_fields() -> dict:
    return dict(num_generations=2, max_completion_length=6)


PROMPTS = {"prompt": ["1+1=", "2+2=", "ab", "cd"]}


def _trainer(name: str, path: str, tmp_path):
    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    if name == "SFT":
        return SFTTrainer(model=path, train_dataset=Dataset.from_dict({"text": ["hello there", "abc", "x y z", "12"]}),
                          args=SFTConfig(**_common(tmp_path), max_length=32, packing=True))
    if name == "DPO":
        data = {"prompt": ["a", "b", "c", "d"], "chosen": [" yes"] * 4, "rejected": [" no"] * 4}
        return DPOTrainer(model=path, train_dataset=Dataset.from_dict(data), args=DPOConfig(**_common(tmp_path)))
    if name == "KTO":
        data = {"prompt": ["a", "b", "c", "d"], "completion": [" yes", " no"] * 2, "label": [True, False] * 2}
        return KTOTrainer(model=path, train_dataset=Dataset.from_dict(data), args=KTOConfig(**_common(tmp_path)))
    if name == "GRPO":
        return GRPOTrainer(model=path, reward_funcs=length, train_dataset=Dataset.from_dict(PROMPTS),
                           args=GRPOConfig(**_common(tmp_path), **_grpo_fields()))
    if name == "RLOO":
        return RLOOTrainer(model=path, reward_funcs=length, train_dataset=Dataset.from_dict(PROMPTS),
                           args=RLOOConfig(**_common(tmp_path), **_grpo_fields()))
    teacher = tiny_model(load_tokenizer(path), seed=1, hidden=32, layers=1)  # not the student: its divergence is 0
    return DistillationTrainer(model=path, teacher_model=teacher, train_dataset=Dataset.from_dict(PROMPTS),
                               args=DistillationConfig(**_common(tmp_path), max_completion_length=6))


@pytest.mark.parametrize("name", ["SFT", "DPO", "KTO", "GRPO", "RLOO", "Distillation"])
def test_every_trainer_trains_qwen3_5s_conditional_generation_checkpoint_on_text(checkpoints, tmp_path, name):
    """The whole model is trained and saved as the checkpoint's class: its language model moves, its vision tower,
    which a text batch never reaches, stays as it was."""
    trainer = _trainer(name, checkpoints["qwen3_5"], tmp_path)
    assert type(trainer.policy).__name__ == "Qwen3_5ForConditionalGeneration"
    trainer.train()
    out = tmp_path / "out"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    before = load_file(f"{checkpoints['qwen3_5']}/model.safetensors")
    after = load_file(str(out / "model.safetensors"))
    assert before.keys() == after.keys()
    vision = [k for k in before if ".visual." in k or k.startswith("model.visual")]
    language = [k for k in before if "language_model" in k and k.endswith("proj.weight")]
    assert vision and language
    assert all(torch.equal(before[k], after[k]) for k in vision)
    assert any(not torch.equal(before[k], after[k]) for k in language)


@pytest.mark.parametrize("family", ["gemma3", "llava", "qwen2_5_vl"])
def test_other_families_train_on_text_too(checkpoints, tmp_path, family):
    trainer = _trainer("GRPO", checkpoints[family], tmp_path)
    trainer.train()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == \
        [type(trainer.policy).__name__]


def test_the_reward_trainer_takes_qwen3_5s_classifier_as_trl_does(checkpoints, tmp_path, tokenizer):
    """AutoModelForSequenceClassification has a text classifier for Qwen3.5's checkpoint (its language model, a new
    score head), which is what TRL's RewardTrainer loads."""
    from transformers import AutoModelForSequenceClassification

    path = checkpoints["qwen3_5"]
    classifier = load_sequence_classifier(path, {"dtype": "float32"})
    trls = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    assert type(classifier) is type(trls)
    language = tiny_vision_language("qwen3_5", tokenizer).model.language_model
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():  # the checkpoint's language model under the new head
        assert torch.allclose(classifier.model(input_ids=ids).last_hidden_state,
                              language(input_ids=ids).last_hidden_state, atol=1e-6)
    data = Dataset.from_dict({"chosen": ["a yes", "b yes"], "rejected": ["a no", "b no"]})
    RewardTrainer(model=path, train_dataset=data, args=RewardConfig(**_common(tmp_path))).train()


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_the_reward_trainer_says_what_to_load_for_a_model_with_no_classifier(checkpoints, tmp_path, family):
    data = Dataset.from_dict({"chosen": ["a yes"], "rejected": ["a no"]})
    with pytest.raises(ModelLoadError, match=rf"^Model '.*{family}.*' \(\w+ForConditionalGeneration, model_type "
                                             rf"'{family}'\) cannot be loaded as a sequence classifier \(the reward "
                                             r"model\): transformers [\d.]+ has no such class for it; start the "
                                             r"reward model from a text model's checkpoint"):
        RewardTrainer(model=checkpoints[family], train_dataset=data, args=RewardConfig(**_common(tmp_path)))


def test_ddp_is_told_to_look_for_the_vision_towers_unused_parameters(checkpoints, tmp_path, tokenizer):
    """As TRL sets it for a vision-language model, where the user has not; not for a text model."""
    common = _common(tmp_path)
    text = SFTTrainer(model=tiny_model(tokenizer, hidden=32, layers=1), processing_class=tokenizer,
                      train_dataset=Dataset.from_dict({"text": ["ab"] * 4}), args=SFTConfig(**common))
    assert text.args.ddp_find_unused_parameters is None
    vision = _trainer("SFT", checkpoints["qwen3_5"], tmp_path)
    assert vision.args.ddp_find_unused_parameters is True
    assert vision.accelerator.ddp_handler.find_unused_parameters is True
    told = SFTTrainer(model=checkpoints["qwen3_5"], train_dataset=Dataset.from_dict({"text": ["ab"] * 4}),
                      args=SFTConfig(**common, ddp_find_unused_parameters=False))
    assert told.args.ddp_find_unused_parameters is False


@pytest.mark.multiproc
def test_two_ddp_processes_train_a_vision_language_checkpoint_on_text(checkpoints, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["hello there", "abc", "x y z", "12"] * 2))
    cmd = [sys.executable, "-m", "posttrain.cli", "sft", "--accelerate_config", "multi_gpu", "--num_processes", "2",
           "--cpu", "--model_name_or_path", checkpoints["qwen3_5"], "--dataset_name", str(data),
           "--per_device_train_batch_size", "2", "--max_steps", "2", "--max_length", "16",
           "--gradient_checkpointing", "false", "--save_strategy", "no", "--report_to", "none",
           "--output_dir", str(tmp_path / "out")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == \
        ["Qwen3_5ForConditionalGeneration"]


def test_ddps_error_for_parameters_without_gradient_is_one_sentence():
    """What DDP raises at the next forward when a trainable parameter got no gradient in a step (a vision tower under
    ddp_find_unused_parameters=False; seen with two processes on the checkpoint above), as the step's one sentence."""
    from posttrain.training.step import TrainingError, _unused_parameters_said

    ddp_error = RuntimeError("Expected to have finished reduction in the prior iteration before starting a new one. "
                             "This error indicates that your module has parameters that were not used in producing "
                             "loss.")
    with pytest.raises(TrainingError) as err, _unused_parameters_said(2):
        raise ddp_error
    assert str(err.value) == (
        "Step 2: some trainable parameters got no gradient in the step before (a vision tower a text batch never "
        "reaches, experts no token was routed to, a layer the loss does not use), and DDP waits for every one: set "
        "ddp_find_unused_parameters=True, or freeze those parameters.")
    with pytest.raises(RuntimeError, match="^something else$"), _unused_parameters_said(2):
        raise RuntimeError("something else")
    with pytest.raises(TrainingError) as err, _unused_parameters_said(3, looking=True):  # find_unused_parameters on
        raise ddp_error
    said = str(err.value)
    assert said.startswith("Step 3: some trainable parameters got no gradient in the step before although DDP looks "
                           "for unused ones") and "set ddp_find_unused_parameters" not in said
