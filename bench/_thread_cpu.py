"""CPU seconds of a process group's threads, grouped by what they run (from /proc; Linux only).

A sixfold server's worker threads carry ``PARTITION@DEVICE`` as their kernel name
(``sixfold.backends.os_threads``), so per-thread CPU reads as per stage: the cards' dense partitions,
the host stage, the host dense fallback, the event loop (the main thread) and the rest (gRPC's
threads and thread pools). Other servers (MLServer) show as main threads and other threads.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["group_pids", "thread_cpu", "cpu_by_group"]

_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_CARD = re.compile(r"@card\d*$")

Sample = dict[tuple[int, int], tuple[str, float]]
"""(pid, tid) -> (kernel thread name, CPU seconds so far)."""


def _stat_fields(path: Path) -> list[str] | None:
    try:
        return path.read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError, PermissionError):
        return None


def group_pids(pgid: int) -> list[int]:
    """Every live process in process group ``pgid`` (a server started with ``start_new_session``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(entry / "stat")
            if fields is not None and int(fields[2]) == pgid:  # field 5 of stat: the process group
                pids.append(int(entry.name))
    return pids


def thread_cpu(pids: list[int]) -> Sample:
    """Each thread's name and CPU seconds (user + system) for the processes ``pids``."""
    out: Sample = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            fields = _stat_fields(task / "stat")
            if fields is None:
                continue
            try:
                name = (task / "comm").read_text().strip()
            except (FileNotFoundError, ProcessLookupError):
                continue
            out[(pid, int(task.name))] = (name, (int(fields[11]) + int(fields[12])) / _CLK)
    return out


def _group(pid: int, tid: int, name: str) -> str:
    if tid == pid:
        return "main thread (event loop)"
    if _CARD.search(name):
        return "cards (dense)"
    if "@" in name:
        partition, _, device = name.partition("@")
        return f"{partition} on {device}"
    return "other threads (gRPC, pools)"


def cpu_by_group(before: Sample, after: Sample) -> dict[str, float]:
    """CPU seconds each group of threads used between two samples (threads born in between counted whole)."""
    groups: dict[str, float] = {}
    for key, (name, cpu) in after.items():
        used = cpu - before.get(key, (name, 0.0))[1]
        if used > 0:
            label = _group(key[0], key[1], name)
            groups[label] = groups.get(label, 0.0) + used
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]))
