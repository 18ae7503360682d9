import asyncio
import math
import time

import pytest
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

def test_trl_reward_names_and_import_paths():
    from posttrain.rewards import (accuracy_reward, get_cosine_scaled_reward, get_repetition_penalty_reward,
                                   get_soft_overlong_punishment, reasoning_accuracy_reward, think_format_reward)

    # TRL's docstring examples, with their results
    pytest.importorskip("math_verify")
    solutions = [r"\frac{1}{3}", r"\frac{1}{3}"]
    completions = [[{"role": "assistant", "content": r"My answer is \boxed{\frac{1}{3}}"}],
                   [{"role": "assistant", "content": r"My answer is \boxed{\frac{1}{2}}"}]]
    assert accuracy_reward(completions, solutions) == [1.0, 0.0]
    reasoned = [[{"role": "assistant", "content": r"<think> R </think> The final answer is \boxed{\frac{1}{3}}"}],
                [{"role": "assistant", "content": r"<think> R </think> The final answer is \boxed{\frac{1}{2}}"}],
                [{"role": "assistant", "content": r"<think> partial \boxed{\frac{1}{3}} but no final answer"}]]
    assert reasoning_accuracy_reward(reasoned, solutions + [r"\frac{1}{3}"], reasoning_delimiters=["</think>"]) == [
        1.0, 0.0, 0.0]
    cosine = get_cosine_scaled_reward(max_len=100)
    assert cosine.__name__ == "cosine_scaled_reward"
    assert cosine([[{"content": r"\boxed{\frac{1}{3}}"}], [{"content": r"\boxed{\frac{1}{2}}"}]], solutions,
                  [[1] * 50, [1] * 50]) == pytest.approx([0.75, -0.75])
    assert think_format_reward([[{"content": "<think>\nreasoning\n</think>\nanswer"}],
                                [{"content": "<think>\nreasoning\nanswer"}]]) == [1.0, 0.0]
    assert get_repetition_penalty_reward(ngram_size=2)([[1, 2, 3, 4], [5, 5, 5, 5, 5]]) == [0.0, -0.75]
    assert get_soft_overlong_punishment(100, 20)([[1] * 90]) == [-0.5]
    # an unparseable reference is not applicable (None), and strings work where TRL needs messages
    logged = {}
    assert accuracy_reward([r"\boxed{2}", "no answer"], ["no number here", "2"],
                           log_extra=lambda c, v: logged.update({c: v})) == [None, 0.0]
    assert logged["answer_parsed"] == ["[skipped]", "[unparseable]"]


def test_trl_rewards_give_trl_results():
    trl_rewards = pytest.importorskip("trl.rewards")
    pytest.importorskip("math_verify")
    from posttrain import rewards as ours

    texts = [r"\boxed{4}", r"so 2+2 = \boxed{5}", r"<think>x</think> \boxed{\frac{2}{4}}", "<think>unfinished",
             r"$0.5$", r"The answer is $\frac{1}{2}$.", "", r"<think>a</think><think>b</think>"]
    solutions = ["4", "4", r"\frac{1}{2}", "3", "0.5", r"\frac12", "1", "2"]
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    ids = [[7] * (5 + 20 * i) for i in range(len(texts))]
    assert ours.accuracy_reward(completions, solutions) == trl_rewards.accuracy_reward(completions, solutions)
    assert ours.reasoning_accuracy_reward(completions, solutions) == trl_rewards.reasoning_accuracy_reward(
        completions, solutions)
    assert ours.get_cosine_scaled_reward(64)(completions, solutions, ids) == pytest.approx(
        trl_rewards.get_cosine_scaled_reward(64)(completions, solutions, ids))
    assert ours.think_format_reward(completions) == trl_rewards.think_format_reward(completions)
    repeated = [[1, 2, 1, 2, 1, 2], [1, 2, 3], [4], [5, 5, 5, 5]]
    assert ours.get_repetition_penalty_reward(2, -0.5)(repeated) == trl_rewards.get_repetition_penalty_reward(
        2, -0.5)(repeated)
    assert ours.get_soft_overlong_punishment(100, 0)(ids) == trl_rewards.get_soft_overlong_punishment(100, 0)(ids)
    assert ours.get_soft_overlong_punishment(100, 30)(ids) == trl_rewards.get_soft_overlong_punishment(100, 30)(ids)


