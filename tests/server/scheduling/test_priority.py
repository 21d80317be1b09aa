"""Priority levels, per-level queue policies (size, timeout, REJECT/DELAY) and preferred batch sizes.

The batcher tests drive the real DynamicBatcher with a real async 'model' on a virtual clock
(tests.virtual_time: the order of events cannot depend on how busy the machine is); the gRPC test
serves rm1 on simulated cards and sends with stock tritonclient.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc.aio as tritonaio
from tritonclient.utils import InferenceServerException

from sixfold import models
from sixfold.partitioner.compile import partition_builtin
from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.scheduling.batcher import BatchingConfig, BatchInfo, DynamicBatcher, QueuePolicy
from sixfold.server.core import InferenceCore
from sixfold.server.errors import DeadlineExceeded, InvalidInput, Overloaded
from sixfold.server.loading.loader import load_partitioned
from sixfold.server.observability.metrics import ServerMetrics
from tests.conftest import free_port, triton_inputs
from tests.virtual_time import loop_clock, virtual_time


def _request(rows: int, tag: float) -> dict[str, np.ndarray]:
    return {"x": np.full((rows, 1), tag, dtype=np.float32)}


class Model:
    """Echoes its input; remembers the tags of every batch, in the order batches started."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.batches: list[list[float]] = []

    async def __call__(self, inputs: dict[str, np.ndarray], info: BatchInfo) -> dict[str, np.ndarray]:
        self.batches.append(sorted(set(inputs["x"][:, 0].tolist()), key=inputs["x"][:, 0].tolist().index))
        await asyncio.sleep(self.delay)
        return {"y": inputs["x"].copy()}


def _one_at_a_time(**config) -> tuple[Model, DynamicBatcher]:
    """One request per batch, one batch at a time, 50 ms each: the order the queue is served in shows."""
    model = Model(delay=0.05)
    batching = BatchingConfig(max_batch_rows=1, max_queue_delay_microseconds=0, **config)
    return model, DynamicBatcher(model, batching, max_inflight=1, clock=loop_clock())


@virtual_time
async def test_a_high_priority_request_queued_behind_low_ones_is_served_first() -> None:
    model, batcher = _one_at_a_time(priority_levels=2, default_priority_level=2)
    running = [asyncio.ensure_future(batcher.submit(_request(1, 0), 1))]
    await asyncio.sleep(0.01)  # tag 0 is on the card
    running += [asyncio.ensure_future(batcher.submit(_request(1, tag), 1)) for tag in (1, 2, 3)]  # default: level 2
    await asyncio.sleep(0.001)
    running.append(asyncio.ensure_future(batcher.submit(_request(1, 9), 1, priority=1)))
    await asyncio.gather(*running)
    assert [b[0] for b in model.batches] == [0, 9, 1, 2, 3]
    await batcher.close()


@virtual_time
async def test_a_batch_fills_from_the_highest_level_down() -> None:
    model = Model(delay=0.05)
    batcher = DynamicBatcher(model, BatchingConfig(max_batch_rows=4, max_queue_delay_microseconds=0,
                                                   priority_levels=3, default_priority_level=3), max_inflight=1,
                             clock=loop_clock())
    first = asyncio.ensure_future(batcher.submit(_request(4, 0), 4))
    await asyncio.sleep(0.01)
    queued = [asyncio.ensure_future(batcher.submit(_request(2, tag), 2, priority=p))
              for tag, p in ((3, 3), (2, 2), (1, 1))]
    await asyncio.gather(first, *queued)
    assert model.batches == [[0], [1, 2], [3]]
    await batcher.close()


@virtual_time
async def test_each_level_has_its_own_queue_bound() -> None:
    model, batcher = _one_at_a_time(priority_levels=2, default_priority_level=2,
                                    priority_queue_policy={1: QueuePolicy(max_queue_size=1)})
    running = [asyncio.ensure_future(batcher.submit(_request(1, 0), 1))]
    await asyncio.sleep(0.01)
    running.append(asyncio.ensure_future(batcher.submit(_request(1, 1), 1, priority=1)))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match="priority level 1.*max_queue_size 1"):
        await batcher.submit(_request(1, 2), 1, priority=1)
    running += [asyncio.ensure_future(batcher.submit(_request(1, t), 1)) for t in (3, 4, 5)]  # level 2: room
    await asyncio.gather(*running)
    assert batcher.queued == 0
    await batcher.close()


