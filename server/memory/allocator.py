"""Keep freed memory in the process: stage workers allocate and free tens of MB per batch.

glibc's malloc gives each thread that allocates its own arena. Outside the main thread an arena
is a chain of heaps of at most 64 MiB, and an allocation above the mmap threshold (128 KiB to
32 MiB, adjusted as the program runs), or one that does not fit the arena's heaps, is mapped
fresh from the kernel and unmapped when freed. So a large batch on a stage's worker thread (ids,
row offsets, embedding_bag's own id-sized buffers: ~21 MB each for 700 rm2 items) faulted in and
zeroed its buffers again: measured on rm2's host stage, 5,000-10,500 page faults and up to 55 ms
of system time per batch, 37-92 ms a batch on a worker thread against 31 ms on the main thread.
With one arena (the main one, whose heap has no such limit) and the thresholds below, batches of
varying size fault no page once the heap has grown to their size.

The cost is memory kept for reuse (the heap keeps its peak, and up to ``trim_threshold`` free at
its top) and one arena lock shared by every thread; the threads that allocate much are a
model's few stage workers, which allocate a few large buffers per batch.

What it must not keep is a burst: requests of 100 MB each (their protobuf bytes, decoded arrays and
merged batch) leave the heap with hundreds of MB free below live allocations, which the top-of-heap
trim cannot reach. ``give_back_freed_memory`` (glibc ``malloc_trim(0)``: every arena, every free
page, not only the top) returns them; the batcher calls it off the event loop once a burst of
queued bytes has drained (``sixfold.server.scheduling.batcher``), at most once a second, so the steady state keeps
its reused buffers and a burst does not stay resident.
"""

from __future__ import annotations

import ctypes
import logging
import platform

__all__ = ["keep_freed_memory", "give_back_freed_memory"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8
_MIB = 1 << 20


def keep_freed_memory(*, arena_max: int = 1, mmap_threshold: int = 32 * _MIB, top_pad: int = 64 * _MIB,
                      trim_threshold: int = 256 * _MIB) -> bool:
    """Set glibc malloc so freed buffers are reused rather than unmapped and faulted in again.

    Call it before the process starts threads: ``arena_max`` (1: every thread allocates from
    the main arena) binds only threads that have not allocated yet. ``mmap_threshold``:
    allocations below it come from a heap (32 MiB is glibc's ceiling; fixing it also stops
    glibc's own adjustment). ``top_pad``: extra bytes a heap grows by, so the next batch's
    buffers fit without growing it again. ``trim_threshold``: free memory at the top of a heap
    kept before it is given back. Returns False, changing nothing, where the C library is not
    glibc (musl, macOS).
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # this process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, arena_max), (_M_MMAP_THRESHOLD, mmap_threshold), (_M_TOP_PAD, top_pad),
        (_M_TRIM_THRESHOLD, trim_threshold)))
    if not ok:
        log.warning("mallopt refused a setting; large batches may fault their buffers in again each time")
    return ok


def _libc_malloc_trim():
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _libc_malloc_trim()


def give_back_freed_memory() -> bool:
    """Return every whole free page of the C heap to the kernel (glibc ``malloc_trim(0)``).

    It walks every arena: milliseconds on a heap of GBs, and it takes the arena locks, so call it
    off the event loop and not per request. Returns whether anything was given back (False
    where the C library is not glibc).
    """
    return bool(_TRIM(0)) if _TRIM is not None else False
