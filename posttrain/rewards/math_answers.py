"""TRL's math rewards, with TRL's names, signatures and results: answers compared by `math_verify` (LaTeX parsed to
sympy), so `\\frac{1}{3}` and `0.333...` style questions are judged as TRL judges them.

They need the optional package math-verify (`pip install 'posttrain[math]'`); without it they raise with that line.
posttrain's own `accuracy` reward (rewards/builtin.py) needs nothing and compares numbers by value.

Completions may be strings or conversational (a list holding one assistant message), where TRL takes only the latter.
"""

import logging
import math
import threading

from posttrain._optional import require
from posttrain.rewards.text import completion_text

PARSE_TIMEOUT, VERIFY_TIMEOUT = 10, 5  # seconds, as TRL; math_verify times out with signal.alarm (main thread only)


def _math_verify(feature: str):
    require("math_verify", feature)
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    return NormalizationConfig, LatexExtractionConfig, parse, verify


def _timeouts() -> tuple:
    """(parse, verify) timeouts: none off the main thread, where signal.alarm cannot run (nor math_verify warn)."""
    if threading.current_thread() is threading.main_thread():
        return PARSE_TIMEOUT, VERIFY_TIMEOUT
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return None, None


def _judge(answers: list[str | None], solution: list[str], feature: str) -> tuple[list, list, list]:
    """Score each answer text against its reference with math_verify.

    An answer of None scores 0.0 without being parsed (an incomplete completion). A reference that does not parse
    scores None (not applicable). The completion's answer is the first LaTeX expression found, \\boxed{} first.
    Returns (rewards, parsed references, parsed answers) as TRL logs them.
    """
    NormalizationConfig, LatexExtractionConfig, parse, verify = _math_verify(feature)
    parse_timeout, verify_timeout = _timeouts()
    extraction = [LatexExtractionConfig(normalization_config=NormalizationConfig(units=True), boxed_match_priority=0,
                                        try_extract_without_anchor=False)]
    if len(answers) != len(solution):
        raise ValueError(f"{feature} got {len(answers)} completions and {len(solution)} solutions.")
    rewards, golds, parsed = [], [], []
    for answer, reference in zip(answers, solution):
        if answer is None:
            rewards.append(0.0)
            golds.append("[incomplete reasoning]")
            parsed.append("[incomplete reasoning]")
            continue
        gold = parse(reference, parsing_timeout=parse_timeout)
        if not gold:
            rewards.append(None)
            golds.append("[unparseable]")
            parsed.append("[skipped]")
            continue
        given = parse(answer, extraction_config=extraction, extraction_mode="first_match",
                      parsing_timeout=parse_timeout)
        rewards.append(float(verify(gold, given, timeout_seconds=verify_timeout)))
        golds.append(str(gold))
        parsed.append(str(given) if given else "[unparseable]")
    return rewards, golds, parsed


def _log(log_extra, solution, golds, parsed) -> None:
    if log_extra is not None:
        log_extra("solution", list(solution))
        log_extra("gold_parsed", golds)
        log_extra("answer_parsed", parsed)


def accuracy_reward(completions, solution, log_extra=None, **kwargs) -> list[float | None]:
    """1.0 when the completion's answer is mathematically equal to `solution` (math_verify), else 0.0; None when the
    solution itself does not parse. TRL's `accuracy_reward`."""
    rewards, golds, parsed = _judge([completion_text(c) for c in completions], list(solution), "accuracy_reward")
    _log(log_extra, solution, golds, parsed)
    return rewards


def reasoning_accuracy_reward(completions, solution, reasoning_delimiters=None, log_extra=None,
                              **kwargs) -> list[float | None]:
    """accuracy_reward on the text after the reasoning: after the last occurrence of the first delimiter present
    (default `</think>`). A completion with no delimiter has not finished reasoning and scores 0.0.
    TRL's `reasoning_accuracy_reward`."""
    delimiters = reasoning_delimiters if reasoning_delimiters is not None else ["</think>"]
    answers = []
    for completion in completions:
        text = completion_text(completion)
        found = next((d for d in delimiters if d in text), None)
        answers.append(text.split(found)[-1] if found is not None else None)
    rewards, golds, parsed = _judge(answers, list(solution), "reasoning_accuracy_reward")
    _log(log_extra, solution, golds, parsed)
    return rewards


# what these rewards import when called, checked when they are named (rewards/resolving.py): a missing package
# stops the run before the model loads, not at step 1
accuracy_reward.requires = reasoning_accuracy_reward.requires = "math_verify"


class CosineScaledReward:
    """accuracy_reward scaled by completion length along a half cosine ("Demystifying Long CoT", appendix C.1).

    With p = min(tokens / max_len, 1): a correct answer earns from max_value_correct (p = 0) down to
    min_value_correct (p = 1); a wrong one from min_value_wrong (p = 0, the harshest) up to max_value_wrong (p = 1).
    """

    __name__ = "cosine_scaled_reward"  # the metric name, as TRL's
    requires = "math_verify"

    def __init__(self, max_len: int, min_value_wrong: float, max_value_wrong: float, min_value_correct: float,
                 max_value_correct: float):
        if max_len <= 0:
            raise ValueError(f"max_len={max_len} must be a positive number of tokens.")
        self.max_len = max_len
        self.wrong = (max_value_wrong, min_value_wrong)  # (value at p = 1, value at p = 0)
        self.correct = (min_value_correct, max_value_correct)

    def __call__(self, completions, solution, completion_ids, **kwargs) -> list[float | None]:
        rewards = []
        for correct, ids in zip(accuracy_reward(completions, solution), completion_ids):
            if correct is None:
                rewards.append(None)
                continue
            at_end, at_start = self.correct if correct else self.wrong
            cosine = math.cos(min(len(ids) / self.max_len, 1.0) * math.pi)
            rewards.append(float(at_end + 0.5 * (at_start - at_end) * (1.0 + cosine)))
        return rewards


def get_cosine_scaled_reward(max_len: int, min_value_wrong: float = -1.0, max_value_wrong: float = -0.5,
                             min_value_correct: float = 0.5, max_value_correct: float = 1.0) -> CosineScaledReward:
    """TRL's `get_cosine_scaled_reward`: a CosineScaledReward with TRL's defaults."""
    return CosineScaledReward(max_len, min_value_wrong, max_value_wrong, min_value_correct, max_value_correct)
