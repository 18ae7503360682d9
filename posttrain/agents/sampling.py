"""The tool loop (agents/loop.py) over a generation engine (posttrain/generation): a round's first turns from the
engine's Rollouts, the later turns sampled within the same round, and the finished rows back as Rollouts with their
tool mask.

    first = first_turns(rollouts)                  [(ids, sampler log-probs)] per row, as sampled
    generate = later_turns(generator)              Turns.generate: later turns within the round (new_round=False)
    rollouts = multi_turn_rollouts(rows, ...)      Rollouts of the MultiTurnRows, tool_mask set

A vision-language model's rows carry their pixels (the prompt's and each tool image's, MultiTurnRow.pixels): a later
turn is sampled with them (and their images, for vLLM), and the finished rows' Rollouts hold them as model_inputs,
with `token_types` (the processor's: model_inputs.TokenTypes).
"""

from typing import Callable

from posttrain.agents.loop import MultiTurnRow
from posttrain.generation import GenerationError, Rollouts
from posttrain.model_inputs import ModelInputs, TokenTypes


def first_turns(rollouts: Rollouts) -> list[tuple[list[int], list[float]]]:
    """Each row's completion ids and sampler log-probs, without padding."""
    out = []
    for ids, mask, logps in zip(rollouts.completion_ids, rollouts.completion_mask, rollouts.sampler_logprobs):
        keep = mask.bool()
        out.append((ids[keep].tolist(), logps[keep].tolist()))
    return out


def row_inputs(rows: list[MultiTurnRow], token_types: TokenTypes | None) -> ModelInputs | None:
    """The rows' pixels as ModelInputs (one row each), or None when no row has any."""
    if not any(row.pixels for row in rows):
        return None
    return ModelInputs.from_rows([row.model_inputs() for row in rows], token_types)


def later_turns(generator, token_types: TokenTypes | None = None
                ) -> Callable[[list[list[int]], list[int], list], list[tuple[list[int], list[float]]]]:
    """Turns.generate over `generator`: one completion per prompt, each with its key, in the round of the first turns
    (no new round seed is drawn, so every process keeps drawing the same seeds however many turns its rows take).
    Each answer is checked to continue exactly the ids sent: an engine that truncated or re-tokenised them stops the
    run (GenerationError) instead of leaving a rollout that is not what the model saw."""
    def generate(prompts: list[list[int]], keys: list[int], rows: list[MultiTurnRow] | None = None
                 ) -> list[tuple[list[int], list[float]]]:
        inputs = row_inputs(rows, token_types) if rows else None
        if inputs is None:
            rollouts = generator.generate(prompts, keys, new_round=False)
        else:  # the prompt's and the tools' images, in the order of their image tokens
            rollouts = generator.generate(prompts, keys, new_round=False, model_inputs=inputs,
                                          images=[list(row.images) for row in rows])
        for r, (sent, ids, mask) in enumerate(zip(prompts, rollouts.prompt_ids, rollouts.prompt_mask)):
            echoed = ids[mask.bool()].tolist()
            if echoed != sent:
                at = next((i for i, (a, b) in enumerate(zip(sent, echoed)) if a != b), min(len(sent), len(echoed)))
                raise GenerationError(f"The generation engine sampled a multi-turn rollout's next turn from ids that "
                                      f"differ from those sent (row {r} of the turn, from position {at}: {len(sent)} "
                                      f"ids sent, {len(echoed)} used), so the rollout would not be the tokens the "
                                      f"model saw: check that the engine takes token ids as given (no truncation "
                                      f"or re-tokenisation).")
        return first_turns(rollouts)

    return generate


def multi_turn_rollouts(rows: list[MultiTurnRow], pad_id: int, eos_ids: list[int], device,
                        token_types: TokenTypes | None = None) -> Rollouts:
    """Rollouts of finished multi-turn rows: each completion every turn and tool suffix, its sampler log-probs (0 on
    a suffix), its tool mask (False on a suffix), and the rows' pixels (model_inputs) where any has some."""
    return Rollouts.from_lists([(row.prompt_ids, row.completion_ids, row.logprobs) for row in rows], pad_id, eos_ids,
                               device, [row.tool_mask for row in rows], row_inputs(rows, token_types))
