"""Environments: `environment_factory=Cls` or `{name: Cls}`, one instance per rollout slot, reused across steps.

    pool = EnvironmentPool(environment_factory, tools=[...], runner=runner)    at construction: one probe per factory
    batch = pool.draw(rows)                  each round: an instance per row, reset with the row, prompts, tool sets
    batch.prompts[i], batch.tools[i]         the row's prompt (reset's text appended) and the tools it may call
    pool.reward_sources()                    (name, fn) for each environment class with a get_reward method

As TRL 1.16's GRPOTrainer does (`__init__` and `_generate_and_score_completions`):
- a factory is called once at construction (the probe, which seeds the pool); its class must define `reset`; its
  public methods (functions on the class, `_`-names, `reset` and `get_reward` left out, in name order) are tools,
  shown after the standalone `tools`;
- each round, the k-th row of an environment gets the pool's k-th instance of it, created when the pool has fewer;
  so instances are created once and reset between uses;
- `reset(**row)`: the row's columns (without `environment` when routing with a dict); what it returns (None, a
  string or a list of content blocks) is appended to the prompt's last message's content; a row without a
  `prompt` gets TRL's placeholder `[{"role": "user", "content": ""}]`;
- with a dict of factories, each row's `environment` column names its environment, and only that environment's
  tools are in its prompt and callable in its rollout;
- `get_reward()` (sync or async) is a reward source of weight 1 named after the class, one per class: a rollout of
  another class gets None from it.
Where posttrain differs: an environment without public methods, or whose methods cannot be described to the model, is
refused at construction (ToolError); a tool name shared by a standalone tool and a method is refused; an async
`reset` is awaited (on the tools' event loop, as async `get_reward` is); `reset` raising, or returning something that
cannot be appended, stops with one sentence naming the class and the row.
"""

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from posttrain.agents.tools import ToolError, ToolRunner, ToolSet
from posttrain.data import DataError
from posttrain.errors import (UserFunctionError, detail_of, function_name, program_stop_message, signature_mismatch,
                              stops_the_program)

PLACEHOLDER_PROMPT = ({"role": "user", "content": ""},)  # TRL's prompt for a row without one
NOT_TOOLS = ("reset", "get_reward")


@dataclass(frozen=True)
class _Environment:
    """One environment name: its factory, class, tool methods' names and its tools (standalone + methods)."""

    factory: Callable[[], Any]
    cls: type
    methods: tuple[str, ...]
    tools: ToolSet


@dataclass
class EnvironmentBatch:
    """One round's environments, one per row.

    Attributes:
        names: [N] each row's environment name (None with a single factory).
        environments: [N] the instances, reset with their rows (reward functions receive them as `environments`).
        prompts: [N] the rows' prompts with what reset returned appended.
        tools: [N] the tools each row may call: the standalone tools and its instance's methods.
    """

    names: list
    environments: list
    prompts: list
    tools: list[ToolSet]


