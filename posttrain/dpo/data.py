"""Preference datasets -> token pairs, in TRL's formats.

    explicit, standard           {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    explicit, conversational     {"prompt": [messages], "chosen": [messages], "rejected": [messages]}
    implicit (no prompt column)  {"chosen": ..., "rejected": ...}: the prompt is their longest common prefix
                                 (of characters, or of whole messages)
    tokenized                    {"prompt_ids": [...], "chosen_ids": [...], "rejected_ids": [...]}

Tokenization is TRL's: prompt_ids = ids(prompt) (conversational: with the generation prompt), chosen_ids =
ids(prompt + chosen)[L:], rejected_ids likewise, where L is where the tokenized prompt stops being a prefix of both
(so a merge across the boundary never misplaces it). Standard chosen and rejected texts get the EOS appended when they
do not end with it. Per-row `tools` and `chat_template_kwargs` columns reach the chat template.

A pair becomes two sequences, prompt + chosen and prompt + rejected, each labelled on its completion and truncated on
its own to max_length (truncation_mode). With keep_start, a pair whose prompt alone fills max_length has no completion
token left and is dropped (counted in the log).

    PairRows    TokenRows (sequences/rows.py) holding 2 rows per pair, chosen at 2i and rejected at 2i + 1, plus each
                pair's dataset index and, once computed, its reference log-probs [P, 2].
"""

import hashlib
import logging
from dataclasses import dataclass

import numpy as np

from posttrain.configs import ConfigError
from posttrain.data import DataError
from posttrain.sequences.chat import check_messages, common_prefix_length, template_kwargs
from posttrain.sequences.rows import TokenRows, truncate

logger = logging.getLogger("posttrain")

FORMATS = ("standard", "conversational", "tokenized")
ACCEPTED = ("prompt + chosen + rejected (text or messages), chosen + rejected with the prompt as their common "
            "start, or prompt_ids + chosen_ids + rejected_ids")


def _is_messages(value) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict)


def detect_format(row: dict, name: str) -> str:
    """standard, conversational or tokenized; a DataError naming the columns found and the formats accepted."""
    if all(k in row for k in ("prompt_ids", "chosen_ids", "rejected_ids")):
        return "tokenized"
    if "chosen" in row and "rejected" in row:
        return "conversational" if _is_messages(row["chosen"]) or _is_messages(row.get("prompt")) else "standard"
    found = ", ".join(row) or "none"
    hint = ""
    if "label" in row and "completion" in row:
        hint = " (an unpaired dataset with labels is KTO's format, not DPO's)"
    elif "prompt" in row and "completion" in row:
        hint = " (prompt/completion is an SFT dataset; a preference dataset pairs a chosen and a rejected answer)"
    elif "chosen" in row or "rejected" in row:
        missing = "rejected" if "chosen" in row else "chosen"
        hint = f" (it has no {missing!r} column)"
    raise DataError(f"{name} is in no preference format: its columns are {found}; DPO needs {ACCEPTED}{hint}.")


def extract_prompt(chosen, rejected):
    """(prompt, chosen, rejected) from an implicit-prompt pair: their longest common prefix of whole messages, or of
    characters (ending before a space, so the completions keep their leading space, as in TRL)."""
    n = common_prefix_length(chosen, rejected)
    if isinstance(chosen, str) and 0 < n < min(len(chosen), len(rejected)) and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


