"""bench/workers_memory.py on the tiny model: every process of the server is counted, and the engine holds the model."""

from __future__ import annotations

import os

from bench.workers_memory import measure, process_tree, pss_bytes


def test_pss_is_read_for_this_process_and_its_tree() -> None:
    assert pss_bytes(os.getpid()) > 1 << 20
    assert process_tree(os.getpid())[0] == os.getpid()


def test_a_two_front_end_server_is_measured_as_supervisor_engine_and_front_ends() -> None:
    row = measure("tiny", 100, 2, requests=4, items=5, connections=2)
    assert row["workers"] == 2 and row["processes"] == 4, row  # supervisor, engine, 2 front ends
    # the engine holds the model: it is the one large process; the others hold only their protocol stacks
    sizes = sorted(row["per_process_mib"])
    assert sizes[-1] > 2 * sizes[-2], row