def test_trl_names_on_the_command_line_resolve():
    funcs = resolve_reward_funcs(["accuracy_reward", "think_format_reward", "get_soft_overlong_punishment",
                                  "reasoning_accuracy_reward", "get_repetition_penalty_reward"], GRPOConfig())
    # named by the function, as TRL names them (so metrics read rewards/soft_overlong_punishment_reward/mean)
    assert [f.name for f in funcs] == ["accuracy_reward", "think_format_reward", "soft_overlong_punishment_reward",
                                       "reasoning_accuracy_reward", "repetition_penalty_reward"]
    overlong = funcs[2].fn
    assert (overlong.max_len, overlong.cache) == (1280, 256)  # the sizes TRL's grpo script uses


def _slow_on_row(hang_row: int, asynchronous: bool = False):
    """A reward that never returns when it is given the completion "hang" (row `hang_row` of the batch)."""
    import threading

    never = threading.Event()

    def hangs(completions, **kw):
        if "hang" in completions:
            never.wait()
        return [1.0] * len(completions)

    async def hangs_async(completions, **kw):
        if "hang" in completions:
            await asyncio.sleep(3600)
        return [1.0] * len(completions)

    return hangs_async if asynchronous else hangs


@pytest.mark.parametrize("asynchronous", [False, True])
def test_reward_timeout_names_the_function_step_and_completion(asynchronous):
    from posttrain.rewards import RewardError

    funcs = resolve_reward_funcs([_slow_on_row(2, asynchronous)], GRPOConfig())
    completions = ["a", "b", "hang", "c"]
    start = time.perf_counter()
    with pytest.raises(RewardError, match=r"Reward function 'hangs(_async)?' did not return within reward_timeout=0.2 s "
                                          r"at step 3 on completion 2 \(prompt 7 of the dataset\)"):
        score(funcs, ["p"] * 4, completions, [[1]] * 4, {}, None, step=3, prompt_indices=[5, 6, 7, 8], timeout=0.2)
    assert time.perf_counter() - start < 5  # the whole batch, then rows 0, 1 and 2 alone: about 4 limits


def test_reward_timeout_skips_under_on_bad_reward_skip():
    funcs = resolve_reward_funcs([_slow_on_row(0), "length"], GRPOConfig(max_completion_length=8))
    bad = []
    m = score(funcs, ["p"] * 2, ["hang", "x"], [[1], [1, 2]], {}, None, step=1, bad_rows=bad, timeout=0.2)
    assert bad == [0, 1] and math.isnan(m[0, 0]) and math.isnan(m[1, 0]) and m[1, 1] == -0.25
    # and without a limit nothing changes: a function that returns is called once, on this thread
    assert score(funcs[1:], ["p"], ["x"], [[1]], {}, None, step=1, timeout=None).tolist() == [[-0.125]]


def test_an_interrupt_inside_a_reward_function_leaves_it_as_it_is():
    """An interrupt raised inside a function (timeouts.InterruptedWaiting, a KeyboardInterrupt) is neither taken for
    the function's failure nor probed for a failing completion, whether the function is async or not, and whatever
    it catches (`except Exception`)."""
    from posttrain.timeouts import InterruptedWaiting, waited_on

    calls, seen = [], []

    def interrupted(completions, **kw):
        calls.append(1)
        seen.append(waited_on())
        try:
            raise InterruptedWaiting(2, "reward function 'interrupted'")
        except Exception:  # a user's catch-all does not keep it
            return [0.0] * len(completions)

    async def interrupted_async(completions, **kw):
        calls.append(1)
        seen.append(waited_on())
        raise InterruptedWaiting(2, "reward function 'interrupted_async'")

    for fn in (interrupted, interrupted_async):
        calls.clear()
        with pytest.raises(InterruptedWaiting):
            _score([fn], ["a", "b"])
        assert calls == [1]
    assert seen == ["reward function 'interrupted'", "reward function 'interrupted_async'"]
    assert waited_on() is None  # the marks are gone with the calls


