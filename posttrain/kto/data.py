"""KTO's datasets -> (prompt, completion, label) token rows, in TRL's formats and with TRL's preparation.

    unpaired, standard         {"prompt": "The sky is", "completion": " blue.", "label": True}
    unpaired, conversational   {"prompt": [messages], "completion": [messages], "label": False}
    paired                     a preference dataset ({"prompt": ..., "chosen": ..., "rejected": ...}, standard or
                               conversational; without a prompt column the prompt is chosen's and rejected's common
                               start, as DPO reads it), unpaired as TRL's unpair_preference_dataset unpairs it: each
                               block of 1000 pairs gives its chosen completions (label True), then its rejected ones
                               (label False)

As TRL's KTOTrainer: a standard completion gets the EOS appended unless it ends with it; the prompt is tokenized alone
(conversational: with the generation prompt) and with the completion (the row's `tools` and `chat_template_kwargs`
reach the chat template), and the completion starts where the two stop agreeing. A row whose prompt alone has
max_length tokens or more is dropped (TRL filters them, whatever the truncation mode); posttrain says how many.

With a vision-language model's processor (`vision`, sequences/images.py), a conversational example's `image` or
`images` go into its prompt as TRL places them, rendered by the processor's template, the image tokens expanded; the
example's row and its KL row (its prompt with another's completion) carry the prompt's pixels as model_inputs. A paired
dataset with images is refused, as TRL refuses to unpair one.

    UnpairedRows  rows: TokenRows, one per example, prompt + completion, labels True on the completion's tokens;
                  desirable [N] bool, the example's label; index [N] its row in the unpaired dataset
"""

import hashlib
import logging
from dataclasses import dataclass

import numpy as np

from posttrain.configs import ConfigError
from posttrain.data import DataError, check_encoded_within_vocabulary, refuse_images
from posttrain.model_inputs import ModelInputs
from posttrain.sequences.chat import (PromptBoundary, chat_ids, check_messages, extract_prompt, is_messages,
                                      template_kwargs)
from posttrain.sequences.batches import block_rows, predecessor_positions
from posttrain.sequences.images import images_of, with_images
from posttrain.sequences.rows import EpochPlan, TokenRows

logger = logging.getLogger("posttrain")

# datasets.map's batch size, the unit in which TRL's unpair_preference_dataset puts a block's chosen completions before
# its rejected ones: the order (and the KL pairs it gives) depends on it
UNPAIR_BLOCK = 1000
ACCEPTED = ("prompt + completion + label (text or messages), or a preference dataset (chosen + rejected, with or "
            "without a prompt column), which is unpaired")


def detect_format(row: dict, name: str, images: bool = False) -> tuple[str, bool]:
    """(standard or conversational, whether the rows are preference pairs to unpair); a DataError naming the columns
    found and the formats accepted. `images`: an image column is taken (a vision-language processor), else refused."""
    if not images:
        refuse_images(row, name)
    if "chosen" in row and "rejected" in row:
        return ("conversational" if is_messages(row["chosen"]) or is_messages(row.get("prompt"))
                else "standard"), True
    if "completion" in row and "label" in row:
        return ("conversational" if is_messages(row["completion"]) or is_messages(row.get("prompt"))
                else "standard"), False
    found = ", ".join(row) or "none"
    hint = ""
    if "completion" in row:
        hint = " (prompt/completion without a label is an SFT dataset; KTO needs each completion's label: True for " \
               "desirable, False for undesirable)"
    elif "chosen" in row or "rejected" in row:
        hint = f" (it has no {'rejected' if 'chosen' in row else 'chosen'!r} column)"
    raise DataError(f"{name} is in no KTO format: its columns are {found}; KTO needs {ACCEPTED}{hint}.")