class EnvironmentPool:
    """The environments of a run (module docstring).

    Args:
        environment_factory: a callable returning an environment, or {name: callable} routed by the rows'
            `environment` column.
        tools: the standalone tools (shown first in every prompt).
        runner: the ToolRunner whose event loop awaits async reset and get_reward.
    """

    def __init__(self, environment_factory, tools: Sequence[Callable] | ToolSet = (), runner: ToolRunner | None = None):
        self.routed = isinstance(environment_factory, Mapping)
        factories = dict(environment_factory) if self.routed else {None: environment_factory}
        if not factories:
            raise ToolError("environment_factory is an empty dict: map at least one name to a factory (a class or a "
                            "function returning an environment), or pass one factory.")
        self.runner = runner or ToolRunner()
        self.standalone = tools if isinstance(tools, ToolSet) else ToolSet(tools)
        self._kinds: dict[Any, _Environment] = {}
        self._pool: dict[Any, list] = {}
        for name, factory in factories.items():
            probe = _create(name, factory)
            self._kinds[name] = self._describe(name, factory, probe)
            self._pool[name] = [probe]

    def _describe(self, name, factory, probe) -> _Environment:
        cls = type(probe)
        members = dict(inspect.getmembers(cls, predicate=inspect.isfunction))  # on the class: properties not run
        if "reset" not in members:
            raise ToolError(f"The environment {cls.__name__} (from environment_factory{_label(name)}) has no reset "
                            f"method: define reset(self, **kwargs), which readies it for a new rollout with the row's "
                            f"columns and may return text to append to the prompt.")
        methods = tuple(m for m in members if m not in NOT_TOOLS and not m.startswith("_"))
        if not methods:
            raise ToolError(f"The environment {cls.__name__} (from environment_factory{_label(name)}) has no public "
                            f"method, so the model has no tool to act on it with: define its actions as methods with "
                            f"type hints and a Google-style docstring (names starting with _ are not tools).")
        own = ToolSet([getattr(probe, m) for m in methods], what=f"The environment {cls.__name__}'s method")
        return _Environment(factory, cls, methods, self.standalone + own)

    @property
    def names(self) -> list:
        """The environments' names (None alone with a single factory)."""
        return list(self._kinds)

    def tools_of(self, name=None) -> ToolSet:
        """The tools a row of environment `name` sees: the standalone ones, then the environment's methods."""
        return self._kinds[name].tools

    def instances(self, name=None) -> list:
        """The pool's instances of environment `name`, in the order rows draw them."""
        return list(self._pool[name])

    def draw(self, rows: Sequence[Mapping]) -> EnvironmentBatch:
        """An instance per row (the k-th row of an environment: its k-th instance), each reset with its row."""
        names = [self._route(i, row) for i, row in enumerate(rows)]
        environments, drawn = [], {}
        for name in names:
            k = drawn[name] = drawn.get(name, -1) + 1
            if k == len(self._pool[name]):
                self._pool[name].append(self._another(name))
            environments.append(self._pool[name][k])
        observations = self._reset(rows, environments)
        prompts = [append_observation(row.get("prompt", [dict(m) for m in PLACEHOLDER_PROMPT]), seen, env, i)
                   for i, (row, env, seen) in enumerate(zip(rows, environments, observations))]
        tools = [self._kinds[name].tools.with_functions(
            self.standalone.functions + tuple(getattr(env, m) for m in self._kinds[name].methods))
            for name, env in zip(names, environments)]
        return EnvironmentBatch(names, environments, prompts, tools)

    def _another(self, name):
        """A new instance of environment `name`, of its probe's class (whose methods the prompts show as tools)."""
        kind, env = self._kinds[name], _create(name, self._kinds[name].factory)
        if type(env) is not kind.cls:
            raise ToolError(f"environment_factory{_label(name)} returned a {kind.cls.__name__} first and then a "
                            f"{type(env).__name__}: return instances of one class (whose methods are the tools in "
                            f"the prompt), or route rows to several classes with a dict of factories.")
        return env

    def _route(self, i: int, row: Mapping):
        """Row i's environment name: its `environment` column with a dict of factories, else None."""
        if not self.routed:
            return None
        known = ", ".join(repr(n) for n in self._kinds)
        if "environment" not in row:
            raise DataError(f"Row {i} of the batch has no `environment` column, which routes each row to one of "
                            f"environment_factory's environments ({known}): add the column to the dataset.")
        if row["environment"] not in self._kinds:
            raise DataError(f"Row {i} of the batch has environment={row['environment']!r}, which is not one of "
                            f"environment_factory's environments ({known}): fix the row's `environment` column, or "
                            f"add a factory of that name.")
        return row["environment"]

    def _reset(self, rows: Sequence[Mapping], environments: list) -> list:
        """What each environment's reset(**row) returned (async ones awaited together on the runner's loop)."""
        results, pending = [], []
        for i, (row, env) in enumerate(zip(rows, environments)):
            kwargs = {k: v for k, v in row.items() if k != "environment"} if self.routed else dict(row)
            mismatch = signature_mismatch(env.reset, **kwargs)
            if mismatch:
                raise UserFunctionError(f"{type(env).__name__}.reset cannot take the row's columns "
                                        f"({', '.join(kwargs) or 'none'}): {mismatch}; give it **kwargs, as it is "
                                        f"called with every column of the row ({_row(i, row)}).")
            try:
                results.append(env.reset(**kwargs))
            except BaseException as err:  # an Exception, or SystemExit and the like (errors.stops_the_program)
                if isinstance(err, Exception) or stops_the_program(err):
                    raise _reset_failed(env, i, row, err) from err
                raise  # the run's own interrupt
            if inspect.isawaitable(results[-1]):
                pending.append(i)
        awaited = self.runner.await_all([results[i] for i in pending], "an environment's reset")
        for i, result in zip(pending, awaited):
            if isinstance(result, BaseException):
                raise _reset_failed(environments[i], i, rows[i], result) from result
            results[i] = result
        return results

    def reward_sources(self) -> list[tuple[str, Callable]]:
        """(class name, reward function) for each environment class with a get_reward method, once per class, in
        the factories' order. The function takes `environments` (the batch's, one per completion) and any keyword,
        and returns [N] get_reward() of each instance of its class, None for the others; async get_reward methods
        are awaited together on the runner's loop, so the function itself is sync."""
        sources, seen = [], set()
        for kind in self._kinds.values():
            if kind.cls in seen or not inspect.isfunction(getattr(kind.cls, "get_reward", None)):  # as TRL finds it
                continue
            seen.add(kind.cls)
            sources.append((kind.cls.__name__, _reward_function(kind.cls, self.runner)))
        return sources


