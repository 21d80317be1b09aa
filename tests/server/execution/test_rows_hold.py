"""PlanRuntime.between_batches: a change to what the host stage reads waits for the batch in the host stage
and holds the next one until it is done (table deltas swap rows this way)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping

import numpy as np

from sixfold.backends.api import Arrays, Executable, PartitionArtifact
from sixfold.backends.spec_catalog import load_spec
from sixfold.server.scheduling.batcher import BatchInfo
from sixfold.server.execution.runtime import PlanRuntime


class Host(Executable):
    """Copies x to h; the first batch blocks until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__(PartitionArtifact("sparse", "test", None, ("x",), ("h",)), load_spec("host-cpu"))
        self.release = threading.Event()
        self.started = threading.Event()
        self.calls = 0

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        self.calls += 1
        self.started.set()
        if self.calls == 1:
            assert self.release.wait(60)
        return {"h": inputs["x"] + self.calls}


class Card(Executable):
    def __init__(self) -> None:
        super().__init__(PartitionArtifact("dense", "test", None, ("h",), ("y",)), load_spec("host-cpu"))

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        return {"y": inputs["h"] * 2}


async def _until(predicate, seconds: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_a_change_waits_for_the_batch_in_the_host_stage_and_holds_the_next() -> None:
    host, card = Host(), Card()
    runtime = PlanRuntime(host, [card], max_inline_s=0, min_split_rows=0)
    x = np.zeros((4, 1), np.float32)
    first = asyncio.ensure_future(runtime.run({"x": x}, BatchInfo(rows=4)))
    await _until(host.started.is_set)
    seen: list[int] = []
    change = asyncio.ensure_future(runtime.between_batches(lambda: seen.append(host.calls) or "done"))
    second = asyncio.ensure_future(runtime.run({"x": x}, BatchInfo(rows=4)))
    await asyncio.sleep(0.05)
    assert not seen and not change.done()  # the first batch is still in the host stage
    host.release.set()
    assert await change == "done"
    assert seen == [1]  # ran after the first batch's host stage, before the second's
    np.testing.assert_array_equal((await first)["y"], np.full((4, 1), 2, np.float32))
    np.testing.assert_array_equal((await second)["y"], np.full((4, 1), 4, np.float32))
    assert host.calls == 2
    runtime.close()


async def test_an_awaitable_change_is_awaited_while_batches_wait() -> None:
    host, card = Host(), Card()
    host.release.set()
    runtime = PlanRuntime(host, [card], max_inline_s=0, min_split_rows=0)
    order: list[str] = []

    async def slow_change() -> None:
        order.append("change start")
        await asyncio.sleep(0.05)
        order.append(f"change end, host calls {host.calls}")

    change = asyncio.ensure_future(runtime.between_batches(slow_change))
    await asyncio.sleep(0)
    batch = asyncio.ensure_future(runtime.run({"x": np.zeros((2, 1), np.float32)}, BatchInfo(rows=2)))
    await change
    await batch
    order.append("batch")
    assert order == ["change start", "change end, host calls 0", "batch"] and host.calls == 1
    runtime.close()
