"""Whether a process still runs: what decides if a leftover named by its pid may be removed."""

from __future__ import annotations

import os

__all__ = ["process_alive"]


def process_alive(pid: int) -> bool:
    """True for this process and any process that exists (another user's included); False once it is gone."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
