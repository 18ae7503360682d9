"""Tools, environments and rollout_func's output (posttrain/agents/tools.py, environments.py, rollout_func.py), against
TRL 1.16's GRPOTrainer on the same inputs: its own tool-execution code (`_tool_call_loop`, generation stubbed out)
and its own environment pool and reset code (`_generate_and_score_completions`, stopped where generation starts)."""

import asyncio
import copy
import functools
import math
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from posttrain.agents.environments import EnvironmentPool, append_observation
from posttrain.agents.rollout_func import RolloutOutputError, check_rollout_output
from posttrain.agents.tools import ToolError, ToolRunner, ToolSet, tool_schema
from posttrain.data import DataError
from posttrain.errors import UserFunctionError
from posttrain.testing import tiny_model, tiny_tokenizer


# ------------------------------------------------------------------ tools used throughout


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def lookup(key: str) -> dict:
    """A record, as a dict (not a string).

    Args:
        key: The record's key.
    """
    return {"key": key, "found": True}


def nothing(flag: bool = False) -> None:
    """Returns None.

    Args:
        flag: Ignored.
    """


def fails(reason: str) -> str:
    """Raises with `reason`.

    Args:
        reason: The message.
    """
    raise RuntimeError(reason)


def picture(caption: str) -> list:
    """Content blocks, as a multimodal tool returns them.

    Args:
        caption: The text block.
    """
    return [{"type": "text", "text": caption}]


async def fetch(url: str) -> str:
    """An async tool.

    Args:
        url: The address.
    """
    await asyncio.sleep(0)
    return f"page of {url}"


async def async_fails(code: int) -> str:
    """An async tool that raises.

    Args:
        code: The status.
    """
    raise ValueError(f"status {code}")


def call(name, **arguments) -> dict:
    """A parsed tool call in TRL's (transformers' response parser's) shape."""
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def raw_call(name, arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


SYNC_TURN = [call("add", a=2, b=3), call("lookup", key="k"), call("nothing"), call("fails", reason="no disk"),
             call("missing_tool", x=1), raw_call("add", '{"a": 1, "b": 2}'), call("add", a=1, c=2), call("add", a=1),
             {"type": "code", "name": "run"}, call("picture", caption="a cat")]
ASYNC_TURN = [call("fetch", url="u1"), call("async_fails", code=404), call("fetch", url="u2"), call("fetch", link="x")]
MIXED_TURN = [call("fetch", url="u3"), call("add", a=1, b=1), call("async_fails", code=500), call("fails", reason="r")]
TOOLS = [add, lookup, nothing, fails, picture, fetch, async_fails]


# ------------------------------------------------------------------ TRL 1.16's GRPOTrainer on a tiny model


class _GenerationReached(Exception):
    """Raised by the stubbed `_generate`: TRL's batch setup (environments, reset, tool dicts) has run."""


def _trl_trainer(tmp: Path, **kwargs):
    """TRL's GRPOTrainer on a tiny model whose chat template is TRL's Qwen2.5 one (tool calling)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    args = GRPOConfig(output_dir=str(tmp), per_device_train_batch_size=2, num_generations=2, max_steps=1,
                      report_to="none", use_cpu=True, save_strategy="no")
    kwargs.setdefault("reward_funcs", [lambda completions, **kw: [0.0] * len(completions)])
    return GRPOTrainer(model=tiny_model(tokenizer, hidden=32, layers=1), args=args, processing_class=tokenizer,
                       train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]] * 2}),
                       **kwargs)


def _trl_batch(trainer, rows: list[dict]) -> list:
    """TRL's `_generate_and_score_completions` on `rows` up to generation: the prompts it would generate from (its
    environments drawn and reset, its tool dicts built on the trainer)."""
    def generate(prompts):
        raise _GenerationReached(prompts)

    trainer._generate = generate
    with pytest.raises(_GenerationReached) as reached:
        trainer._generate_and_score_completions(copy.deepcopy(rows))
    return reached.value.args[0]


def _trl_tool_turn(trainer, turns: list[list[dict]]):
    """TRL's `_tool_call_loop` on one turn of calls per row (the model's next turn stubbed as empty, so the loop
    stops after running the calls): (each row's tool messages, tool_call_count, tool_failure_count)."""
    rows = [{"prompt": [{"role": "user", "content": "hi"}]} for _ in turns]
    prompts = _trl_batch(trainer, rows)
    trainer._get_tool_suffix_ids = lambda tool_messages: []  # no budget rollback: the messages are what is compared
    trainer._generate_single_turn = lambda ids, *args, **kwargs: ([[] for _ in ids], None)
    completions = [[{"role": "assistant", "content": "", "tool_calls": copy.deepcopy(calls)}] for calls in turns]
    n = len(turns)
    out = trainer._tool_call_loop(prompts, [[1]] * n, [[2]] * n, completions, None, None, {})
    completions, count, failures = out[1], out[4], out[5]
    return [messages[1:] for messages in completions], count, failures


@pytest.fixture(scope="module")
def trl_tools_trainer(tmp_path_factory):
    return _trl_trainer(tmp_path_factory.mktemp("trl_tools"), tools=TOOLS)


@pytest.fixture
def runner():
    tool_runner = ToolRunner()
    yield tool_runner
    tool_runner.close()


# ------------------------------------------------------------------ schemas


def test_schemas_are_transformers_own_and_render_as_trl_renders_the_functions():
    from transformers.utils import get_json_schema

    tools = ToolSet(TOOLS)
    assert tools.schemas == [get_json_schema(f) for f in TOOLS]
    assert tools.names == [f.__name__ for f in TOOLS]
    tokenizer = tiny_tokenizer()
    trl = pytest.importorskip("trl")
    template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    prompt = [{"role": "user", "content": "hi"}]
    as_trl = tokenizer.apply_chat_template(prompt, tools=TOOLS, chat_template=template, tokenize=False)
    assert tokenizer.apply_chat_template(prompt, tools=tools.schemas, chat_template=template, tokenize=False) == as_trl
    assert '"name": "fetch"' in as_trl


def _no_docstring(a: int):
    return a


def _no_hint(a):
    """Something.

    Args:
        a: The thing.
    """


def _undocumented(a: int, b: int):
    """Something.

    Args:
        a: The thing.
    """


class _Opaque:
    pass


def _custom_hint(a: _Opaque):
    """Something.

    Args:
        a: The thing.
    """


def _star_args(*values: int):
    """Something.

    Args:
        values: The things.
    """


class _CallableObject:
    def __call__(self, a: int):
        """Something.

        Args:
            a: The thing.
        """


@pytest.mark.parametrize("fn, says", [
    (_no_docstring, r"'_no_docstring' cannot be described to the model: it has no docstring; add a Google-style "),
    (_no_hint, r"'_no_hint' cannot be described to the model: its argument 'a' has no type hint; annotate every "),
    (_undocumented, r"'_undocumented' cannot be described .* does not describe the argument 'b'; add a line `b: "),
    (_custom_hint, r"'_custom_hint' cannot be described .* get_json_schema raised TypeHintParsingException: "
                   r"Couldn't convert the type hint .*_Opaque.*; use str, int, float"),
    (_star_args, r"'_star_args' has the parameter \*values, which the model cannot pass"),
    (functools.partial(add, 1), r"'add' is a functools.partial, not a function: pass a plain function"),
    (_CallableObject(), r"'_CallableObject' is a _CallableObject object, not a function"),
])
def test_a_tool_that_cannot_be_described_is_refused_in_one_sentence(fn, says):
    with pytest.raises(ToolError, match=says) as refused:
        ToolSet([add, fn])
    message = str(refused.value)
    assert message.startswith("Tool ") and message.endswith(".") and "\n" not in message


@pytest.mark.parametrize("fn", [_no_docstring, _no_hint, _undocumented, _custom_hint, functools.partial(add, 1)])
def test_what_is_refused_is_what_trl_would_fail_on_when_the_first_prompt_is_rendered(fn):
    tokenizer = tiny_tokenizer()
    with pytest.raises(Exception):  # noqa: B017 - transformers' own exception types differ per case
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[fn], tokenize=False)


