"""Preference datasets -> token pairs, in TRL's formats (DPOTrainer's preparation; any trainer of preference pairs
against their completions uses it).

    explicit, standard           {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    explicit, conversational     {"prompt": [messages], "chosen": [messages], "rejected": [messages]}
    implicit (no prompt column)  {"chosen": ..., "rejected": ...}: the prompt is their longest common prefix
                                 (of characters, or of whole messages)
    tokenized                    {"prompt_ids": [...], "chosen_ids": [...], "rejected_ids": [...]}

Tokenization is TRL's: prompt_ids = ids(prompt) (conversational: with the generation prompt), chosen_ids =
ids(prompt + chosen)[L:], rejected_ids likewise, where L is where the tokenized prompt stops being a prefix of both
(so a merge across the boundary never misplaces it). Standard chosen and rejected texts get the EOS appended when they
do not end with it. Per-row `tools` and `chat_template_kwargs` columns reach the chat template.

With a vision-language model's processor (`vision`, sequences/images.py), a conversational pair's `image` or `images`
go into its prompt as TRL places them, rendered by the processor's template, the image tokens expanded; both of its
sequences carry the prompt's pixels as their model_inputs.

A pair becomes two sequences, prompt + chosen and prompt + rejected, each labelled on its completion and truncated on
its own to max_length (truncation_mode). Pairs that cannot teach are dropped and counted (DroppedPairs), the same on
every process (the rule reads the prepared tokens alone, before the pairs are shared out):
    - with keep_start, a pair whose prompt alone fills max_length has no completion token left;
    - a pair whose chosen and rejected sequences give the model the same tokens to predict (the same answer twice, as
      given or once truncated): every model gives both the same log-prob, so the preference is empty (sigmoid's loss
      is log 2 with no gradient).

    PairRows    (sequences/pairs.py) 2 token rows per pair, chosen at 2i and rejected at 2i + 1, each pair's dataset
                index and, once computed, its reference log-probs [P, 2].
"""

import logging

import numpy as np

from posttrain.configs import ConfigError
from posttrain.data import DataError, check_encoded_within_vocabulary
from posttrain.sequences.chat import PromptBoundary, chat_ids, check_messages, extract_prompt, template_kwargs
from posttrain.sequences.images import images_of, with_images
from posttrain.sequences.batches import BLOCK, block_rows
from posttrain.sequences.preference import preference_format
from posttrain.sequences.pairs import DroppedPairs, PairRows, nothing_left, same_answers, same_answers_warning
from posttrain.sequences.rows import TokenRows, truncate
from posttrain.model_inputs import ModelInputs

logger = logging.getLogger("posttrain")

FORMATS = ("standard", "conversational", "tokenized")
ACCEPTED = ("prompt + chosen + rejected (text or messages), chosen + rejected with the prompt as their common "
            "start, or prompt_ids + chosen_ids + rejected_ids")


def detect_format(row: dict, name: str, needs: str = "DPO", images: bool = False) -> str:
    """standard, conversational or tokenized (prompt_ids, chosen_ids, rejected_ids); a DataError naming the columns
    found and the formats accepted (`needs`: the trainer, as the message names it; `images`: an image column is
    taken)."""
    return preference_format(row, name, tokenized=(("prompt_ids", "chosen_ids", "rejected_ids"),), needs=needs,
                             accepted=ACCEPTED, images=images)