@dataclass
class UnpairedRows:
    """Unpaired examples as token rows: `rows` one row per example, prompt + completion (untruncated: max_length cuts
    each sequence when it is batched, the KL pairs' too); `desirable` [N] bool; `index` [N] each example's row in the
    unpaired dataset; `ref` [N, 2] float64 (reference log-prob of the completion, of the example's KL pair) once
    precomputed, else None."""

    rows: TokenRows
    desirable: np.ndarray
    index: np.ndarray
    ref: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.index)

    @property
    def lengths(self) -> np.ndarray:
        return self.rows.lengths

    def select(self, examples) -> "UnpairedRows":
        examples = np.asarray(examples, dtype=np.int64)
        return UnpairedRows(self.rows.select(examples), self.desirable[examples], self.index[examples],
                            None if self.ref is None else self.ref[examples])

    @classmethod
    def concatenate(cls, parts: list["UnpairedRows"]) -> "UnpairedRows":
        if not parts:
            return cls(TokenRows.from_sequences([]), np.zeros(0, dtype=bool), np.zeros(0, dtype=np.int64))
        refs = [p.ref for p in parts]
        return cls(TokenRows.concatenate([p.rows for p in parts]), np.concatenate([p.desirable for p in parts]),
                   np.concatenate([p.index for p in parts]),
                   None if any(r is None for r in refs) else np.concatenate(refs))

    def fingerprint(self) -> str:
        h = hashlib.sha256(self.rows.fingerprint().encode())
        h.update(np.ascontiguousarray(self.desirable).tobytes())
        h.update(np.ascontiguousarray(self.index).tobytes())
        return h.hexdigest()[:16]


