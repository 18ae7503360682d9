"""Training on the CPU: keep freed memory in the process's heap instead of handing it back to the system.

A step frees and allocates the same large buffers every time (activations, gradients, log-prob chunks). glibc's
malloc serves a block above its mmap threshold (at most 32 MiB) with a fresh mapping and unmaps it on free, and trims
the heap's free top: each step then touches new pages, and every first touch is a page fault that zero-fills 4 KiB.
On a virtual machine whose host backs guest memory lazily, a fault costs tens of microseconds: on the development
machine a 0.5B-parameter GRPO step spent about 2 s of its 12 in them (docs/performance.md). With mmap off and the
trim off, freed blocks are reused, and the process no longer shrinks between steps.

The price is memory: a block of hundreds of MiB that once had its own mapping now sits in the one heap, and a hole
it leaves fits only what is no larger, so the heap's top (the peak RSS) climbs above the peak of live memory. Without
activation checkpointing that is about 5% (9,700 against 9,245 MiB on an 8-layer 0.5B-wide GRPO step at 512 tokens);
with it, the backward's recomputed layers interleave short-lived blocks with the gradients that stay, and it is
about 22% (8,492 against 6,943 MiB); on a small model, whose states are a small part of the peak, the holes weigh
more (7-22% on a 78 MB model). So the heap is kept only where it pays and the run has not asked to trade time for
memory: a CPU, `fast_paths` on, `gradient_checkpointing` off and weights of at least 1 GiB (training/setup.py).

Where the run has asked to trade time for memory (`gradient_checkpointing` on a CPU), the opposite: every block from
RETURN_FROM up gets a mapping of its own, unmapped when freed. glibc's default raises its mmap threshold to the size
of each mapped block freed, up to 32 MiB, so that after the first large free the backward's gradients and recomputed
activations (3-32 MiB each at Qwen2.5-0.5B's shape) come from the heap, where the gradients that stay pin the holes of
the activations that went: a GRPO step at that shape with 256-token completions peaked 0.6-1.0 GiB above its live
tensors (malloc_trim after the backward gave 640 MiB back). With the threshold fixed it peaked at 10,521 MiB against
11,146-11,635; each large block's pages are faulted in anew, and the step took 198-213 s against 180-183 s.
`fast_paths=False` leaves the allocator as it was.
"""

import ctypes
import ctypes.util
import logging

logger = logging.getLogger("posttrain")

# Kept only for a model whose weights take at least this: on the 152k-vocabulary tiny model (78 MB of weights) the kept
# heap's holes raised DPO's and SFT's peak RSS 7-22% for steps 5-15% faster; on Qwen2.5-0.5B's shape (2 GB) it cut a
# GRPO step from 12.3-13.9 s to 10.4-12.3 s with the same peak (docs/performance.md, "The heap")
HEAP_PAYS_FROM = 1 << 30
M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
RETURN_FROM = 1 << 20  # with checkpointing, blocks of at least this many bytes are mapped and unmapped on their own
_kept = False


def heap_pays(model) -> bool:
    """Whether `model`'s weights take at least HEAP_PAYS_FROM bytes (where keeping the heap pays)."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) >= HEAP_PAYS_FROM


def keep_freed_host_memory() -> bool:
    """Ask glibc to serve every block from the heap (no per-block mappings) and never trim it. Once per process;
    True where it took effect, False where the C library is not glibc (musl, macOS) or refused."""
    global _kept
    if _kept:
        return True
    libc = _glibc()
    if libc is None:
        return False
    _kept = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, -1))
    if not _kept:
        logger.debug("glibc refused mallopt: freed memory goes back to the system as usual")
    return _kept


def return_freed_host_memory() -> bool:
    """Ask glibc to map every block of RETURN_FROM bytes or more on its own and unmap it when freed (a fixed
    threshold, which also stops glibc raising it). True where it took effect; not after keep_freed_host_memory."""
    libc = None if _kept else _glibc()
    return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, RETURN_FROM))


def _glibc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # only glibc has it
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError, TypeError):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc
