"""The multi-turn tool loop, token-in/token-out: the model's turns as it sampled them, the tool results' tokens as the
chat template renders them, joined without decoding and re-encoding anything the model produced.

    rows = tool_loop(prompt_ids, first_turns, Turns(...), Budget(...))

For each row whose last turn holds tool calls (and while the budget lasts), one iteration:
  1. run the turn's calls (`Turns.run_calls`: every call of the turn, results in call order);
  2. the tool messages' token ids (`Turns.suffix_ids`: what the template puts between the model's turn and its next
     one, generation prompt included);
  3. if prompt + completion + suffix would pass max_completion_length (counted over the whole multi-turn
     completion) or the model's context, the results are rolled back and the row ends with the model's turn, as in
     TRL; else the next turn is sampled from prompt + completion + suffix (`Turns.generate`, one completion per row,
     each row its own key), cut to the budget left;
  4. the new turn is parsed (`Turns.parse`) for further calls.
The row's completion is then every turn's ids and every suffix in order; its tool mask is False on the suffixes;
its sampler log-probs are 0 there (placeholders, as TRL's). A vision-language model's rows carry their pixels: the
prompt's, then each kept suffix's (a tool that returned an image: its image tokens in the suffix, its pixels joining
the row's, as TRL joins them to the next turn's prompt). `Turns` holds what depends on the template, the tools and
the engine, so the loop itself is plain bookkeeping, tested with scripted turns.
"""

from dataclasses import dataclass, field
from typing import Callable

# a row's key in turn t (t >= 1) is its first turn's key + t * TURN_KEY_STRIDE: each turn samples with its own stream,
# and the same row gets the same turns whichever process or request samples it
TURN_KEY_STRIDE = 1 << 32


@dataclass(frozen=True)
class Budget:
    """How far a rollout may go.

    Attributes:
        max_completion_length: tokens of the whole multi-turn completion (the model's turns and the tool results).
        max_model_len: the model's context: prompt + completion must stay below it.
        max_iterations: rounds of tool calls (TRL's max_tool_calling_iterations; None: no limit).
    """

    max_completion_length: int
    max_model_len: int
    max_iterations: int | None = None


@dataclass(frozen=True)
class Suffix:
    """A round of tool results as the template renders them after the model's turn.

    Attributes:
        ids: their token ids, the next turn's generation prompt included (a result's image tokens expanded).
        pixels: the results' images' model_inputs ({name: tensor}, the processor's), {} without images.
        images: the results' images, as the tools returned them.
    """

    ids: list[int]
    pixels: dict = field(default_factory=dict)
    images: list = field(default_factory=list)


@dataclass(frozen=True)
class Turns:
    """What the loop asks of the template, the tools and the engine.

    Attributes:
        generate: (prompt id lists, row keys, the MultiTurnRows they continue) -> one (completion ids, sampler
            log-probs) per prompt.
        parse: (row, turn's ids, the ids before it) -> the assistant message of the turn, with "tool_calls" when it
            calls tools.
        run_calls: (row, tool calls) -> (tool messages in call order, failed calls).
        suffix_ids: (row, tool messages) -> their token ids as the template renders them after the model's turn,
            the next turn's generation prompt included; a Suffix where they hold images.
    """

    generate: Callable[[list[list[int]], list[int], list], list[tuple[list[int], list[float]]]]
    parse: Callable[[int, list[int], list[int]], dict]
    run_calls: Callable[[int, list[dict]], tuple[list[dict], int]]
    suffix_ids: Callable[[int, list[dict]], "list[int] | Suffix"]


