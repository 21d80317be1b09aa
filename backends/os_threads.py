"""What the kernel knows of a worker thread: its name and its CPU priority.

Names are what ``top -H``, ``ps -L`` and ``/proc/PID/task/TID/comm`` show.

Python's thread names stay inside Python: every worker thread of a server shows as the process's
name, so an operator cannot tell a hot card's thread from the host stage's. Each executable's worker
names itself ``PARTITION@DEVICE`` (e.g. ``dense@card3``, ``sparse@host-cpu``), cut to the 15 bytes
Linux keeps, so per-thread CPU can be read per stage and per card, as Triton's and TorchRec's
threads are named.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading

__all__ = ["os_thread_name", "name_this_thread", "lower_this_thread", "start_worker_thread"]

_PR_SET_NAME = 15
_MAX_BYTES = 15  # TASK_COMM_LEN - 1


def os_thread_name(partition: str, device: str) -> str:
    """``partition@device`` with the device's last path part (``m2-card/card3`` -> ``card3``), at most 15 bytes."""
    short = device.rsplit("/", 1)[-1]
    name = f"{partition}@{short}"
    return name.encode()[:_MAX_BYTES].decode(errors="ignore")


def name_this_thread(name: str) -> None:
    """Give the calling thread ``name`` in the kernel (Linux; elsewhere nothing happens)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):  # a name is a convenience: never fail a worker for it
        ctypes.CDLL(None).prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:_MAX_BYTES]), 0, 0, 0)


def lower_this_thread(nice: int) -> None:
    """Raise the calling thread's niceness by ``nice`` (Linux: per thread; any user may lower its own
    threads; nothing happens where it cannot be done)."""
    if nice <= 0:
        return
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


def start_worker_thread(name: str, nice: int = 0) -> None:
    """A worker thread's initializer: its kernel name, then its priority."""
    name_this_thread(name)
    lower_this_thread(nice)
