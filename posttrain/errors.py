"""The base of every error a user can cause and fix (config, data, model path, rewards, checkpoints).

The command line prints these as one line, `posttrain: error: ...`, without a traceback.
"""

import threading


class UserError(Exception):
    """An error whose message names the cause and the fix.

    `shows_cause`: the exception it was raised from is the user's own code's (a reward function, a formatting
    function, a module of theirs that failed to import), whose traceback the command line prints above the message.
    Otherwise the cause is a library's or the system's, already said in the message: no traceback."""

    shows_cause = False


def user_code_cause(err: BaseException) -> BaseException | None:
    """The exception of the user's code behind `err` (see UserError.shows_cause), whose traceback is worth showing;
    None for any other."""
    return err.__cause__ if isinstance(err, UserError) and err.shows_cause else None


class StorageError(UserError, OSError):
    """Something could not be written or read on disk; the message names the path and the cause."""


def _errno_of(err: BaseException) -> int | None:
    """The OS error number behind a failed disk operation: an OSError's own, or the one safetensors' Rust writer puts
    in its message ("I/O error: No space left on device (os error 28)"); torch.save's RuntimeError for a file it
    could not write in full means a full disk."""
    import errno
    import re

    if isinstance(err, OSError):
        return err.errno
    if isinstance(err, RuntimeError) and "unexpected pos" in str(err):
        return errno.ENOSPC
    found = re.search(r"\(os error (\d+)\)", str(err))
    return int(found.group(1)) if found else None


def _cause(err: BaseException) -> str:
    import errno

    number = _errno_of(err)
    return {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
            errno.EACCES: "permission denied", errno.EPERM: "permission denied",
            errno.EROFS: "the filesystem is read-only", errno.ENOTDIR: "a part of the path is a file, not a directory",
            errno.EISDIR: "it is a directory", errno.ENOENT: "it does not exist"}.get(
        number, getattr(err, "strerror", None) or str(err))


def is_storage_failure(err: BaseException) -> bool:
    """An OSError, torch.save's RuntimeError for a file that could not be written in full, or safetensors'
    SafetensorError for an I/O error (a full disk while writing model.safetensors)."""
    return isinstance(err, OSError) or _errno_of(err) is not None


def storage_error(err: BaseException, doing: str, path: str,
                  fix: str = "choose another output_dir") -> StorageError:
    """One sentence for a failed disk operation: what, where, why, and what to do."""
    where = getattr(err, "filename", None) or path
    return StorageError(f"Could not {doing} {where}: {_cause(err)}. Free some space, fix the permissions, or {fix}.")


class UserFunctionError(UserError, RuntimeError):
    """A function the user passed (formatting_func, compute_metrics, preprocess_logits_for_metrics,
    dynamic_sampling_filter) raised, or returned something posttrain cannot use; the message names the function, what
    it was given and the fix. When it raised, its own exception is the cause, whose traceback the command line prints
    above the message."""

    shows_cause = True


def function_name(fn) -> str:
    """A user's function as messages name it: its qualified name (a method's class included, the functions it is
    defined in left out), a functools.partial's function's, or the class of a callable object."""
    import functools

    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if not isinstance(name, str):
        return type(fn).__name__
    return name.rpartition("<locals>.")[2]  # a function defined in a function: its own name and class


def described(fn) -> str:
    """`name(parameters)`: the function and its signature, or its name alone when it has none to show."""
    import inspect

    try:
        return f"{function_name(fn)}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return function_name(fn)


def signature_mismatch(fn, *args, **kwargs) -> str | None:
    """Why calling `fn(*args, **kwargs)` would raise TypeError for its signature (Python's reason, e.g. "missing a
    required argument: 'labels'"), or None when the arguments fit, or when `fn` has no signature to check (some
    builtins): a call that cannot be checked before it is made."""
    import inspect

    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as err:
        return str(err)
    return None


def message_of(err: BaseException) -> str:
    """str(err); where the exception's own __str__ raises, a note saying so: a user's exception never breaks the
    message about it."""
    try:
        return str(err)
    except Exception as inner:  # noqa: BLE001 - whatever a user's __str__ raises
        return f"<its message could not be read: {type(err).__name__}.__str__ raised {type(inner).__name__}>"


def detail_of(err: BaseException) -> str:
    """`: the first line of its message` for an exception a user's function raised (empty when it has none), to end
    the clause that names the function, the exception's type and where it was called."""
    text = message_of(err).strip()
    return f": {text.splitlines()[0].rstrip('.')}" if text else ""


def stops_the_program(err: BaseException) -> bool:
    """Whether a user's function raised what is not an Exception, and is not the run's own interrupt or cancellation:
    SystemExit (sys.exit), GeneratorExit, or a KeyboardInterrupt of its own. Not a failure the run can count: the run
    stops with one sentence naming the function (program_stop_message), rather than the program ending silently or an
    event loop's thread dying under its waiter. A KeyboardInterrupt is the function's own only where no signal can
    have raised it, off the main thread (Python runs signal handlers there; timeouts.run_within and `contained` mark
    it): on the main thread it is taken as the user's Ctrl-C, and left to raise."""
    import asyncio

    if isinstance(err, (Exception, asyncio.CancelledError)) or getattr(err, "from_signal", False):
        return False
    return not isinstance(err, KeyboardInterrupt) or getattr(err, "off_main_thread", False)


def program_stop_message(what: str, err: BaseException) -> str:
    """The sentence for `what` (e.g. "Tool 'search' (search)") having raised SystemExit or the like."""
    raised = type(err).__name__ + (f"({', '.join(map(repr, err.args))})" if err.args else "")
    return (f"{what} raised {raised}, which would stop the program: a user's function returns its result or raises an "
            "Exception (a tool's error is read by the model, a reward function's stops the run with its traceback); "
            "remove the sys.exit or raise an Exception instead.")


class Raised:
    """What a user's awaitable raised that stops_the_program, held as a value (contained): raised inside an asyncio
    task it would end the event loop's thread."""

    def __init__(self, err: BaseException):
        self.err = err


async def contained(awaitable):
    """`awaitable`'s result, or Raised(err) for what it raised that stops_the_program (anything else propagates)."""
    try:
        return await awaitable
    except BaseException as err:  # noqa: BLE001 - SystemExit and the like are held, the rest raised
        if isinstance(err, KeyboardInterrupt) and threading.current_thread() is not threading.main_thread():
            err.off_main_thread = True  # no signal raised it: the function's own
        if stops_the_program(err):
            return Raised(err)
        raise