class PairEncoder:
    """Tokenizes the pairs of one dataset in its format (TRL's preparation).

    Args:
        tokenizer: the policy's tokenizer (EOS and padding already set by the trainer).
        first_row: the dataset's first row, which decides the format (as in TRL).
        name: the dataset's name in messages.
        vocab_size: the model's vocabulary_rows: every token id must lie below it (None: unchecked).
        needs: the trainer, as a wrong format's message names it.
        vision: a vision-language processor's rows (sequences/images.py VisionProcessing), for pairs with images;
            None: text only.
        source: the map-style dataset the pairs come from (their images read again when a batch takes them), or
            None (a stream: the pixels kept with the pairs).
    """

    def __init__(self, tokenizer, first_row: dict, name: str = "train_dataset", vocab_size: int | None = None, *,
                 needs: str = "DPO", vision=None, source=None):
        self.tokenizer, self.vocab_size, self.vision, self.source = tokenizer, vocab_size, vision, source
        self.name = name
        self.format = detect_format(first_row, name, needs, images=vision is not None)
        if vision is not None and self.format != "conversational":
            raise DataError(f"{name} has images and is {self.format} pairs: images go with conversational pairs "
                            "(prompt, chosen and rejected as messages), as in TRL; write the rows as messages.")
        self.inputs: list[dict] = []  # the rows last encoded: each pair's model_inputs (with a processor)
        self.implicit = self.format != "tokenized" and "prompt" not in first_row
        if self.format == "conversational" and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{name} is conversational, and the tokenizer has no chat template to render the "
                              "messages: use a chat model's tokenizer, or set tokenizer.chat_template before passing "
                              "it.")
        self._boundary = PromptBoundary(name)

    def encode(self, rows: list[dict], first_index: int) -> list[tuple[list, list, list]]:
        """[(prompt_ids, chosen_ids, rejected_ids)] of each row, in order, every id within the model's vocabulary."""
        out = self._encoded(rows, first_index)
        columns = ("prompt_ids", "chosen_ids", "rejected_ids") if self.format == "tokenized" else (None,) * 3
        check_encoded_within_vocabulary(out, range(first_index, first_index + len(out)), self.name, self.vocab_size,
                                        self.tokenizer, columns)
        return out

    def _encoded(self, rows: list[dict], first_index: int) -> list[tuple[list, list, list]]:
        if self.format == "tokenized":
            return [self._tokenized(row, first_index + i) for i, row in enumerate(rows)]
        pairs = [self._pair(row, first_index + i) for i, row in enumerate(rows)]
        if self.format == "standard":
            return self._standard(pairs)
        if self.vision is not None:
            self.inputs = []
            return [self._vision_conversation(p, c, r, row, first_index + i)
                    for i, ((p, c, r), row) in enumerate(zip(pairs, rows))]
        return [self._conversation(p, c, r, template_kwargs(row), first_index + i)
                for i, ((p, c, r), row) in enumerate(zip(pairs, rows))]

    # ------------------------------------------------------------------ rows

    def _pair(self, row: dict, index: int):
        for column in ("chosen", "rejected"):
            if column not in row:
                raise DataError(f"Row {index} of {self.name} has no {column!r}: every row needs chosen and rejected.")
        chosen, rejected = row["chosen"], row["rejected"]
        prompt = row.get("prompt")
        if self.implicit and chosen == rejected:
            # the same answer twice: encoded whole, to be dropped with the explicit-prompt ones (pair_rows)
            prompt = [] if self.format == "conversational" else ""
        elif self.implicit:
            prompt, chosen, rejected = extract_prompt(chosen, rejected)
        kind = list if self.format == "conversational" else str
        for column, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            if not isinstance(value, kind):
                raise DataError(f"Row {index} of {self.name} has {type(value).__name__} in {column!r} where the "
                                f"first row has {'messages' if kind is list else 'text'}: every row must be in the "
                                "same format.")
            if kind is list:
                # an empty chosen or rejected is named below, with why it may be empty
                check_messages(value, f"Row {index} of {self.name}", column, allow_empty=True)
        for column, value in (("chosen", chosen), ("rejected", rejected)):
            if len(value) == 0:
                where = (" once the prompt (their common start) is taken out, as one of chosen and rejected "
                         "extends the other" if self.implicit and row["chosen"] != row["rejected"] else "")
                raise DataError(f"Row {index} of {self.name} has an empty {column} completion{where}: a pair needs "
                                "two answers to compare; drop the row (dataset.filter) or fix it.")
        return prompt, chosen, rejected

    def _tokenized(self, row: dict, index: int):
        ids = tuple(list(row[c]) for c in ("prompt_ids", "chosen_ids", "rejected_ids"))
        for column, value in zip(("chosen_ids", "rejected_ids"), ids[1:]):
            if not value:
                raise DataError(f"Row {index} of {self.name} has an empty {column}: a pair needs two answers to "
                                "compare; drop the row (dataset.filter) or fix it.")
        return ids

    def _split(self, prompt_ids: list, chosen_full: list, rejected_full: list):
        n = self._boundary.length(prompt_ids, chosen_full, rejected_full)
        return prompt_ids[:n], chosen_full[n:], rejected_full[n:]

    def _standard(self, pairs):
        eos = self.tokenizer.eos_token
        prompts = [p for p, _, _ in pairs]
        chosen = [p + (c if c.endswith(eos) else c + eos) for p, c, _ in pairs]
        rejected = [p + (r if r.endswith(eos) else r + eos) for p, _, r in pairs]
        tok = self.tokenizer
        prompt_ids, chosen_ids, rejected_ids = (tok(texts)["input_ids"] for texts in (prompts, chosen, rejected))
        return [self._split(p, c, r) for p, c, r in zip(prompt_ids, chosen_ids, rejected_ids)]

    def _conversation(self, prompt, chosen, rejected, kwargs: dict, index: int):
        row = f"Row {index} of {self.name}"

        def ids(messages, **extra):
            return chat_ids(self.tokenizer, messages, kwargs, row, **extra)

        prompt_ids = ids(prompt, add_generation_prompt=True) if prompt else []
        return self._split(prompt_ids, ids(prompt + chosen), ids(prompt + rejected))

    def _vision_conversation(self, prompt, chosen, rejected, row: dict, index: int):
        """A pair through the processor: its images in the prompt, each sequence's image tokens expanded; the
        prompt's pixels kept as the pair's model_inputs."""
        where, images, kwargs = f"Row {index} of {self.name}", images_of(row), template_kwargs(row)
        prompt = with_images(prompt, images, where)

        def ids(messages, generation_prompt=False, keep=False):
            text = self.vision.render(messages, generation_prompt=generation_prompt, **kwargs)
            if not keep:
                return self.vision.encode(text, images, where)[0]
            out, inputs = self.vision.row_inputs(text, images, where, self.source, index)
            self.inputs.append(inputs)
            return out

        prompt_ids = ids(prompt, generation_prompt=True, keep=True)
        return self._split(prompt_ids, ids(prompt + with_images(chosen, [], where)),
                           ids(prompt + with_images(rejected, [], where)))


