"""`reward_timeout`: a reward function that does not return within the limit stops the run (or, with
on_bad_reward=skip, its batch is skipped) instead of stalling training forever.

Python cannot stop a thread, so a call that times out keeps running in a daemon thread (it never keeps the process
alive at exit); the trainer goes on without its result.
"""

import threading
import time


class TimedOut(Exception):
    """A call did not return within its limit."""


def run_within(call, timeout: float | None, name: str = "posttrain-reward"):
    """call() in a daemon thread named `name`, waiting at most `timeout` seconds (None: call it here, without a
    limit); raises TimedOut, or what call() raised."""
    if timeout is None:
        return call()
    box = {}

    def target():
        try:
            box["result"] = call()
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = err

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimedOut()
    if "error" in box:
        raise box["error"]
    return box["result"]


def hanging_row(call_row, n: int, timeout: float) -> int | None:
    """The first of `n` completions on which `call_row(i)` alone does not return within `timeout`; None when none
    does (the hang depends on the whole batch) or probing would take more than three limits."""
    start = time.monotonic()
    for i in range(n):
        if time.monotonic() - start > 3 * timeout:
            return None
        try:
            run_within(lambda i=i: call_row(i), timeout)
        except TimedOut:
            return i
        except Exception:  # noqa: BLE001 - a row that raises is not the one that hangs
            continue
    return None
