"""Reward functions: calling them and checking what they return (resolving.py resolves what the user named).

The calling convention is TRL's: `f(prompts, completions, completion_ids, **kwargs) -> list[float | None]`,
where kwargs hold every other dataset column (one value per completion), `trainer_state` (a
`transformers.TrainerState`), and `log_extra(column, values)` / `log_metric(name, value)` to add columns to the
completions log and scalars to the metrics. Functions may be `async def`; those run concurrently. A
sequence-classification model scores prompt + completion, tokenized by its own tokenizer (or the one given in
`reward_processing_classes`). None means "not applicable"; it becomes NaN in the reward matrix and is left out of
statistics.

While a user's function runs (not posttrain's built-ins, which return), the main thread is marked as waiting on it
(posttrain/timeouts.py's `waiting_on`): a SIGINT or SIGTERM then stops the run at once, naming the function
(training/interrupts.py), rather than at the end of a step the function might never let come.

TRL's built-in rewards are importable from here under TRL's names: accuracy_reward, reasoning_accuracy_reward,
get_cosine_scaled_reward, think_format_reward, get_repetition_penalty_reward, get_soft_overlong_punishment.
"""

import asyncio
import contextlib
import logging
import math
import numbers
from typing import Any

import torch

from posttrain.errors import Raised, UserError, contained, detail_of, program_stop_message, stops_the_program
from posttrain.rewards.resolving import (CONVENTION_ARGS, PASSED_WHOLE, RewardFunction,  # noqa: F401 - the API
                                         check_required_columns, import_dotted, resolve_reward_funcs,
                                         unaccepted_keywords, without_kwargs_message)
from posttrain.rewards.async_calls import run_async
from posttrain.rewards.timeouts import TimedOut, hanging_row, run_within
from posttrain.timeouts import waiting_on

logger = logging.getLogger("posttrain")


class RewardError(UserError, RuntimeError):
    """A reward function failed or returned something unusable; the message names it and the step. When it raised,
    its own exception is the cause, whose traceback the command line prints above the message."""

    shows_cause = True


_NO_LOGGERS = {"log_extra": lambda column, values: None, "log_metric": lambda name, value: None}


def reward_weights(weights: list | None, given: int, sources: int) -> torch.Tensor:
    """[given + sources] the reward_weights of the `given` reward functions (default 1), then 1 for each
    environment's get_reward."""
    from posttrain.configs import ConfigError

    if weights is None:
        return torch.ones(given + sources)
    if len(weights) != given:
        raise ConfigError(f"reward_weights has {len(weights)} entries for {given} reward functions: give one "
                          "weight per function (an environment's get_reward has weight 1).")
    return torch.cat([torch.tensor([float(w) for w in weights]), torch.ones(sources)])


