"""SIGINT and SIGTERM stop a run at the next step boundary, with a checkpoint, and say where it is.

The first signal is noted; the loop finishes the step it is in, saves a checkpoint of it (`save_on_interrupt`,
default on), and stops with one line: "Interrupted (SIGINT) at step N; the newest checkpoint is ...". A second
signal stops at once (Python's own KeyboardInterrupt, or the default SIGTERM). In a multi-process run the
processes agree at each step boundary whether any of them was signalled, so they stop at the same step.

While the run waits on user code that may never return (a reward function, a filter, a callback: marked with
posttrain/timeouts.py's `waiting_on`), the first signal raises `InterruptedWaiting` at once instead: the step under
way is dropped, and the trainer stops with one line naming what it waited on and the newest checkpoint. Several
processes agree on it as on any failure (training/distributed.py), so every process stops.
"""

import signal
import threading

from posttrain.errors import UserError
from posttrain.timeouts import InterruptedWaiting, waited_on


class Interrupted(UserError, RuntimeError):
    """The run was stopped by a signal; the message says at which step and where the newest checkpoint is."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


def interrupted_waiting(stop: InterruptedWaiting, step: int, max_steps: int, newest: str | None) -> Interrupted:
    """The one sentence of a run stopped while it waited on user code, after `step` of `max_steps` steps; `newest`:
    the newest checkpoint's path, or None."""
    where = (f"the newest checkpoint is {newest}: resume with resume_from_checkpoint=true" if newest
             else "no checkpoint was saved before it, so none can be resumed from")
    return Interrupted(f"Interrupted ({signal.Signals(stop.signum).name}) at step {step} of {max_steps} while waiting "
                       f"on {stop.what}; {where}.", stop.signum)


class InterruptWatch:
    """Notes SIGINT / SIGTERM while installed (a context manager); `received()` agrees on it across processes."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.signum = 0
        self.previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # handlers can be set on the main thread only
            for sig in self.SIGNALS:
                self.previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}
        return False

    def _note(self, signum, frame):
        self.signum = signum
        signal.signal(signum, self.previous.get(signum, signal.SIG_DFL))  # a second signal acts at once
        what = waited_on()
        if what is not None:  # user code that may never return: the step's end may never come
            raise InterruptedWaiting(signum, what)

    def received(self) -> int:
        """The signal any process received (0: none); every process calls this at each step boundary."""
        if self.accelerator.num_processes == 1:
            return self.signum
        import torch
        import torch.distributed as dist

        signum = torch.tensor([self.signum], device=self.accelerator.device)
        dist.all_reduce(signum, op=dist.ReduceOp.MAX)
        return int(signum)
