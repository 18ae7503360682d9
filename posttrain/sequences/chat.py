"""What chat data of every trainer shares: a row's chat template keyword arguments, and where two token lists part."""


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