@virtual_time
async def test_a_priority_the_model_does_not_have_is_refused() -> None:
    _, batcher = _one_at_a_time(priority_levels=2, default_priority_level=1)
    with pytest.raises(InvalidInput, match="'priority' is 3 .*priority_levels 2"):
        await batcher.submit(_request(1, 0), 1, priority=3)
    _, plain = _one_at_a_time()
    out, _ = await plain.submit(_request(1, 7), 1, priority=5)  # priorities off: Triton ignores it too
    assert out["y"][0, 0] == 7
    await plain.close()


@virtual_time
@pytest.mark.parametrize("action", ["REJECT", "DELAY"])
async def test_a_timed_out_request_is_rejected_or_delayed_behind_the_others(action: str) -> None:
    model, batcher = _one_at_a_time(default_timeout_microseconds=20_000, timeout_action=action)
    running = asyncio.ensure_future(batcher.submit(_request(1, 0), 1))
    await asyncio.sleep(0.005)
    late = asyncio.ensure_future(batcher.submit(_request(1, 1), 1))  # times out at ~25 ms, card busy to 50 ms
    await asyncio.sleep(0.03)
    fresh = asyncio.ensure_future(batcher.submit(_request(1, 2), 1, timeout_s=1.0))  # capped at 20 ms, not 1 s
    await asyncio.gather(running, fresh)
    if action == "REJECT":
        with pytest.raises(DeadlineExceeded, match="before compute"):
            await late
        assert [b[0] for b in model.batches] == [0, 2]
    else:
        await late
        assert [b[0] for b in model.batches] == [0, 2, 1]  # kept, but after the one still in time
    await batcher.close()


@virtual_time
async def test_without_timeout_override_the_client_timeout_is_ignored() -> None:
    model, batcher = _one_at_a_time(allow_timeout_override=False)
    running = asyncio.ensure_future(batcher.submit(_request(1, 0), 1))
    await asyncio.sleep(0.005)
    out, _ = await batcher.submit(_request(1, 1), 1, timeout_s=0.001)  # would expire; the policy says no
    await running
    assert out["y"][0, 0] == 1
    await batcher.close()


@virtual_time
async def test_a_request_whose_client_left_is_dropped_before_compute() -> None:
    model, batcher = _one_at_a_time()
    running = asyncio.ensure_future(batcher.submit(_request(1, 0), 1))
    await asyncio.sleep(0.005)
    gone = asyncio.ensure_future(batcher.submit(_request(1, 1), 1))
    await asyncio.sleep(0.005)
    gone.cancel()
    await asyncio.sleep(0)
    assert batcher.queued == 0
    await running
    await asyncio.sleep(0.01)
    assert model.batches == [[0]]
    await batcher.close()


@virtual_time
async def test_reaching_a_preferred_size_dispatches_without_waiting_out_the_delay() -> None:
    model = Model()
    batcher = DynamicBatcher(model, BatchingConfig(max_batch_rows=100, max_queue_delay_microseconds=300_000,
                                                   preferred_batch_rows=(8,)), max_inflight=1, clock=loop_clock())
    t0 = loop_clock()()
    results = await asyncio.gather(*(batcher.submit(_request(r, r), r) for r in (5, 4, 6)))
    elapsed = [info.queue_s for _, info in results]
    # 5 + 4 crosses 8: those two leave at once; 6 alone reaches no preferred size and waits the 300 ms.
    assert model.batches == [[5, 4], [6]]
    assert elapsed[0] < 0.1 and elapsed[1] < 0.1, elapsed
    assert elapsed[2] >= 0.25 and loop_clock()() - t0 >= 0.25, elapsed
    await batcher.close()


@virtual_time
async def test_without_a_preferred_size_the_batch_waits_for_the_delay() -> None:
    model = Model()
    batcher = DynamicBatcher(model, BatchingConfig(max_batch_rows=100, max_queue_delay_microseconds=100_000),
                             max_inflight=1, clock=loop_clock())
    results = await asyncio.gather(*(batcher.submit(_request(r, r), r) for r in (5, 4)))
    assert model.batches == [[5, 4]] and all(info.queue_s >= 0.09 for _, info in results)
    await batcher.close()


