"""What chat data of every trainer shares: message checks, a row's chat template keyword arguments, and where two
token lists part."""

from posttrain.data import VALID_ROLES, DataError


def check_messages(messages, row: str, column: str, allow_empty: bool = False) -> None:
    """Stop, in one sentence naming `row` (e.g. "Row 3 of the train dataset") and `column`, on messages that are not a
    list (or, unless `allow_empty`, an empty one) of {'role', 'content'} dicts with a known role."""
    if not isinstance(messages, list) or not (messages or allow_empty):
        raise DataError(f"{row} has {type(messages).__name__} in {column!r}: it must be a "
                        "non-empty list of {'role', 'content'} messages.")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise DataError(f"{row} has a message without 'role' and 'content' in {column!r} "
                            f"({m!r}): write each message as {{'role': ..., 'content': ...}}.")
        if m["role"] not in VALID_ROLES:
            raise DataError(f"{row} has a message with role {m['role']!r}: use one of "
                            f"{', '.join(sorted(VALID_ROLES))}.")


def common_prefix_length(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


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
