"""Rows with images (TRL's vision datasets: an `image` or `images` column) through a vision-language model's processor:
the images placed in the conversation as TRL places them, the text's image tokens expanded and the pixels
processed, per row.

    images_of(row)                        [] | [image, ...]: the row's `image` (one) or `images` (a list)
    with_images(messages, images)         the messages with content parts and the images in them, as TRL 1.16's
                                          prepare_multimodal_messages: the images before the text of the first user
                                          message whose content is a string; blocks {"type": "image"} already there
                                          take the images in order
    vision = VisionProcessing(processor)  one processor's rows:
    vision.render(messages, ...)          the processor's chat template applied (text)
    vision.encode(text, images)           (token ids [L] with each image token expanded, {name: tensor} the row's
                                          model_inputs: pixel_values [patches, D] and image_grid_thw [images, 3] for
                                          Qwen-VL, pixel_values [images, C, H, W] for LLaVA)
    vision.token_types                    the per-token input the model derives from the ids (model_inputs.py)

A row is processed alone (`processor(text=[text], images=images)`), so a row's inputs do not depend on the rows
batched with it. A prepared dataset (SFT's, DPO's, KTO's) keeps each row's ids and a RowPixels, not its pixels: the
row's text and where its images are (the dataset and the row), processed again when a batch takes the row, as TRL's
collators process each batch; a whole image dataset's pixels are never held at once. The per-token inputs a processor
returns (`mm_token_type_ids`, Gemma 3's `token_type_ids`) are not stored but derived from the ids of each forward
(model_inputs.TokenTypes), and so follow its padding. Processors whose pixel inputs are laid out per batch rather than
per image (Idefics2/3 and SmolVLM's `pixel_attention_mask`) are refused in one sentence.
"""

from dataclasses import dataclass
from typing import Any

import numpy as np

from posttrain.data import IMAGE_COLUMNS, DataError
from posttrain.model_inputs import ModelInputs, TokenTypes

_SEQUENCE_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")  # [1, L]: the ids' own
_PER_BATCH_INPUTS = ("pixel_attention_mask",)  # laid out per batch (Idefics2/3, SmolVLM): not carried per row


def is_vision_processor(processing_class) -> bool:
    """Whether `processing_class` is a processor with an image processor (transformers' ProcessorMixin), as TRL tells a
    vision-language model's."""
    try:
        from transformers import ProcessorMixin
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(processing_class, ProcessorMixin) and getattr(processing_class, "image_processor", None) \
        is not None


def has_image_columns(columns) -> bool:
    return any(c in (columns or ()) for c in IMAGE_COLUMNS)


def images_of(row: dict) -> list:
    """The row's images: its `image` (one, or None for none) or `images` (a list, possibly empty) column."""
    if row.get("images") is not None:
        images = row["images"]
        return list(images) if isinstance(images, (list, tuple)) else [images]
    return [] if row.get("image") is None else [row["image"]]


def _as_parts(content) -> list:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])


def _open_image_block(part) -> bool:
    """An {"type": "image"} content part without its image (a dataset gives an absent key None)."""
    return isinstance(part, dict) and part.get("type") == "image" and part.get("image") is None


def _open_image_blocks(messages: list) -> int:
    return sum(1 for m in messages if m.get("role") != "tool" for part in _as_parts(m.get("content"))
               if _open_image_block(part))


def with_images(messages: list, images: list, where: str) -> list:
    """`messages` with every content a list of parts, and `images` in them: as image blocks before the text of the
    first user message whose content is a string, or filling the {"type": "image"} blocks the messages already hold, in
    order (TRL's placement). `where` names the row in the one sentence a count that does not match gives."""
    out, placed = [], False
    for message in messages:
        content = message.get("content")
        if message.get("role") == "user" and isinstance(content, str) and not placed:
            message = {**message, "content": [{"type": "image"} for _ in images] + [{"type": "text", "text": content}]}
            placed = True
        elif isinstance(content, str):
            message = {**message, "content": _as_parts(content)}
        out.append(message)
    open_blocks = _open_image_blocks(out)
    if open_blocks != len(images):
        raise DataError(f"{where} has {len(images)} image(s) and {open_blocks} place(s) for one in its messages (a "
                        "{'type': 'image'} block, or the first user message's text): give each image its block, or "
                        "write the first user message as a string for the images to go before it.")
    remaining = iter(images)
    for i, message in enumerate(out):
        if message.get("role") == "tool" or not message.get("content"):
            continue
        out[i] = {**message, "content": [{**part, "image": next(remaining)} if _open_image_block(part) else part
                                         for part in message["content"]]}
    return out


def token_types_of(processor) -> TokenTypes | None:
    """The per-token input the processor gives (and the model takes): Qwen-VL's mm_token_type_ids, Gemma 3's
    token_type_ids; None for a processor that gives none (LLaVA)."""
    if not getattr(processor, "return_mm_token_type_ids", False):
        return None
    given = processor(text=["."], return_tensors="pt")  # under the name the processor gives them (Gemma 3 renames)
    name = next((n for n in ("mm_token_type_ids", "token_type_ids") if n in given), None)
    if name is None:
        return None
    types = []
    for kind, ids in ((1, "image_token_ids"), (2, "video_token_ids"), (3, "audio_token_ids")):
        for token in getattr(processor, ids, None) or ():
            if token is not None:
                types.append((int(token), kind))
    return TokenTypes(name, tuple(types))