class KTOEncoder:
    """Tokenizes a dataset's examples in its format (TRL's KTOTrainer preparation).

    Args:
        tokenizer: the model's tokenizer.
        first_row: the dataset's first row, which decides the format (as in TRL).
        name: the dataset's name in messages.
        vocab_size: the model's vocabulary_rows: every token id must lie below it (None: unchecked).
        vision: a vision-language processor's rows (sequences/images.py VisionProcessing), for examples with images;
            None: text only.
    """

    def __init__(self, tokenizer, first_row: dict, name: str = "train_dataset", vocab_size: int | None = None, *,
                 vision=None, source=None):
        self.tokenizer, self.name, self.vocab_size, self.vision = tokenizer, name, vocab_size, vision
        self.source = source  # the map-style dataset (its rows' images read again when a batch takes them), or None
        self.format, self.paired = detect_format(first_row, name, images=vision is not None)
        if vision is not None and (self.paired or self.format != "conversational"):
            raise DataError(f"{name} has images and is {'paired' if self.paired else self.format} data: images go "
                            "with conversational unpaired examples (prompt and completion as messages, and a "
                            "label), as in TRL, which does not unpair a vision dataset; convert the rows to that "
                            "format.")
        self.inputs: list[dict] = []  # the examples last encoded: each one's model_inputs (with a processor)
        self.implicit = self.paired and "prompt" not in first_row
        if self.format == "conversational" and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{name} is conversational, and the tokenizer has no chat template to render the "
                              "messages: use a chat model's tokenizer, or set chat_template_path.")
        self._boundary = PromptBoundary(name)

    def encode(self, rows: list[dict], first_index: int) -> list[tuple[list, list, bool, int]]:
        """[(prompt_ids, completion_ids, label, unpaired index)] of a block of the dataset's rows (starting at row
        `first_index`), in the unpaired dataset's order."""
        examples = self._unpaired(rows, first_index)
        if self.format == "standard":
            out = self._standard(examples)
        elif self.vision is not None:
            self.inputs = []
            out = [self._vision_conversation(prompt, completion, label, index, kwargs, rows[index - first_index])
                   for prompt, completion, label, index, kwargs in examples]
        else:
            out = [self._conversation(prompt, completion, label, index, kwargs)
                   for prompt, completion, label, index, kwargs in examples]
        rows_of = [first_index + k % len(rows) for k in range(len(out))]  # a pair's chosen, then its rejected
        check_encoded_within_vocabulary(out, rows_of, self.name, self.vocab_size, self.tokenizer, (None, None))
        return out

    # ------------------------------------------------------------------ rows

    def _unpaired(self, rows: list[dict], first_index: int) -> list[tuple]:
        """[(prompt, completion, label, unpaired index, template kwargs)]: a block of pairs gives its chosen
        completions, then its rejected ones (TRL's unpairing of a map batch)."""
        if not self.paired:
            return [self._example(row, first_index + i) for i, row in enumerate(rows)]
        pairs = [self._pair(row, first_index + i) for i, row in enumerate(rows)]
        start, n = 2 * first_index, len(rows)
        kwargs = [self._template_kwargs(row) for row in rows]
        chosen = [(p, c, True, start + i, k) for i, ((p, c, _), k) in enumerate(zip(pairs, kwargs))]
        rejected = [(p, r, False, start + n + i, k) for i, ((p, _, r), k) in enumerate(zip(pairs, kwargs))]
        return chosen + rejected

    def _example(self, row: dict, index: int) -> tuple:
        for column in ("completion", "label"):
            if column not in row:
                raise DataError(f"Row {index} of {self.name} has no {column!r}: every row needs a completion and its "
                                "label.")
        label = row["label"]
        if not isinstance(label, (bool, np.bool_)) and label not in (0, 1):
            raise DataError(f"Row {index} of {self.name} has label {label!r}: a label is True (a desirable "
                            "completion) or False (an undesirable one).")
        prompt = self._checked(row.get("prompt"), "prompt", index)
        completion = self._checked(row["completion"], "completion", index)
        return prompt, completion, bool(label), index, self._template_kwargs(row)

    def _template_kwargs(self, row: dict) -> dict:
        """The row's chat template keyword arguments (its tools read once per row), for conversational rows only."""
        return template_kwargs(row) if self.format == "conversational" else {}

    def _pair(self, row: dict, index: int) -> tuple:
        for column in ("chosen", "rejected"):
            if column not in row:
                raise DataError(f"Row {index} of {self.name} has no {column!r}: every row needs chosen and rejected.")
        chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
        if self.implicit:
            prompt, chosen, rejected = extract_prompt(chosen, rejected)
        return (self._checked(prompt, "prompt", index), self._checked(chosen, "chosen", index),
                self._checked(rejected, "rejected", index))

    def _checked(self, value, column: str, index: int):
        kind = list if self.format == "conversational" else str
        if value is None and column == "prompt":
            return kind()
        if not isinstance(value, kind):
            raise DataError(f"Row {index} of {self.name} has {type(value).__name__} in {column!r} where the first row "
                            f"has {'messages' if kind is list else 'text'}: every row must be in the same format.")
        if kind is list:
            check_messages(value, f"Row {index} of {self.name}", column, allow_empty=True)
        return value

    # ------------------------------------------------------------------ tokens

    def _split(self, prompt_ids: list, full_ids: list) -> tuple[list, list]:
        n = self._boundary.length(prompt_ids, full_ids)
        return prompt_ids[:n], full_ids[n:]

    def _standard(self, examples: list[tuple]) -> list[tuple]:
        eos, tok = self.tokenizer.eos_token, self.tokenizer
        prompts = [p for p, *_ in examples]
        full = [p + (c if c.endswith(eos) else c + eos) for p, c, *_ in examples]
        prompt_ids, full_ids = tok(prompts)["input_ids"], tok(full)["input_ids"]
        return [(*self._split(list(p), list(f)), label, index)
                for p, f, (_, _, label, index, _) in zip(prompt_ids, full_ids, examples)]

    def encoded_inputs(self):
        """(each example last encoded's model_inputs, their token types) with a vision processor, else None."""
        return None if self.vision is None else (self.inputs, self.vision.token_types)

    def _vision_conversation(self, prompt, completion, label: bool, index: int, kwargs: dict, row: dict) -> tuple:
        """An example through the processor: its images in the prompt, the image tokens expanded; the prompt's pixels
        kept as the example's model_inputs."""
        where, images = f"Row {index} of {self.name}", images_of(row)
        prompt = with_images(prompt, images, where)

        def text(messages, generation_prompt=False):
            return self.vision.render(messages, generation_prompt=generation_prompt, **kwargs)

        prompt_ids, inputs = self.vision.row_inputs(text(prompt, True), images, where, self.source, index)
        self.inputs.append(inputs)
        full_ids = self.vision.encode(text(prompt + with_images(completion, [], where)), images, where)[0]
        return (*self._split(prompt_ids, full_ids), label, index)

    def _conversation(self, prompt, completion, label: bool, index: int, kwargs: dict) -> tuple:
        row = f"Row {index} of {self.name}"
        prompt_ids = chat_ids(self.tokenizer, prompt, kwargs, row, add_generation_prompt=True) if prompt else []
        return (*self._split(prompt_ids, chat_ids(self.tokenizer, prompt + completion, kwargs, row)), label, index)


