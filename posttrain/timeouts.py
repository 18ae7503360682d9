"""Waiting on a call that may not return: bounded by a timeout, and cut short by an interrupt.

`run_within` runs a call in a daemon thread and stops waiting after a limit. Python cannot stop a thread, so a call
that times out keeps running in its daemon thread (it never keeps the process alive at exit); the caller goes on
without its result. Used by the reward calls (reward_timeout, rewards/timeouts.py) and by the NCCL weight transfer
(generation/vllm_transfer.py).

`waiting_on(what)` marks the main thread as waiting on user code that may never return (a reward function, a
dynamic_sampling_filter, a callback, compute_metrics). The run's signal handler (training/interrupts.py), which
otherwise lets the step finish, raises `InterruptedWaiting` while such a mark is set: the step might never finish.

This module imports nothing of posttrain: rewards/, grpo/ and training/ all mark their calls through it.
"""

import contextlib
import threading
from typing import Callable


class TimedOut(Exception):
    """A call did not return within its limit."""


class InterruptedWaiting(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived while the run waited on user code; the trainer turns it into its one sentence.

    A KeyboardInterrupt, not an Exception: neither a user's `except Exception` nor an asyncio task keeps it from
    leaving the user's code.

    Attributes:
        signum: the signal.
        what: the user code waited on, e.g. "reward function 'judge'".
    """

    from_signal = True  # the run's own interrupt, not one a user's function raised (errors.stops_the_program)

    def __init__(self, signum: int, what: str):
        super().__init__(signum, what)  # args rebuild it when it travels to other processes (pickled)
        self.signum, self.what = signum, what


_WAITING: list = []  # what the main thread waits on, the innermost last: strings or callables returning one


@contextlib.contextmanager
def waiting_on(what: str | Callable[[], str]):
    """Within the block, the main thread waits on the user code `what` (a description, or a callable giving the
    description at the moment it is needed). Off the main thread, which receives no signals, it marks nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _WAITING.append(what)
    try:
        yield
    finally:
        _WAITING.pop()


def waited_on() -> str | None:
    """The user code the main thread waits on now (the innermost mark), or None."""
    if not _WAITING:
        return None
    what = _WAITING[-1]
    return what() if callable(what) else what


def run_within(call, timeout: float | None, name: str = "posttrain-reward", in_thread: bool = False):
    """call() in a daemon thread named `name`, waiting at most `timeout` seconds; raises TimedOut, or what call()
    raised. With timeout None: call it here, without a limit, or with `in_thread` in the daemon thread, waiting as
    long as it takes (a signal handler can still raise in the waiting thread)."""
    if timeout is None and not in_thread:
        return call()
    box = {}

    def target():
        try:
            box["result"] = call()
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            if isinstance(err, KeyboardInterrupt):
                err.off_main_thread = True  # raised by the call, not a signal (errors.stops_the_program)
            box["error"] = err

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimedOut()
    if "error" in box:
        raise box["error"]
    return box["result"]