class VisionProcessing:
    """One vision-language processor's rows: rendering, image tokens expanded, pixels processed."""

    def __init__(self, processor):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.token_types = token_types_of(processor)
        ids = {getattr(processor, "image_token_id", None)} | {t for t, _ in (self.token_types.types if self.token_types
                                                                              else ())}
        self.image_token_ids = sorted(int(t) for t in ids if t is not None)  # the ids that stand for pixels

    def render(self, messages: list, *, generation_prompt: bool = False, **kwargs) -> str:
        """The processor's chat template applied to `messages` (content parts, images in place), as text."""
        return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **kwargs)

    def encode(self, text: str, images: list, where: str) -> tuple[list[int], dict]:
        """(token ids with each image token expanded to the image's size, the row's model_inputs {name: tensor})."""
        try:
            out = self.processor(text=[text], images=images or None, return_tensors="pt", add_special_tokens=False)
        except ValueError as err:  # the processor's own check: the image tokens in the text against the images
            raise DataError(f"{where}: the processor could not pair its {len(images)} image(s) with the image "
                            f"tokens of its text ({str(err).splitlines()[0] if str(err) else type(err).__name__}); "
                            "give the text one image token per image, or images where the chat template puts "
                            "them.") from err
        per_batch = [name for name in _PER_BATCH_INPUTS if name in out]
        if per_batch:
            raise DataError(f"{type(self.processor).__name__} lays out {per_batch[0]} per batch, not per image, which "
                            "posttrain does not carry row by row: use a Qwen-VL, LLaVA, LLaVA-NeXT or Gemma 3 "
                            "checkpoint.")
        inputs = {name: value for name, value in out.items() if name not in _SEQUENCE_INPUTS}
        return out["input_ids"][0].tolist(), inputs

    def encode_prompt(self, row: dict, where: str, template_kwargs: dict) -> tuple[list[int], dict]:
        """`encode` for a prompt row (GRPO's): its images in its conversation, rendered with the generation prompt; a
        string prompt with images is refused, as TRL refuses it."""
        images, prompt = images_of(row), row["prompt"]
        if isinstance(prompt, str):
            if images:
                raise DataError(f"{where} is a string with {len(images)} image(s): images go with conversational "
                                "prompts (a list of {'role', 'content'} messages), as in TRL; write the prompt as "
                                "messages.")
            return self.encode(prompt, [], where)
        text = self.render(with_images(prompt, images, where), generation_prompt=True, **template_kwargs)
        return self.encode(text, images, where)

    def check_cut(self, rows, max_length: int | None, name: str, first_index: int) -> None:
        """A row longer than `max_length` whose image tokens lie beyond it would lose an image's place (its pixels
        then match no tokens): one sentence naming the first such row of `rows` (TokenRows, cut at the end; row r
        is row first_index + r of dataset `name`)."""
        if max_length is None:
            return
        for r in range(len(rows)):
            span = rows.tokens[rows.row(r)]
            if len(span) > max_length and np.isin(span[max_length:], self.image_token_ids).any():
                raise DataError(f"Row {first_index + r} of {name} has image tokens beyond max_length={max_length} "
                                f"(it is {len(span)} tokens long), so cutting it there would leave its images without their "
                                "tokens: raise max_length, or shorten the text before the images.")

    def row_inputs(self, text: str, images: list, where: str, source: Any = None, index: int = 0):
        """(ids, the row's model_inputs) of `text` with `images`: the pixels themselves, or, when the row is row
        `index` of the map-style dataset `source`, a RowPixels that makes them again when a batch takes the row."""
        ids, inputs = self.encode(text, images, where)
        if source is None or not inputs:
            return ids, inputs
        return ids, RowPixels(self, text, source, index, where, tuple(sorted(inputs)))

    def model_inputs(self, rows: list[dict]) -> ModelInputs:
        """ModelInputs of per-row {name: tensor} (from `encode`), with this processor's token types."""
        return ModelInputs.from_rows(rows, self.token_types)


@dataclass(frozen=True, eq=False)
class RowPixels:
    """A prepared row's pixels, made when a batch takes the row (model_inputs.py's deferred row): the processor run
    again on the row's text and its images, read from its dataset row (row `index` of `source`)."""

    vision: VisionProcessing
    text: str
    source: Any
    index: int
    where: str
    names: tuple

    def resolve(self) -> dict:
        return self.vision.encode(self.text, images_of(self.source[self.index]), self.where)[1]

    def fingerprint(self) -> bytes:
        """What the row's pixels are made from: its dataset's fingerprint (datasets' own, of its contents) and row,
        and its text."""
        return f"{getattr(self.source, '_fingerprint', id(self.source))}:{self.index}:{self.text}".encode()
