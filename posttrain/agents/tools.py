"""Tools: plain Python functions the model calls, described to it by their JSON schema, and one turn's calls run.

    tools = ToolSet([search, calculate])          every function checked, its schema built (transformers' own code)
    runner = ToolRunner(tool_timeout=None)       one event loop (a daemon thread) for every async tool of the run
    result = runner.run(calls, tools)            ToolResults: the tool messages in call order, calls, failures

A tool is a function or method, `def` or `async def`, with a type hint for every argument and a Google-style
docstring describing each one: transformers' `get_json_schema` turns it into the schema the chat template shows the
model, and a function it cannot describe is refused here, before training, in one sentence naming the function and
the fix (TRL finds out when the first prompt is rendered).

One turn's calls, as TRL 1.16 runs them (`GRPOTrainer._tool_call_loop`):
- sync tools are called one after the other in the calling thread, in call order; then the async ones run together
  (`asyncio.gather`) on one event loop that lives as long as the runner (TRL's daemon loop), so an async tool may
  keep loop-bound state (a client session) between calls;
- a call that raises, an unknown tool name (`Tool {name} not found.`), arguments the function does not take (Python's
  TypeError for `fn(**arguments)`: not a mapping, an unexpected or a missing argument) or a call whose type is not
  "function" (`Unsupported tool call type: {type}`) becomes the tool message `str({"error": message})` and counts as
  a failure; the model sees it and the rollout goes on;
- a result that is a string is the message's content; a list of content blocks (`{"type": "text", ...}`,
  `{"type": "image", ...}`) is passed through as TRL passes it (multimodal tool results); None (a forgotten return)
  is a failure the model reads as an error, said once per tool (TRL shows it "None"); anything else but a list is
  `str(result)`, as in TRL. A list that is not content blocks is refused (UserFunctionError): TRL hands it to the
  chat template, which renders it empty (Qwen3), as Python's repr (Qwen2.5) or crashes (Qwen3-VL);
- a tool that raises SystemExit (sys.exit), or a KeyboardInterrupt or GeneratorExit of its own, stops the run with
  one sentence naming it, sync or async (TRL's run exits silently, or waits forever on its event loop).
Where posttrain differs: the messages are in call order (TRL puts the results of the async calls that ran after
every other message of the turn); a call in TRL's flat shape `{"name", "arguments"}` runs (TRL's loop reads
`call["type"]` and raises KeyError); a sync tool that returns an awaitable (a decorated async function) has it
awaited; tools with *args, **kwargs or positional-only parameters (which `fn(**arguments)` cannot fill), and two tools
of one name (TRL calls the last, while the prompt shows both), are refused; and `tool_timeout` (seconds, None: no
limit, as in TRL) bounds each call: past it the call becomes `str({"error": "Tool {name} did not return within {t}
seconds."})`, counted as a failure, and its thread or task is left behind (Python cannot stop a thread).
"""

import asyncio
import concurrent.futures
import inspect
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from posttrain.errors import (Raised, UserError, UserFunctionError, contained, function_name, message_of,
                              program_stop_message, stops_the_program)
from posttrain.timeouts import TimedOut, run_within, waiting_on

logger = logging.getLogger("posttrain")

# what waiting on a blocked event loop adds to tool_timeout before the calls still running count as timed out
LOOP_GRACE_SECONDS = 1.0


class ToolError(UserError, ValueError):
    """A tool or an environment cannot be used as given: transformers cannot describe it to the model, its name
    clashes with another tool's, or an environment has no reset or no tool methods. The message names it and the
    fix."""


# ------------------------------------------------------------------ schemas


