"""Training on a CPU that other work shares: as many intra-op threads as there are cores the others leave free.

torch's intra-op threads split each operation evenly and wait for the slowest: a thread that shares its core with
another process finishes last, and every operation waits for it. Measured on the 2-core development machine beside
one busy single-threaded process, GRPO's default bench row (a 4-layer model of width 256) ran its step in 1.17-1.20 s
with 2 threads and 0.53-0.55 s with one, against 0.36-0.38 s quiet with 2 (docs/performance.md, "How fast").

So at each step's start, where 0.3 s have passed since the last look, posttrain reads how much of the machine's
processors the other processes used since then (/proc/stat's busy time less this process's own) and sets the
threads to the cores left, at least one and at most the count the run started with. Quiet again, the threads come
back. Only on a CPU run with `fast_paths` on, and not where the user fixed the count through OMP_NUM_THREADS or
MKL_NUM_THREADS; a machine without /proc/stat keeps its threads.
"""

import logging
import math
import os
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger("posttrain")

LOOK_EVERY_S = 0.3  # the shortest window read (30 of the kernel's 10 ms ticks): shorter ones see noise, not load
FREE_ENOUGH = 0.25  # a core counts as free while the others use less than three quarters of it
USER_SETTINGS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class Usage:
    """Where the machine's and this process's processor time stood at one moment, in seconds."""
    wall: float
    machine_busy: float  # every processor's busy time, this process's included
    own: float  # this process's user and system time, all its threads


def read_usage() -> Usage | None:
    """The machine's busy time from /proc/stat (user, nice, system, irq, softirq and steal: a virtual machine's
    stolen time is a core it did not get) and this process's from os.times(); None where /proc/stat is not there."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    ticks = os.sysconf("SC_CLK_TCK")
    own = os.times()
    return Usage(time.monotonic(), (user + nice + system + irq + softirq + steal) / ticks, own.user + own.system)


def cores_used_by_others(before: Usage, after: Usage) -> float:
    """The number of cores the other processes kept busy between two readings, on average."""
    wall = after.wall - before.wall
    others = (after.machine_busy - before.machine_busy) - (after.own - before.own)
    return max(0.0, others / wall) if wall > 0 else 0.0


def threads_for(most: int, cores: int, others: float) -> int:
    """The intra-op threads for a machine of `cores` processors on which the other processes use `others` of
    them: the cores left (a core counts while they use less than 3/4 of it), between 1 and `most`."""
    return max(1, min(most, math.floor(cores - others + FREE_ENOUGH)))


class IntraOpThreads:
    """Sets torch's intra-op threads at each step's start to what the machine's other work leaves (module doc)."""

    def __init__(self, device_type: str, fast_paths: bool, read=None):
        self.most = torch.get_num_threads()  # the run's own count: torch's default, or the caller's
        self._read = read or read_usage  # a test's reader in its place
        self._cores = os.cpu_count() or 1
        self._last = self._read() if self._managed(device_type, fast_paths) else None

    def _managed(self, device_type: str, fast_paths: bool) -> bool:
        return device_type == "cpu" and fast_paths and self.most > 1 and \
            not any(name in os.environ for name in USER_SETTINGS)

    def adjust(self) -> None:
        """At a step's start: where 0.3 s have passed since the last reading, set the threads for the load seen
        since then."""
        if self._last is None:
            return
        now = self._read()
        if now is None or now.wall - self._last.wall < LOOK_EVERY_S:
            return
        others = cores_used_by_others(self._last, now)
        self._last = now
        threads = threads_for(self.most, self._cores, others)
        if threads != torch.get_num_threads():
            logger.info(f"{threads} intra-op thread{'s' if threads > 1 else ''} from now: other processes kept "
                        f"{others:.1f} of this machine's {self._cores} cores busy")
            torch.set_num_threads(threads)

    def restore(self) -> None:
        """The run's own count back, at the end of training."""
        if self._last is not None and torch.get_num_threads() != self.most:
            torch.set_num_threads(self.most)
