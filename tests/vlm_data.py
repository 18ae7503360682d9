"""Tiny image datasets in TRL's vision formats (zen-image's configs: an `images` list, or one `image`, beside
conversational rows), for the trainers' vision-language tests; and the trainers against a reference that DPO's and
KTO's tests build on both sides (posttrain's, and TRL's `_compute_loss` on TRL's own batch)."""

import copy

import numpy as np


def image(seed: int, size=(16, 16)):
    """A seeded RGB PIL image of `size` (width, height)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


QUESTIONS = ["What is in the picture?", "Describe it.", "Which colour is it?", "Two pictures: what differs?"]
ANSWERS = ["A square.", "Noise, mostly.", "Red.", "The second is darker."]


def image_count(i: int) -> int:
    """Row i's images: the last of every four rows has two (zen-multi-image's kind), the others one."""
    return 2 if i % 4 == 3 else 1


def language_modeling(n: int = 4) -> list[dict]:
    """`messages` rows with `images` (SFT's conversational language modeling)."""
    return [{"messages": [{"role": "user", "content": QUESTIONS[i % 4]},
                          {"role": "assistant", "content": ANSWERS[i % 4]}],
             "images": [image(10 * i + k, (16, 12 + 4 * (k % 2))) for k in range(image_count(i))]} for i in range(n)]


def prompt_completion(n: int = 4) -> list[dict]:
    """Conversational prompt/completion rows with `images`."""
    return [{"prompt": [{"role": "user", "content": QUESTIONS[i % 4]}],
             "completion": [{"role": "assistant", "content": ANSWERS[i % 4]}],
             "images": [image(10 * i + k) for k in range(image_count(i))]} for i in range(n)]


def prompt_only(n: int = 4) -> list[dict]:
    """Conversational prompts with `images` (GRPO, RLOO, Distillation)."""
    return [{"prompt": [{"role": "user", "content": QUESTIONS[i % 4]}],
             "images": [image(10 * i + k) for k in range(image_count(i))]} for i in range(n)]


def preference(n: int = 4) -> list[dict]:
    """Conversational prompt/chosen/rejected rows with `images` (DPO)."""
    return [{"prompt": [{"role": "user", "content": QUESTIONS[i % 4]}],
             "chosen": [{"role": "assistant", "content": ANSWERS[i % 4]}],
             "rejected": [{"role": "assistant", "content": ANSWERS[(i + 1) % 4]}],
             "images": [image(10 * i + k) for k in range(image_count(i))]} for i in range(n)]


def unpaired_preference(n: int = 4) -> list[dict]:
    """Conversational prompt/completion/label rows with `images` (KTO)."""
    return [{"prompt": [{"role": "user", "content": QUESTIONS[i % 4]}],
             "completion": [{"role": "assistant", "content": ANSWERS[(i + i % 2) % 4]}], "label": i % 2 == 0,
             "images": [image(10 * i + k) for k in range(image_count(i))]} for i in range(n)]


def reference_trainer(name: str, model, ref_model, processor, rows: list[dict], output_dir, **overrides):
    """posttrain's `name`Trainer (DPO, KTO) on `rows`, one batch of all of them a step."""
    import posttrain
    from datasets import Dataset

    values = dict(output_dir=str(output_dir), per_device_train_batch_size=len(rows), max_steps=1, report_to="none",
                  use_cpu=True, save_strategy="no", learning_rate=1e-2, logging_steps=1, beta=0.1)
    values.update(overrides)
    return getattr(posttrain, f"{name}Trainer")(model, ref_model=ref_model,
                                                  args=getattr(posttrain, f"{name}Config")(**values),
                                                  train_dataset=Dataset.from_list(rows), processing_class=processor)


def trl_loss(name: str, model, ref_model, processor, rows: list[dict], batch: dict, output_dir, **config):
    """TRL's `name`Trainer._compute_loss (DPO, KTO) on its own vision batch `batch`, through copies of the same
    policy and reference, in float32."""
    import torch
    import trl
    from datasets import Dataset

    trainer = getattr(trl, f"{name}Trainer")(
        copy.deepcopy(model), ref_model=copy.deepcopy(ref_model), processing_class=processor,
        train_dataset=Dataset.from_list(rows),
        args=getattr(trl, f"{name}Config")(output_dir=str(output_dir), per_device_train_batch_size=len(rows),
                                           report_to="none", use_cpu=True, bf16=False, beta=0.1, **config))
    with torch.no_grad():
        return trainer._compute_loss(trainer.model, batch, False)