def test_two_tools_of_one_name_are_refused():
    def add(x: int) -> int:  # noqa: F811 - the clash under test
        """Another add.

        Args:
            x: The value.
        """
        return x

    with pytest.raises(ToolError, match=r"^Two tools are named 'add' \(add and add\): the model calls a tool by its "
                                        r"name, so rename one\.$"):
        ToolSet([globals()["add"], add])


def test_methods_are_described_without_self():
    class Box:
        def put(self, item: str) -> str:
            """Put an item in the box.

            Args:
                item: What to put.
            """
            return item

    schema = tool_schema(Box().put)["function"]
    assert schema["name"] == "put" and list(schema["parameters"]["properties"]) == ["item"]


# ------------------------------------------------------------------ one turn's calls, against TRL's _tool_call_loop


def _trl_order(turn: list[dict], messages: list[dict]) -> list[dict]:
    """Our call-ordered messages in TRL's order: every call that did not run as async (sync calls and calls refused
    before running) first, then the async ones, each group in call order."""
    is_async = [c.get("function", {}).get("name") in ("fetch", "async_fails") and isinstance(
        c["function"].get("arguments"), dict) and set(c["function"]["arguments"]) <= {"url", "code"} for c in turn]
    return [m for m, a in zip(messages, is_async) if not a] + [m for m, a in zip(messages, is_async) if a]


