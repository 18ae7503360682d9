"""Built-in reward functions, in TRL's calling convention.

Each takes `completions` (strings, or lists of messages for conversational data) and the dataset
columns it needs as keyword arguments, and returns one float (or None: not applicable) per completion.
"""

import re

from posttrain.rewards.text import completion_text

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_THINK = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


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


def think_format_reward(completions, **kwargs) -> list[float]:
    """1.0 when the completion opens with one `<think>...</think>` block (and no second `<think>`), else 0.0.
    TRL's `think_format_reward` (strings are accepted too)."""
    return [1.0 if _THINK.match(completion_text(c)) else 0.0 for c in completions]


think_format = think_format_reward  # posttrain's shorter name


class SoftOverlongPunishment:
    """DAPO's soft overlong punishment for a completion of L tokens (TRL's `get_soft_overlong_punishment`):

    0 when L <= max - cache; (max - cache - L) / cache in (max - cache, max]; -1 beyond max.
    """

    __name__ = "soft_overlong_punishment_reward"  # the metric name, as TRL's

    def __init__(self, max_completion_len: int, soft_punish_cache: int):
        if not 0 <= soft_punish_cache <= max_completion_len:
            raise ValueError(f"soft_punish_cache={soft_punish_cache} must be in [0, max_completion_len="
                             f"{max_completion_len}].")
        self.max_len, self.cache = max_completion_len, soft_punish_cache

    def __call__(self, completion_ids, **kwargs) -> list[float]:
        free = self.max_len - self.cache
        return [0.0 if len(ids) <= free else (free - len(ids)) / self.cache if len(ids) <= self.max_len else -1.0
                for ids in completion_ids]


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> SoftOverlongPunishment:
    """TRL's factory of DAPO's soft overlong punishment (see SoftOverlongPunishment)."""
    return SoftOverlongPunishment(max_completion_len, soft_punish_cache)


class RepetitionPenalty:
    """Penalty for repeated n-grams of token ids ("Demystifying Long CoT", appendix C.2; TRL's
    `get_repetition_penalty_reward`): max_penalty * (1 - distinct n-grams / n-grams), 0 for fewer than n tokens."""

    __name__ = "repetition_penalty_reward"  # the metric name, as TRL's

    def __init__(self, ngram_size: int = 3, max_penalty: float = -1.0):
        if max_penalty > 0:
            raise ValueError(f"max_penalty {max_penalty} should not be positive: it is the most negative reward.")
        if ngram_size < 1:
            raise ValueError(f"ngram_size={ngram_size} must be at least 1.")
        self.n, self.max_penalty = ngram_size, max_penalty

    def __call__(self, completion_ids, **kwargs) -> list[float]:
        rewards = []
        for ids in completion_ids:
            if len(ids) < self.n:
                rewards.append(0.0)
                continue
            grams = [tuple(ids[i:i + self.n]) for i in range(len(ids) - self.n + 1)]
            repeated = 1 - len(set(grams)) / len(grams)
            rewards.append(repeated * self.max_penalty if repeated else 0.0)
        return rewards


def get_repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0) -> RepetitionPenalty:
    """TRL's factory of the n-gram repetition penalty (see RepetitionPenalty)."""
    return RepetitionPenalty(ngram_size, max_penalty)


def get_length_reward(max_completion_len: int):
    """-(tokens / max_completion_len): a reward in [-1, 0] that favours shorter completions."""

    def length(completion_ids, **kwargs) -> list[float]:
        return [-len(ids) / max_completion_len for ids in completion_ids]

    return length


def by_name(name: str, config):
    """A built-in reward selected by name on the command line; factories are sized from `config`.

    posttrain's names (accuracy, think_format, soft_overlong, length) and the names TRL's `trl grpo` script takes
    (accuracy_reward, reasoning_accuracy_reward, think_format_reward, get_soft_overlong_punishment with TRL's sizes
    1280/256), plus TRL's other factories with their defaults.
    """
    from posttrain.rewards import math_answers as math_rewards

    makers = {
        "accuracy": lambda: accuracy,
        "think_format": lambda: think_format,
        "soft_overlong": lambda: get_soft_overlong_punishment(
            config.max_completion_length, max(1, config.max_completion_length // 4)),
        "length": lambda: get_length_reward(config.max_completion_length),
        "accuracy_reward": lambda: math_rewards.accuracy_reward,
        "reasoning_accuracy_reward": lambda: math_rewards.reasoning_accuracy_reward,
        "think_format_reward": lambda: think_format_reward,
        "get_soft_overlong_punishment": lambda: get_soft_overlong_punishment(1280, 256),
        "get_cosine_scaled_reward": lambda: math_rewards.get_cosine_scaled_reward(config.max_completion_length),
        "get_repetition_penalty_reward": lambda: get_repetition_penalty_reward(),
    }
    return makers[name]() if name in makers else None


BUILTIN_NAMES = ("accuracy", "think_format", "soft_overlong", "length", "accuracy_reward", "reasoning_accuracy_reward",
                 "think_format_reward", "get_soft_overlong_punishment", "get_cosine_scaled_reward",
                 "get_repetition_penalty_reward")
