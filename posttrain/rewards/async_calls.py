"""Async reward functions, awaited together on an event loop of their own, which an interrupt can stop.

`run_async(coroutines)` is asyncio.run of the coroutines gathered (an exception stands for a coroutine that raised
one), with two differences that let a run stop while a function never returns (timeouts.InterruptedWaiting):
- on an interrupt, the tasks are cancelled and given a second to end, and the loop closes without waiting for the
  threads they started;
- those threads (`asyncio.to_thread`, `loop.run_in_executor(None, ...)`) are daemon threads (`DaemonThreads`), at
  most as many at once as asyncio's own executor runs: a call that never returns cannot keep the process alive once
  the run has stopped (the standard executor's threads are joined when the interpreter exits).
Inside a running event loop (e.g. Jupyter) the loop runs in a daemon thread.
"""

import asyncio
import concurrent.futures
import os
import threading

from posttrain.timeouts import run_within


class DaemonThreads(concurrent.futures.ThreadPoolExecutor):
    """An executor running each call on a daemon thread of its own, at most `max_workers` at once (asyncio's default:
    min(32, CPUs + 4)); shutting it down waits for nothing. A ThreadPoolExecutor by type only (asyncio's default
    executor must be one): its public methods are replaced, and it starts none of the pool's threads."""

    def __init__(self, max_workers: int | None = None):
        super().__init__(max_workers)
        self._slots = threading.BoundedSemaphore(max_workers or min(32, (os.cpu_count() or 1) + 4))

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future = concurrent.futures.Future()

        def run():
            with self._slots:
                if not future.set_running_or_notify_cancel():
                    return
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as err:  # noqa: BLE001 - handed to the awaiting coroutine
                    future.set_exception(err)

        threading.Thread(target=run, name="posttrain-reward-thread", daemon=True).start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass


def run_async(coroutines: list) -> list:
    """The coroutines' results, awaited together; an exception stands for a coroutine that raised one."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _on_own_loop(coroutines)
    return run_within(lambda: _on_own_loop(coroutines), None, name="posttrain-async-rewards", in_thread=True)


def _on_own_loop(coroutines: list) -> list:
    async def gathered():
        return await asyncio.gather(*coroutines, return_exceptions=True)

    loop = asyncio.new_event_loop()
    loop.set_default_executor(DaemonThreads())
    try:
        results = loop.run_until_complete(gathered())
        loop.run_until_complete(loop.shutdown_asyncgens())
        return results
    except BaseException:  # an interrupt: cancel the functions, without waiting for their threads
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        if tasks:
            loop.run_until_complete(asyncio.wait(tasks, timeout=1.0))
        raise
    finally:
        loop.close()
