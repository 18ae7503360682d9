"""Preference datasets -> the two token sequences a reward model scores, in TRL's formats and with TRL's preparation.

    explicit, standard           {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    implicit, standard           {"chosen": "The sky is blue.", "rejected": "The sky is green."}
    explicit, conversational     {"prompt": [messages], "chosen": [messages], "rejected": [messages]}
    implicit, conversational     {"chosen": [messages], "rejected": [messages]}
    tokenized                    {"chosen_ids": [...], "rejected_ids": [...]} (TRL's earlier chosen_input_ids /
                                 rejected_input_ids are read as these)
    any of them, optionally      "margin": a number per pair (the Bradley-Terry loss subtracts it)

As TRL's RewardTrainer: a standard chosen or rejected text gets the EOS appended unless it ends with it; the prompt
is prepended to each (text, or messages), and the whole is tokenized at once (conversational: the chat template,
with the row's `tools` and `chat_template_kwargs`); tokenized rows are used as they are. A pair whose chosen or
rejected sequence is longer than max_length is dropped, not truncated (TRL filters them); posttrain says how many.

The pairs are PairRows (sequences/pairs.py): rows 2i and 2i + 1 are pair i's chosen and rejected sequences, every
token labelled (the labels are not used: a reward model has no token targets), `margin` the margin column.
"""

import logging

import numpy as np

from posttrain.configs import ConfigError
from posttrain.data import DataError, check_encoded_within_vocabulary
from posttrain.sequences.chat import chat_ids, check_messages, template_kwargs
from posttrain.sequences.batches import BLOCK, block_rows
from posttrain.sequences.preference import preference_format
from posttrain.sequences.pairs import DroppedPairs, PairRows, nothing_left, same_answers, same_answers_warning
from posttrain.sequences.rows import TokenRows

logger = logging.getLogger("posttrain")

ACCEPTED = ("chosen + rejected (text or messages, with or without a prompt column), or chosen_ids + rejected_ids")
LEGACY = {"chosen_ids": "chosen_input_ids", "rejected_ids": "rejected_input_ids"}  # TRL's earlier names


def detect_format(row: dict, name: str) -> str:
    """standard, conversational or tokenized (chosen_ids and rejected_ids, or TRL's earlier names); a DataError
    naming the columns found and the formats accepted."""
    return preference_format(row, name, tokenized=(tuple(LEGACY), tuple(LEGACY.values())), needs="a reward model",
                             accepted=ACCEPTED)


class RewardEncoder:
    """Tokenizes a dataset's pairs in its format (TRL's RewardTrainer preparation).

    Args:
        tokenizer: the model's tokenizer (EOS and padding already set by the trainer).
        first_row: the dataset's first row, which decides the format (as in TRL).
        name: the dataset's name in messages.
        vocab_size: the model's vocabulary_rows: every token id must lie below it (None: unchecked).
    """

    def __init__(self, tokenizer, first_row: dict, name: str = "train_dataset", vocab_size: int | None = None):
        self.tokenizer, self.name, self.vocab_size = tokenizer, name, vocab_size
        self.format = detect_format(first_row, name)
        self.has_margin = "margin" in first_row
        if self.format == "conversational" and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{name} is conversational, and the tokenizer has no chat template to render the "
                              "messages: use a chat model's tokenizer, or set chat_template_path.")

    def encode(self, rows: list[dict], first_index: int) -> list[tuple[list, list]]:
        """[(chosen_ids, rejected_ids)] of each row, in order, every id within the model's vocabulary."""
        out = self._encoded(rows, first_index)
        columns = ("chosen_ids", "rejected_ids") if self.format == "tokenized" else (None, None)
        check_encoded_within_vocabulary(out, range(first_index, first_index + len(out)), self.name, self.vocab_size,
                                        self.tokenizer, columns)
        return out

    def _encoded(self, rows: list[dict], first_index: int) -> list[tuple[list, list]]:
        if self.format == "tokenized":
            return [self._tokenized(row, first_index + i) for i, row in enumerate(rows)]
        texts = [self._texts(row, first_index + i) for i, row in enumerate(rows)]
        if self.format == "standard":
            eos = self.tokenizer.eos_token
            chosen = [p + (c if c.endswith(eos) else c + eos) for p, c, _ in texts]
            rejected = [p + (r if r.endswith(eos) else r + eos) for p, _, r in texts]
            return list(zip(self.tokenizer(chosen)["input_ids"], self.tokenizer(rejected)["input_ids"]))
        return [self._conversation(p + c, p + r, template_kwargs(row), first_index + i)
                for i, ((p, c, r), row) in enumerate(zip(texts, rows))]

    def margins(self, rows: list[dict], first_index: int) -> np.ndarray | None:
        """[n] each row's margin (float64), when the dataset has the column."""
        if not self.has_margin:
            return None
        out = np.zeros(len(rows), dtype=np.float64)
        for i, row in enumerate(rows):
            value = row.get("margin")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
                raise DataError(f"Row {first_index + i} of {self.name} has margin {value!r}: every row's margin must "
                                "be a finite number (the first row has one).")
            out[i] = value
        return out

    def _texts(self, row: dict, index: int):
        for column in ("chosen", "rejected"):
            if column not in row:
                raise DataError(f"Row {index} of {self.name} has no {column!r}: every row needs chosen and rejected.")
        kind = list if self.format == "conversational" else str
        prompt = row.get("prompt", [] if kind is list else "")
        if prompt is None:
            prompt = [] if kind is list else ""
        for column, value in (("prompt", prompt), ("chosen", row["chosen"]), ("rejected", row["rejected"])):
            if not isinstance(value, (str, list)):
                raise DataError(f"Row {index} of {self.name} has {type(value).__name__} in {column!r}: a prompt, "
                                "chosen or rejected is text or a list of messages (token ids go in chosen_ids and "
                                "rejected_ids).")
            if not isinstance(value, kind):
                raise DataError(f"Row {index} of {self.name} has {type(value).__name__} in {column!r} where the "
                                f"first row has {'messages' if kind is list else 'text'}: every row must be in the "
                                "same format.")
            if kind is list:  # an empty answer is one to score (standard text gets the EOS), as in TRL
                check_messages(value, f"Row {index} of {self.name}", column, allow_empty=True)
        return prompt, row["chosen"], row["rejected"]

    def _tokenized(self, row: dict, index: int):
        ids = []
        for column in ("chosen_ids", "rejected_ids"):
            value = row.get(column, row.get(LEGACY[column]))
            if not value:
                raise DataError(f"Row {index} of {self.name} has an empty {column}: a pair needs two answers to "
                                "compare; drop the row (dataset.filter) or fix it.")
            ids.append(list(value))
        return tuple(ids)

    def _conversation(self, chosen, rejected, kwargs: dict, index: int):
        row = f"Row {index} of {self.name}"
        return chat_ids(self.tokenizer, chosen, kwargs, row), chat_ids(self.tokenizer, rejected, kwargs, row)


