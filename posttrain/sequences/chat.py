"""What chat data of every trainer shares: message checks, a row's chat template keyword arguments, where two
token lists part, and TRL's training versions of chat templates."""

from posttrain.data import VALID_ROLES, DataError


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
