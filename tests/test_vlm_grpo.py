"""GRPO on a vision-language model with images, as TRL 1.16 takes them: conversational prompts with `image` or
`images`, each prompt's images placed in its conversation and processed with it, sampled in process with the pixels
in the prefill (the image tokens never sampled), the pixels riding with the rows into every log-prob forward. The
completions' log-probs equal TRL's own `_get_per_token_logps_and_entropies` on TRL's own processing of the same
prompts, through the same tiny model (LLaVA: pixel_values per image; Gemma 3: token_type_ids; Qwen2.5-VL and Qwen3.5:
flattened patches, image_grid_thw and the mm_token_type_ids of their multimodal rotary positions)."""

import copy
import os

import pytest
import torch
from datasets import Dataset

from posttrain.testing import VISION_PROCESSORS, tiny_vision_processor
from tests import vlm_data


def _length_reward(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]


def _content_reward(completions, **kwargs):
    """Varies with what was sampled, also when every completion reaches max_completion_length (the tiny tokenizer's
    tokens are bytes: one character each)."""
    return [float(sum(map(ord, c[0]["content"])) % 10) for c in completions]


def _config(tmp_path, **overrides):
    from posttrain import GRPOConfig

    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_completion_length=5,
                  max_steps=1, report_to="none", use_cpu=True, save_strategy="no", learning_rate=1e-2, logging_steps=1,
                  seed=0)
    values.update(overrides)
    return GRPOConfig(**values)


def _trainer(model, processor, rows, tmp_path, **overrides):
    from posttrain import GRPOTrainer

    return GRPOTrainer(model, _length_reward, _config(tmp_path, **overrides), train_dataset=Dataset.from_list(rows),
                       processing_class=processor)


def _trl_logps(model, processor, rows, rollouts, tmp_path):
    """TRL's per-token log-probs of `rollouts`' completions: TRL's own processing of the rows' prompts (images
    placed, the processor left-padding them) and its own log-prob function, on a copy of the model."""
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer
    from trl.data_utils import apply_chat_template, prepare_multimodal_messages

    trl = TRLTrainer(copy.deepcopy(model), _length_reward, processing_class=processor,
                     train_dataset=Dataset.from_list(rows),
                     args=TRLConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4,
                                    num_generations=2, max_completion_length=5, report_to="none", use_cpu=True,
                                    bf16=False))
    images = [r["images"] for r in rows]
    prompts = [prepare_multimodal_messages(r["prompt"], images=r["images"]) for r in rows]
    texts = [apply_chat_template({"prompt": p}, processor)["prompt"] for p in prompts]
    processor.tokenizer.padding_side = "left"
    inputs = processor(images=images, text=texts, padding=True, return_tensors="pt")
    assert torch.equal(inputs["input_ids"], rollouts.prompt_ids) and torch.equal(inputs["attention_mask"].bool(),
                                                                               rollouts.prompt_mask.bool())
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
    for name in ("mm_token_type_ids", "token_type_ids"):  # as TRL extends them over the completion
        if name in extra:
            extra[name] = torch.cat([extra[name], torch.zeros_like(rollouts.completion_ids)], 1)
    ids = torch.cat([inputs["input_ids"], rollouts.completion_ids], 1)
    mask = torch.cat([inputs["attention_mask"], rollouts.completion_mask.long()], 1)
    with torch.no_grad():
        logps, _, _ = trl._get_per_token_logps_and_entropies(trl.model, ids, mask, rollouts.completion_ids.size(1),
                                                             num_images=[len(i) for i in images], **extra)
    return logps


