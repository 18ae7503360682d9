"""The multi-turn tool loop's bookkeeping (posttrain/agents/loop.py), with scripted turns: the model's ids kept as
sampled, the tool results' suffix masked out, TRL's budget rules (roll back a round of results that would pass
max_completion_length or the context, cut the next turn to what is left), max_tool_calling_iterations, and each turn
sampled with its own key."""

from posttrain.agents.loop import TURN_KEY_STRIDE, Budget, Turns, tool_loop

CALL, END = 50, 2  # a turn holding CALL calls a tool; END ends a turn
SUFFIX = [60, 61, 62]  # what the "template" renders for a round of tool results


def _turns(script: dict, seen: list):
    """Turns whose model answers the row's n-th continuation with script[row][n], and whose tools echo."""
    def generate(prompts, keys, rows=None):
        seen.extend(keys)
        out = []
        for prompt, key in zip(prompts, keys):
            row, turn = key % TURN_KEY_STRIDE, key // TURN_KEY_STRIDE
            ids = script[row][turn]
            out.append((ids, [-0.1 * (i + 1) for i in range(len(ids))]))
        return out

    def parse(row, ids, before):
        return {"role": "assistant", "content": f"turn of {len(ids)}",
                **({"tool_calls": [{"type": "function", "function": {"name": "echo", "arguments": {}}}] * ids.count(CALL)}
                   if CALL in ids else {})}

    def run_calls(row, calls):
        return [{"role": "tool", "name": "echo", "content": "ok"} for _ in calls], 0

    return Turns(generate=generate, parse=parse, run_calls=run_calls, suffix_ids=lambda row, messages: list(SUFFIX))


def _run(script, budget, prompts=None):
    seen = []
    turns = _turns(script, seen)
    prompts = prompts or [[1, 1] for _ in script]
    first = turns.generate(prompts, list(range(len(script))))
    seen.clear()
    return tool_loop(prompts, first, list(range(len(script))), turns, budget), seen


def test_a_tool_round_joins_the_turns_ids_as_sampled_with_the_results_masked_out():
    script = {0: {0: [5, CALL, CALL, END], 1: [7, 8, END]}, 1: {0: [9, END]}}
    (row, plain), keys = _run(script, Budget(max_completion_length=32, max_model_len=64))
    assert row.completion_ids == [5, CALL, CALL, END] + SUFFIX + [7, 8, END]
    assert row.tool_mask == [True] * 4 + [False] * 3 + [True] * 3
    assert row.logprobs[4:7] == [0.0] * 3 and row.logprobs[:4] == [-0.1, -0.2, -0.30000000000000004, -0.4]
    assert [m["role"] for m in row.messages] == ["assistant", "tool", "tool", "assistant"]  # both parallel calls
    assert (row.tool_calls, row.tool_failures, row.rolled_back) == (2, 0, False)
    assert plain.completion_ids == [9, END] and plain.tool_mask == [True, True] and plain.tool_calls == 0
    assert keys == [0 + TURN_KEY_STRIDE]  # only the calling row samples again, with its own stream


def test_results_that_would_pass_the_budget_are_rolled_back_and_the_next_turn_is_cut_to_what_is_left():
    script = {0: {0: [5, CALL, END], 1: [7, 8, 9, 10, END]}, 1: {0: [5, 5, 5, 5, CALL, END]}}
    (cut, over), _ = _run(script, Budget(max_completion_length=8, max_model_len=64))
    assert cut.completion_ids == [5, CALL, END] + SUFFIX + [7, 8]  # 3 + 3 + what is left of the next turn
    assert cut.tool_mask == [True] * 3 + [False] * 3 + [True] * 2
    assert over.completion_ids == [5, 5, 5, 5, CALL, END] and over.rolled_back  # 6 + 3 > 8: results dropped
    assert over.tool_calls == 1 and [m["role"] for m in over.messages] == ["assistant"]
    (context,), _ = _run({0: {0: [5, CALL, END], 1: [7, END]}}, Budget(32, max_model_len=8))
    assert context.completion_ids == [5, CALL, END] and context.rolled_back  # 2 + 3 + 3 reaches the context


def test_max_tool_calling_iterations_ends_the_loop_after_that_many_rounds():
    script = {0: {t: [5, CALL, END] for t in range(5)}}
    (row,), keys = _run(script, Budget(64, 128, max_iterations=2))
    assert row.completion_ids == ([5, CALL, END] + SUFFIX) * 2 + [5, CALL, END]
    assert row.tool_calls == 2 and keys == [TURN_KEY_STRIDE, 2 * TURN_KEY_STRIDE]
    (none,), _ = _run(script, Budget(64, 128, max_iterations=0))
    assert none.completion_ids == [5, CALL, END] and none.tool_calls == 0


def test_over_the_in_process_engine_later_turns_sample_within_the_round_from_the_joined_ids(tokenizer):
    """With the real in-process generator: a row's second turn is what the engine samples from prompt + first turn +
    suffix with the row's next key in the same round (no new seed drawn), and the Rollouts hold every id as joined,
    the suffix masked out."""
    import torch

    from posttrain.agents.sampling import first_turns, later_turns, multi_turn_rollouts
    from posttrain.generation import SamplingParams
    from posttrain.generation.transformers_backend import TransformersGenerator
    from posttrain.testing import tiny_model

    generator = TransformersGenerator(tiny_model(tokenizer, hidden=32, layers=1), tokenizer,
                                      SamplingParams(max_new_tokens=6), seed=3, shares_policy=True)
    prompts, keys = [[5, 6, 7], [8, 9]], [0, 1]
    first = first_turns(generator.generate(prompts, keys))
    seed = generator._round_seed
    calls = {0}  # row 0 calls a tool after its first turn, row 1 does not
    turns = Turns(generate=later_turns(generator),
                  parse=lambda r, ids, before: {"tool_calls": [{"function": {"name": "t"}}]} if r in calls and
                  len(before) == len(prompts[r]) else {},
                  run_calls=lambda r, calls: ([{"role": "tool", "name": "t", "content": "x"}], 0),
                  suffix_ids=lambda r, messages: list(SUFFIX))
    rows = tool_loop(prompts, first, keys, turns, Budget(max_completion_length=20, max_model_len=64))
    joined = prompts[0] + first[0][0] + SUFFIX
    second = generator.generate_seeded([joined], seed, [keys[0] + TURN_KEY_STRIDE])
    expected = first_turns(second)[0][0]
    assert rows[0].completion_ids == first[0][0] + SUFFIX + expected and rows[1].completion_ids == first[1][0]
    assert generator._round_seed == seed  # the later turn drew no new seed
    rollouts = multi_turn_rollouts(rows, tokenizer.pad_token_id, generator.eos_ids, "cpu")
    n = len(first[0][0])
    assert rollouts.tool_mask[0, n:n + 3].tolist() == [False] * 3 and rollouts.model_tokens[0].sum() == n + len(expected)
    assert torch.equal(rollouts.completion_ids[0, :len(rows[0].completion_ids)], torch.tensor(rows[0].completion_ids))