def tool_schema(fn: Callable, what: str = "Tool") -> dict:
    """fn's JSON schema as transformers' `get_json_schema` writes it ({"type": "function", "function": {name,
    description, parameters}}), or ToolError naming fn and the fix (`what` is how the message names it: "Tool",
    "The environment Counter's method")."""
    from transformers.utils import get_json_schema

    name = function_name(fn)
    if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
        raise ToolError(f"{what} {name!r} is {_kind_of(fn)}, not a function: pass a plain function or method (def or "
                        f"async def) with type hints and a Google-style docstring, from which transformers' "
                        f"get_json_schema builds the schema the model sees.")
    _check_parameter_kinds(fn, name, what)
    problem = _undescribable(fn)
    if problem is None:
        try:
            return get_json_schema(fn)
        except Exception as err:  # noqa: BLE001 - a type hint transformers cannot write as JSON, a bad forward ref
            problem = (f"transformers' get_json_schema raised {type(err).__name__}: "
                       f"{_first_line(err)}; use str, int, float, bool, list, dict, Literal or Enum hints")
    raise ToolError(f"{what} {name!r} cannot be described to the model: {problem}.")


def _kind_of(fn) -> str:
    import functools

    if isinstance(fn, functools.partial):
        return "a functools.partial"
    if inspect.isclass(fn):
        return f"the class {fn.__name__}"
    if inspect.isbuiltin(fn):
        return "a builtin"
    return f"a {type(fn).__name__} object" if callable(fn) else f"not callable ({type(fn).__name__})"


def _check_parameter_kinds(fn: Callable, name: str, what: str) -> None:
    """The model passes arguments by name (`fn(**arguments)`): *args, **kwargs and positional-only parameters cannot
    be given, and transformers would describe *args and **kwargs as one argument of that name."""
    kinds = {inspect.Parameter.VAR_POSITIONAL: "*{}", inspect.Parameter.VAR_KEYWORD: "**{}",
             inspect.Parameter.POSITIONAL_ONLY: "{} (positional-only)"}
    for param in inspect.signature(fn).parameters.values():
        if param.kind in kinds:
            raise ToolError(f"{what} {name!r} has the parameter {kinds[param.kind].format(param.name)}, which the "
                            f"model cannot pass: the model calls a tool with named arguments, so give it named "
                            f"parameters only.")


def _undescribable(fn: Callable) -> str | None:
    """Why transformers' get_json_schema would refuse fn (checked in its order: docstring, type hints, argument
    descriptions), with the fix; None when it has all three."""
    from transformers.utils.chat_template_utils import parse_google_format_docstring

    doc = inspect.getdoc(fn)
    if not doc:
        return ("it has no docstring; add a Google-style docstring (a description, then an `Args:` section with one "
                "`name: description` line per argument), from which transformers' get_json_schema builds its schema")
    params = [p for p in inspect.signature(fn).parameters.values() if not _implicit_receiver(fn, p)]
    for param in params:
        if param.annotation is inspect.Parameter.empty:
            return (f"its argument {param.name!r} has no type hint; annotate every argument "
                    f"(for example `{param.name}: str`)")
    described = parse_google_format_docstring(doc.strip())[1] or {}
    for param in params:
        if param.name not in described:
            return (f"its docstring does not describe the argument {param.name!r}; add a line "
                    f"`{param.name}: <what it is>` under `Args:`")
    return None


def _implicit_receiver(fn: Callable, param: inspect.Parameter) -> bool:
    """`self` or `cls` without a hint as a plain function's first parameter (transformers leaves it out)."""
    first = next(iter(inspect.signature(fn).parameters))
    return param.name == first and first in ("self", "cls") and param.annotation is inspect.Parameter.empty


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__).rstrip(".")


