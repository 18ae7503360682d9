import asyncio
import math
import time

import torch

from posttrain.configs import GRPOConfig
from posttrain.rewards import resolve_reward_funcs, score
from posttrain.rewards.builtin import (accuracy, extract_answer, get_soft_overlong_punishment, normalize_answer,
                                       think_format)


def _score(funcs, completions, **columns):
    resolved = resolve_reward_funcs(funcs, GRPOConfig(max_completion_length=8))
    ids = [[1] * len(c) for c in completions]
    return score(resolved, ["p"] * len(completions), completions, ids, columns, None, step=3)


def test_accuracy_normalises_numbers():
    assert normalize_answer("1,000.0") == "1000" and normalize_answer(" 7. ") == "7"
    assert extract_answer("so \\boxed{42} and 7") == "42" and extract_answer("it is 3 then 5") == "5"
    out = accuracy(["The answer is 12.0", "12,0?", "[[1]]", "nothing"], answer=["12", "12", "1", ""])
    assert out == [1.0, 0.0, 1.0, None]
    conversational = [[{"role": "assistant", "content": "= 4"}]]
    assert accuracy(conversational, solution=["4"]) == [1.0]


def test_think_format_and_soft_overlong():
    assert think_format(["<think>a</think> 4", "4 <think>a</think>", "<think>a<think>b</think>"]) == [1.0, 0.0, 0.0]
    f = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)
    assert f(completion_ids=[[0] * 6, [0] * 8, [0] * 10, [0] * 11]) == [0.0, -0.5, -1.0, -1.0]


def test_none_becomes_nan_and_weights_matrix_shape():
    def half(completions, **kw):
        return [None, 1.0, 0.5]

    m = _score([half, "length"], ["a", "bb", "ccc"])
    assert m.shape == (3, 2) and math.isnan(m[0, 0]) and m[1, 0] == 1.0
    assert torch.allclose(m[:, 1], torch.tensor([-1 / 8, -2 / 8, -3 / 8]))


def test_columns_and_trainer_state_reach_the_function():
    seen = {}

    def f(prompts, completions, completion_ids, answer, trainer_state, **kw):
        seen.update(answer=answer, state=trainer_state, ids=completion_ids)
        return [0.0] * len(completions)

    resolved = resolve_reward_funcs([f], GRPOConfig())
    score(resolved, ["p", "q"], ["a", "b"], [[1], [2, 3]], {"answer": ["x", "y"]}, "STATE", step=1)
    assert seen == {"answer": ["x", "y"], "state": "STATE", "ids": [[1], [2, 3]]}


def test_async_rewards_run_concurrently():
    async def slow_a(completions, **kw):
        await asyncio.sleep(0.3)
        return [1.0] * len(completions)

    async def slow_b(completions, **kw):
        await asyncio.sleep(0.3)
        return [2.0] * len(completions)

    start = time.perf_counter()
    m = _score([slow_a, slow_b], ["a", "b"])
    assert time.perf_counter() - start < 0.55  # concurrent, not 0.6 s in sequence
    assert m.tolist() == [[1.0, 2.0], [1.0, 2.0]]


def test_dotted_path_and_reward_model(tmp_path, tokenizer):
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    funcs = resolve_reward_funcs(["posttrain.rewards.builtin.think_format"], GRPOConfig())
    assert funcs[0].fn is think_format
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_config(cfg)
    rm.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    m = _score([str(tmp_path / "rm")], ["one", "two words"])
    assert m.shape == (2, 1) and torch.isfinite(m).all() and m[0, 0] != m[1, 0]