def test_a_turn_of_calls_gives_trls_messages_and_counts(trl_tools_trainer, runner):
    turns = [SYNC_TURN, ASYNC_TURN, MIXED_TURN]
    trl_messages, trl_calls, trl_failures = _trl_tool_turn(trl_tools_trainer, turns)
    ours = [runner.run(copy.deepcopy(turn), ToolSet(TOOLS)) for turn in turns]
    assert sum(r.calls for r in ours) == trl_calls == sum(map(len, turns))
    # by design, a None result (a forgotten return) is a failure the model reads as one: TRL shows it "None", a success
    assert sum(r.failures for r in ours) == trl_failures + 1 == 6 + 2 + 2 + 1
    assert trl_messages[0][2] == {"role": "tool", "name": "nothing", "content": "None"}
    none_failed = {"role": "tool", "name": "nothing", "content": "{'error': 'Tool nothing returned no result.'}"}
    # sync calls only: the same messages, in the same order
    assert ours[0].messages == trl_messages[0][:2] + [none_failed] + trl_messages[0][3:]
    # TRL puts the results of the async calls that ran after every other message (a bad argument fails as the
    # coroutine is made, so it counts as not run); ours are in call order
    assert _trl_order(ASYNC_TURN, ours[1].messages) == trl_messages[1]
    assert _trl_order(MIXED_TURN, ours[2].messages) == trl_messages[2]
    assert [m["content"] for m in ours[1].messages] == [
        "page of u1", "{'error': 'status 404'}", "page of u2",
        "{'error': \"fetch() got an unexpected keyword argument 'link'\"}"]
    assert [m["name"] for m in ours[2].messages] == ["fetch", "add", "async_fails", "fails"]
    contents = [m["content"] for m in ours[0].messages]
    assert contents[:5] == ["5", "{'key': 'k', 'found': True}", none_failed["content"], "{'error': 'no disk'}",
                            "{'error': 'Tool missing_tool not found.'}"]
    assert "argument after ** must be a mapping, not str" in contents[5]
    assert "unexpected keyword argument 'c'" in contents[6] and "missing 1 required" in contents[7]
    assert contents[8] == "{'error': 'Unsupported tool call type: code'}"
    assert contents[9] == [{"type": "text", "text": "a cat"}]  # content blocks passed through, as TRL passes them


def test_trls_flat_call_shape_runs(runner):
    result = runner.run([{"name": "add", "arguments": {"a": 4, "b": 5}}, {"name": "lookup", "arguments": {"key": "q"}}],
                        ToolSet(TOOLS))
    assert [m["content"] for m in result.messages] == ["9", "{'key': 'q', 'found': True}"] and result.failures == 0


def test_a_none_result_is_a_failure_the_model_reads_said_once_per_tool(runner, monkeypatch, caplog):
    """A forgotten `return`, sync or async: counted in tools/failure_frequency, told to the model as an error, and
    warned about once per tool (TRL shows the model the text "None" as a success)."""
    import posttrain.agents.tools as tools_module

    async def async_nothing(x: int) -> None:
        """Returns None.

        Args:
            x: Ignored.
        """

    monkeypatch.setattr(tools_module, "_SAID_NONE", set())
    with caplog.at_level("WARNING", logger="posttrain"):
        results = [runner.run([call("nothing"), call("async_nothing", x=1), call("add", a=1, b=1)],
                              ToolSet([nothing, async_nothing, add])) for _ in range(2)]
    for result in results:
        assert (result.calls, result.failures) == (3, 2)
        assert [m["content"] for m in result.messages] == ["{'error': 'Tool nothing returned no result.'}",
                                                           "{'error': 'Tool async_nothing returned no result.'}", "2"]
    said = [r.getMessage() for r in caplog.records if "returned None" in r.getMessage()]
    assert [m.split(" (")[0] for m in said] == ["Tool 'nothing'", "Tool 'async_nothing'"]
    assert said[0].endswith("counts in tools/failure_frequency; return a string.")


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no text")


def test_an_exception_whose_str_raises_is_still_a_message_to_the_model(runner):
    def breaks(x: int) -> str:
        """Raises an exception that cannot be printed.

        Args:
            x: Ignored.
        """
        raise _Unprintable()

    async def async_breaks(x: int) -> str:
        """The same, async.

        Args:
            x: Ignored.
        """
        raise _Unprintable()

    result = runner.run([call("breaks", x=1), call("async_breaks", x=1)], ToolSet([breaks, async_breaks]))
    unreadable = "{'error': '<its message could not be read: _Unprintable.__str__ raised RuntimeError>'}"
    assert [m["content"] for m in result.messages] == [unreadable, unreadable] and result.failures == 2


@pytest.mark.parametrize("stop", [SystemExit(2), KeyboardInterrupt(), GeneratorExit()],
                         ids=["SystemExit", "KeyboardInterrupt", "GeneratorExit"])
def test_an_async_tool_that_would_stop_the_program_stops_the_run_and_the_loop_lives_on(runner, stop):
    """Raised inside the tools' event loop, such an exception would end its thread (TRL's run then waits forever);
    here it is one sentence, and the loop takes the next turn."""
    async def leave(why: str) -> str:
        """Leave.

        Args:
            why: Why.
        """
        raise stop

    with pytest.raises(UserFunctionError, match=rf"^Tool 'leave' \(.*leave\) raised {type(stop).__name__}"
                                                r"(\(2\))?, which would stop the program: "):
        runner.run([call("fetch", url="u1"), call("leave", why="bored")], ToolSet([leave, fetch]))
    assert runner.run([call("fetch", url="u2")], ToolSet([fetch])).messages[0]["content"] == "page of u2"


def test_a_keyboard_interrupt_on_the_main_thread_is_left_to_raise(runner):
    """A sync tool without tool_timeout runs on the main thread, where Ctrl-C lands: its KeyboardInterrupt is the
    user's, not the tool's, and raises as Python raises it."""
    def interrupted(x: int) -> str:
        """As if Ctrl-C arrived while it ran.

        Args:
            x: Ignored.
        """
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as raised:
        runner.run([call("interrupted", x=1)], ToolSet([interrupted]))
    assert type(raised.value) is KeyboardInterrupt


