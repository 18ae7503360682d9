"""Which preference format a dataset is in, from its first row: what DPO, the reward model and the next pair trainer
share (their encoders: sequences/pair_data.py, reward/data.py).

    standard          chosen + rejected texts (a prompt column or none)
    conversational    chosen + rejected messages (a prompt column of messages or none)
    tokenized         the trainer's id columns (DPO: prompt_ids, chosen_ids, rejected_ids)
"""

from posttrain.data import DataError, refuse_images
from posttrain.sequences.chat import is_messages


def preference_format(row: dict, name: str, *, tokenized: tuple[tuple[str, ...], ...], needs: str,
                      accepted: str, images: bool = False) -> str:
    """standard, conversational or tokenized (`row` has every column of one of the `tokenized` tuples); else a
    DataError naming the columns found, what `needs` (the trainer, as the message says it) takes, and what the row
    looks like instead. `images`: an image column is taken (a vision-language processor), else refused."""
    if not images:
        refuse_images(row, name)
    if any(all(k in row for k in columns) for columns in tokenized):
        return "tokenized"
    if "chosen" in row and "rejected" in row:
        return "conversational" if is_messages(row["chosen"]) or is_messages(row.get("prompt")) else "standard"
    found = ", ".join(row) or "none"
    hint = ""
    if "label" in row and "completion" in row:
        hint = f" (an unpaired dataset with labels is KTO's format, not {needs}'s)"
    elif "prompt" in row and "completion" in row:
        hint = " (prompt/completion is an SFT dataset; a preference dataset pairs a chosen and a rejected answer)"
    elif "chosen" in row or "rejected" in row:
        hint = f" (it has no {'rejected' if 'chosen' in row else 'chosen'!r} column)"
    raise DataError(f"{name} is in no preference format: its columns are {found}; {needs} needs {accepted}{hint}.")