class ToolSet:
    """The tools one rollout may call, by name, with their schemas.

    Attributes:
        functions: the callables, in the order given (the order their schemas are shown in).
        schemas: [T] their JSON schemas (what `apply_chat_template(tools=...)` renders).
    """

    def __init__(self, functions: Iterable[Callable] = (), what: str = "Tool"):
        """Check every function (tool_schema) and that no two share a name (TRL's loop finds a tool by `__name__`, so
        the later one would shadow the earlier while the prompt shows both); ToolError otherwise."""
        functions = tuple(functions)
        self._set(functions, [tool_schema(fn, what) for fn in functions])

    def _set(self, functions: tuple, schemas: list[dict]) -> None:
        self.functions, self.schemas = functions, schemas
        self._by_name: dict[str, Callable] = {}
        for fn, schema in zip(functions, schemas):
            name = schema["function"]["name"]
            if name in self._by_name:
                raise ToolError(f"Two tools are named {name!r} ({function_name(self._by_name[name])} and "
                                f"{function_name(fn)}): the model calls a tool by its name, so rename one.")
            self._by_name[name] = fn

    def with_functions(self, functions: Sequence[Callable]) -> "ToolSet":
        """The same tools (names, schemas, in order) as other callables: an environment's methods bound to another
        instance of its class. Nothing is checked again."""
        tools = object.__new__(ToolSet)
        tools._set(tuple(functions), self.schemas)
        return tools

    def __add__(self, other: "ToolSet") -> "ToolSet":
        """Both sets, this one's first (ToolError on a name in both)."""
        tools = object.__new__(ToolSet)
        tools._set(self.functions + other.functions, self.schemas + other.schemas)
        return tools

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    def get(self, name) -> Callable | None:
        return self._by_name.get(name) if isinstance(name, str) else None

    def __len__(self) -> int:
        return len(self.functions)


# ------------------------------------------------------------------ running one turn's calls


@dataclass
class ToolResults:
    """One turn's calls, run.

    Attributes:
        messages: [K] one tool message per call, in call order: {"role": "tool", "name": ..., "content": ...}.
        calls: K, the calls made (TRL's tool_call_count).
        failures: the calls that became an error message (TRL's tool_failure_count).
    """

    messages: list[dict]
    calls: int
    failures: int


@dataclass
class _Outcome:
    name: str
    content: Any
    failed: bool


def _error(name: str, message: str) -> _Outcome:
    """TRL's tool message for a failed call: the dict {"error": message} as str() writes it."""
    return _Outcome(name, str({"error": message}), True)


def _timed_out(name: str, timeout: float) -> _Outcome:
    return _error(name, f"Tool {name} did not return within {timeout:g} seconds.")


def _read_call(call) -> tuple[str, Any, str | None]:
    """(name, arguments, why it cannot run) of one parsed call: TRL's nested shape {"type": "function", "function":
    {"name", "arguments"}} or the flat {"name", "arguments"}; missing arguments are {} (as TRL's parser leaves
    them)."""
    if not isinstance(call, dict):
        return "unknown", None, f"Unsupported tool call: {call!r}"
    if "function" in call or "type" in call:
        if call.get("type") != "function":
            return call.get("name", "unknown"), None, f"Unsupported tool call type: {call.get('type')}"
        function = call.get("function")
        if not isinstance(function, dict):
            return "unknown", None, f"Unsupported tool call: {call!r}"
    else:
        function = call
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str):  # TRL's parser turns such a call into plain text; here it is reported as a call
        return "unknown", None, f"Unsupported tool call: {call!r}"
    return name, {} if arguments is None else arguments, None


def _content(name: str, fn: Callable, result) -> Any:
    """A result as a tool message's content: a string as is; a list of content blocks passed through (TRL's
    multimodal results); any other value but a list as str(result) (TRL's)."""
    if isinstance(result, str):
        return result
    if not isinstance(result, list):
        return str(result)
    for item in result:
        if not (isinstance(item, dict) and isinstance(item.get("type"), str)
                and (item["type"] != "text" or isinstance(item.get("text"), str))
                and (item["type"] != "image" or "image" in item)):
            raise UserFunctionError(
                f"Tool {name!r} ({function_name(fn)}) returned a list holding {_short(item)}, which is not a content "
                f"block: return a string (for example json.dumps of the value), or a list of blocks "
                f"{{'type': 'text', 'text': ...}} / {{'type': 'image', 'image': ...}}.")
    return result


