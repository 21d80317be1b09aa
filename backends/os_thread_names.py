"""Names the kernel shows for worker threads (``top -H``, ``ps -L``, ``/proc/PID/task/TID/comm``).

Python's thread names stay inside Python: every worker thread of a server shows as the process's
name, so an operator cannot tell a hot card's thread from the host stage's. Each executable's worker
names itself ``PARTITION@DEVICE`` (e.g. ``dense@card3``, ``sparse@host-cpu``), cut to the 15 bytes
Linux keeps, so per-thread CPU can be read per stage and per card, as Triton's and TorchRec's
threads are named.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys

__all__ = ["os_thread_name", "name_this_thread"]

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
