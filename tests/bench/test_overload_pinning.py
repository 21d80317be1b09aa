"""bench/overload.py keeps the load generator off the server's CPUs, and reads the model's own times.

On a 2-core host a generator sharing the server's cores sent 203 of 233 q/s at 3x and made the
capacity it is a multiple of meaningless; ``--server-cpus`` / ``--generator-cpus`` split them.
"""

from __future__ import annotations

import os

import pytest

from bench.overload import ServerProcess, choose_pinning, parse_cpus, where_time_went


def test_cpu_lists_parse_and_a_bad_one_names_itself() -> None:
    assert parse_cpus("0") == {0}
    assert parse_cpus("0,2-3") == {0, 2, 3}
    with pytest.raises(ValueError, match="'zero'"):
        parse_cpus("zero")


def test_auto_splits_the_usable_cpus_and_does_not_pin_one() -> None:
    assert choose_pinning("auto", "auto", {0, 1}) == {"server": [0], "generator": [1]}
    assert choose_pinning("auto", "auto", {4, 5, 6, 7}) == {"server": [4, 5], "generator": [6, 7]}
    assert choose_pinning("auto", "auto", {3}) == {}
    assert choose_pinning("none", "auto", {0, 1}) == {}
    assert choose_pinning("1", "auto", {0, 1}) == {"server": [1], "generator": [0]}
    with pytest.raises(ValueError, match="--generator-cpus"):
        choose_pinning("0", "7", {0, 1})


@pytest.mark.timeout(180)
def test_the_started_server_runs_on_its_cpus_and_says_its_model_times() -> None:
    cpu = min(os.sched_getaffinity(0))
    with ServerProcess("rm1", cards=1, max_rows=200, cpus=[cpu]) as server:
        tasks = os.listdir(f"/proc/{server.pid}/task")
        assert len(tasks) > 1  # the server's threads, started after the pinning, inherit it
        assert all(os.sched_getaffinity(int(t)) == {cpu} for t in tasks)
        times = server.model_times()
    assert times["requests"] == 0 and times["refused_unread"] == 0
    # no request answered between two readings: nothing to break down
    assert where_time_went(times, times, {"mean": 1.0, "p50": 1.0, "p99": 1.0}) == {}