_SAID_NONE: set[str] = set()  # tools whose None result was said (once per tool and process)


def _result(name: str, fn: Callable, result) -> _Outcome:
    """A tool's return value as its outcome: None (a forgotten `return`) is a failure the model reads as an error
    message, counted and said once per tool (TRL shows the model the text "None" as a success); anything else is
    the message's content (_content)."""
    if result is None:
        if name not in _SAID_NONE:
            _SAID_NONE.add(name)
            logger.warning(f"Tool {name!r} ({function_name(fn)}) returned None (a forgotten return?): the model is "
                           "told the call failed, and it counts in tools/failure_frequency; return a string.")
        return _error(name, f"Tool {name} returned no result.")
    return _Outcome(name, _content(name, fn, result), False)


def _stop_if_it_stops_the_program(name: str, fn: Callable, err: BaseException) -> None:
    """A tool that raised SystemExit, or a KeyboardInterrupt of its own, stops the run with one sentence (the run's
    own interrupt is left to raise)."""
    if stops_the_program(err):
        raise UserFunctionError(program_stop_message(f"Tool {name!r} ({function_name(fn)})", err)) from err


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class ToolRunner:
    """Runs tool calls: sync ones in the calling thread (each in a daemon thread when `tool_timeout` is set), async
    ones together on one event loop in a daemon thread, started on first use and kept until `close()`.

    Args:
        tool_timeout: seconds a call may take (None: no limit, as in TRL); past it the call is an error message to
            the model, counted as a failure.
    """

    def __init__(self, tool_timeout: float | None = None):
        if tool_timeout is not None and not tool_timeout > 0:
            raise ToolError(f"tool_timeout must be a positive number of seconds or None (no limit), not "
                            f"{tool_timeout!r}.")
        self.tool_timeout = tool_timeout
        self._loop = _LoopThread()

    def run(self, calls: Sequence[dict], tools: ToolSet) -> ToolResults:
        """Every call of one turn (module docstring): [K] calls -> their K tool messages in call order."""
        outcomes: list[_Outcome | None] = [None] * len(calls)
        pending = []  # (index, name, fn, awaitable): the async calls, awaited together once the sync ones ran
        for i, call in enumerate(calls):
            name, arguments, problem = _read_call(call)
            fn = tools.get(name)
            if problem is not None:
                outcomes[i] = _error(name, problem)
            elif fn is None:
                outcomes[i] = _error(name, f"Tool {name} not found.")
            else:
                outcome = self._call(name, fn, arguments)
                if isinstance(outcome, _Awaiting):
                    pending.append((i, name, fn, outcome.awaitable))
                else:
                    outcomes[i] = outcome
        for (i, _, _, _), outcome in zip(pending, self._await_tools(pending)):
            outcomes[i] = outcome
        messages = [{"role": "tool", "name": o.name, "content": o.content} for o in outcomes]
        return ToolResults(messages, len(calls), sum(o.failed for o in outcomes))

    def _call(self, name: str, fn: Callable, arguments) -> "_Outcome | _Awaiting":
        """fn(**arguments), run (a sync function) or made (an async function's coroutine, or an awaitable a sync
        function returned: awaited later, with the turn's other async calls). Binding errors raise here, for async
        functions too, as in TRL."""
        try:
            if inspect.iscoroutinefunction(fn):
                result = fn(**arguments)
            else:
                with waiting_on(f"tool {name!r}"):
                    result = run_within(lambda: fn(**arguments), self.tool_timeout, name=f"posttrain-tool-{name}")
        except TimedOut:
            return _timed_out(name, self.tool_timeout)
        except Exception as err:  # noqa: BLE001 - a failing tool is a message to the model, as in TRL
            return _error(name, message_of(err))
        except BaseException as err:
            _stop_if_it_stops_the_program(name, fn, err)
            raise  # the run's own interrupt
        if inspect.isawaitable(result):
            return _Awaiting(result)
        return _result(name, fn, result)

    def _await_tools(self, pending: list) -> list[_Outcome]:
        """The pending calls' outcomes, awaited together, each bounded by tool_timeout."""
        if not pending:
            return []
        outcomes: list[_Outcome | None] = [None] * len(pending)

        async def one(k: int, name: str, fn: Callable, awaitable) -> None:
            task = asyncio.ensure_future(contained(awaitable))  # a SystemExit inside would end the loop's thread
            done, _ = await asyncio.wait({task}, timeout=self.tool_timeout)
            if not done:
                task.cancel()
                outcomes[k] = _timed_out(name, self.tool_timeout)
            elif task.cancelled() or task.exception() is not None:
                outcomes[k] = _error(name, "" if task.cancelled() else message_of(task.exception()))
            else:
                outcomes[k] = _Outcome(name, task.result(), False)

        async def every() -> None:
            await asyncio.gather(*(one(k, name, fn, a) for k, (_, name, fn, a) in enumerate(pending)))

        names = ", ".join(repr(name) for _, name, _, _ in pending)
        limit = None if self.tool_timeout is None else self.tool_timeout + LOOP_GRACE_SECONDS
        try:
            self._loop.run(every(), f"tools {names}", limit)
        except concurrent.futures.TimeoutError:
            logger.warning(f"The async tools {names} kept their event loop busy past tool_timeout "
                           f"({self.tool_timeout:g} s; a blocking call inside an async def?): the calls still running "
                           f"count as timed out, and later async calls run on a new event loop.")
            self._loop.abandon()
        return [self._finished(outcome, call) for outcome, call in zip(outcomes, pending)]

    def _finished(self, outcome: _Outcome | None, pending_call) -> _Outcome:
        _, name, fn, _ = pending_call
        if outcome is None:
            return _timed_out(name, self.tool_timeout)
        if outcome.failed:
            return outcome
        if isinstance(outcome.content, Raised):
            _stop_if_it_stops_the_program(name, fn, outcome.content.err)
        return _result(name, fn, outcome.content)

    def await_all(self, awaitables: Sequence, what: str) -> list:
        """The awaitables' results, awaited together on the runner's event loop, an exception standing for one that
        raised (environments' async reset and get_reward: the same loop as their async tools)."""
        if not awaitables:
            return []

        async def every():
            return await asyncio.gather(*(contained(a) for a in awaitables), return_exceptions=True)

        return [r.err if isinstance(r, Raised) else r for r in self._loop.run(every(), what, None)]

    def close(self) -> None:
        """Stop the event loop (a later call starts a new one)."""
        self._loop.close()


