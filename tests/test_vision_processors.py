"""posttrain.testing's tiny vision-language models with their processors, built offline (no hub, no torchvision):
the family's real chat template renders an image turn, the processor expands its image tokens as the model expects,
and each row processed alone, carried as model_inputs (posttrain/model_inputs.py), batches as the processor batches
the rows together."""

import numpy as np
import pytest
import torch

from posttrain.model_inputs import ModelInputs
from posttrain.testing import VISION_PROCESSORS, tiny_vision_processor

IMAGE_KEYS = ("pixel_values", "image_grid_thw")  # what a row carries besides its token ids


def _image(seed: int, size=(16, 16)):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _conversation(text: str) -> list:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


@pytest.mark.parametrize("family", VISION_PROCESSORS)
def test_rows_processed_alone_batch_as_the_processor_batches_them(family):
    model, processor = tiny_vision_processor(family)
    texts = [processor.apply_chat_template(_conversation(t), tokenize=False, add_generation_prompt=True)
             for t in ("What is it?", "And this one, please?")]
    images = [_image(0), _image(1, (12, 16))]
    # the token each image expands to (Gemma 3's processor names its begin-of-image, and expands the soft token)
    expanded = processor.tokenizer.image_token if family == "gemma3" else processor.image_token
    image_token = processor.tokenizer.convert_tokens_to_ids(expanded)
    config = model.config
    assert image_token == (config.image_token_index if family == "llava" else config.image_token_id)
    alone = [processor(text=[t], images=[i], return_tensors="pt") for t, i in zip(texts, images)]
    together = processor(text=texts, images=[[i] for i in images], return_tensors="pt", padding=True)
    rows = ModelInputs.from_rows([{k: row[k] for k in IMAGE_KEYS if k in row} for row in alone])
    batched = rows.batched()
    assert sorted(batched) == sorted(k for k in IMAGE_KEYS if k in together)
    for key, value in batched.items():
        assert torch.equal(value, together[key]), key
    for row in alone:  # the template's one image placeholder, expanded to the model's image tokens
        assert int((row["input_ids"] == image_token).sum()) > 1
    with torch.no_grad():
        logits = model(**together).logits
    assert logits.shape[:2] == together["input_ids"].shape and bool(torch.isfinite(logits).all())