def reward_pairs(encoded: list[tuple], margins: np.ndarray | None, first_index: int,
                 max_length: int | None) -> tuple[PairRows, DroppedPairs]:
    """(the pairs within max_length whose chosen and rejected differ, the pairs dropped: longer than max_length, or
    scoring the same sequence twice: sequences/pairs.py)."""
    sequences, index, kept = [], [], []
    for i, pair in enumerate(encoded):
        if max_length is not None and max(len(pair[0]), len(pair[1])) > max_length:
            continue
        for ids in pair:
            sequences.append((np.asarray(ids, dtype=np.int64), np.ones(len(ids), dtype=bool)))
        index.append(first_index + i)
        kept.append(i)
    margin = None if margins is None else margins[np.asarray(kept, dtype=np.int64)]
    pairs = PairRows(TokenRows.from_sequences(sequences), np.asarray(index, dtype=np.int64), margin=margin)
    same = same_answers(pairs.rows)  # every token is scored: the whole sequences compared
    dropped = DroppedPairs(identical=int(same.sum()), too_long=len(encoded) - len(index))
    return (pairs.select(np.flatnonzero(~same)) if same.any() else pairs), dropped


class RewardPreparation:
    """Turns a dataset's rows into PairRows with one config; the interface sequences/batches.py's batchers use.
    `announce`: this process says what is dropped (the main process; every process drops the same pairs)."""

    def __init__(self, encoder: RewardEncoder, args, name: str, announce: bool = True):
        self.encoder, self.args, self.name, self.announce = encoder, args, name, announce

    def sequences(self, rows: list[dict], first_index: int):
        return self.encoder.encode(rows, first_index), self.encoder.margins(rows, first_index), first_index

    def rows(self, sequences) -> tuple[PairRows, int]:
        """A block's pairs, and how many were dropped for their length (the stream batcher reports them); those with
        the same sequence twice are reported here, one warning a block."""
        encoded, margins, first_index = sequences
        pairs, dropped = reward_pairs(encoded, margins, first_index, self.args.max_length)
        if dropped.same_answers and self.announce:
            where = f"at rows {first_index}-{first_index + len(encoded) - 1}"
            logger.warning(same_answers_warning(self.name, dropped, where, self.args.max_length, "score"))
        return pairs, dropped.too_long

    @staticmethod
    def concatenate(parts: list[PairRows]) -> PairRows:
        return PairRows.concatenate(parts)


def prepare_reward_pairs(dataset, preparation: RewardPreparation, block: int = BLOCK) -> PairRows:
    """Every row of a map-style dataset as token pairs; those dropped for their length counted in one warning (from
    the announcing process), or one sentence when none is left."""
    name, max_length = preparation.name, preparation.args.max_length
    if len(dataset) == 0:
        raise DataError(f"{name} is empty: it needs at least one pair.")
    parts, dropped = [], DroppedPairs()
    for start in range(0, len(dataset), block):
        rows = block_rows(dataset[start:start + block])
        encoded, margins, first = preparation.sequences(rows, start)
        part, lost = reward_pairs(encoded, margins, first, max_length)
        parts.append(part)
        dropped = dropped + lost
    pairs = PairRows.concatenate(parts)
    if len(pairs) == 0:
        raise nothing_left(name, dropped, len(dataset), max_length)
    if preparation.announce:
        if dropped.same_answers:
            logger.warning(same_answers_warning(name, dropped, f"of {len(dataset)}", max_length, "score"))
        if dropped.too_long:
            logger.warning("%s: %d of %d pairs were dropped because their chosen or rejected sequence is longer than "
                           "max_length=%s (as TRL filters them); raise max_length to keep them.", name,
                           dropped.too_long, len(dataset), max_length)
        logger.info("%s: %d pairs, %d tokens.", name, len(pairs), len(pairs.rows.tokens))
    return pairs


def pairs_as_dataset(pairs: PairRows):
    """Prepared pairs as TRL shows its prepared dataset: chosen_ids, rejected_ids (and margin)."""
    from datasets import Dataset

    rows = pairs.rows
    columns = {"chosen_ids": [rows.tokens[rows.row(2 * p)].tolist() for p in range(len(pairs))],
               "rejected_ids": [rows.tokens[rows.row(2 * p + 1)].tolist() for p in range(len(pairs))]}
    if pairs.margin is not None:
        columns["margin"] = pairs.margin.tolist()
    return Dataset.from_dict(columns)
