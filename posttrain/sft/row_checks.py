"""What SFT checks of a row beyond its format, where training would otherwise go on silently wrong or crash later:

    template_dropped_text   a chat template that leaves the last assistant message's text out of the rendered
                            conversation (it skips assistant turns, or renders only the last user message): the
                            template's fault, not the row's
    parts_as_python         a template that renders a list of content parts as Python text ("[{'type': 'text', ...")
    untrained_reason        why a sequence has nothing to train on, when its length is not the reason
    tokenized_rows          already tokenized rows (input_ids and their masks) as (ids, label mask), each checked

The first three return what they found (None when nothing); the encoder (formats.py) words the sentence with the
row's name.
"""

import numpy as np

from posttrain.data import DataError

# a reasoning template keeps only the answer after the thoughts of earlier turns
_THOUGHTS_END = "</think>"
# how Python writes a typed content part, which a template that expects string content renders as it is
_PYTHON_PART = "{'type': "


def message_texts(message: dict) -> list[str]:
    """The texts of a message that any faithful rendering contains: its string content, or its text parts, stripped
    (templates trim), each the answer after its last </think> (reasoning templates drop earlier turns' thoughts)."""
    content = message.get("content")
    pieces = [content] if isinstance(content, str) else [
        part.get("text") for part in content or [] if isinstance(part, dict) and isinstance(part.get("text"), str)]
    texts = [piece.rsplit(_THOUGHTS_END, 1)[-1].strip() for piece in pieces]
    return [text for text in texts if text]


def template_dropped_text(messages: list, rendered: str) -> int | None:
    """Index of the conversation's last assistant message if the rendered conversation lacks its text, or None. Only
    the last: a template may leave earlier turns out by design (the model sees them so at inference, and
    assistant_only_loss then finds the turns rewritten), but one that leaves out the final answer (it skips assistant
    messages, or renders only the last user message) trains on none of it."""
    last = next((j for j in range(len(messages) - 1, -1, -1) if messages[j].get("role") == "assistant"), None)
    if last is None or all(text in rendered for text in message_texts(messages[last])):
        return None
    return last


def parts_as_python(messages: list, rendered: str) -> int | None:
    """Index of the first message with a list of content parts, if the template rendered such a list as Python text
    (it expects strings), or None."""
    if _PYTHON_PART not in rendered:
        return None
    return next((j for j, m in enumerate(messages) if isinstance(m.get("content"), list)), None)


def untrained_reason(data_format: str, length: int, from_function: bool, text_column: str,
                     mask_columns: list[str], assistant_only: bool) -> tuple[str, str]:
    """(why a sequence of `length` tokens (the EOS included) of `data_format` data has no target before any
    truncation, the fix). A sequence's first token is never a target: nothing before it predicts it."""
    if data_format == "text" and length <= 1:
        if from_function:
            return ("formatting_func returned an empty string for it",
                    "make the function return the row's text, or filter such rows out first")
        return f"its {text_column!r} is empty", "fill it in, or filter empty rows out first"
    if data_format == "prompt-completion" and length <= 1:
        return "its prompt and completion are both empty", "fill them in, or filter such rows out first"
    if data_format == "tokenized":
        if length <= 1:
            return (f"its input_ids hold {length} token(s), and the first token of a sequence is never trained on",
                    "give every row at least 2 tokens")
        given = " and ".join(mask_columns) or "its masks"
        return f"its {given} leave no token after the first to train on", "mark the tokens to train on"
    if data_format == "conversational prompt-completion" and assistant_only:
        return ("its completion holds no assistant message, and assistant_only_loss=True trains on assistant turns "
                "only", "give every completion an assistant message, or set assistant_only_loss=False")
    return "none of its tokens after the first is trained on", "check what its label masks keep"


def tokenized_rows(rows: list[dict], first_index: int, name: str, completion_only: bool) -> list[tuple[list, list]]:
    """[(ids, label mask)] of already tokenized rows (input_ids, with labels, completion_mask (with completion-only
    loss) or assistant_masks saying what trains), each checked in one sentence naming the row of dataset `name`."""
    out = []
    for i, row in enumerate(rows):
        index = first_index + i
        ids = list(row["input_ids"])
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids):
            raise DataError(f"Row {index} of {name} has input_ids that are not all token ids (integers).")
        mask = [True] * len(ids)
        columns = ["labels"] + (["completion_mask"] if completion_only else []) + ["assistant_masks"]
        for column in columns:
            if row.get(column) is None:
                continue
            values = list(row[column])
            if len(values) != len(ids):
                raise DataError(f"Row {index} of {name} has {len(values)} {column} for {len(ids)} input_ids: "
                                "give one per token.")
            if column == "labels":
                if any(v != -100 and v != t for v, t in zip(values, ids)):
                    raise DataError(f"Row {index} of {name} has labels that differ from its input_ids: labels "
                                    "must be the input_ids, with -100 where a token is not trained on.")
                keep = [v != -100 for v in values]
            else:
                wrong = next(((p, v) for p, v in enumerate(values) if v not in (0, 1)), None)
                if wrong is not None:
                    raise DataError(f"Row {index} of {name} has {wrong[1]!r} at position {wrong[0]} of its "
                                    f"{column}: give 1 where a token is trained on and 0 elsewhere.")
                keep = [bool(v) for v in values]
            mask = [a and b for a, b in zip(mask, keep)]
        out.append((ids, mask))
    return out