# --- over real gRPC, stock tritonclient -------------------------------------------------------------

ROWS = 8


@pytest.fixture(scope="module")
def slow_rm1():
    """rm1 on 2 throttled simcards (~200 ms a batch), one batch at a time, one request per batch;
    level 1 may queue 2 requests, level 2 (the default) 64."""
    _, partitioned = partition_builtin("rm1", max_rows=300, seed=1, cards=2)
    metrics = ServerMetrics()
    batching = BatchingConfig(max_batch_rows=ROWS, max_queue_delay_microseconds=0, max_inflight_batches=1,
                              max_queue_size=64, priority_levels=2, default_priority_level=2,
                              priority_queue_policy={1: QueuePolicy(max_queue_size=2)})
    # NOTE: host dense off: the tuner explores the host with every 2nd batch, which finishes in a few ms,
    # so two batches in a row ended ~5 ms apart and their responses could reach the client in either
    # order (CI, 2 cores busy: low0 before high1). Every batch held ~200 ms on a card keeps them apart.
    served = load_partitioned(partitioned, backend="simcard", metrics=metrics, batching=batching,
                              backend_options={"faults": {"slow_factor": 4000.0}}, host_dense_max_rows=0)
    # NOTE: no warm-up: the test needs the first batch held on a card while the others queue
    background = BackgroundServer(InferenceCore([served]), ServerConfig(grpc_port=0, metrics_port=free_port(),
                                                                        warmup=False), metrics).start()
    try:
        yield background.url
    finally:
        background.stop()


async def test_over_grpc_priority_orders_service_and_each_level_has_its_queue_bound(slow_rm1: str) -> None:
    request = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=300), seed=4).make(ROWS)
    done: list[str] = []
    async with tritonaio.InferenceServerClient(slow_rm1) as client:
        async def send(tag: str, priority: int = 0) -> str:
            try:
                await client.infer("rm1", triton_inputs(tritonaio, request), priority=priority)
            except InferenceServerException as exc:
                done.append(f"{tag}:{exc.status()}")
                return exc.status()
            done.append(tag)
            return "ok"

        first = asyncio.ensure_future(send("first"))
        await asyncio.sleep(0.1)  # on the card for ~200 ms
        low = [asyncio.ensure_future(send(f"low{i}")) for i in range(2)]
        await asyncio.sleep(0.05)
        high = [asyncio.ensure_future(send(f"high{i}", priority=1)) for i in range(4)]
        t0 = time.perf_counter()
        await asyncio.wait(high, return_when=asyncio.FIRST_COMPLETED)
        refused_after = time.perf_counter() - t0
        results = await asyncio.gather(first, *low, *high)
    refused = [r for r in results if r != "ok"]
    assert refused == [str(grpc.StatusCode.RESOURCE_EXHAUSTED)] * 2, done
    assert refused_after < 0.15, f"the refusal took {refused_after * 1e3:.0f} ms; it should be at once"
    served = [tag for tag in done if ":" not in tag]
    # NOTE: the four high requests are sent in one instant over one channel; which two the server reads first is
    # not defined (each handler reads its own message), only that two are queued, two refused, and both served
    # before the level-2 queue: level 1 jumped it
    assert served[0] == "first" and served[3:] == ["low0", "low1"], done
    assert len(set(served[1:3])) == 2 and all(tag.startswith("high") for tag in served[1:3]), done


def test_the_priority_parameter_is_read_like_tritonclient_sends_it_and_bad_values_are_named() -> None:
    from tritonclient.grpc import service_pb2

    from sixfold.server.protocol.codec import request_priority

    request = service_pb2.ModelInferRequest()
    assert request_priority(request) == 0
    request.parameters["priority"].uint64_param = 2  # tritonclient's infer(..., priority=2)
    assert request_priority(request) == 2
    request.parameters["priority"].int64_param = 1
    assert request_priority(request) == 1
    for bad in ("string_param", "int64_param", "bool_param"):
        request = service_pb2.ModelInferRequest()
        setattr(request.parameters["priority"], bad, {"string_param": "high", "int64_param": -1,
                                                      "bool_param": True}[bad])
        with pytest.raises(InvalidInput, match="parameter 'priority' must be a non-negative integer"):
            request_priority(request)
