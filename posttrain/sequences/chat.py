"""What chat data of every trainer shares: message checks, a row's chat template keyword arguments, its messages
rendered to token ids, where two token lists part, and TRL's training versions of chat templates."""

import logging

from posttrain.data import VALID_ROLES, DataError

logger = logging.getLogger("posttrain")


def is_messages(value) -> bool:
    """Whether a column's value is a conversation: a non-empty list of message dicts."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict)


def chat_ids(tokenizer, messages: list, kwargs: dict, row: str, **extra) -> list:
    """The token ids of `messages` through the tokenizer's chat template, with the row's template keyword arguments
    (template_kwargs) and `extra` (add_generation_prompt, ...); a template's own error as one sentence naming `row`
    (e.g. "Row 3 of train_dataset")."""
    try:
        return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs,
                                                  **extra)["input_ids"])
    except Exception as err:  # a template's own error: say which row
        raise DataError(f"{row} could not be rendered by the chat template ({err}); fix the row's messages, or use a "
                        "template that accepts them.") from err


def check_messages(messages, row: str, column: str, allow_empty: bool = False) -> None:
    """Stop, in one sentence naming `row` (e.g. "Row 3 of the train dataset") and `column`, on messages that are not a
    list (or, unless `allow_empty`, an empty one) of {'role', 'content'} dicts with a known role and a content
    (check_content)."""
    if not isinstance(messages, list) or not (messages or allow_empty):
        raise DataError(f"{row} has {type(messages).__name__} in {column!r}: it must be a "
                        "non-empty list of {'role', 'content'} messages.")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise DataError(f"{row} has a message without 'role' and 'content' in {column!r} "
                            f"({m!r}): write each message as {{'role': ..., 'content': ...}}.")
        if not isinstance(m["role"], str) or m["role"] not in VALID_ROLES:
            raise DataError(f"{row} has a message with role {m['role']!r}: use one of "
                            f"{', '.join(sorted(VALID_ROLES))}.")
        check_content(m, f"{row} has", f"message {j} ({m['role']}) of {column!r}")


def check_content(message: dict, subject: str, where: str) -> None:
    """Stop on a message content a chat template would render wrongly: None or missing (rendered as the text 'None',
    as nothing, or a template error), except in an assistant message that carries tool_calls (OpenAI's and TRL's
    format for a tool call without text); anything but a string or a list of typed parts ({'type': 'text', ...})."""
    content = message.get("content")
    if content is None:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            return
        state = "content None" if "content" in message else "no 'content'"
        raise DataError(f"{subject} {state} in {where}, which a chat template renders as the text 'None', as nothing "
                        "or as an error: give the message its text (only an assistant message with tool_calls may "
                        "leave it out).")
    if isinstance(content, str) or (isinstance(content, list) and all(
            isinstance(part, dict) and isinstance(part.get("type"), str) for part in content)):
        return
    raise DataError(f"{subject} content of type {type(content).__name__} in {where}: write it as a string (or a list "
                    "of typed parts, {'type': 'text', 'text': ...}).")


class PromptBoundary:
    """Where each row's completion starts in its tokens (DPO's and KTO's tokenization, TRL's rule): after the longest
    start of the tokenized prompt that the tokenized prompt + completion (every one of them) shares. Said once per
    dataset, as a warning, when a prompt is not a whole prefix."""

    def __init__(self, name: str):
        self.name, self._warned = name, False

    def length(self, prompt_ids: list, *full_ids: list) -> int:
        n = min(common_prefix_length(prompt_ids, ids) for ids in full_ids)
        if n < len(prompt_ids) and not self._warned:
            self._warned = True
            logger.warning(
                "%s: the tokenized prompt is not a prefix of the tokenized prompt + completion (the chat template "
                "renders the prompt alone differently, or tokens merge across the boundary); the completion starts "
                "where they differ, as in TRL. Shown once.", self.name)
        return n


def common_prefix_length(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def extract_prompt(chosen, rejected):
    """(prompt, chosen, rejected) from an implicit-prompt pair: their longest common prefix of whole messages, or of
    characters (ending before a space, so the completions keep their leading space, as in TRL)."""
    n = common_prefix_length(chosen, rejected)
    if isinstance(chosen, str) and 0 < n < min(len(chosen), len(rejected)) and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


def template_kwargs(row: dict) -> dict:
    """The chat template's keyword arguments of a row: its `chat_template_kwargs` and `tools` (a JSON string or a
    list) columns."""
    import json

    tools = row.get("tools")
    if isinstance(tools, str):
        tools = json.loads(tools)
    kwargs = dict(row.get("chat_template_kwargs") or {})
    if tools is not None:
        kwargs["tools"] = tools
    return kwargs


def trl_training_template(tokenizer) -> str | None:
    """TRL's bundled training version of the tokenizer's chat template (with {% generation %} markers, rendering
    earlier turns unchanged: prefix-preserving), when TRL is installed and ships one for it; else None."""
    try:
        from trl.chat_template_utils import get_training_chat_template
    except ImportError:
        return None
    try:
        return get_training_chat_template(tokenizer)
    except ValueError:  # a template TRL has no training version of
        return None
