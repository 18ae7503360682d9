"""`reward_timeout`: a reward function that does not return within the limit stops the run (or, with
on_bad_reward=skip, its batch is skipped) instead of stalling training forever.

Python cannot stop a thread, so a call that times out keeps running in a daemon thread (it never keeps the process
alive at exit); the trainer goes on without its result. The bounded call itself (`run_within`, `TimedOut`) is
posttrain/timeouts.py's, shared with the weight transfer; it is importable from here too.
"""

import time

from posttrain.timeouts import TimedOut, run_within

__all__ = ["TimedOut", "hanging_row", "run_within"]


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