def unpaired_rows(encoded: list[tuple], max_length: int | None, inputs=None) -> tuple[UnpairedRows, int]:
    """(the examples whose prompt is shorter than max_length, how many were not and are dropped): each example one
    token row, prompt + completion, labelled on the completion. `inputs`: each example's model_inputs and their token
    types ((list, TokenTypes) from a vision processor), or None; a kept prompt, its image tokens with it, is whole."""
    sequences, desirable, index, kept_inputs = [], [], [], []
    for k, (prompt_ids, completion_ids, label, row) in enumerate(encoded):
        if max_length is not None and len(prompt_ids) >= max_length:
            continue
        if inputs is not None:
            kept_inputs.append(inputs[0][k])
        tokens = np.asarray(prompt_ids + completion_ids, dtype=np.int64)
        labels = np.zeros(len(tokens), dtype=bool)
        labels[len(prompt_ids):] = True
        sequences.append((tokens, labels))
        desirable.append(label)
        index.append(row)
    model_inputs = None if inputs is None else ModelInputs.from_rows(kept_inputs, inputs[1])
    rows = UnpairedRows(TokenRows.from_sequences(sequences, model_inputs), np.asarray(desirable, dtype=bool),
                        np.asarray(index, dtype=np.int64))
    return rows, len(encoded) - len(index)


def prepare_unpaired(dataset, encoder: KTOEncoder, max_length: int | None, announce: bool = True,
                     block: int = UNPAIR_BLOCK) -> UnpairedRows:
    """Every row of a map-style dataset as unpaired token rows (a paired dataset unpaired a block of `block` pairs
    at a time, TRL's map batch); those dropped for their prompt's length counted in one warning (from the announcing
    process), or one sentence when none is left."""
    name = encoder.name
    if len(dataset) == 0:
        raise DataError(f"{name} is empty: it needs at least one example.")
    parts, dropped, total = [], 0, 0
    for start in range(0, len(dataset), block):
        rows = block_rows(dataset[start:start + block])
        encoded = encoder.encode(rows, start)
        part, lost = unpaired_rows(encoded, max_length, encoder.encoded_inputs())
        parts.append(part)
        dropped, total = dropped + lost, total + len(encoded)
    examples = UnpairedRows.concatenate(parts)
    if len(examples) == 0:
        raise DataError(f"{name} has no example left: the prompt of every one of its {total} examples has "
                        f"max_length={max_length} tokens or more, leaving no room for its completion; raise max_length "
                        "(or set it to None).")
    if announce and dropped:
        logger.warning("%s: %d of %d examples were dropped because their prompt alone has max_length=%s tokens or "
                       "more (as TRL filters them); raise max_length to keep them.", name, dropped, total, max_length)
    return examples


def rotated(n: int) -> np.ndarray:
    """[n] the example before each of n examples, the first taking the last (TRL's rotation by one); one example is
    its own."""
    return np.roll(np.arange(n), 1)


