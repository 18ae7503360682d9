"""A call bounded by a timeout: it runs in a daemon thread, and the caller stops waiting after the limit.

Python cannot stop a thread, so a call that times out keeps running in its daemon thread (it never keeps the process
alive at exit); the caller goes on without its result. Used by the reward calls (reward_timeout,
rewards/timeouts.py) and by the NCCL weight transfer (generation/vllm_transfer.py); it imports nothing of posttrain.
"""

import threading


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
