"""The base of every error a user can cause and fix (config, data, model path, rewards, checkpoints).

The command line prints these as one line, `posttrain: error: ...`, without a traceback.
"""


class UserError(Exception):
    """An error whose message names the cause and the fix."""


class StorageError(UserError, OSError):
    """Something could not be written or read on disk; the message names the path and the cause."""


def _cause(err: BaseException) -> str:
    import errno

    if isinstance(err, RuntimeError):  # torch.save's message when the disk fills mid-write
        return "the disk is full"
    return {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
            errno.EACCES: "permission denied", errno.EPERM: "permission denied",
            errno.EROFS: "the filesystem is read-only", errno.ENOTDIR: "a part of the path is a file, not a directory",
            errno.EISDIR: "it is a directory", errno.ENOENT: "it does not exist"}.get(err.errno, err.strerror or str(err))


def is_storage_failure(err: BaseException) -> bool:
    """An OSError, or torch.save's RuntimeError for a file that could not be written in full."""
    return isinstance(err, OSError) or (isinstance(err, RuntimeError) and "unexpected pos" in str(err))


def storage_error(err: BaseException, doing: str, path: str,
                  fix: str = "choose another output_dir") -> StorageError:
    """One sentence for a failed disk operation: what, where, why, and what to do."""
    where = getattr(err, "filename", None) or path
    return StorageError(f"Could not {doing} {where}: {_cause(err)}. Free some space, fix the permissions, or {fix}.")
