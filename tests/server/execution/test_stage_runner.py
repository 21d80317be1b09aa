"""StageRunner: cheap host-side stages run on the event loop, the rest on their worker thread."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping

import numpy as np

from sixfold.backends.api import Arrays, Executable, PartitionArtifact
from sixfold.backends.spec_catalog import load_spec
from sixfold.server.execution.runtime import StageRunner


class Recorder(Executable):
    """Doubles its input; remembers which thread ran each batch; ``sleep_s`` blocks without using CPU."""

    def __init__(self, sleep_s: float = 0.0, thread_safe: bool = False) -> None:
        super().__init__(PartitionArtifact("stage", "test", None, ("x",), ("y",)), load_spec("host-cpu"))
        self.sleep_s = sleep_s
        self.thread_safe = thread_safe  # type: ignore[misc]
        self.threads: list[str] = []

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        self.threads.append(threading.current_thread().name)
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return {"y": inputs["x"] * 2}


def _on_loop(stage: Recorder) -> list[bool]:
    return [name == threading.current_thread().name for name in stage.threads]


async def _run(runner: StageRunner, times: int, rows: int = 4) -> None:
    for _ in range(times):
        out = await runner.infer({"x": np.ones(rows, np.float32)}, rows)
        np.testing.assert_array_equal(out["y"], np.full(rows, 2, np.float32))


async def test_a_cheap_stage_moves_onto_the_loop_after_one_measured_run_on_its_worker() -> None:
    stage = Recorder()
    runner = StageRunner(stage, max_inline_s=0.01)
    await _run(runner, 3)
    assert _on_loop(stage) == [False, True, True]
    assert runner.runs_inline(4) and not runner.runs_inline(64)  # another rows bucket is measured apart
    stage.close()


async def test_a_stage_that_blocks_goes_back_to_its_worker_and_backs_off() -> None:
    stage = Recorder(sleep_s=0.02)  # no CPU on the worker, but 20 ms on the loop: over the limit
    runner = StageRunner(stage, max_inline_s=0.002)
    await _run(runner, 6)
    # worker (measured), inline try (too slow), 1 held, try, 2 held, ...
    assert _on_loop(stage) == [False, True, False, True, False, False]
    stage.close()


async def test_off_when_zero_and_never_for_an_executable_with_its_own_infer() -> None:
    class OwnInfer(Recorder):
        async def infer(self, inputs):
            return await super().infer(inputs)

    for stage, limit in ((Recorder(), 0.0), (OwnInfer(), 0.01)):
        runner = StageRunner(stage, max_inline_s=limit)
        await _run(runner, 3)
        assert _on_loop(stage) == [False, False, False] and not runner.inlinable
        stage.close()


async def test_one_batch_at_a_time_unless_the_executable_is_thread_safe() -> None:
    for thread_safe in (False, True):
        stage = Recorder(thread_safe=thread_safe)
        runner = StageRunner(stage, max_inline_s=0.05)
        await _run(runner, 1)  # measured on the worker: cheap
        stage.sleep_s = 0.03
        big = asyncio.ensure_future(runner.infer({"x": np.ones(64, np.float32)}, 64))  # unmeasured: worker
        await asyncio.sleep(0.01)
        stage.sleep_s = 0.0
        await _run(runner, 1)
        await big
        assert _on_loop(stage) == [False, False, thread_safe]
        stage.close()


def test_the_loop_thread_runs_ops_on_one_thread_and_other_threads_keep_the_default():
    """The event loop's inline stages must not wake the OpenMP pool; worker threads still use it."""
    import threading

    import torch

    from sixfold.server.execution.runtime import single_threaded_ops_here

    default = torch.get_num_threads()
    seen: dict[str, int] = {}

    def loop_thread() -> None:
        seen["kept"] = single_threaded_ops_here()
        torch.nn.functional.embedding_bag(torch.arange(6), torch.ones(8, 4), torch.tensor([0, 3]), mode="sum")
        seen["loop"] = torch.get_num_threads()  # still 1 after a parallel op

        def worker() -> None:
            seen["worker"] = torch.get_num_threads()
        w = threading.Thread(target=worker)
        w.start()
        w.join()

    t = threading.Thread(target=loop_thread)
    t.start()
    t.join()
    assert seen == {"kept": default, "loop": 1, "worker": default}
    assert torch.get_num_threads() == default  # nothing leaked into this thread either


async def test_one_slow_run_does_not_send_a_cheap_stage_to_its_worker() -> None:
    """A preemption on a shared machine: one inline run takes 8x the limit, the next ones are cheap again."""
    stage = Recorder()
    runner = StageRunner(stage, max_inline_s=0.01)
    await _run(runner, 3)  # worker (measured), then inline
    stage.sleep_s = 0.08
    await _run(runner, 1)  # counts as 0.02 (twice the limit): the average stays under it
    stage.sleep_s = 0.0
    await _run(runner, 2)
    assert _on_loop(stage) == [False, True, True, True, True, True]
    stage.close()


async def test_a_batch_behind_another_on_the_worker_reports_its_wait() -> None:
    # The host stage's wait for its worker is what a burst of large queries costs (latency_breakdown's
    # host_wait): two batches at once on a one-thread worker, the second waits out the first.
    stage = Recorder(sleep_s=0.05)
    runner = StageRunner(stage, max_inline_s=1e-4)  # both on the worker: nothing measured inline yet
    first, second = {}, {}
    x = {"x": np.ones(4, np.float32)}
    await asyncio.gather(runner.infer(x, 4, first), runner.infer(x, 4, second))
    assert first["wait_s"] < 0.04 <= second["wait_s"] < 5.0
    stage.close()