@pytest.mark.parametrize("family", VISION_PROCESSORS)
def test_completion_log_probs_equal_trls_on_trls_processing_of_the_same_prompts(family, tmp_path):
    from posttrain.models.logprobs import token_logprobs

    model, processor = tiny_vision_processor(family)
    rows = vlm_data.prompt_only(2)
    trainer = _trainer(model, processor, rows, tmp_path, shuffle_dataset=False)
    scored = trainer.rollout.training_round(next(trainer._stream), 1)
    r = scored.rollouts
    assert r.model_inputs is not None and len(r.model_inputs) == 4
    image_ids = trainer.vision.image_token_ids
    assert not torch.isin(r.completion_ids[r.completion_mask], torch.tensor(image_ids)).any()  # never sampled
    with torch.no_grad():
        ours, _ = token_logprobs(trainer.model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
                                 model_inputs=r.forward_inputs())
    rows_repeated = [rows[i // 2] for i in range(4)]  # each prompt num_generations times, in order
    theirs = _trl_logps(model, processor, rows_repeated, r, tmp_path)
    m = r.completion_mask
    torch.testing.assert_close(ours[m], theirs[m], atol=1e-5, rtol=1e-5)
    # the sampler (the prefill with the pixels, then the cache) samples the same distribution, the image tokens
    # taken out (as TRL's generate suppresses them)
    with torch.no_grad():
        ids = torch.cat([r.prompt_ids, r.completion_ids], 1)
        logits = trainer.model(input_ids=ids, attention_mask=torch.cat([r.prompt_mask, r.completion_mask], 1).long(),
                               **r.forward_inputs()).logits[:, r.prompt_ids.size(1) - 1:-1].float()
    logits[..., image_ids] = float("-inf")
    sampled = torch.log_softmax(logits, -1).gather(-1, r.completion_ids[..., None])[..., 0]
    torch.testing.assert_close(r.sampler_logprobs[m], sampled[m], atol=1e-4, rtol=1e-4)


def test_a_run_trains_and_resumes_with_image_rows_buffered(tmp_path):
    model, processor = tiny_vision_processor("qwen2_5_vl", seed=1)
    rows = vlm_data.prompt_only(4)
    rows[1]["images"] = []  # a text-only prompt among image prompts
    trainer = _trainer(model, processor, rows, tmp_path / "a", max_steps=2, steps_per_generation=2,
                       per_device_train_batch_size=2, save_strategy="steps", save_steps=1)
    trainer.train()
    losses = [e for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(e["loss"])) for e in losses)
    # resuming from step 1 restores the buffered image rows and trains step 2 as the run did
    model2, _ = tiny_vision_processor("qwen2_5_vl", seed=1)
    again = _trainer(model2, processor, rows, tmp_path / "a", max_steps=2, steps_per_generation=2,
                     per_device_train_batch_size=2, save_strategy="no")
    again.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-1"))
    for p, q in zip(trainer.policy.parameters(), again.policy.parameters()):
        torch.testing.assert_close(p, q)


def test_posttrain_serve_samples_image_prompts_as_the_process_itself_would(tmp_path):
    """GRPO with vllm_mode='server' at `posttrain serve`: each request carries its prompts' pixels (as the trainer's
    processor made them), the server samples them through the same sampler with the image tokens suppressed, and a
    round's completions and sampler log-probs are those sampled in process; a step then trains on them."""
    from posttrain.serving.engine import TransformersEngine
    from tests.test_serve import running

    model, processor = tiny_vision_processor("qwen2_5_vl", seed=3)
    rows = vlm_data.prompt_only(2)
    rows[1]["images"] = []  # a text prompt beside an image prompt
    alone = _trainer(copy.deepcopy(model), processor, rows, tmp_path / "a", shuffle_dataset=False)
    expected = alone.rollout.training_round(next(alone._stream), 1).rollouts
    engine = TransformersEngine(copy.deepcopy(model), processor.tokenizer, max_model_len=512, name="tiny-vl")
    with running(engine) as url:
        served = _trainer(model, processor, rows, tmp_path / "b", shuffle_dataset=False, use_vllm=True,
                          vllm_mode="server", vllm_server_base_url=url, max_steps=1)
        got = served.rollout.training_round(next(served._stream), 1).rollouts
        for name in ("prompt_ids", "completion_ids", "completion_mask", "is_eos"):
            assert torch.equal(getattr(got, name), getattr(expected, name)), name
        torch.testing.assert_close(got.sampler_logprobs, expected.sampler_logprobs)
        assert not torch.isin(got.completion_ids, torch.tensor(served.vision.image_token_ids)).any()
        served.train()
    assert [e for e in served.state.log_history if "loss" in e]


@pytest.mark.parametrize("option, said", [
    (dict(async_generation=True), r"^async_generation=True is not supported with images"),
])
def test_what_cannot_take_images_yet_is_one_sentence(tmp_path, option, said):
    from posttrain.configs import ConfigError

    model, processor = tiny_vision_processor("qwen2_5_vl")
    with pytest.raises(ConfigError, match=said):
        _trainer(model, processor, vlm_data.prompt_only(2), tmp_path, **option)


def test_a_string_prompt_with_images_is_refused_as_trl_refuses_it(tmp_path):
    from posttrain.data import DataError

    model, processor = tiny_vision_processor("qwen2_5_vl")
    rows = [{"prompt": "Describe it.", "images": [vlm_data.image(0)]}, {"prompt": "And this?", "images": []}]
    trainer = _trainer(model, processor, rows, tmp_path, shuffle_dataset=False)
    with pytest.raises(DataError, match=r"^Prompt 0 is a string with 1 image\(s\): images go with conversational"):
        next(trainer._stream)


def test_rloo_trains_on_image_prompts_through_grpo_s_path(tmp_path):
    from posttrain import RLOOConfig, RLOOTrainer

    model, processor = tiny_vision_processor("llava", seed=2)
    config = RLOOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                        max_completion_length=4, max_steps=2, report_to="none", use_cpu=True, save_strategy="no",
                        learning_rate=1e-2, logging_steps=1, beta=0.05)
    trainer = RLOOTrainer(model, _content_reward, args=config, train_dataset=Dataset.from_list(vlm_data.prompt_only(4)),
                          processing_class=processor)
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    trainer.train()
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == 2 and all("kl" in e for e in logged)
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.policy.named_parameters())