def test_async_rewards_threads_keep_no_process_alive():
    """A thread an async reward function starts (asyncio.to_thread, run_in_executor) is a daemon thread, and the
    loop closes without waiting for it: one that never returns cannot keep the process from exiting."""
    import threading

    from posttrain.rewards.async_calls import run_async

    release = threading.Event()

    async def leaves_a_thread(completions, **kw):
        asyncio.get_running_loop().run_in_executor(None, release.wait)
        return await asyncio.to_thread(lambda: [1.0] * len(completions))

    try:
        start = time.perf_counter()
        assert run_async([leaves_a_thread(["a"])]) == [[1.0]]
        assert time.perf_counter() - start < 1.0
        waiting = [t for t in threading.enumerate() if t.name == "posttrain-reward-thread" and t.is_alive()]
        assert waiting and all(t.daemon for t in waiting)
    finally:
        release.set()


def test_numpy_and_torch_scalars_count_as_numbers():
    import numpy as np

    m = _score([lambda completions, **kw: [np.bool_(True), np.float32(0.5), torch.tensor(2.0), False]],
               ["a", "b", "c", "d"])
    assert m[:, 0].tolist() == [1.0, 0.5, 2.0, 0.0]


def _console_script_path(monkeypatch):
    """sys.path as the `posttrain` console script has it: the current directory not on it (restored afterwards)."""
    import os
    import sys

    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.abspath(p or os.curdir) != os.getcwd()])


