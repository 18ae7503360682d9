"""The text of a completion, as every reward reads it (rewards/builtin.py and rewards/math_answers.py): imports
nothing, so both can use it without importing each other."""


def completion_text(completion) -> str:
    """The text of a completion: the string itself, or the content of its last message."""
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"] if completion else ""
