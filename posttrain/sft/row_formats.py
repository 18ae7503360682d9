"""Which of TRL's SFT dataset formats a row is in (formats.py encodes it), from the columns that hold a value: a
dataset gives None (null) to a column a row lacks, so a row of a file that mixes formats has every format's columns,
most of them null, and a null is a missing value, never a format."""

from posttrain.configs import ConfigError
from posttrain.data import DataError, refuse_images
from posttrain.sequences.chat import is_messages

FORMATS = ("text", "prompt-completion", "conversational", "conversational prompt-completion", "tokenized")
ACCEPTED = ("a text column (dataset_text_field), prompt + completion, messages (or conversations), or input_ids; "
            "or pass a formatting_func")
# ShareGPT's role names, as chat templates know them
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "tool": "tool", "function_call": "assistant",
                  "observation": "tool"}
TEXT = "__formatted_text__"  # where a formatting function's string goes


def from_sharegpt(messages: list) -> list:
    """[{"from", "value"}] -> [{"role", "content"}], ShareGPT's human/gpt as user/assistant."""
    out = []
    for m in messages:
        if isinstance(m, dict) and "from" in m and "value" in m:
            rest = {k: v for k, v in m.items() if k not in ("from", "value")}
            out.append({"role": SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m["value"], **rest})
        else:
            out.append(m)
    return out


def has_value(row: dict, column: str) -> bool:
    """Whether the row has a value (not None, null) in `column`."""
    return row.get(column) is not None


def format_of(row: dict, text_field: str) -> str | None:
    """The format of a (formatted) row, from its columns that hold a value; None when it is in none."""
    if TEXT in row:
        return "text"
    if has_value(row, "input_ids"):
        return "tokenized"
    if has_value(row, "prompt") and has_value(row, "completion"):
        return "conversational prompt-completion" if is_messages(row["prompt"]) else "prompt-completion"
    if has_value(row, "messages") or has_value(row, "conversations"):
        return "conversational"
    if has_value(row, text_field):
        return "text"
    return None


def detect_format(row: dict, text_field: str, images: bool = False) -> str:
    """The format of a (formatted) row, or DataError naming its columns and the formats accepted; `images`: whether
    an image column is taken (a vision-language model's processor), else refused."""
    if not images:
        refuse_images(row, "The dataset")
    found_format = format_of(row, text_field)
    if found_format is not None:
        return found_format
    found = ", ".join(row) or "none"
    hint = (f" (the text column is dataset_text_field={text_field!r})" if text_field != "text" else "")
    if "prompt" in row and "completion" not in row:
        hint = " (a prompt alone is GRPO's format; SFT needs its completion too)"
    if "chosen" in row and "rejected" in row:
        hint = " (prompt/chosen/rejected is a preference dataset, for DPO)"
    raise DataError(f"The dataset is in no SFT format: its columns are {found}; SFT needs {ACCEPTED}{hint}.")


def format_columns(data_format: str, row: dict, text_field: str) -> list[str]:
    """The columns of `row` that `data_format` reads its sequence from."""
    columns = {"text": [TEXT, text_field], "tokenized": ["input_ids"], "conversational": ["messages", "conversations"],
               "prompt-completion": ["prompt", "completion"],
               "conversational prompt-completion": ["prompt", "completion"]}[data_format]
    return [c for c in columns if c in row]


def check_vision_options(data_format: str, args, name: str) -> None:
    """What a dataset with images cannot be (already tokenized) or train with (assistant_only_loss), in one sentence."""
    if data_format == "tokenized":
        raise DataError(f"{name} has images and is already tokenized (input_ids): posttrain cannot know where its "
                        "image tokens meet the images; give the rows as text, prompt-completion or messages.")
    if args.assistant_only_loss:
        raise ConfigError(f"assistant_only_loss=True with images in {name} is not in this release: set it to "
                          "False (every token of the conversation trains), or use prompt-completion rows "
                          "(completion-only loss).")
