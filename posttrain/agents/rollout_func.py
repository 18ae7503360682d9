"""`rollout_func(prompts, trainer) -> dict`: TRL 1.16's white-box generation, its output checked before it is used.

    output = check_rollout_output(rollout_func(prompts, trainer), len(prompts), vocab_size=V, reserved=...)

What TRL reads from the dict (`GRPOTrainer._generate` and `_generate_and_score_completions`): `prompt_ids`,
`completion_ids` and `logprobs` (required keys; `logprobs` may be None: no sampler log-probs), optional `env_mask`
(TRL's tool_mask: 1 on the model's tokens, 0 on the environment's), and every other key, an extra column for the
reward functions: a list gives row i its i-th value, anything else is given whole to every row. TRL checks only that
the three keys are there; a row count, a row length or a value that does not fit then fails later (a padding error,
an index error) or silently (an extra list shorter than the rows leaves the last rows without the column). Here each
is one sentence naming the field and the row.
"""

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Collection, Mapping

from posttrain.errors import UserFunctionError

REQUIRED = ("prompt_ids", "completion_ids", "logprobs")
# above 0 by more than float rounding: no log-probability is (probabilities given instead?)
LOGPROB_TOLERANCE = 1e-3


class RolloutOutputError(UserFunctionError, ValueError):
    """rollout_func returned a dict posttrain cannot use; the message names the field, the row and the fix."""


