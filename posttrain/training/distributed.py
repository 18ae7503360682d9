"""A failure on one process reaches every process: no process is left waiting in a collective for one that died.

Work that can fail on some processes only (generation, reward functions, user callbacks, the main process's
writes) runs inside `guarded(accelerator)`. At its end every process takes part in one small all-reduce saying
whether it failed; if any did, every process raises: the first failing process its own error, the others a
`PeerFailure` carrying that process's message (and the traceback of the user code that raised, if any). The main
process is the one that reports it, so the message is printed once (training/trainer.py and cli.py).

A signal that stops a process while it waits on user code (timeouts.InterruptedWaiting, training/interrupts.py)
travels the same way, and every process raises it as it is: they all stop with the same sentence.

A run of one process pays nothing: the error is raised where it happened.
"""

import atexit
import contextlib
import time
import traceback

from posttrain.errors import UserError, is_storage_failure, storage_error, user_code_cause
from posttrain.timeouts import InterruptedWaiting

# set on an exception that every process raises together: only the main process reports it
AGREED = "_posttrain_agreed"


class PeerFailure(UserError, RuntimeError):
    """Another process failed. `detail` is the traceback text of the user code (or internal error) behind it."""

    def __init__(self, message: str, rank: int, detail: str = ""):
        super().__init__(f"on process {rank}: {message}")
        self.rank = rank
        self.detail = detail


def _report(error: BaseException, rank: int) -> tuple:
    """(rank, message, traceback text worth showing, the error itself when every process raises it as it is) of an
    error, for the other processes."""
    if isinstance(error, InterruptedWaiting):
        return rank, str(error), "", error
    detail = ""
    if not isinstance(error, UserError):  # an internal error: its own traceback
        detail = "".join(traceback.format_exception(error))
    elif user_code_cause(error) is not None:
        detail = "".join(traceback.format_exception(user_code_cause(error)))  # the user's code that raised
    text = str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"
    return rank, text, detail, None


def agree(accelerator, error: BaseException | None) -> None:
    """Called by every process at the same point: returns when no process failed, else raises on every process."""
    if accelerator.num_processes == 1:
        if error is not None:
            raise error
        return
    import torch
    from accelerate.utils import gather_object

    failed = accelerator.reduce(torch.tensor([0.0 if error is None else 1.0], device=accelerator.device),
                                reduction="sum")
    if float(failed) == 0:
        return
    mine = _report(error, accelerator.process_index) if error is not None else None
    reports = [r for r in gather_object([mine]) if r is not None]
    rank, message, detail, shared = reports[0]
    if shared is not None:  # an interrupt: every process stops as the one that received it
        raise mark_agreed(shared)
    if error is not None and rank == accelerator.process_index:
        setattr(error, AGREED, True)
        raise error
    failure = PeerFailure(message, rank, detail)
    setattr(failure, AGREED, True)
    raise failure


@contextlib.contextmanager
def guarded(accelerator, writing: str | None = None):
    """Run the block; then every process learns whether any process's block failed (see `agree`).

    Args:
        writing: the path the block writes to: a failed disk write then becomes one sentence naming the path and
            the cause (posttrain.errors.storage_error) instead of an OSError's traceback.
    """
    try:
        yield
    except (Exception, InterruptedWaiting) as error:  # noqa: BLE001 - any failure must reach the other processes
        failure = error
        if writing is not None and is_storage_failure(error) and not isinstance(error, UserError):
            failure = storage_error(error, "write", writing)
            failure.__cause__ = error
        agree(accelerator, failure)  # raises, on every process
        raise
    agree(accelerator, None)


def mark_agreed(error: BaseException) -> BaseException:
    """For an error every process raises at once by construction (it follows from reduced values)."""
    setattr(error, AGREED, True)
    return error


def reported_elsewhere(error: BaseException, is_main: bool) -> bool:
    """Whether this process should stay quiet about `error`: every process raised it, and the main one reports it."""
    return getattr(error, AGREED, False) and not is_main


def run_name(accelerator) -> str:
    """A short random name, the same on every process (the main process's, broadcast): a run's weight versions on a
    generation server."""
    import uuid

    from accelerate.utils import broadcast_object_list

    name = [uuid.uuid4().hex[:12]]
    if accelerator.num_processes > 1:
        broadcast_object_list(name, from_process=0)
    return name[0]


def _let_collectives_finish() -> None:
    """gloo's worker threads free a finished collective's tensors after the caller has moved on, and freeing a
    Python-owned tensor takes the GIL: at interpreter exit such a thread is killed inside a C++ destructor and the
    process aborts ("terminate called without an active exception", pytorch/pytorch#38228). A moment without the GIL
    lets them finish while the interpreter is alive. Registered to run at exit by every multi-process trainer, so
    that scripts which never call `close()` (as TRL's users do not) are covered too."""
    time.sleep(0.05)


def let_collectives_finish_at_exit() -> None:
    """Register `_let_collectives_finish` once per process, however many trainers it builds."""
    atexit.unregister(_let_collectives_finish)
    atexit.register(_let_collectives_finish)