def _create(name, factory):
    if not callable(factory):
        raise ToolError(f"environment_factory{_label(name)} is {type(factory).__name__}, not callable: pass the "
                        f"environment's class, or a function returning a new environment.")
    try:
        return factory()
    except BaseException as err:  # an Exception, or SystemExit and the like (errors.stops_the_program)
        if not (isinstance(err, Exception) or stops_the_program(err)):
            raise  # the run's own interrupt
        what = f"environment_factory{_label(name)} ({function_name(factory)})"
        if stops_the_program(err):
            raise UserFunctionError(program_stop_message(f"{what}, creating an environment,", err)) from err
        raise UserFunctionError(f"{what} raised {type(err).__name__} creating an environment{detail_of(err)}.") from err


def _label(name) -> str:
    return "" if name is None else f"[{name!r}]"


def _row(i: int, row: Mapping, limit: int = 100) -> str:
    text = repr(dict(row))
    return f"row {i} of the batch: {text if len(text) <= limit else text[:limit - 3] + '...'}"


def _reset_failed(env, i: int, row: Mapping, err: BaseException) -> UserFunctionError:
    if stops_the_program(err):
        return UserFunctionError(program_stop_message(f"{type(env).__name__}.reset, on {_row(i, row)},", err))
    return UserFunctionError(f"{type(env).__name__}.reset raised {type(err).__name__}{detail_of(err)} on "
                             f"{_row(i, row)}; fix reset or that row.")


def append_observation(prompt, observation, env=None, i: int = 0):
    """The prompt with reset's return appended to its last message's content, as TRL appends it (a new prompt; the
    row's is left as it is): None leaves it; a string is appended to text content (or added as a text block to a
    list of blocks); a list of blocks is appended to a list (text content becomes a text block first)."""
    if observation is None:
        return prompt
    owner = type(env).__name__ if env is not None else "The environment"
    if not isinstance(observation, (str, list)):
        raise UserFunctionError(f"{owner}.reset returned {type(observation).__name__} ({observation!r:.60}) for row "
                                f"{i} of the batch: return None, a string to append to the prompt, or a list of "
                                f"content blocks.")
    if not (isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[-1], Mapping)
            and isinstance(prompt[-1].get("content"), (str, list))):
        raise DataError(f"Row {i} of the batch has a prompt that is not a conversation ({prompt!r:.60}), so the text "
                        f"{owner}.reset returned has no message to be appended to: give the rows conversational "
                        f"prompts (a list of messages), or no prompt column.")
    content = prompt[-1]["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return list(prompt[:-1]) + [{**prompt[-1], "content": content + observation}]


def _reward_function(cls: type, runner: ToolRunner) -> Callable:
    """get_reward() of each of `environments` whose type is exactly `cls` (None for the others), as TRL scores them;
    named after the class."""
    def reward(environments=None, **kwargs) -> list:
        environments = list(environments or [])
        mine = {i for i, env in enumerate(environments) if type(env) is cls}
        values = [env.get_reward() if i in mine else None for i, env in enumerate(environments)]
        pending = [i for i in sorted(mine) if inspect.isawaitable(values[i])]
        for i, value in zip(pending, runner.await_all([values[i] for i in pending], f"{cls.__name__}.get_reward")):
            if isinstance(value, BaseException):
                raise value
            values[i] = value
        return values

    reward.__name__ = reward.__qualname__ = cls.__name__
    return reward