@pytest.mark.peft
def test_lora_adapters_train_on_image_prompts_and_the_vision_tower_stays(tmp_path):
    """TRL's test_train_vlm_peft: adapters on the language model's linear layers train from image prompts; the base
    weights, the vision tower's included, do not move."""
    from peft import LoraConfig

    from posttrain import GRPOTrainer

    model, processor = tiny_vision_processor("qwen2_5_vl", seed=4)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model, _content_reward, _config(tmp_path, max_steps=2, per_device_train_batch_size=2,
                                                         learning_rate=0.1),
                          train_dataset=Dataset.from_list(vlm_data.prompt_only(2)), processing_class=processor,
                          peft_config=lora)
    trainer.train()
    named = dict(trainer.policy.named_parameters())
    adapters = {n: p for n, p in named.items() if "lora_" in n}
    assert adapters and any(float(p.abs().sum()) > 0 for n, p in adapters.items() if "lora_B" in n)
    # every base weight, under peft's names (base_model.model.<name>, a wrapped layer's weight in base_layer)
    after = {n.removeprefix("base_model.model.").replace(".base_layer", ""): p for n, p in named.items()
             if "lora_" not in n}
    assert sorted(after) == sorted(base)
    assert all(torch.equal(after[name].detach(), value) for name, value in base.items())