@dataclass
class RolloutOutput:
    """rollout_func's output, checked: N rows, row i's completion of C_i tokens.

    Attributes:
        prompt_ids: [N][P_i] token ids.
        completion_ids: [N][C_i] token ids.
        logprobs: [N][C_i] the sampler's log-probabilities (a None value read as NaN, as TRL reads vLLM's), or None.
        env_mask: [N][C_i] 1 on the model's tokens, 0 on the environment's; None when not returned.
        extra: {column: [N] values} for the reward functions (a value returned whole repeated for every row).
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]] | None
    env_mask: list[list[int]] | None = None
    extra: dict[str, list] = field(default_factory=dict)


def check_rollout_output(output, num_rows: int, vocab_size: int | None = None, reserved: Collection[str] = (),
                         name: str = "rollout_func") -> RolloutOutput:
    """The checked output for `num_rows` prompts, or RolloutOutputError naming the field and the row.

    Args:
        output: what rollout_func returned.
        num_rows: N, the prompts it was given.
        vocab_size: when given, every id must be below it.
        reserved: names the reward functions already receive (prompts, completions, ...): no extra column may
            take one.
        name: how messages name the function.
    """
    if not isinstance(output, Mapping):
        raise RolloutOutputError(f"{name} returned {type(output).__name__}, not a dict: return {{'prompt_ids': ..., "
                                 f"'completion_ids': ..., 'logprobs': ...}} with one row per prompt.")
    missing = [k for k in REQUIRED if k not in output]
    if missing:
        raise RolloutOutputError(f"{name}'s output has no {', '.join(missing)} (its keys: "
                                 f"{', '.join(map(str, output)) or 'none'}): return prompt_ids, completion_ids and "
                                 f"logprobs (None when there are none), one row per prompt.")
    check = _Checker(name, num_rows, vocab_size)
    prompt_ids = check.id_rows("prompt_ids", output["prompt_ids"])
    completion_ids = check.id_rows("completion_ids", output["completion_ids"])
    lengths = [len(row) for row in completion_ids]
    logprobs = None if output["logprobs"] is None else check.logprob_rows(output["logprobs"], lengths)
    env_mask = None if output.get("env_mask") is None else check.mask_rows(output["env_mask"], lengths)
    extra = {key: check.extra(key, value, lengths, reserved) for key, value in output.items()
             if key not in REQUIRED and key != "env_mask"}
    return RolloutOutput(prompt_ids, completion_ids, logprobs, env_mask, extra)


class _Checker:
    """The checks of one output's fields; every refusal names the function, the field and the row."""

    def __init__(self, name: str, num_rows: int, vocab_size: int | None):
        self.name, self.num_rows, self.vocab_size = name, num_rows, vocab_size

    def fail(self, text: str) -> RolloutOutputError:
        return RolloutOutputError(f"{self.name}'s {text}")

    def rows(self, field_name: str, value) -> list:
        """The field's N rows, each a list (a tensor or array row as its list)."""
        if not isinstance(value, (list, tuple)):
            raise self.fail(f"{field_name} is {type(value).__name__}: return a list with one row per prompt "
                            f"(each a list, without padding).")
        if len(value) != self.num_rows:
            raise self.fail(f"{field_name} has {len(value)} rows for {self.num_rows} prompts: return one row per "
                            f"prompt it was given, in their order.")
        rows = [row.tolist() if hasattr(row, "tolist") else row for row in value]
        for i, row in enumerate(rows):
            if not isinstance(row, (list, tuple)):
                raise self.fail(f"{field_name}[{i}] is {type(row).__name__}, not a list: return each row as a list.")
        return [list(row) for row in rows]

    def id_rows(self, field_name: str, value) -> list[list[int]]:
        rows = self.rows(field_name, value)
        for i, row in enumerate(rows):
            if not row:
                what = "a prompt to generate from" if field_name == "prompt_ids" else (
                    "at least one token (a completion that ends at once is its end-of-sequence token)")
                raise self.fail(f"{field_name}[{i}] is empty: every row needs {what}.")
            for j, token in enumerate(row):
                if isinstance(token, bool) or not isinstance(token, numbers.Integral):
                    raise self.fail(f"{field_name}[{i}][{j}] is {token!r} ({type(token).__name__}), not a token id: "
                                    f"return the ids as ints.")
                if token < 0 or (self.vocab_size is not None and token >= self.vocab_size):
                    raise self.fail(f"{field_name}[{i}][{j}] is {token}, outside the model's vocabulary "
                                    f"[0, {self.vocab_size if self.vocab_size is not None else 'V'}): return the "
                                    f"policy tokenizer's ids.")
            rows[i] = [int(token) for token in row]
        return rows

    def logprob_rows(self, value, lengths: list[int]) -> list[list[float]]:
        rows = self.rows("logprobs", value)
        for i, row in enumerate(rows):
            self.row_length("logprobs", i, row, lengths[i], "one log-probability per completion token (0.0 for "
                                                             "tokens the model did not sample)")
            for j, x in enumerate(row):
                if x is not None and (isinstance(x, bool) or not isinstance(x, numbers.Real)):
                    raise self.fail(f"logprobs[{i}][{j}] is {x!r} ({type(x).__name__}), not a number: return "
                                    f"floats (None for a log-probability the sampler could not give).")
                if x is not None and x > LOGPROB_TOLERANCE:
                    raise self.fail(f"logprobs[{i}][{j}] is {x}, above 0, which no log-probability is: return "
                                    f"log-probabilities (math.log of each probability), not probabilities.")
            rows[i] = [math.nan if x is None else float(x) for x in row]
        return rows

    def mask_rows(self, value, lengths: list[int]) -> list[list[int]]:
        rows = self.rows("env_mask", value)
        for i, row in enumerate(rows):
            self.row_length("env_mask", i, row, lengths[i], "one value per completion token")
            for j, x in enumerate(row):
                if x not in (0, 1) or not isinstance(x, numbers.Number):
                    raise self.fail(f"env_mask[{i}][{j}] is {x!r}: env_mask holds 1 for the model's tokens and 0 for "
                                    f"the environment's, one per completion token.")
            rows[i] = [int(x) for x in row]
        return rows

    def row_length(self, field_name: str, i: int, row: list, length: int, what: str) -> None:
        if len(row) != length:
            raise self.fail(f"{field_name}[{i}] has {len(row)} values for the {length} tokens of completion_ids[{i}]: "
                            f"return {what}.")

    def extra(self, key: str, value: Any, lengths: list[int], reserved: Collection[str]) -> list:
        """An extra column's N values: a list's own (one per row), anything else repeated (as TRL gives it)."""
        if key in reserved:
            raise self.fail(f"extra column {key!r} has the name of an argument the reward functions already receive "
                            f"({', '.join(sorted(reserved))}): rename it.")
        if not isinstance(value, list):
            return [value] * self.num_rows
        if len(value) != self.num_rows:
            raise self.fail(f"extra column {key!r} is a list of {len(value)} values for {self.num_rows} rows: return "
                            f"one value per row, or a value that is not a list to give every row the same.")
        if key == "logprob_token_ids":  # TRL: the same shape as logprobs, [N][C_i][k]
            for i, row in enumerate(self.rows(key, value)):
                self.row_length(key, i, row, lengths[i], "the sampler's top token ids per completion token")
        return list(value)
