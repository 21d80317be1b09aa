"""usable_cores: the affinity mask and the cgroup quota, read from real files in a cgroup-like tree."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sixfold.backends.host.usable_cores import cgroup_quota, usable_cores


def _tree(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_v2_quota_of_one_and_a_half_cpus_gives_two_cores_of_four(tmp_path: Path) -> None:
    _tree(tmp_path, {"proc": "0::/kubepods/pod1/c1\n", "fs/cpu.max": "max 100000\n",
                     "fs/kubepods/cpu.max": "max 100000\n", "fs/kubepods/pod1/c1/cpu.max": "150000 100000\n"})
    cores = usable_cores(affinity=4, proc_cgroup=tmp_path / "proc", cgroup_root=tmp_path / "fs")
    assert (cores.count, cores.affinity, cores.quota) == (2, 4, 1.5)
    assert cores.describe() == "2 host cores (affinity 4, cgroup quota 1.5 CPUs)"


def test_a_tighter_quota_on_an_ancestor_cgroup_wins(tmp_path: Path) -> None:
    _tree(tmp_path, {"proc": "0::/a/b\n", "fs/a/cpu.max": "50000 100000\n", "fs/a/b/cpu.max": "400000 100000\n"})
    assert cgroup_quota(tmp_path / "proc", tmp_path / "fs") == 0.5
    cores = usable_cores(affinity=8, proc_cgroup=tmp_path / "proc", cgroup_root=tmp_path / "fs")
    assert cores.count == 1  # half a CPU still runs one lane


def test_no_quota_leaves_the_affinity_mask(tmp_path: Path) -> None:
    _tree(tmp_path, {"proc": "0::/x\n", "fs/x/cpu.max": "max 100000\n"})
    cores = usable_cores(affinity=3, proc_cgroup=tmp_path / "proc", cgroup_root=tmp_path / "fs")
    assert (cores.count, cores.quota) == (3, None)
    assert cores.describe() == "3 host cores (affinity 3, cgroup quota none)"


def test_a_quota_above_the_affinity_mask_does_not_add_cores(tmp_path: Path) -> None:
    _tree(tmp_path, {"proc": "0::/\n", "fs/cpu.max": "800000 100000\n"})
    assert usable_cores(affinity=2, proc_cgroup=tmp_path / "proc", cgroup_root=tmp_path / "fs").count == 2


def test_a_v1_cfs_quota_is_read_from_the_cpu_controller(tmp_path: Path) -> None:
    _tree(tmp_path, {"proc": "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n",
                     "fs/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n",
                     "fs/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
                     "fs/cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "fs/cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    cores = usable_cores(affinity=16, proc_cgroup=tmp_path / "proc", cgroup_root=tmp_path / "fs")
    assert (cores.count, cores.quota) == (3, 3.0)


def test_a_v1_container_sees_its_own_cgroup_at_the_mount_root(tmp_path: Path) -> None:
    # inside a container, /proc/self/cgroup names the host's path, but the mount holds the container's own files
    _tree(tmp_path, {"proc": "3:cpu,cpuacct:/docker/abc\n", "fs/cpu,cpuacct/cpu.cfs_quota_us": "200000\n",
                     "fs/cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert cgroup_quota(tmp_path / "proc", tmp_path / "fs") == 2.0


def test_no_cgroup_files_mean_no_quota(tmp_path: Path) -> None:
    assert cgroup_quota(tmp_path / "missing", tmp_path / "fs") is None
    _tree(tmp_path, {"proc": "0::/x\n", "fs/x/cpu.max": "garbage\n"})
    assert cgroup_quota(tmp_path / "proc", tmp_path / "fs") is None


def test_this_process_gets_at_most_its_affinity_mask() -> None:
    cores = usable_cores()
    assert cores.affinity == len(os.sched_getaffinity(0))
    assert 1 <= cores.count <= cores.affinity


def test_an_empty_affinity_is_refused() -> None:
    with pytest.raises(ValueError, match="affinity"):
        usable_cores(affinity=0)
