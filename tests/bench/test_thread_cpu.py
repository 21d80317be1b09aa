"""bench/_thread_cpu.py: per-thread CPU of a real process group, grouped by the threads' kernel names."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench._thread_cpu import cpu_by_group, group_pids, thread_cpu

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# A child in its own session: a thread named like a card's worker spins; the main thread sleeps; a
# grandchild in the same group spins on its main thread.
_CHILD = """
import subprocess, sys, threading, time
from sixfold.backends.os_threads import name_this_thread, os_thread_name
def spin(name):
    name_this_thread(name)
    end = time.thread_time() + 0.6
    while time.thread_time() < end:
        pass
    time.sleep(30)
threading.Thread(target=spin, args=(os_thread_name("dense", "m2-card/card2"),), daemon=True).start()
threading.Thread(target=spin, args=(os_thread_name("sparse", "host-cpu"),), daemon=True).start()
subprocess.Popen([sys.executable, "-c", "import time\\nend = time.thread_time() + 0.4\\nwhile time.thread_time() < end: pass\\ntime.sleep(30)"])
print("up", flush=True)
time.sleep(30)
"""


def test_cpu_is_grouped_by_stage_across_the_process_group() -> None:
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True,
                             start_new_session=True, cwd=str(Path(__file__).parents[2]))
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        deadline = time.monotonic() + 10
        while len(group_pids(child.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = group_pids(child.pid)
        assert child.pid in pids and len(pids) == 2
        before = {key: (name, 0.0) for key, (name, _) in thread_cpu(pids).items()}
        deadline = time.monotonic() + 20  # the spinners' CPU, on a machine perhaps busy
        done = {"cards (dense)": 0.59, "sparse on host-cpu": 0.59, "main thread (event loop)": 0.4}
        groups = cpu_by_group(before, thread_cpu(pids))
        while time.monotonic() < deadline and any(groups.get(g, 0.0) < v for g, v in done.items()):
            time.sleep(0.1)
            groups = cpu_by_group(before, thread_cpu(pids))
        time.sleep(0.3)
        groups = cpu_by_group(before, thread_cpu(pids))  # nothing more: the spinners sleep now
        assert groups["cards (dense)"] == pytest.approx(0.6, abs=0.05)
        assert groups["sparse on host-cpu"] == pytest.approx(0.6, abs=0.05)
        # both main threads: the grandchild's spun 0.4 s, the child's started Python and slept
        assert 0.4 <= groups["main thread (event loop)"] < 1.5
        assert list(groups) == sorted(groups, key=lambda g: -groups[g])
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(10)


def test_threads_born_between_samples_count_whole_and_idle_ones_not_at_all() -> None:
    before = {(10, 10): ("python", 1.0), (10, 11): ("dense@card0", 2.0)}
    after = {(10, 10): ("python", 1.0), (10, 11): ("dense@card0", 2.5), (10, 12): ("dense@card1", 0.3),
             (10, 13): ("grpc_global_tim", 0.1)}
    assert cpu_by_group(before, after) == pytest.approx({"cards (dense)": 0.8, "other threads (gRPC, pools)": 0.1})
