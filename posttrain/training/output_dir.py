"""The output directory: checked before anything slow, owned by one run at a time, and cleaned of stale temporaries.

- `check_writable`: output_dir is created and a probe file written before the model loads, so a path that is a
  file, a read-only or full disk stops at once with one sentence naming the path and the cause.
- `OutputLock`: a run holds output_dir/.posttrain.lock (pid, host) while it trains; a second run on the same
  directory is refused (two runs would interleave their checkpoints and metrics). A lock left by a process that is
  gone (same host) is taken over.
- `remove_stale_temporaries`: `*.tmp` directories a killed save left behind are removed when a run starts.
"""

import glob
import json
import logging
import os
import shutil
import socket
import time

from posttrain.errors import StorageError, storage_error

logger = logging.getLogger("posttrain")
LOCK = ".posttrain.lock"


def check_writable(output_dir: str) -> None:
    """Create output_dir and write (then remove) a probe file in it; StorageError when that fails."""
    probe = os.path.join(output_dir, ".posttrain-write-test")
    try:
        os.makedirs(output_dir, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as err:
        raise storage_error(err, "write to output_dir", output_dir) from err


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OutputLock:
    """output_dir/.posttrain.lock for the duration of a run (a context manager; main process only)."""

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, LOCK)
        self.held = False

    def __enter__(self):
        mine = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            except OSError as err:
                raise storage_error(err, "create the lock file", self.path) from err
            with os.fdopen(fd, "w") as f:
                json.dump(mine, f)
            self.held = True
            return self
        raise StorageError(f"Could not take {self.path}: another run keeps creating it.")

    def _take_over_if_stale(self) -> None:
        try:
            with open(self.path) as f:
                owner = json.load(f)
        except (OSError, ValueError):
            owner = {}
        pid, host = owner.get("pid"), owner.get("host")
        if host == socket.gethostname() and isinstance(pid, int) and pid != os.getpid() and _alive(pid):
            raise StorageError(f"{os.path.dirname(self.path)} is in use by another run (pid {pid} on {host}, since "
                               f"{owner.get('since')}): two runs would mix their checkpoints and metrics; wait for it or "
                               "choose another output_dir.")
        if host not in (None, socket.gethostname()):
            raise StorageError(f"{os.path.dirname(self.path)} is in use by a run on {host} (pid {pid}, since "
                               f"{owner.get('since')}): choose another output_dir, or delete {self.path} if that run "
                               "is gone.")
        logger.warning("Taking over %s, left by a run that is gone (pid %s).", self.path, pid)
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass

    def __exit__(self, *exc):
        if self.held:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
            self.held = False
        return False


def remove_stale_temporaries(output_dir: str) -> None:
    """Remove the `*.tmp` directories saves killed mid-write left (never a complete checkpoint)."""
    for path in glob.glob(os.path.join(output_dir, "*.tmp")):
        if os.path.isdir(path):
            logger.info("Removing %s, left by a save that did not finish.", path)
            shutil.rmtree(path, ignore_errors=True)