def test_async_calls_of_a_turn_run_together_on_one_event_loop_kept_between_turns(runner):
    loops, threads = [], []

    async def wait(seconds: float) -> str:
        """Sleeps.

        Args:
            seconds: How long.
        """
        loops.append(asyncio.get_running_loop())
        await asyncio.sleep(seconds)
        return "done"

    def where(tag: str) -> str:
        """Records its thread.

        Args:
            tag: A label.
        """
        threads.append(threading.current_thread())
        return tag

    tools = ToolSet([wait, where])
    start = time.perf_counter()
    result = runner.run([call("wait", seconds=0.3)] * 3 + [call("where", tag="x")], tools)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.6, elapsed  # 3 x 0.3 s, awaited together
    assert result.failures == 0 and [m["content"] for m in result.messages] == ["done"] * 3 + ["x"]
    runner.run([call("wait", seconds=0)], tools)
    assert len(set(loops)) == 1  # one loop for the run, as TRL's daemon loop
    assert threads == [threading.current_thread()]  # sync tools: in the calling thread, as in TRL (no timeout)


def test_a_sync_tool_returning_an_awaitable_has_it_awaited(runner):
    def decorated(x: int):
        """A sync wrapper returning a coroutine (a decorator on an async function).

        Args:
            x: The value.
        """
        return fetch(url=str(x))

    assert runner.run([call("decorated", x=7)], ToolSet([decorated])).messages[0]["content"] == "page of 7"


def test_tool_timeout_turns_a_hanging_call_into_an_error_message_counted_as_a_failure():
    release = threading.Event()

    def hangs(x: int) -> str:
        """Never returns in time.

        Args:
            x: Ignored.
        """
        release.wait(10)
        return "late"

    async def async_hangs(x: int) -> str:
        """Never returns in time.

        Args:
            x: Ignored.
        """
        await asyncio.sleep(10)

    tools = ToolSet([hangs, async_hangs, add])
    runner = ToolRunner(tool_timeout=0.2)
    try:
        start = time.perf_counter()
        result = runner.run([call("hangs", x=1), call("async_hangs", x=1), call("add", a=1, b=2)], tools)
        assert time.perf_counter() - start < 1.5
    finally:
        release.set()
        runner.close()
    assert [m["content"] for m in result.messages] == [
        "{'error': 'Tool hangs did not return within 0.2 seconds.'}",
        "{'error': 'Tool async_hangs did not return within 0.2 seconds.'}", "3"]
    assert (result.calls, result.failures) == (3, 2)


def test_an_async_tool_blocking_its_loop_past_the_timeout_is_timed_out_and_the_loop_replaced(monkeypatch, caplog):
    import posttrain.agents.tools as tools_module

    monkeypatch.setattr(tools_module, "LOOP_GRACE_SECONDS", 0.1)
    release = threading.Event()

    async def blocks(x: int) -> str:
        """Blocks its event loop (a sync wait inside an async def).

        Args:
            x: Ignored.
        """
        release.wait(5)
        return "late"

    runner = ToolRunner(tool_timeout=0.1)
    try:
        with caplog.at_level("WARNING", logger="posttrain"):
            result = runner.run([call("blocks", x=1)], ToolSet([blocks, fetch]))
        release.set()
        assert result.messages[0]["content"] == "{'error': 'Tool blocks did not return within 0.1 seconds.'}"
        assert "kept their event loop busy past tool_timeout" in caplog.text
        assert runner.run([call("fetch", url="u")], ToolSet([blocks, fetch])).messages[0]["content"] == "page of u"
    finally:
        release.set()
        runner.close()


def test_tool_timeout_must_be_positive():
    with pytest.raises(ToolError, match=r"tool_timeout must be a positive number of seconds or None"):
        ToolRunner(tool_timeout=0)


def test_a_list_that_is_not_content_blocks_is_refused_naming_the_tool(runner):
    def numbers(n: int) -> list:
        """A list of ints.

        Args:
            n: How many.
        """
        return list(range(n))

    with pytest.raises(UserFunctionError, match=r"^Tool 'numbers' \(numbers\) returned a list holding 0, which is not "
                                                r"a content block: return a string \(for example json\.dumps"):
        runner.run([call("numbers", n=3)], ToolSet([numbers]))


def test_trl_hands_such_a_list_to_the_template_which_renders_it_empty(trl_tools_trainer):
    """Why the list is refused: TRL's tool message holds it as content, which Qwen3's template drops."""
    trl = pytest.importorskip("trl")
    messages, _, _ = _trl_tool_turn(trl_tools_trainer, [[call("add", a=1, b=2)]])
    listed = [{**messages[0][0], "content": [1, 2, 3]}]
    template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    dummy = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call("add")]}]
    text = tiny_tokenizer().apply_chat_template(dummy + listed, chat_template=template, tokenize=False)
    assert "<tool_response>\n\n</tool_response>" in text


# ------------------------------------------------------------------ environments