def test_a_tiny_model_learns_to_answer_from_the_image(tmp_path):
    """examples/vlm_colours.py: the same text beside a red or a blue image, the reward 1 for the image's colour's
    letter and 0.5 for the other's. Answering without the image earns 0.75 at most; GRPO on image prompts takes the
    mean reward from about 0 to above 0.9 in 200 steps."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import vlm_colours

    _, rewards = vlm_colours.train(str(tmp_path / "out"), 200)
    first, last = sum(rewards[:20]) / 20, sum(rewards[-20:]) / 20
    assert first < 0.2 and last > 0.9, (first, last)


def test_log_multimodal_logs_each_rows_images_with_its_completion(tmp_path, monkeypatch):
    """TRL's log_multimodal (default True): with log_completions, a row's images are saved beside completions.jsonl
    (its "images" their paths, the pixels as given) and the trackers' completions table gets TRL's "image" column of
    wandb Images; log_multimodal=False logs none (TRL's test_train_vlm_log_multimodal_false)."""
    import json
    import sys
    import types

    from PIL import Image

    logged = []

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    import importlib.machinery

    wandb = types.SimpleNamespace(init=lambda **kw: None, finish=lambda: None, Table=Table, Image=lambda path: path,
                                  log=lambda record, step: logged.append(record),
                                  __spec__=importlib.machinery.ModuleSpec("wandb", None))
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    model, processor = tiny_vision_processor("qwen2_5_vl")
    rows = vlm_data.prompt_only(2)
    for multimodal in (True, False):
        out = tmp_path / str(multimodal)
        trainer = _trainer(copy.deepcopy(model), processor, rows, out, log_completions=True, report_to=["wandb"],
                           log_multimodal=multimodal, shuffle_dataset=False)
        trainer.train()
        written = [json.loads(line) for line in open(out / "completions.jsonl")]
        if not multimodal:
            assert all("images" not in row for row in written)
            continue
        assert len(written) == 4
        for row in written:
            source = next(r for r in rows if r["prompt"] == row["prompt"])
            assert len(row["images"]) == len(source["images"])
            for path, image in zip(row["images"], source["images"]):
                assert list(Image.open(out / path).convert("RGB").getdata()) == list(image.convert("RGB").getdata())
        table = [record["completions"] for record in logged if "completions" in record][-1]
        assert table.columns[-1] == "image"
        assert [cell for *_, cell in table.data] == [[str(out / p) for p in row["images"]] for row in written]


def test_pad_to_multiple_of_pads_gemma3s_token_types_with_its_ids(tmp_path):
    """TRL's test_train_vlm_with_pad_to_multiple_of (Gemma 3, whose token_type_ids mark its images' bidirectional
    attention): the rows padded to a multiple of 32 give the log-probs the unpadded rows give, the token types being
    derived from each forward's ids; a step trains."""
    model, processor = tiny_vision_processor("gemma3", seed=1)
    rows = vlm_data.prompt_only(2)
    padded = _trainer(model, processor, rows, tmp_path, shuffle_dataset=False, pad_to_multiple_of=32)
    r = padded.rollout.training_round(next(padded._stream), 1).rollouts
    wide = r.padded(32)
    assert wide.prompt_ids.size(1) % 32 == 0 and wide.completion_ids.size(1) % 32 == 0
    assert wide.prompt_ids.size(1) > r.prompt_ids.size(1)  # the image rows really are padded
    with torch.no_grad():
        wide_logps, _ = padded.rollout.policy_logps(padded.model, wide)
        logps, _ = padded.rollout.policy_logps(padded.model, r)
    m, width = r.completion_mask, r.completion_ids.size(1)
    torch.testing.assert_close(wide_logps[:, :width][m], logps[m], atol=1e-5, rtol=1e-5)
    padded.train()
    assert [e for e in padded.state.log_history if "loss" in e]


def test_evaluation_samples_image_prompts_with_their_pixels(tmp_path):
    """GRPO's evaluate() on an eval_dataset with images: every eval round samples its prompts with their pixels, and
    the rewards are logged under TRL's eval_ names."""
    from posttrain import GRPOTrainer

    model, processor = tiny_vision_processor("qwen2_5_vl", seed=2)
    rows = vlm_data.prompt_only(2)
    trainer = GRPOTrainer(model, _content_reward, _config(tmp_path, num_generations_eval=2),
                          train_dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows),
                          processing_class=processor)
    seen = []
    generate = trainer.generator.generate
    trainer.generator.generate = lambda *a, **k: seen.append(k.get("model_inputs")) or generate(*a, **k)
    metrics = trainer.evaluate()
    assert seen and all(inputs is not None and "pixel_values" in inputs.names for inputs in seen)
    assert "eval_reward" in metrics and metrics["eval_reward"] == metrics["eval_reward"]  # finite, not NaN