def test_a_dotted_path_resolves_from_the_current_directory(tmp_path, monkeypatch):
    """`--reward_funcs my_rewards.fn` with my_rewards.py where the command runs, as TRL's script finds it."""
    import sys

    (tmp_path / "cwd_rewards_ok.py").write_text("def fn(completions, **kw):\n    return [7.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    _console_script_path(monkeypatch)
    try:
        funcs = resolve_reward_funcs(["cwd_rewards_ok.fn"], GRPOConfig())
        assert funcs[0].name == "fn" and funcs[0].fn(["a"]) == [7.0]
        assert funcs[0].fn.__module__ == "cwd_rewards_ok" and sys.modules["cwd_rewards_ok"].__file__ == str(
            tmp_path / "cwd_rewards_ok.py")
    finally:
        sys.modules.pop("cwd_rewards_ok", None)


@pytest.mark.parametrize("source, said", [
    ("def fn(completions, **kw)\n    return [0.0]\n", r"raised SyntaxError on import: expected ':' \(.*line 1\); fix "
                                                     r"the module\.$"),
    ("import no_such_package_xyz\n", r"raised ModuleNotFoundError on import: No module named 'no_such_package_xyz'; "
                                     r"install the package it imports, or fix the import\.$"),
    ("raise RuntimeError('no API key')\n", r"raised RuntimeError on import: no API key; fix the module\.$"),
])
def test_a_reward_module_that_raises_on_import_says_so(tmp_path, monkeypatch, source, said):
    import sys

    from posttrain.configs import ConfigError

    (tmp_path / "cwd_rewards_bad.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    _console_script_path(monkeypatch)
    try:
        with pytest.raises(ConfigError, match=r"^Reward function 'cwd_rewards_bad\.fn' could not be imported: its "
                                              r"module cwd_rewards_bad " + said):
            resolve_reward_funcs(["cwd_rewards_bad.fn"], GRPOConfig())
    finally:
        sys.modules.pop("cwd_rewards_bad", None)


def test_a_dotted_path_to_no_module_or_a_missing_name_says_which(tmp_path, monkeypatch):
    import re
    import sys

    from posttrain.configs import ConfigError

    (tmp_path / "cwd_rewards_named.py").write_text("def fn(completions, **kw):\n    return [0.0]\n")
    monkeypatch.chdir(tmp_path)
    _console_script_path(monkeypatch)
    try:
        with pytest.raises(ConfigError, match=r"the module cwd_rewards_named \(.*cwd_rewards_named\.py\) has no 'fnn': "
                                              r"check the name\. Did you mean fn\?$"):
            resolve_reward_funcs(["cwd_rewards_named.fnn"], GRPOConfig())
    finally:
        sys.modules.pop("cwd_rewards_named", None)
    here = re.escape(str(tmp_path))
    with pytest.raises(ConfigError, match=rf"^Reward function 'cwd_rewards_absent\.fn' could not be imported: there "
                                          rf"is no module cwd_rewards_absent in the current directory \({here}\) or "
                                          r"the installed packages; check the name, or run from the folder that holds "
                                          r"cwd_rewards_absent\.py\.$"):
        resolve_reward_funcs(["cwd_rewards_absent.fn"], GRPOConfig())


def test_dynamic_sampling_filter_resolves_from_the_current_directory(tmp_path, monkeypatch):
    import sys

    from posttrain.configs import ConfigError
    from posttrain.grpo.dynamic_sampling import resolve_filter

    (tmp_path / "cwd_filters.py").write_text("def keep(group):\n    return True\n\nbroken = 1\n")
    monkeypatch.chdir(tmp_path)
    _console_script_path(monkeypatch)
    try:
        assert resolve_filter("cwd_filters.keep").__module__ == "cwd_filters"
        with pytest.raises(ConfigError, match=r"^dynamic_sampling_filter 'cwd_filters\.broken' is not a function "
                                              r"\(int in .*cwd_filters\.py\): name a function\.$"):
            resolve_filter("cwd_filters.broken")
    finally:
        sys.modules.pop("cwd_filters", None)


def test_a_misnamed_argument_gets_the_closest_name():
    from posttrain.data import DataError
    from posttrain.rewards import check_required_columns

    def singular(completion, **kwargs):
        return [0.0] * len(completion)

    def typo(completions, answr, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(DataError, match=r"'singular' requires the argument 'completion', but the dataset has no "
                                        r"'completion' column \(columns: answer\): rename it, add the column, or give "
                                        r"it a default\. Did you mean completions\?$"):
        check_required_columns(resolve_reward_funcs([singular], GRPOConfig()), ["answer"])
    with pytest.raises(DataError, match=r"Did you mean answer\?$"):
        check_required_columns(resolve_reward_funcs([typo], GRPOConfig()), ["answer"])


def test_a_reward_function_without_kwargs_is_told_to_add_them():
    """Before training (check_required_columns) and when called (score, sync and async): the fix, not 'return
    None'."""
    from posttrain.configs import ConfigError
    from posttrain.rewards import RewardError, check_required_columns

    def exact(completions, answer):
        return [float(c == a) for c, a in zip(completions, answer)]

    async def exact_async(completions, answer):
        return [float(c == a) for c, a in zip(completions, answer)]

    def takes_everything(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, answer):
        return [0.0] * len(completions)

    fix = (r"^Add \*\*kwargs to the signature of reward function '{}': every reward function is passed completion_ids, "
           r"completions, log_extra, log_metric, prompts, trainer_state and the dataset's columns as keyword arguments "
           r"\(as in TRL\), and it does not take completion_ids, log_extra, log_metric, prompts, trainer_state\.$")
    with pytest.raises(ConfigError, match=fix.format("exact")):
        check_required_columns(resolve_reward_funcs([exact], GRPOConfig()), ["answer"])
    for fn in (exact, exact_async):
        with pytest.raises(RewardError, match=fix.format(fn.__name__)):
            _score([fn], ["a", "b"], answer=["a", "c"])
    check_required_columns(resolve_reward_funcs([takes_everything], GRPOConfig()), ["answer"])  # names them all
    assert _score([takes_everything], ["a"], answer=["a"]).tolist() == [[0.0]]