@dataclass
class PairRows:
    """Token pairs: `rows` has 2 rows per pair (chosen 2i, rejected 2i + 1); `index` [P] the dataset row of each
    pair; `ref` [P, 2] float64 reference log-probs (chosen, rejected) once precomputed, else None."""

    rows: TokenRows
    index: np.ndarray
    ref: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.index)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of each pair (chosen + rejected sequence)."""
        return self.rows.lengths.reshape(-1, 2).sum(1)

    def select(self, pairs) -> "PairRows":
        pairs = np.asarray(pairs, dtype=np.int64)
        rows = np.stack([2 * pairs, 2 * pairs + 1], 1).reshape(-1)
        return PairRows(self.rows.select(rows), self.index[pairs], None if self.ref is None else self.ref[pairs])

    @classmethod
    def concatenate(cls, parts: list["PairRows"]) -> "PairRows":
        if not parts:
            return cls(TokenRows.from_sequences([]), np.zeros(0, np.int64))
        refs = [p.ref for p in parts]
        ref = None if any(r is None for r in refs) else np.concatenate(refs)
        return cls(TokenRows.concatenate([p.rows for p in parts]), np.concatenate([p.index for p in parts]), ref)

    def fingerprint(self) -> str:
        h = hashlib.sha256(self.rows.fingerprint().encode())
        h.update(np.ascontiguousarray(self.index).tobytes())
        return h.hexdigest()[:16]


class PairEncoder:
    """Tokenizes the pairs of one dataset in its format (TRL's preparation).

    Args:
        tokenizer: the policy's tokenizer (EOS and padding already set by the trainer).
        first_row: the dataset's first row, which decides the format (as in TRL).
        name: the dataset's name in messages.
    """

    def __init__(self, tokenizer, first_row: dict, name: str = "train_dataset"):
        self.tokenizer = tokenizer
        self.name = name
        self.format = detect_format(first_row, name)
        self.implicit = self.format != "tokenized" and "prompt" not in first_row
        if self.format == "conversational" and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{name} is conversational, and the tokenizer has no chat template to render the "
                              "messages: use a chat model's tokenizer, or set tokenizer.chat_template before passing "
                              "it.")
        self._warned_prefix = False

    def encode(self, rows: list[dict], first_index: int) -> list[tuple[list, list, list]]:
        """[(prompt_ids, chosen_ids, rejected_ids)] of each row, in order."""
        if self.format == "tokenized":
            return [self._tokenized(row, first_index + i) for i, row in enumerate(rows)]
        pairs = [self._pair(row, first_index + i) for i, row in enumerate(rows)]
        if self.format == "standard":
            return self._standard(pairs)
        return [self._conversation(p, c, r, template_kwargs(row), first_index + i)
                for i, ((p, c, r), row) in enumerate(zip(pairs, rows))]

    # ------------------------------------------------------------------ rows

    def _pair(self, row: dict, index: int):
        for column in ("chosen", "rejected"):
            if column not in row:
                raise DataError(f"Row {index} of {self.name} has no {column!r}: every row needs chosen and rejected.")
        chosen, rejected = row["chosen"], row["rejected"]
        prompt = row.get("prompt")
        if self.implicit:
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
                where = (" once the prompt (their common start) is taken out: chosen and rejected are identical "
                         "or one extends the other" if self.implicit else "")
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
        n = min(common_prefix_length(prompt_ids, chosen_full), common_prefix_length(prompt_ids, rejected_full))
        if n < len(prompt_ids) and not self._warned_prefix:
            self._warned_prefix = True
            logger.warning("%s: the tokenized prompt is not a prefix of the tokenized prompt + completion (the chat "
                           "template renders the prompt alone differently, or tokens merge across the boundary); the "
                           "completion starts where they differ, as in TRL. Shown once.", self.name)
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
        tok = self.tokenizer

        def ids(messages, **extra):
            out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs, **extra)
            return list(out["input_ids"])

        try:
            prompt_ids = ids(prompt, add_generation_prompt=True) if prompt else []
            return self._split(prompt_ids, ids(prompt + chosen), ids(prompt + rejected))
        except Exception as err:  # a template's own error: say which row
            raise DataError(f"Row {index} of {self.name} could not be rendered by the chat template ({err}); fix the "
                            "row's messages, or use a template that accepts them.") from err


def pair_rows(encoded: list[tuple], first_index: int, max_length: int | None, truncation_mode: str):
    """(PairRows, pairs dropped because their prompt alone fills max_length) of encoded pairs."""
    sequences, index, dropped = [], [], 0
    for i, (prompt, chosen, rejected) in enumerate(encoded):
        if max_length is not None and truncation_mode == "keep_start" and len(prompt) >= max_length:
            dropped += 1
            continue
        for completion in (chosen, rejected):
            ids = np.asarray(list(prompt) + list(completion), dtype=np.int64)
            labels = np.zeros(len(ids), dtype=bool)
            labels[len(prompt):] = True
            sequences.append((ids, labels))
        index.append(first_index + i)
    rows = truncate(TokenRows.from_sequences(sequences), max_length, truncation_mode)
    return PairRows(rows, np.asarray(index, dtype=np.int64)), dropped


class PairPreparation:
    """Turns a dataset's rows into PairRows with one config; the interface sequences/batches.py's batchers use."""

    def __init__(self, encoder: PairEncoder, args, name: str):
        self.encoder = encoder
        self.args = args
        self.name = name

    def sequences(self, rows: list[dict], first_index: int):
        return self.encoder.encode(rows, first_index), first_index

    def rows(self, sequences) -> tuple[PairRows, int]:
        encoded, first_index = sequences
        return pair_rows(encoded, first_index, self.args.max_length, self.args.truncation_mode)

    @staticmethod
    def concatenate(parts: list[PairRows]) -> PairRows:
        return PairRows.concatenate(parts)


def prepare_pairs(dataset, preparation: PairPreparation, block: int = 1000) -> PairRows:
    """Every row of a map-style dataset as token pairs, with the dropped ones counted in the log."""
    name, args = preparation.name, preparation.args
    if len(dataset) == 0:
        raise DataError(f"{name} is empty: it needs at least one pair.")
    parts, dropped = [], 0
    for start in range(0, len(dataset), block):
        columns = dataset[start:start + block]
        names = list(columns)
        rows = [dict(zip(names, values)) for values in zip(*(columns[n] for n in names))]
        part, lost = preparation.rows(preparation.sequences(rows, start))
        parts.append(part)
        dropped += lost
    pairs = PairRows.concatenate(parts)
    if len(pairs) == 0:
        raise DataError(f"{name} has no pair left: every prompt alone fills max_length={args.max_length}, leaving no "
                        "completion token; raise max_length or shorten the prompts.")
    if dropped:
        logger.warning("%s: %d of %d pairs were dropped because their prompt alone fills max_length=%s.", name,
                       dropped, len(dataset), args.max_length)
    logger.info("%s: %d pairs, %d tokens, %d of them completion targets.", name, len(pairs), len(pairs.rows.tokens),
                int(pairs.rows.target_counts.sum()))
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