class Counter:
    """An environment: a counter the model adds to."""

    def __init__(self):
        self.total, self.resets = 0, 0

    def reset(self, **row):
        self.total, self.resets, self.row = 0, self.resets + 1, row
        return f" Start at {row.get('start', 0)}."

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: The amount.
        """
        self.total += by
        return self.total

    def decrement(self, by: int) -> int:
        """Subtract from the counter.

        Args:
            by: The amount.
        """
        self.total -= by
        return self.total

    def _private(self):
        return None

    @property
    def doubled(self) -> int:
        raise AssertionError("properties are not run when methods are listed")

    def get_reward(self) -> float:
        return float(self.total)


class Lamp:
    """A second environment, with an async tool, an async reward and a reset returning content blocks."""

    def reset(self, **row):
        self.on = False
        return [{"type": "text", "text": " (lamp)"}]

    async def switch(self, on: bool) -> str:
        """Switch the lamp.

        Args:
            on: Whether to turn it on.
        """
        self.on, self.loop = on, asyncio.get_running_loop()
        return "on" if on else "off"

    async def get_reward(self) -> float:
        self.reward_loop = asyncio.get_running_loop()
        return 1.0 if self.on else 0.0


def _rows(n: int, **columns) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"q{i}"}], "start": i, **columns} for i in range(n)]


def test_environment_tools_prompts_and_pool_match_trl(tmp_path):
    trainer = _trl_trainer(tmp_path, environment_factory=Counter, tools=[add])
    pool = EnvironmentPool(Counter, tools=[add])
    assert pool.tools_of().names == [t.__name__ for t in trainer._env_tools[None]] == ["add", "decrement",
                                                                                         "increment"]
    assert trainer.reward_func_names[-1] == "Counter" and [n for n, _ in pool.reward_sources()] == ["Counter"]
    for step, n in enumerate([3, 2, 4]):  # the pool grows to the largest round, and is reused
        rows = _rows(n)
        trl_prompts = _trl_batch(trainer, rows)
        batch = pool.draw(rows)
        assert batch.prompts == trl_prompts  # "q0 Start at 0." ...: reset's text appended to the last message
        assert [env.row for env in batch.environments] == [env.row for env in trainer.environments] == rows
        assert len(pool.instances()) == len(trainer._environment_pool[None])
        assert batch.environments == pool.instances()[:n]
        for i, env in enumerate(batch.environments):
            assert batch.tools[i].get("increment").__self__ is env  # each row acts on its own instance
            assert trainer._sync_tool_dicts[i]["increment"].__self__ is trainer.environments[i]
            assert batch.tools[i].get("add") is add
    assert [env.resets for env in pool.instances()] == [3, 3, 2, 1]  # created once, reset at each use


@pytest.mark.parametrize("trainer_name", ["GRPOTrainer", "RLOOTrainer"])
def test_an_environments_reward_alone_with_reward_funcs_empty_as_trl(tmp_path, trainer_name):
    """reward_funcs=[] beside an environment_factory whose class has get_reward: TRL takes the environment's reward
    as the only one; so does posttrain (GRPO and RLOO)."""
    import posttrain
    from datasets import Dataset

    trl_trainer = _trl_trainer(tmp_path / "trl", environment_factory=Counter, reward_funcs=[])
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (Path(pytest.importorskip("trl").__file__).parent / "chat_templates" /
                               "qwen2_5.jinja").read_text()
    config = getattr(posttrain, trainer_name.replace("Trainer", "Config"))(
        output_dir=str(tmp_path / "ours"), per_device_train_batch_size=2, num_generations=2, max_steps=1,
        max_completion_length=8, report_to="none", use_cpu=True, save_strategy="no")
    ours = getattr(posttrain, trainer_name)(
        model=tiny_model(tokenizer, hidden=32, layers=1, max_positions=2048), reward_funcs=[], args=config,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]] * 2}),
        environment_factory=Counter)
    assert [f.name for f in ours.reward_funcs] == trl_trainer.reward_func_names == ["Counter"]
    ours.train()
    assert ours.state.global_step == 1


def test_routed_environments_match_trl_and_expose_only_their_tools(tmp_path):
    factories = {"counter": Counter, "lamp": Lamp}
    trainer = _trl_trainer(tmp_path, environment_factory=factories)
    pool = EnvironmentPool(factories)
    rows = [{**row, "environment": name} for row, name in zip(_rows(3), ["lamp", "counter", "lamp"])]
    trl_prompts = _trl_batch(trainer, rows)
    batch = pool.draw(rows)
    assert batch.prompts == trl_prompts  # text content became blocks for Lamp's blocks, as in TRL
    assert batch.prompts[0][-1]["content"] == [{"type": "text", "text": "q0"}, {"type": "text", "text": " (lamp)"}]
    assert [type(e) for e in batch.environments] == [type(e) for e in trainer.environments]
    assert batch.names == ["lamp", "counter", "lamp"]
    assert "environment" not in batch.environments[1].row and batch.environments[1].row == trainer.environments[1].row
    assert [t.names for t in batch.tools] == [["switch"], ["decrement", "increment"], ["switch"]]
    assert [[t.__name__ for t in trainer._env_tools[n]] for n in batch.names] == [t.names for t in batch.tools]
    assert [n for n, _ in pool.reward_sources()] == trainer.reward_func_names[-2:] == ["Counter", "Lamp"]


def test_environment_rewards_sync_and_async_one_event_loop(runner):
    pool = EnvironmentPool({"counter": Counter, "lamp": Lamp}, runner=runner)
    batch = pool.draw([{**row, "environment": n} for row, n in zip(_rows(3), ["counter", "lamp", "lamp"])])
    runner.run([call("increment", by=4)], batch.tools[0])
    runner.run([call("switch", on=True)], batch.tools[1])
    rewards = {name: fn(environments=batch.environments, prompts=[]) for name, fn in pool.reward_sources()}
    assert rewards == {"Counter": [4.0, None, None], "Lamp": [None, 1.0, 0.0]}
    lamp = batch.environments[1]
    assert lamp.reward_loop is lamp.loop  # async get_reward on the loop its async tools ran on
    assert [fn.__name__ for _, fn in pool.reward_sources()] == ["Counter", "Lamp"]


class _NoTools:
    def reset(self, **row):
        return None

    def _hidden(self, x: int) -> int:
        return x


class _NoReset:
    def act(self, x: int) -> int:
        """Act.

        Args:
            x: The value.
        """
        return x


class _UndocumentedMethod(_NoTools):
    def act(self, x: int) -> int:
        return x


class _ClashingMethod(_NoTools):
    def add(self, x: int) -> int:
        """A method named like a standalone tool.

        Args:
            x: The value.
        """
        return x


@pytest.mark.parametrize("factory, tools, error, says", [
    (_NoTools, [], ToolError, r"^The environment _NoTools \(from environment_factory\) has no public method, so the "
                              r"model has no tool to act on it with: define its actions as methods"),
    ({"a": _NoReset}, [], ToolError, r"^The environment _NoReset \(from environment_factory\['a'\]\) has no reset "
                                     r"method: define reset\(self, \*\*kwargs\)"),
    (_UndocumentedMethod, [], ToolError, r"^The environment _UndocumentedMethod's method '_UndocumentedMethod\.act' "
                                         r"cannot be described to the model: it has no docstring"),
    (_ClashingMethod, [add], ToolError, r"^Two tools are named 'add' \(add and _ClashingMethod\.add\)"),
    ({}, [], ToolError, r"^environment_factory is an empty dict"),
    ("Counter", [], ToolError, r"^environment_factory is str, not callable"),
    (lambda: 1 / 0, [], UserFunctionError, r"^environment_factory \(<lambda>\) raised ZeroDivisionError creating an "
                                           r"environment: division by zero\.$"),
])
def test_environments_that_cannot_be_used_are_refused_at_construction(factory, tools, error, says):
    with pytest.raises(error, match=says):
        EnvironmentPool(factory, tools=tools)


def test_a_row_routed_to_no_environment_is_refused():
    pool = EnvironmentPool({"counter": Counter})
    with pytest.raises(DataError, match=r"^Row 1 of the batch has environment='lamp', which is not one of "
                                        r"environment_factory's environments \('counter'\): fix the row's"):
        pool.draw([{**row, "environment": n} for row, n in zip(_rows(2), ["counter", "lamp"])])
    with pytest.raises(DataError, match=r"^Row 0 of the batch has no `environment` column"):
        pool.draw(_rows(1))


def test_reset_raising_names_the_class_and_the_row():
    class Fragile(Counter):
        def reset(self, **row):
            raise KeyError("answer")

    with pytest.raises(UserFunctionError, match=r"^Fragile\.reset raised KeyError: 'answer' on row 0 of the batch: "
                                                r"\{'prompt': .*; fix reset or that row\.$") as raised:
        EnvironmentPool(Fragile).draw(_rows(1))
    assert isinstance(raised.value.__cause__, KeyError)


def test_reset_that_takes_no_row_columns_and_bad_observations_are_refused():
    class Strict(Counter):
        def reset(self):
            return None

    class Numeric(Counter):
        def reset(self, **row):
            return 42

    with pytest.raises(UserFunctionError, match=r"^Strict\.reset cannot take the row's columns \(prompt, start\): "
                                                r"got an unexpected keyword argument 'prompt'; give it \*\*kwargs"):
        EnvironmentPool(Strict).draw(_rows(1))
    with pytest.raises(UserFunctionError, match=r"^Numeric\.reset returned int \(42\) for row 0 of the batch: "
                                                r"return None, a string"):
        EnvironmentPool(Numeric).draw(_rows(1))
    with pytest.raises(DataError, match=r"^Row 0 of the batch has a prompt that is not a conversation \('q'\)"):
        EnvironmentPool(Counter).draw([{"prompt": "q"}])


def test_an_async_reset_is_awaited_and_a_row_without_prompt_gets_trls_placeholder(runner):
    class AsyncReset(Counter):
        async def reset(self, **row):
            await asyncio.sleep(0)
            return "task 7"

    batch = EnvironmentPool(AsyncReset, runner=runner).draw([{"seed": 1}])
    assert batch.prompts == [[{"role": "user", "content": "task 7"}]]  # TRL's placeholder prompt, reset's text added


def test_append_observation_leaves_the_row_untouched():
    prompt = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert append_observation(prompt, "!") == [prompt[0], {"role": "user", "content": "u!"}]
    assert prompt[1]["content"] == "u" and append_observation(prompt, None) is prompt


# ------------------------------------------------------------------ rollout_func's output


def _output(**changes) -> dict:
    output = {"prompt_ids": [[1, 2], [3]], "completion_ids": [[4, 5, 6], [7]],
              "logprobs": [[-0.1, -0.2, -0.3], [-0.5]], "env_mask": [[1, 0, 1], [1]], "answer": ["a", "b"],
              "source": "dataset"}
    return {**output, **changes}


def test_rollout_output_checked_and_normalised():
    torch = pytest.importorskip("torch")
    checked = check_rollout_output(_output(completion_ids=[torch.tensor([4, 5, 6]), [7]],
                                           logprobs=[[-0.1, None, -0.3], [-0.5]]), 2, vocab_size=8)
    assert checked.completion_ids == [[4, 5, 6], [7]] and checked.prompt_ids == [[1, 2], [3]]
    assert checked.logprobs[0][0] == -0.1 and math.isnan(checked.logprobs[0][1])  # None read as NaN, as TRL reads it
    assert checked.env_mask == [[1, 0, 1], [1]]
    assert checked.extra == {"answer": ["a", "b"], "source": ["dataset", "dataset"]}  # not a list: every row's
    assert check_rollout_output(_output(logprobs=None, env_mask=None), 2).logprobs is None


@pytest.mark.parametrize("changes, says", [
    ({"prompt_ids": [[1, 2]]}, r"rollout_func's prompt_ids has 1 rows for 2 prompts: return one row per prompt"),
    ({"completion_ids": [[4, 5, 6], [9]]}, r"completion_ids\[1\]\[0\] is 9, outside the model's vocabulary \[0, 8\)"),
    ({"completion_ids": [[4, 5.0, 6], [7]]}, r"completion_ids\[0\]\[1\] is 5\.0 \(float\), not a token id"),
    ({"completion_ids": [[4, 5, 6], []]}, r"completion_ids\[1\] is empty: every row needs at least one token"),
    ({"prompt_ids": "1 2"}, r"prompt_ids is str: return a list with one row per prompt"),
    ({"prompt_ids": [[1, 2], 3]}, r"prompt_ids\[1\] is int, not a list"),
    ({"logprobs": [[-0.1, -0.2], [-0.5]]}, r"logprobs\[0\] has 2 values for the 3 tokens of completion_ids\[0\]: "
                                           r"return one log-probability per completion token"),
    ({"logprobs": [[-0.1, 0.5, -0.3], [-0.5]]}, r"logprobs\[0\]\[1\] is 0\.5, above 0, which no log-probability is"),
    ({"logprobs": [[-0.1, "x", -0.3], [-0.5]]}, r"logprobs\[0\]\[1\] is 'x' \(str\), not a number"),
    ({"env_mask": [[1, 0], [1]]}, r"env_mask\[0\] has 2 values for the 3 tokens of completion_ids\[0\]"),
    ({"env_mask": [[1, 2, 1], [1]]}, r"env_mask\[0\]\[1\] is 2: env_mask holds 1 for the model's tokens and 0"),
    ({"answer": ["a"]}, r"extra column 'answer' is a list of 1 values for 2 rows: return one value per row"),
    ({"completions": ["x", "y"]}, r"extra column 'completions' has the name of an argument the reward functions"),
])
def test_a_misshapen_rollout_output_names_the_field_and_the_row(changes, says):
    with pytest.raises(RolloutOutputError, match=says) as refused:
        check_rollout_output(_output(**changes), 2, vocab_size=8, reserved={"prompts", "completions"})
    assert str(refused.value).startswith("rollout_func's ") and "\n" not in str(refused.value)


def test_a_rollout_output_that_is_not_a_dict_or_lacks_keys_is_refused():
    with pytest.raises(RolloutOutputError, match=r"^rollout_func returned list, not a dict"):
        check_rollout_output([[1]], 1)
    with pytest.raises(RolloutOutputError, match=r"^rollout_func's output has no logprobs \(its keys: prompt_ids, "
                                                 r"completion_ids\): return prompt_ids, completion_ids and logprobs"):
        check_rollout_output({"prompt_ids": [[1]], "completion_ids": [[2]]}, 1)


def test_a_valid_rollout_output_is_read_as_trl_reads_it(tmp_path):
    """TRL's `_generate` with the same rollout_func: its tool mask is env_mask, its extra fields ours (the mask
    taken out), and it gives a row of a non-list value whole, as ours repeats it."""
    trainer = _trl_trainer(tmp_path)
    output = _output()
    trainer.rollout_func = lambda prompts, trl_trainer: copy.deepcopy(output)
    prompts = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]
    prompt_ids, completion_ids, tool_mask, _, logprobs, extra, _, _ = trainer._generate(prompts)
    ours = check_rollout_output(copy.deepcopy(output), len(prompts))
    assert (prompt_ids, completion_ids, logprobs) == (ours.prompt_ids, ours.completion_ids, ours.logprobs)
    assert tool_mask == ours.env_mask
    assert set(extra) == set(ours.extra)
    assert [[extra[k][i] if isinstance(extra[k], list) else extra[k] for k in extra] for i in range(2)] == [
        [ours.extra[k][i] for k in extra] for i in range(2)]


def test_a_factory_changing_class_is_refused_when_the_pool_grows():
    made = []

    def factory():
        made.append(1)
        return Counter() if len(made) == 1 else Lamp()

    pool = EnvironmentPool(factory)
    with pytest.raises(ToolError, match=r"^environment_factory returned a Counter first and then a Lamp: return "
                                        r"instances of one class"):
        pool.draw(_rows(2))


def _rollout_stage(fn, max_completion_length: int = 4):
    from posttrain.agents.loop import Budget
    from posttrain.agents.rollouts import AgentRollouts, Agents

    return AgentRollouts(tiny_tokenizer(), None, Agents(rollout_func=fn), chat_template=None, chat_template_kwargs={},
                         budget=Budget(max_completion_length, 512), vocab_size=100)


def test_rollout_rows_that_cannot_train_as_expected_are_said_once_a_run(caplog):
    """Rows whose env_mask is all 0 hold no token of the model's (no gradient); completions past
    max_completion_length train whole, as in TRL: each said once a run, not every step."""
    masked = _output(completion_ids=[[4, 5, 6], [7, 8, 9, 10, 11, 12]], logprobs=None, env_mask=[[0, 0, 0], [1] * 6])
    stage = _rollout_stage(lambda prompts, trainer: copy.deepcopy(masked))
    try:
        with caplog.at_level("WARNING", logger="posttrain"):
            for _ in range(2):
                _, rows, extra = stage._from_rollout_func(["a", "b"])
    finally:
        stage.close()
    assert [len(ids) for ids, _ in rows] == [3, 6] and extra["env_mask"][0] == [False] * 3  # trained as returned
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rollout_func")]
    assert len(said) == 2
    assert "returned 1 of 2 rows whose env_mask is all 0, so they hold no token of the model's" in said[0]
    assert "returned completions of up to 6 tokens, past max_completion_length=4; they are trained whole" in said[1]


def test_a_rollout_func_that_exits_stops_the_run_naming_it():
    def leave(prompts, trainer):
        raise SystemExit("done")

    stage = _rollout_stage(leave)
    try:
        with pytest.raises(UserFunctionError, match=r"^rollout_func '.*leave' raised SystemExit\('done'\), which would "
                                                    r"stop the program: .*remove the sys\.exit or raise an Exception "
                                                    r"instead\.$"):
            stage._from_rollout_func(["a"])
    finally:
        stage.close()


def test_an_environment_whose_reset_exits_stops_the_run_naming_it():
    class Quitter(Counter):
        def reset(self, **row):
            raise SystemExit(1)

    def factory():
        sys.exit(4)

    with pytest.raises(UserFunctionError, match=r"^Quitter\.reset, on row 0 of the batch: \{.*\}, raised SystemExit\(1\), "
                                                r"which would stop the program: "):
        EnvironmentPool(Quitter).draw(_rows(1))
    with pytest.raises(UserFunctionError, match=r"^environment_factory \(.*factory\), creating an environment, raised "
                                                r"SystemExit\(4\), which would stop the program: "):
        EnvironmentPool(factory).draw(_rows(1))


def test_a_tool_result_with_a_token_the_embedding_lacks_is_one_sentence():
    """A result holding a token added to the tokenizer, the embeddings not resized: one sentence naming the tool and
    the fix, not an IndexError (a device-side assert on a GPU) in the next turn's forward."""
    from posttrain.agents.loop import Budget
    from posttrain.agents.rollouts import AgentRollouts, Agents
    from posttrain.testing import TOOL_CHAT_TEMPLATE

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    rows = len(tokenizer)
    tokenizer.add_tokens(["<added>"])
    stage = AgentRollouts(tokenizer, None, Agents(tools=[lookup]), chat_template=TOOL_CHAT_TEMPLATE,
                          chat_template_kwargs={}, budget=Budget(64, 512), vocab_size=rows)
    try:
        assert stage._suffix_ids([{"role": "tool", "name": "lookup", "content": "found"}])
        with pytest.raises(DataError, match=rf"^The result of tool 'lookup' tokenizes to id {rows} \('<added>'\), "
                                            rf"beyond the model's {rows} embedding rows, as the tokenizer has "
                                            rf"{rows + 1} tokens: resize the model's embeddings"):
            stage._suffix_ids([{"role": "tool", "name": "lookup", "content": "found <added>"}])
    finally:
        stage.close()


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_an_environment_reward_that_exits_stops_the_run_naming_it(runner, is_async):
    """get_reward calling sys.exit, sync or async (on the tools' loop), reaches score as any reward function's does:
    one sentence naming the class and the step."""
    from posttrain.rewards import RewardError, resolve_reward_funcs, score
    from posttrain.configs import GRPOConfig

    class Exiting(Counter):
        def get_reward(self):
            raise SystemExit(5)

    class AsyncExiting(Counter):
        async def get_reward(self):
            raise SystemExit(5)

    cls = AsyncExiting if is_async else Exiting
    pool = EnvironmentPool(cls, runner=runner)
    batch = pool.draw(_rows(2))
    funcs = resolve_reward_funcs([fn for _, fn in pool.reward_sources()], GRPOConfig())
    with pytest.raises(RewardError, match=rf"^Reward function '{cls.__name__}', at step 3, raised SystemExit\(5\), "
                                          r"which would stop the program: "):
        score(funcs, ["p", "p"], ["a", "b"], [[1], [1]], {"environments": batch.environments}, None, 3)
    runner.run([call("fetch", url="u")], ToolSet([fetch]))  # the loop lives on
