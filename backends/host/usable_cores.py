"""How many CPU cores this process may really use: its affinity mask and its cgroup's CPU quota.

``os.cpu_count()`` counts the machine's cores, not the ones a container or a ``taskset`` leaves to
the process: a pod limited to 2 CPUs on a 64-core node would otherwise start 64 dense lanes that
the kernel throttles. The usable count is the smaller of the affinity mask and the quota of the
process's cgroup and every cgroup above it (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` /
``cpu.cfs_period_us``), rounded up: a quota of 1.5 CPUs runs two lanes busy three quarters of the time.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["UsableCores", "usable_cores", "cgroup_quota"]


@dataclass(frozen=True)
class UsableCores:
    """The cores a process may use, and where the limit comes from."""

    count: int
    """min(affinity, ceil(quota)), at least 1."""
    affinity: int
    """CPUs in the process's affinity mask (``os.sched_getaffinity``; ``os.cpu_count()`` where there is none)."""
    quota: float | None
    """CPUs the cgroup quota allows (e.g. 1.5); None: no quota."""

    def describe(self) -> str:
        """``2 host cores (affinity 2, cgroup quota none)``: what the start-up plan prints."""
        quota = "none" if self.quota is None else f"{self.quota:g} CPUs"
        return f"{self.count} host core{'s' if self.count != 1 else ''} (affinity {self.affinity}, cgroup quota {quota})"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _v2_quota(directory: Path) -> float | None:
    """CPUs of one v2 cgroup's ``cpu.max`` ("max 100000" or "150000 100000"); None: no limit or no file."""
    text = _read(directory / "cpu.max")
    if not text:
        return None
    parts = text.split()
    if parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1]) if len(parts) > 1 else 100_000
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_quota(directory: Path) -> float | None:
    """CPUs of one v1 cgroup's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: no limit)."""
    quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    try:
        q, p = int(quota or "-1"), int(period or "0")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _smallest_up_the_tree(root: Path, relative: str, read) -> float | None:  # noqa: ANN001 - one of the two readers
    """The tightest quota of the cgroup at ``root/relative`` and every ancestor up to ``root``."""
    quotas = []
    directory = root / relative.strip("/")
    while True:
        quota = read(directory)
        if quota is not None:
            quotas.append(quota)
        if directory == root or root not in directory.parents:
            break
        directory = directory.parent
    return min(quotas) if quotas else None


def cgroup_quota(proc_cgroup: str | Path = "/proc/self/cgroup", cgroup_root: str | Path = "/sys/fs/cgroup") -> float | None:
    """CPUs the process's cgroup quota allows (None: no quota, or no cgroup filesystem to read).

    ``proc_cgroup`` lists the process's cgroups ("0::/path" for v2; "N:cpu,cpuacct:/path" for v1);
    ``cgroup_root`` is where the hierarchy is mounted (v1 controllers in sub-folders such as ``cpu,cpuacct``).
    """
    root = Path(cgroup_root)
    text = _read(Path(proc_cgroup))
    if text is None:
        return None
    quotas = []
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, relative = fields
        if controllers == "":  # v2 unified hierarchy
            quota = _smallest_up_the_tree(root, relative, _v2_quota)
        elif "cpu" in controllers.split(","):
            mounts = [root / controllers, root / "cpu", root / "cpu,cpuacct"]
            mount = next((m for m in mounts if m.is_dir()), None)
            # NOTE: inside a container the v1 path names the host's cgroup, and the mount is its own root
            quota = None if mount is None else (_smallest_up_the_tree(mount, relative, _v1_quota)
                                                if (mount / relative.strip("/")).is_dir() else _v1_quota(mount))
        else:
            continue
        if quota is not None:
            quotas.append(quota)
    return min(quotas) if quotas else None


def usable_cores(*, affinity: int | None = None, proc_cgroup: str | Path = "/proc/self/cgroup",
                 cgroup_root: str | Path = "/sys/fs/cgroup") -> UsableCores:
    """The cores this process may use now (``affinity``: given, else this process's mask)."""
    if affinity is None:
        try:
            affinity = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # no affinity on this OS
            affinity = os.cpu_count() or 1
    if affinity < 1:
        raise ValueError(f"affinity must count at least 1 CPU, got {affinity}")
    quota = cgroup_quota(proc_cgroup, cgroup_root)
    count = affinity if quota is None else max(1, min(affinity, math.ceil(quota - 1e-9)))
    return UsableCores(count=count, affinity=affinity, quota=quota)