def pair_rows(encoded: list[tuple], first_index: int, max_length: int | None,
              truncation_mode: str, inputs=None) -> tuple[PairRows, DroppedPairs]:
    """(PairRows, the pairs dropped, by cause) of encoded pairs: each pair's two sequences truncated, then the pairs
    that cannot teach left out (the module's docstring). `inputs`: each pair's model_inputs and their token types
    ((list, TokenTypes) from a vision processor), or None. With keep_start, a kept pair's prompt fits max_length
    whole, its image tokens with it."""
    sequences, index, dropped, kept_inputs = [], [], DroppedPairs(), []
    for i, (prompt, chosen, rejected) in enumerate(encoded):
        if max_length is not None and truncation_mode == "keep_start" and len(prompt) >= max_length:
            dropped.prompt_fills += 1
            continue
        for completion in (chosen, rejected):
            ids = np.asarray(list(prompt) + list(completion), dtype=np.int64)
            labels = np.zeros(len(ids), dtype=bool)
            labels[len(prompt):] = True
            sequences.append((ids, labels))
            if inputs is not None:
                kept_inputs.append(inputs[0][i])
        index.append(first_index + i)
    untruncated = TokenRows.from_sequences(sequences, None if inputs is None else
                                           ModelInputs.from_rows(kept_inputs, inputs[1]))
    pairs = PairRows(truncate(untruncated, max_length, truncation_mode), np.asarray(index, dtype=np.int64))
    same_before = same_answers(untruncated)
    same_now = same_before if pairs.rows is untruncated else same_answers(pairs.rows)
    dropped.identical = int(same_before.sum())
    dropped.identical_truncated = int((same_now & ~same_before).sum())
    return (pairs.select(np.flatnonzero(~same_now)) if same_now.any() else pairs), dropped


