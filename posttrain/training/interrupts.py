"""SIGINT and SIGTERM stop a run at the next step boundary, with a checkpoint, and say where it is.

The first signal is noted; the loop finishes the step it is in, saves a checkpoint of it (`save_on_interrupt`,
default on), and stops with one line: "Interrupted (SIGINT) at step N; the newest checkpoint is ...". A second
signal stops at once (Python's own KeyboardInterrupt, or the default SIGTERM). In a multi-process run the
processes agree at each step boundary whether any of them was signalled, so they stop at the same step.
"""

import signal
import threading

from posttrain.errors import UserError


class Interrupted(UserError, RuntimeError):
    """The run was stopped by a signal; the message says at which step and where the newest checkpoint is."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


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

    def received(self) -> int:
        """The signal any process received (0: none); every process calls this at each step boundary."""
        if self.accelerator.num_processes == 1:
            return self.signum
        import torch
        import torch.distributed as dist

        signum = torch.tensor([self.signum], device=self.accelerator.device)
        dist.all_reduce(signum, op=dist.ReduceOp.MAX)
        return int(signum)