@dataclass
class _Awaiting:
    """A call's awaitable, to be awaited with the turn's other async calls."""

    awaitable: Any


class _LoopThread:
    """An asyncio event loop running in a daemon thread, started on first use (TRL's "GRPOTrainer-AsyncLoop")."""

    def __init__(self):
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def run(self, coroutine, what: str, timeout: float | None):
        """coroutine's result, waited for at most `timeout` seconds (concurrent.futures.TimeoutError past it); an
        interrupt while waiting cancels it."""
        if self._loop is None:
            from posttrain.rewards.async_calls import DaemonThreads  # the rewards package loads torch: only now

            self._loop = asyncio.new_event_loop()
            self._loop.set_default_executor(DaemonThreads())  # asyncio.to_thread in a hanging tool never blocks exit
            self._thread = threading.Thread(target=self._loop.run_forever, name="posttrain-tools-loop", daemon=True)
            self._thread.start()
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            with waiting_on(what):
                return future.result(timeout)
        except BaseException:
            future.cancel()
            raise

    def abandon(self) -> None:
        """Leave a blocked loop to its daemon thread; the next run starts a new one."""
        self._loop = self._thread = None

    def close(self) -> None:
        loop, thread = self._loop, self._thread
        self.abandon()
        if loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=1.0)
        if not thread.is_alive():
            loop.close()