def _model_scores(f: RewardFunction, prompts, completions) -> list[float]:
    if isinstance(prompts[0], list):
        texts = [f.tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
    else:
        texts = [p + c for p, c in zip(prompts, completions)]
    enc = f.tokenizer(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    device = next(f.model.parameters()).device
    with torch.inference_mode():
        logits = f.model(**{k: v.to(device) for k, v in enc.items()}).logits
    return logits[:, 0].float().tolist()


FLOAT32_MAX = 3.4028234663852886e38  # rewards are float32 tensors: anything larger becomes inf


def _as_number(v):
    """A reward value as a Python float; None for None; raises TypeError for anything that is not a number.

    numpy and torch scalars (bools too, as Python's bools are) count as numbers."""
    if v is None:
        return None
    if hasattr(v, "item") and callable(v.item) and getattr(v, "ndim", getattr(v, "dim", lambda: 0)) in (0, ()):
        v = v.item()  # numpy / torch scalars
    if isinstance(v, numbers.Real):
        return float(v)
    raise TypeError(type(v).__name__)


def _check_output(f: RewardFunction, values, n: int, step: int, bad_rows: list | None) -> list[float]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if isinstance(values, (dict, set, frozenset, str, bytes)) or not hasattr(values, "__len__"):
        kind = {dict: "a dict (its keys would be taken as the rewards)", set: "a set (it has no order)",
                frozenset: "a set (it has no order)"}.get(type(values), type(values).__name__)
        raise RewardError(f"Reward function {f.name!r} returned {kind} at step {step}: return a list with one float "
                          "(or None) per completion, in the order of the completions.")
    values = list(values)
    if len(values) != n:
        raise RewardError(f"Reward function {f.name!r} returned {len(values)} values for {n} completions at "
                          f"step {step}: return one float (or None) per completion.")
    out = []
    for i, v in enumerate(values):
        try:
            number = _as_number(v)
        except TypeError:
            raise RewardError(f"Reward function {f.name!r} returned {v!r} ({type(v).__name__}) for completion "
                              f"{i} at step {step}: rewards must be numbers or None.") from None
        if number is None:
            out.append(math.nan)
        elif not math.isfinite(number) or abs(number) > FLOAT32_MAX:
            if bad_rows is None:
                problem = "rewards must be finite" if not math.isfinite(number) else (
                    "rewards must fit in float32 (|r| < 3.4e38), or they become inf")
                raise RewardError(f"Reward function {f.name!r} returned {v} for completion {i} at step {step}: "
                                  f"{problem} (return None for 'not applicable', or set on_bad_reward=skip to skip "
                                  "such groups).")
            bad_rows.append(i)
            out.append(math.nan)
        else:
            out.append(number)
    return out


def reward_inputs(tokenizer, rollouts, conversational: bool) -> tuple[list, list, list]:
    """What reward functions receive from rollouts: (completion_ids without padding, texts, completions).

    Completions are the texts, or `[{"role": "assistant", "content": text}]` for conversational prompts.
    """
    completion_ids = rollouts.completion_lists()
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    return completion_ids, texts, completions


def _async_results(funcs: list[RewardFunction], keys: list[int], call: dict, timeout: float | None, step: int,
                   prompt_indices, bad_rows) -> dict:
    """{key: what the async function returned} for `funcs` (score's `keys`), awaited together within `timeout`: a
    time-out as score handles it, anything raised as score raises it."""
    results = {}
    for k, f, out in zip(keys, funcs, _run_async_within(funcs, call, timeout)):
        if isinstance(out, (TimedOut, asyncio.TimeoutError)):
            results[k] = _timed_out(f, step, call, prompt_indices, timeout, bad_rows)
        elif isinstance(out, Raised):  # SystemExit and the like, held (errors.contained)
            raise _raised(f, out.err, step, call, prompt_indices) from out.err
        elif isinstance(out, Exception):
            raise _raised(f, out, step, call, prompt_indices) from out
        elif isinstance(out, BaseException):  # the run's own interrupt: as it is
            raise out
        else:
            results[k] = out
    return results


def score(funcs: list[RewardFunction], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list], trainer_state: Any, step: int, bad_rows: list | None = None,
          prompt_indices: list[int] | None = None, loggers: dict | None = None,
          timeout: float | None = None) -> torch.Tensor:
    """Call every reward function on N completions.

    Args:
        prompts, completions: N prompts and completions (strings, or message lists if conversational).
        completion_ids: N token-id lists without padding.
        columns: other dataset columns, each a list of N values.
        bad_rows: None to stop on a NaN/inf reward or a timeout; a list to skip instead: such values become NaN and
            the completions' indices are appended to the list.
        prompt_indices: each completion's prompt's index in the dataset, named when a function raises.
        loggers: {"log_extra": f(column, values), "log_metric": f(name, value)} passed to every function; default
            functions that drop what they are given.
        timeout: seconds a function may take (reward_timeout); None waits as long as it takes.
    Returns:
        [N, F] float32 rewards, NaN where a function returned None.
    """
    n = len(completions)
    kwargs = dict(columns, trainer_state=trainer_state, **(loggers or _NO_LOGGERS))
    call = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
    for f in funcs:  # one that cannot take what it is passed would raise TypeError (async: before awaiting)
        unaccepted = unaccepted_keywords(f.fn, call) if f.fn is not None else []
        if unaccepted:
            raise RewardError(without_kwargs_message(f.name, unaccepted))
    results: dict[int, Any] = {}
    pending = []
    for k, f in enumerate(funcs):
        try:
            if f.model is not None:
                results[k] = _model_scores(f, prompts, completions)
            elif f.is_async:
                pending.append(k)
            else:
                with _waiting_on(f):
                    results[k] = run_within(lambda f=f: f.fn(**call), timeout)
        except TimedOut:
            results[k] = _timed_out(f, step, call, prompt_indices, timeout, bad_rows)
        except BaseException as err:  # an Exception, or SystemExit and the like (errors.stops_the_program)
            if not (isinstance(err, Exception) or stops_the_program(err)):
                raise  # the run's own interrupt
            raise _raised(f, err, step, call, prompt_indices) from err
    if pending:
        results.update(_async_results([funcs[k] for k in pending], pending, call, timeout, step, prompt_indices,
                                      bad_rows))
    matrix = [results[k] if results[k] is _SKIPPED else _checked(funcs[k], results[k], n, step, bad_rows)
              for k in range(len(funcs))]
    matrix = [[math.nan] * n if values is _SKIPPED else values for values in matrix]
    for f, values in zip(funcs, matrix):
        if all(math.isnan(v) for v in values):
            logger.warning("Reward function %r returned None for all %d completions at step %d: it adds nothing to "
                           "training. Check that the dataset has the columns it reads.", f.name, n, step)
    return torch.tensor(matrix, dtype=torch.float32).T.reshape(n, len(funcs))


_SKIPPED = object()  # a timed-out function's result under on_bad_reward=skip: every completion is skipped


def _described(f: RewardFunction) -> str:
    """A reward function as the sentence of an interrupted run names it."""
    return f"reward function {f.name!r}"


def _waiting_on(f: RewardFunction):
    """timeouts.waiting_on `f` while it runs, so that a signal stops the run at once (it might never return); not
    for posttrain's own built-ins, which do return: a signal then lets the step finish and checkpoint it."""
    ours = (getattr(f.fn, "__module__", None) or "").startswith("posttrain.")
    return contextlib.nullcontext() if ours else waiting_on(_described(f))


def _run_async_within(funcs: list[RewardFunction], call: dict, timeout: float | None) -> list:
    """Await the async functions together, each within `timeout` (a coroutine that blocks without awaiting is
    caught by a limit on the whole event loop). While they run, the main thread waits on those not yet returned
    (timeouts.waiting_on)."""
    running = dict.fromkeys(range(len(funcs)))  # ordered: the functions not yet returned

    async def tracked(k: int, coroutine):
        try:
            return await contained(coroutine)  # a SystemExit inside would end the loop rather than say whose it is
        finally:
            running.pop(k, None)

    def waited() -> str:
        pending = list(running)  # one copy (with reward_timeout, another thread's loop updates it)
        names = [funcs[k].name for k in (pending or range(len(funcs)))]
        return f"reward function {names[0]!r}" if len(names) == 1 else f"reward functions {', '.join(map(repr, names))}"

    with waiting_on(waited):
        if timeout is None:
            return run_async([tracked(k, f.fn(**call)) for k, f in enumerate(funcs)])
        try:
            return run_within(lambda: run_async([tracked(k, asyncio.wait_for(f.fn(**call), timeout))
                                                  for k, f in enumerate(funcs)]), timeout + 1.0)
        except TimedOut:
            return [TimedOut()] * len(funcs)


def _timed_out(f: RewardFunction, step: int, call: dict, prompt_indices, timeout: float, bad_rows: list | None):
    """The error of a reward function past reward_timeout (naming the first completion that alone hangs it), or,
    with on_bad_reward=skip, a warning and every completion marked to skip."""
    n = len(call["completions"])
    if bad_rows is not None:
        logger.warning("Reward function %r did not return within reward_timeout=%s s at step %d: the %d completions "
                       "it was scoring are skipped (on_bad_reward=skip).", f.name, timeout, step, n)
        bad_rows.extend(range(n))
        return _SKIPPED

    def call_row(i):
        one = {k: v[i:i + 1] for k, v in call.items() if k not in PASSED_WHOLE}
        one.update(trainer_state=call["trainer_state"], **_NO_LOGGERS)
        if not f.is_async:
            return f.fn(**one)
        out = run_async([asyncio.wait_for(f.fn(**one), timeout)])[0]
        if isinstance(out, asyncio.TimeoutError):
            raise TimedOut()
        return out

    with _waiting_on(f):  # probing calls it again
        row = hanging_row(call_row, n, timeout) if f.fn is not None else None
    where = ""
    if row is not None:
        where = f" on completion {row}" + (f" (prompt {prompt_indices[row]} of the dataset)" if prompt_indices else "")
    raise RewardError(f"Reward function {f.name!r} did not return within reward_timeout={timeout} s at step {step}"
                      f"{where}: make it faster, raise reward_timeout, or set on_bad_reward=skip to skip such "
                      "batches.")


def _checked(f: RewardFunction, values, n: int, step: int, bad_rows: list | None) -> list[float]:
    """_check_output, and with on_bad_reward=skip one warning per function that returned NaN or inf."""
    skipped = [] if bad_rows is not None else None
    out = _check_output(f, values, n, step, skipped)
    if skipped:
        logger.warning("Reward function %r returned NaN or inf for %d completion(s) at step %d (first: completion "
                       "%d): their groups are skipped (on_bad_reward=skip).", f.name, len(skipped), step, skipped[0])
        bad_rows.extend(skipped)
    return out


def _raised(f: RewardFunction, err: BaseException, step: int, call: dict, prompt_indices) -> RewardError:
    """The error for a reward function that raised, naming the first completion that alone makes it raise (not
    probed for SystemExit and the like: calling it again would raise it again)."""
    if stops_the_program(err):
        return RewardError(program_stop_message(f"Reward function {f.name!r}, at step {step},", err))
    with _waiting_on(f):  # probing calls it again
        row = _failing_row(f, call)
    where = ""
    if row is not None:
        where = f" on completion {row}" + (f" (prompt {prompt_indices[row]} of the dataset)" if prompt_indices else "")
    return RewardError(f"Reward function {f.name!r} raised {type(err).__name__} at step {step}{where}"
                       f"{detail_of(err)}. Fix the function, or have it return None for completions it cannot score.")


def _failing_row(f: RewardFunction, call: dict) -> int | None:
    """Call `f` on one completion at a time; the index of the first call that raises, or None.

    Run only after `f` raised on the whole batch, to say which input did it.
    """
    if f.fn is None:
        return None
    n = len(call["completions"])
    for i in range(n):
        one = {k: v[i:i + 1] for k, v in call.items() if k not in PASSED_WHOLE}
        one.update(trainer_state=call["trainer_state"], **_NO_LOGGERS)
        try:
            out = run_async([f.fn(**one)])[0] if f.is_async else f.fn(**one)
        except Exception:
            return i
        if isinstance(out, BaseException):
            return i
    return None


from posttrain.rewards.builtin import (get_repetition_penalty_reward, get_soft_overlong_punishment,  # noqa: E402
                                       think_format_reward)
from posttrain.rewards.math_answers import (accuracy_reward, get_cosine_scaled_reward,  # noqa: E402
                                            reasoning_accuracy_reward)

__all__ = ["RewardError", "RewardFunction", "accuracy_reward", "check_required_columns", "get_cosine_scaled_reward",
           "get_repetition_penalty_reward", "get_soft_overlong_punishment", "reasoning_accuracy_reward",
           "resolve_reward_funcs", "reward_inputs", "score", "think_format_reward"]