class PairPreparation:
    """Turns a dataset's rows into PairRows with one config; the interface sequences/batches.py's batchers use.
    `announce`: this process says what is dropped (the main process; every process drops the same pairs)."""

    def __init__(self, encoder: PairEncoder, args, name: str, announce: bool = True):
        self.encoder = encoder
        self.args = args
        self.name = name
        self.announce = announce

    def sequences(self, rows: list[dict], first_index: int):
        encoded = self.encoder.encode(rows, first_index)
        vision = self.encoder.vision
        return encoded, first_index, None if vision is None else (self.encoder.inputs, vision.token_types)

    def pairs(self, sequences) -> tuple[PairRows, DroppedPairs]:
        """The block's pairs and those dropped, by cause."""
        encoded, first_index, inputs = sequences
        return pair_rows(encoded, first_index, self.args.max_length, self.args.truncation_mode, inputs)

    def rows(self, sequences) -> tuple[PairRows, int]:
        """A stream's block (sequences/batches.py): its pairs, and those dropped because the prompt fills max_length,
        which the batcher reports; the pairs with the same answer twice are reported here, one warning a block."""
        pairs, dropped = self.pairs(sequences)
        if dropped.same_answers and self.announce:
            first = sequences[1]
            logger.warning(same_answers_warning(self.name, dropped, f"at rows {first}-{first + len(sequences[0]) - 1}",
                                                self.args.max_length))
        return pairs, dropped.prompt_fills

    @staticmethod
    def concatenate(parts: list[PairRows]) -> PairRows:
        return PairRows.concatenate(parts)


def prepare_pairs(dataset, preparation: PairPreparation, block: int = BLOCK) -> PairRows:
    """Every row of a map-style dataset as token pairs; those dropped counted in one warning per cause (from the
    announcing process), or one sentence when none is left."""
    name, args = preparation.name, preparation.args
    if len(dataset) == 0:
        raise DataError(f"{name} is empty: it needs at least one pair.")
    parts, dropped = [], DroppedPairs()
    for start in range(0, len(dataset), block):
        rows = block_rows(dataset[start:start + block])
        part, lost = preparation.pairs(preparation.sequences(rows, start))
        parts.append(part)
        dropped = dropped + lost
    pairs = PairRows.concatenate(parts)
    if len(pairs) == 0:
        raise nothing_left(name, dropped, len(dataset), args.max_length)
    if preparation.announce:
        if dropped.prompt_fills:
            logger.warning("%s: %d of %d pairs were dropped because their prompt alone fills max_length=%s.", name,
                           dropped.prompt_fills, len(dataset), args.max_length)
        if dropped.same_answers:
            logger.warning(same_answers_warning(name, dropped, f"of {len(dataset)}", args.max_length))
        logger.info("%s: %d pairs, %d tokens, %d of them completion targets.", name, len(pairs),
                    len(pairs.rows.tokens), int(pairs.rows.target_counts.sum()))
    return pairs


def pairs_as_dataset(pairs: "PairRows"):
    """Prepared pairs as TRL shows them: a Dataset of prompt_ids, chosen_ids, rejected_ids (and ref_chosen_logps,
    ref_rejected_logps when precomputed)."""
    from datasets import Dataset

    rows = pairs.rows
    columns = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
    for p in range(len(pairs)):
        for column, r in (("chosen_ids", 2 * p), ("rejected_ids", 2 * p + 1)):
            span = rows.row(r)
            tokens, labels = rows.tokens[span].tolist(), rows.labels[span]
            first = int(np.argmax(labels)) if labels.any() else len(tokens)
            if column == "chosen_ids":
                columns["prompt_ids"].append(tokens[:first])
            columns[column].append(tokens[first:])
    if pairs.ref is not None:
        columns["ref_chosen_logps"] = pairs.ref[:, 0].tolist()
        columns["ref_rejected_logps"] = pairs.ref[:, 1].tolist()
    return Dataset.from_dict(columns)