@dataclass
class MultiTurnRow:
    """One rollout over its turns.

    Attributes:
        prompt_ids: the prompt's ids (as given).
        completion_ids: every turn's ids and every tool suffix, in order.
        logprobs: one per completion token: the sampler's for the model's tokens, 0.0 for a suffix's.
        tool_mask: one per completion token: True for the model's, False for a suffix's.
        messages: the completion as messages: each assistant turn (parsed), each tool message.
        tool_calls, tool_failures: the calls run, and those that failed.
        rolled_back: whether a round of tool results was dropped for the budget.
        pixels: a vision-language model's model_inputs in the order of their image tokens: the prompt's, then each
            kept suffix's ({name: tensor} each).
        images: the images those pixels were made from, in the same order (what vLLM takes).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    tool_mask: list[bool]
    messages: list[dict] = field(default_factory=list)
    tool_calls: int = 0
    tool_failures: int = 0
    rolled_back: bool = False
    pixels: list[dict] = field(default_factory=list)
    images: list = field(default_factory=list)

    def model_inputs(self) -> dict:
        """The row's pixels for one forward: each input's pieces joined along dim 0 in order ({} without any)."""
        from posttrain.model_inputs import ModelInputs

        return ModelInputs.from_rows(self.pixels).batched()

    def extend(self, ids: list[int], logprobs: list[float], by_model: bool) -> None:
        self.completion_ids += ids
        self.logprobs += logprobs if by_model else [0.0] * len(ids)
        self.tool_mask += [by_model] * len(ids)


def tool_loop(prompt_ids: list[list[int]], first_turns: list[tuple[list[int], list[float]]], row_keys: list[int],
              turns: Turns, budget: Budget, pixels: list[dict] | None = None,
              images: list[list] | None = None) -> list[MultiTurnRow]:
    """Every row's rollout, from its first sampled turn on (module docstring).

    Args:
        prompt_ids: [N] each row's prompt ids.
        first_turns: [N] each row's first turn, (ids, sampler log-probs), as sampled with the row's key.
        row_keys: [N] each row's key in the round (later turns sample with key + turn * TURN_KEY_STRIDE).
        pixels, images: [N] each prompt's model_inputs and images (a vision-language model's), or None.
    """
    rows = [MultiTurnRow(list(p), list(ids), list(logps), [True] * len(ids)) for p, (ids, logps) in
            zip(prompt_ids, first_turns)]
    for r, row in enumerate(rows):
        row.pixels = [dict(pixels[r])] if pixels is not None and pixels[r] else []
        row.images = list(images[r]) if images is not None and images[r] else []
    calling = []
    for r, row in enumerate(rows):
        message = turns.parse(r, row.completion_ids, row.prompt_ids) if row.completion_ids else {}
        row.messages.append(message)
        if message.get("tool_calls"):
            calling.append(r)
    iteration = 0
    while calling and (budget.max_iterations is None or iteration < budget.max_iterations):
        iteration += 1
        extended = {r: _with_tool_results(rows[r], r, turns, budget) for r in calling}
        continuing = [r for r in calling if extended[r] is not None]
        if not continuing:
            break
        sampled = turns.generate([rows[r].prompt_ids + rows[r].completion_ids for r in continuing],
                                 [row_keys[r] + iteration * TURN_KEY_STRIDE for r in continuing],
                                 [rows[r] for r in continuing])
        calling = []
        for r, (ids, logps) in zip(continuing, sampled):
            row = rows[r]
            room = budget.max_completion_length - len(row.completion_ids)
            ids, logps = ids[:room], logps[:room]
            before = row.prompt_ids + row.completion_ids
            row.extend(ids, logps, by_model=True)
            if not ids:
                continue
            message = turns.parse(r, ids, before)
            row.messages.append(message)
            if message.get("tool_calls"):
                calling.append(r)
    return rows


def _with_tool_results(row: MultiTurnRow, r: int, turns: Turns, budget: Budget) -> list[int] | None:
    """Run the row's last turn's calls and append their results (messages and suffix ids, masked out); None, with
    nothing appended, when the results would pass the budget (the row then ends with its calling turn)."""
    calls = row.messages[-1]["tool_calls"]
    tool_messages, failures = turns.run_calls(r, calls)
    row.tool_calls += len(calls)
    row.tool_failures += failures
    suffix = turns.suffix_ids(r, tool_messages)
    suffix = suffix if isinstance(suffix, Suffix) else Suffix(list(suffix))
    completion = len(row.completion_ids) + len(suffix.ids)
    if completion > budget.max_completion_length or len(row.prompt_ids) + completion >= budget.max_model_len:
        row.rolled_back = True
        return None
    row.messages += tool_messages
    row.extend(suffix.ids, [], by_model=False)
    if suffix.pixels:
        row.pixels.append(suffix.pixels)
        row.images += suffix.images
    return suffix.ids
