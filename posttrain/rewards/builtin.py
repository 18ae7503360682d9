"""Built-in reward functions, in TRL's calling convention.

Each takes `completions` (strings, or lists of messages for conversational data) and the dataset
columns it needs as keyword arguments, and returns one float (or None: not applicable) per completion.
"""

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_THINK = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def completion_text(completion) -> str:
    """The text of a completion: the string itself, or the content of its last message."""
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"] if completion else ""


def normalize_answer(text: str) -> str:
    """Canonical form of an answer: numbers as their value ("1,000.0" -> "1000"), other text trimmed, lowercased."""
    text = text.strip().strip("$").strip().rstrip(".")
    number = text.replace(",", "")
    try:
        value = float(number)
    except ValueError:
        return " ".join(text.lower().split())
    return str(int(value)) if value.is_integer() else repr(value)


def extract_answer(text: str) -> str | None:
    """The answer a completion gives: the last `\\boxed{...}` if any, else the last number in the text."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1]
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def accuracy(completions, solution=None, answer=None, **kwargs) -> list[float | None]:
    """1.0 when the completion's answer equals the reference, else 0.0; None when there is no reference.

    The reference comes from the `solution` column (TRL's name) or the `answer` column. The completion's
    answer is its last `\\boxed{}` content or else its last number; numbers compare by value.
    """
    references = solution if solution is not None else answer
    if references is None:
        raise ValueError("The accuracy reward needs a `solution` or `answer` column in the dataset.")
    rewards = []
    for completion, reference in zip(completions, references):
        if reference is None or str(reference).strip() == "":
            rewards.append(None)
            continue
        given = extract_answer(completion_text(completion))
        ok = given is not None and normalize_answer(given) == normalize_answer(str(reference))
        rewards.append(1.0 if ok else 0.0)
    return rewards


def think_format(completions, **kwargs) -> list[float]:
    """1.0 when the completion opens with one `<think>...</think>` block (and no second `<think>`), else 0.0."""
    return [1.0 if _THINK.match(completion_text(c)) else 0.0 for c in completions]


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int):
    """DAPO's soft overlong punishment for completion length L (tokens):

    0 when L <= max - cache; (max - cache - L) / cache in (max - cache, max]; -1 beyond max.
    """
    if not 0 < soft_punish_cache <= max_completion_len:
        raise ValueError(f"soft_punish_cache={soft_punish_cache} must be in (0, max_completion_len="
                         f"{max_completion_len}].")
    free = max_completion_len - soft_punish_cache

    def soft_overlong_punishment(completion_ids, **kwargs) -> list[float]:
        rewards = []
        for ids in completion_ids:
            n = len(ids)
            rewards.append(0.0 if n <= free else (free - n) / soft_punish_cache if n <= max_completion_len else -1.0)
        return rewards

    return soft_overlong_punishment


def get_length_reward(max_completion_len: int):
    """-(tokens / max_completion_len): a reward in [-1, 0] that favours shorter completions."""

    def length(completion_ids, **kwargs) -> list[float]:
        return [-len(ids) / max_completion_len for ids in completion_ids]

    return length


def by_name(name: str, config):
    """A built-in reward selected by name on the command line; factories are sized from `config`."""
    makers = {
        "accuracy": lambda: accuracy,
        "think_format": lambda: think_format,
        "soft_overlong": lambda: get_soft_overlong_punishment(
            config.max_completion_length, max(1, config.max_completion_length // 4)),
        "length": lambda: get_length_reward(config.max_completion_length),
    }
    return makers[name]() if name in makers else None


BUILTIN_NAMES = ("accuracy", "think_format", "soft_overlong", "length")