def kl_rows(examples: UnpairedRows, partners: UnpairedRows) -> TokenRows:
    """The mismatched (prompt, completion) pairs: example i's prompt with partners' example i's completion, one token
    row each, labelled on the completion."""
    rows, other_rows = examples.rows, partners.rows
    sequences = []
    for i in range(len(examples)):
        own, other = rows.row(i), other_rows.row(i)
        prompt = rows.tokens[own][~rows.labels[own]]
        completion = other_rows.tokens[other][other_rows.labels[other]]
        labels = np.zeros(len(prompt) + len(completion), dtype=bool)
        labels[len(prompt):] = True
        sequences.append((np.concatenate([prompt, completion]), labels))
    return TokenRows.from_sequences(sequences, rows.model_inputs)  # example i's prompt: its pixels


def kl_completions(examples: UnpairedRows, batch_size: int) -> TokenRows:
    """The KL pairs as TRL 1.16 builds them in its prepared dataset: the examples in blocks of `batch_size`
    (per_device_train_batch_size) in the prepared order, each prompt with the completion of the example before it in
    its block. posttrain's trainer pairs within each optimizer step's examples (every process's micro-batches in turn,
    sequences/batches.py predecessor_positions), which is this pairing where a step is one such block: one process,
    one micro-batch a step, sequential sampling, as here."""
    plan = EpochPlan(examples.lengths, batch_size, num_processes=1, accumulation=1, strategy="sequential")
    return kl_rows(examples, examples.select(predecessor_positions(plan, len(examples))))


class UnpairedPreparation:
    """Turns a dataset's rows into UnpairedRows with one config; the interface sequences/batches.py's batchers use.
    `announce`: this process says what is dropped (the main process; every process drops the same examples)."""

    def __init__(self, encoder: KTOEncoder, max_length: int | None, name: str, announce: bool = True):
        self.encoder, self.max_length, self.name, self.announce = encoder, max_length, name, announce

    def sequences(self, rows: list[dict], first_index: int) -> tuple:
        return self.encoder.encode(rows, first_index), self.encoder.encoded_inputs()

    def rows(self, encoded: tuple) -> tuple[UnpairedRows, int]:
        """A stream's block: its examples, and how many were dropped for their prompt's length."""
        return unpaired_rows(encoded[0], self.max_length, encoded[1])

    @staticmethod
    def concatenate(parts: list[UnpairedRows]) -> UnpairedRows:
        return UnpairedRows.concatenate(parts)


def balance_advice(desirable: int, undesirable: int, desirable_weight: float, undesirable_weight: float) -> str | None:
    """TRL's advice when the classes are unbalanced and neither weight lies in the range Eq. (8) of the KTO paper
    (arXiv 2402.01306) recommends for them: desirable_weight * desirable / (undesirable_weight * undesirable) in
    [1, 4/3]. None where the classes are balanced or a weight is in its range."""
    if not desirable or not undesirable:
        kinds = ("desirable", "undesirable") if desirable else ("undesirable", "desirable")
        return (f"The data has {desirable + undesirable} {kinds[0]} examples and no {kinds[1]} one: KTO learns from "
                f"both kinds, and no weight makes up for one that is missing; add {kinds[1]} examples (label "
                f"{kinds[1] == 'desirable'}).")
    if desirable == undesirable:
        return None
    des_low = round(undesirable * undesirable_weight / desirable, 2)
    des_high = round(undesirable * undesirable_weight / desirable * 1.33, 2)
    und_low = round(desirable * desirable_weight / undesirable / 1.33, 2)
    und_high = round(desirable * desirable_weight / undesirable, 2)
    if des_low <= desirable_weight <= des_high or und_low <= undesirable_weight <= und_high:
        return None
    return (f"The data has {desirable} desirable and {undesirable} undesirable examples, and neither weight is in "
            f"the range the KTO paper recommends for that balance: set desirable_weight in [{des_low}, {des_high}] or "
            f"undesirable_weight in [{und_low}, {und_high}] (not both).")
