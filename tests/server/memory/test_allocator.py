"""keep_freed_memory: a worker thread's large batch buffers are reused, not faulted in again each batch."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# Run in a fresh interpreter: malloc settings are process-wide and the count must not depend on
# what earlier tests left in this process's heaps.
_PROBE = """
import resource, sys, threading
import numpy as np
from sixfold.server.memory.allocator import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
faults = []
def batches():
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        ids = np.ones(21 << 17)  # 21 MiB, like 700 rm2 items' ids; then two more buffers that size
        rows = ids + 1.0
        pooled = rows * 2.0
        del ids, rows, pooled
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
worker = threading.Thread(target=batches)  # not the main thread: its own arena, as a stage's worker
worker.start(); worker.join()
print(applied, sum(faults[2:]))
"""


def _faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True,
                         timeout=60).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt settings are glibc's")
def test_a_worker_thread_reuses_its_large_buffers() -> None:
    _, default = _faults("default")
    applied, kept = _faults("keep")
    assert applied == "True"
    # three 21 MiB buffers live at once overflow the worker arena's heap: glibc maps some afresh
    # each batch (~1,800 page faults a batch here)
    assert default > 2_000, default
    assert kept < default / 20, (kept, default)
