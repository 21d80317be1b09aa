"""Admission by work and bytes, and memory given back after a burst (sixfold.server.scheduling.batcher, sixfold.server.scheduling.admission).

The batcher tests hold batches on the card with an event and move an injected
clock, so every number is exact. The last test is real: large requests over
gRPC to a served model, and the server's RSS read from /proc.
"""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest

from sixfold.server.scheduling.admission import PlanCost
from sixfold.server.scheduling.batcher import BatchingConfig, BatchInfo, DynamicBatcher
from sixfold.server.errors import DeadlineExceeded, Overloaded
from tests.virtual_time import loop_clock, virtual_time

MIB = 1 << 20


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class HeldModel:
    """Holds every batch until ``release``; the clock moves ``batch_s`` while a batch runs."""

    def __init__(self, clock: FakeClock | None = None, batch_s: float = 0.0) -> None:
        self.clock, self.batch_s = clock, batch_s
        self.gate = asyncio.Event()
        self.batches: list[int] = []

    async def __call__(self, inputs: dict[str, np.ndarray], info: BatchInfo) -> dict[str, np.ndarray]:
        self.batches.append(inputs["x"].shape[0])
        await self.gate.wait()
        if self.clock is not None:
            self.clock.now += self.batch_s
        return {"y": inputs["x"][:, :1] * 2}


def per_row_ms(ms: float):
    """A fake cost model: ``ms`` milliseconds per row."""
    return lambda inputs, rows: rows * ms / 1e3


def _request(rows: int, cols: int = 2) -> dict[str, np.ndarray]:
    return {"x": np.ones((rows, cols), dtype=np.float32)}


def _one_at_a_time(model, *, clock=None, cost=None, trim=None, **config) -> DynamicBatcher:
    config = {"max_batch_rows": 1, "max_queue_delay_microseconds": 0, "max_queue_size": 0, **config}
    return DynamicBatcher(model, BatchingConfig(**config), max_inflight=1, clock=clock or time.monotonic,
                          cost=cost, trim=trim)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def _drain(tasks) -> None:
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5.0)


async def test_the_work_bound_refuses_the_request_that_would_exceed_it_and_quotes_the_numbers() -> None:
    model = HeldModel()
    batcher = _one_at_a_time(model, clock=FakeClock(), cost=per_row_ms(10), max_queue_work_ms=30)
    running = [asyncio.ensure_future(batcher.submit(_request(1), 1))]
    await _settle()  # on the card: no longer queued work
    assert model.batches == [1] and batcher.queued_work_s == 0
    running += [asyncio.ensure_future(batcher.submit(_request(1), 1)) for _ in range(3)]
    await _settle()
    assert batcher.queued == 3 and batcher.queued_work_s == pytest.approx(0.030)
    # 30 ms ahead, exactly at the bound: admitted (its own 10 ms is its service, not a wait)
    running.append(asyncio.ensure_future(batcher.submit(_request(1), 1)))
    await _settle()
    assert batcher.queued == 4 and batcher.queued_work_s == pytest.approx(0.040)
    with pytest.raises(Overloaded, match=r"40\.0 ms of work waiting ahead exceeds max_queue_work_ms 30 \(estimated "
                                         r"at the measured service rate; this request's own 10\.0 ms not counted\)"):
        batcher.enqueue(_request(1), 1)
    assert batcher.queued == 4 and batcher.queued_work_s == pytest.approx(0.040)  # the refusal holds nothing
    model.gate.set()
    await _drain(running)
    assert batcher.queued_work_s == 0 and batcher.queued_bytes == 0
    # A request larger than the bound runs when it is alone: it is never refused for its own size.
    out, _ = await batcher.submit(_request(8), 8)
    assert out["y"].shape == (8, 1)
    await batcher.close()


async def test_a_client_deadline_is_the_sla_its_request_is_admitted_against() -> None:
    """With a deadline share, a request's deadline, not max_queue_work_ms, bounds the work ahead of it:
    a loose deadline queues deeper than the server's bound, a tight one is refused early, and a request
    with no deadline keeps the server's bound."""
    model = HeldModel()
    batcher = _one_at_a_time(model, clock=FakeClock(), cost=per_row_ms(10), max_queue_work_ms=30,
                             deadline_work_share=0.5)
    running = [asyncio.ensure_future(batcher.submit(_request(1), 1))]
    await _settle()
    running += [asyncio.ensure_future(batcher.submit(_request(1), 1, timeout_s=10.0)) for _ in range(6)]
    await _settle()
    assert batcher.queued == 6 and batcher.queued_work_s == pytest.approx(0.060)  # past the 30 ms bound
    with pytest.raises(Overloaded, match=r"60\.0 ms of work waiting ahead exceeds max_queue_work_ms 30 "):
        batcher.enqueue(_request(1), 1)  # no deadline: the server's bound
    with pytest.raises(Overloaded, match=r"60\.0 ms of work waiting ahead exceeds 0\.5 of this request's "
                                         r"100 ms deadline"):
        batcher.enqueue(_request(1), 1, timeout_s=0.100)  # 50 ms of it: refused now, not timed out later
    running.append(asyncio.ensure_future(batcher.submit(_request(1), 1, timeout_s=0.250)))  # 125 ms of it
    await _settle()
    assert batcher.queued == 7
    model.gate.set()
    await _drain(running)
    assert all(not isinstance(r, Exception) for r in [t.result() for t in running])
    await batcher.close()


def test_the_deadline_share_is_checked() -> None:
    with pytest.raises(ValueError, match="deadline_work_share must be in 0..1"):
        BatchingConfig(deadline_work_share=1.5)


async def test_estimates_are_rescaled_by_the_measured_service_rate() -> None:
    """The cost model says 1 ms a row; batches of 1 row take 10 ms: the bound counts 10 ms a row."""
    clock = FakeClock()
    model = HeldModel(clock, batch_s=0.010)
    batcher = _one_at_a_time(model, clock=clock, cost=per_row_ms(1), max_queue_work_ms=35)
    model.gate.set()
    await batcher.submit(_request(1), 1)  # alone (concurrency 1): 10 ms for 1 ms estimated
    assert batcher.seconds_per_estimate == pytest.approx(10.0)
    model.gate.clear()
    running = [asyncio.ensure_future(batcher.submit(_request(1), 1))]
    await _settle()  # on the card
    running += [asyncio.ensure_future(batcher.submit(_request(1), 1)) for _ in range(4)]  # 4 wait: 40 ms
    await _settle()
    assert batcher.queued == 4 and batcher.queued_work_s == pytest.approx(0.040)
    with pytest.raises(Overloaded, match=r"40\.0 ms of work waiting ahead exceeds max_queue_work_ms 35"):
        batcher.enqueue(_request(1), 1)
    model.gate.set()
    await _drain(running)
    await batcher.close()


class CardTime:
    """Each batch takes ``seconds_per_row`` x its rows of virtual time, then waits for ``gate`` (open by default)."""

    def __init__(self, seconds_per_row: float) -> None:
        self.seconds_per_row = seconds_per_row
        self.gate = asyncio.Event()
        self.gate.set()
        self.batches: list[int] = []

    async def __call__(self, inputs: dict[str, np.ndarray], info: BatchInfo) -> dict[str, np.ndarray]:
        self.batches.append(inputs["x"].shape[0])
        await asyncio.sleep(self.seconds_per_row * inputs["x"].shape[0])
        await self.gate.wait()
        return {"y": inputs["x"][:, :1] * 2}


MS_PER_ROW = 15.6 / 700
"""rm2's cost model in make demo: a 700-item query is estimated at 15.6 ms."""


async def _demo_batcher(busy_slots: int = 0) -> tuple[CardTime, DynamicBatcher, list[asyncio.Future]]:
    """make demo's batcher (6 cards: 7 slots, 30 ms bound) with the scale measured at 2.6, and
    ``busy_slots`` slots held by 1-row batches."""
    model = CardTime(2.6 * MS_PER_ROW / 1e3)  # the cards take 2.6x the cost model's estimate
    batcher = DynamicBatcher(model, BatchingConfig(max_batch_rows=1024, max_queue_work_ms=30), max_inflight=7,
                             clock=loop_clock(), cost=per_row_ms(MS_PER_ROW))
    await batcher.submit(_request(100), 100)  # alone: teaches the scale
    assert batcher.seconds_per_estimate == pytest.approx(2.6)
    model.gate.clear()
    held = []
    for _ in range(busy_slots):
        held.append(asyncio.ensure_future(batcher.submit(_request(1), 1)))
        await asyncio.sleep(0.003)  # past the 2 ms window: a batch of its own
    assert model.batches == [100] + [1] * busy_slots and batcher.queued == 0
    return model, batcher, held


@virtual_time
async def test_queued_work_that_free_slots_take_at_once_is_not_a_wait() -> None:
    """make demo at 5 q/s: a 700-item and a 300-item query arrive in one turn of the loop, every card idle.

    The 700's 15.6 ms estimate x the measured 2.6 = 40.6 ms counted as a wait over the 30 ms bound
    and the 300 was refused, though a free slot takes the 700 at once (had the loop taken it a
    moment earlier it would have been running, and not counted).
    """
    model, batcher, _ = await _demo_batcher()
    model.gate.set()
    large = batcher.enqueue(_request(700), 700)  # same turn: the batching loop has not run yet
    assert batcher.queued_work_s == pytest.approx(0.04056)  # queued, over the 30 ms bound
    small = batcher.enqueue(_request(300), 300)  # admitted: a free slot takes the 700 at once
    assert (await small.future)["y"].shape == (300, 1) and (await large.future)["y"].shape == (700, 1)
    assert model.batches == [100, 1000]  # they rode together, without waiting the window (no_wait_rows)
    await batcher.close()


@virtual_time
async def test_queued_work_that_waits_for_a_slot_is_still_a_wait() -> None:
    """Overload is still refused: with every slot busy the queued 700 waits for one, and would the 300."""
    model, batcher, held = await _demo_batcher(busy_slots=7)
    queued = [batcher.enqueue(_request(700), 700)]
    with pytest.raises(Overloaded, match=r"40\.6 ms of work waiting ahead exceeds max_queue_work_ms 30"):
        batcher.enqueue(_request(300), 300)
    model.gate.set()
    await asyncio.gather(*held, queued[0].future)
    await batcher.close()

    # One slot free: it takes the first 700; the second does not fit that batch (1400 rows > 1024)
    # and waits for a slot, so the 300 behind both is refused for the second alone.
    model, batcher, held = await _demo_batcher(busy_slots=6)
    queued = [batcher.enqueue(_request(700), 700), batcher.enqueue(_request(700), 700)]
    assert batcher.queued_work_s == pytest.approx(2 * 0.04056)
    with pytest.raises(Overloaded, match=r"40\.6 ms of work waiting ahead exceeds max_queue_work_ms 30"):
        batcher.enqueue(_request(300), 300)
    model.gate.set()
    await asyncio.gather(*held, *(q.future for q in queued))
    await batcher.close()


async def test_the_bytes_bound_refuses_beyond_max_queue_bytes() -> None:
    model = HeldModel()
    batcher = _one_at_a_time(model, max_queue_bytes=int(2.5 * MIB), max_queue_work_ms=0)
    one_mib = lambda: _request(MIB // 8, 2)  # noqa: E731 - float32 x 2 columns: 1 MiB
    running = [asyncio.ensure_future(batcher.submit(one_mib(), MIB // 8))]
    await _settle()  # on the card
    running += [asyncio.ensure_future(batcher.submit(one_mib(), MIB // 8)) for _ in range(2)]
    await _settle()
    assert batcher.queued == 2 and batcher.queued_bytes == 2 * MIB
    with pytest.raises(Overloaded, match=r"queued requests hold 2\.0 MiB and this one 1\.0 MiB, over "
                                         r"max_queue_bytes 2\.5 MiB"):
        batcher.enqueue(one_mib(), MIB // 8)
    small = asyncio.ensure_future(batcher.submit(_request(1), 1))  # 8 bytes more still fit
    await _settle()
    assert batcher.queued == 3
    model.gate.set()
    await _drain(running + [small])
    assert batcher.queued_bytes == 0
    await batcher.close()


async def test_work_and_bytes_are_released_when_requests_finish_time_out_or_are_abandoned() -> None:
    model = HeldModel()
    batcher = _one_at_a_time(model, cost=per_row_ms(1), max_queue_work_ms=1000, default_timeout_microseconds=0)
    first = asyncio.ensure_future(batcher.submit(_request(1), 1))
    await _settle()
    timed = asyncio.ensure_future(batcher.submit(_request(2), 2, timeout_s=0.02))
    gone = asyncio.ensure_future(batcher.submit(_request(3), 3))
    served = asyncio.ensure_future(batcher.submit(_request(4), 4))
    await _settle()
    assert batcher.queued == 3 and batcher.queued_work_s == pytest.approx(0.009)
    assert batcher.queued_bytes == 9 * 8
    with pytest.raises(DeadlineExceeded):
        await asyncio.wait_for(timed, 2.0)
    gone.cancel()  # the client went away
    await _settle()
    assert batcher.queued == 1 and batcher.queued_work_s == pytest.approx(0.004) and batcher.queued_bytes == 4 * 8
    model.gate.set()
    await _drain([first, served])
    assert (batcher.queued, batcher.queued_work_s, batcher.queued_bytes) == (0, 0.0, 0)
    assert model.batches == [1, 4]  # the timed-out and abandoned requests never ran
    await batcher.close()


async def test_the_default_timeout_fails_queued_requests_without_a_timer_each() -> None:
    model = HeldModel()
    batcher = _one_at_a_time(model, default_timeout_microseconds=20_000)
    first = asyncio.ensure_future(batcher.submit(_request(1), 1))
    await _settle()
    started = time.monotonic()
    queued = [batcher.enqueue(_request(1), 1) for _ in range(3)]
    assert all(q.timer is None for q in queued)  # one expiry timer for the queue, not one per request
    for q in queued:
        with pytest.raises(DeadlineExceeded, match="before compute"):
            await asyncio.wait_for(q.future, 2.0)
        batcher.abandon(q)
    assert 0.015 < time.monotonic() - started < 1.0
    assert batcher.queued == 0 and batcher.queued_bytes == 0
    model.gate.set()
    await _drain([first])
    await batcher.close()


async def test_memory_is_given_back_once_a_burst_of_bytes_drains_at_most_once_a_second() -> None:
    calls: list[float] = []
    model = HeldModel()
    batcher = DynamicBatcher(model, BatchingConfig(max_batch_rows=1, max_queue_delay_microseconds=0),
                             max_inflight=1, trim=lambda: calls.append(time.monotonic()), trim_after_bytes=MIB)
    model.gate.set()
    await batcher.submit(_request(4), 4)  # small: under trim_after_bytes
    await asyncio.sleep(0.15)
    assert calls == []
    model.gate.clear()
    burst = [asyncio.ensure_future(batcher.submit(_request(MIB // 8), MIB // 8))]
    await _settle()  # on the card
    burst += [asyncio.ensure_future(batcher.submit(_request(MIB // 8), MIB // 8)) for _ in range(2)]
    await _settle()
    assert batcher.queued_bytes == 2 * MIB  # one on the card, two queued
    await asyncio.sleep(0.15)
    assert calls == []  # not while the burst is held
    model.gate.set()
    await _drain(burst)
    await asyncio.sleep(0.3)
    assert len(calls) == 1 and batcher.trims == 1
    await _drain([asyncio.ensure_future(batcher.submit(_request(MIB // 8), MIB // 8)) for _ in range(3)])
    await asyncio.sleep(0.3)
    assert len(calls) == 1  # a second burst within a second: not again
    await batcher.close()


async def test_large_requests_one_at_a_time_are_no_burst_and_keep_their_memory() -> None:
    # Steady traffic of large queries, each alone in the queue: their running total passes the mark
    # many times over, but the queue never held it at once, so nothing is given back (a trim there
    # made every next batch fault its buffers in again).
    calls: list[float] = []
    model = HeldModel()
    batcher = DynamicBatcher(model, BatchingConfig(max_batch_rows=1, max_queue_delay_microseconds=0),
                             max_inflight=1, trim=lambda: calls.append(time.monotonic()),
                             trim_after_bytes=2 * MIB, trim_every_s=0.0)
    model.gate.set()
    for _ in range(6):
        await batcher.submit(_request(MIB // 8), MIB // 8)  # 1 MiB each, 6 MiB in all
        await asyncio.sleep(0.06)
    assert calls == [] and batcher.trims == 0
    model.gate.clear()
    burst = [asyncio.ensure_future(batcher.submit(_request(MIB // 8), MIB // 8)) for _ in range(3)]
    await _settle()
    assert batcher.queued_bytes == 2 * MIB  # the mark, held at once
    model.gate.set()
    await _drain(burst)
    await asyncio.sleep(0.2)
    assert len(calls) == 1


async def test_large_requests_one_after_another_are_given_back_once_the_server_is_quiet() -> None:
    # Not a burst, but the heap grew: given back after trim_quiet_s with no request, never while they come.
    calls: list[float] = []
    model = HeldModel()
    batcher = DynamicBatcher(model, BatchingConfig(max_batch_rows=1, max_queue_delay_microseconds=0),
                             max_inflight=1, trim=lambda: calls.append(time.monotonic()),
                             trim_after_bytes=2 * MIB, trim_every_s=0.0, trim_quiet_s=0.15)
    model.gate.set()
    for _ in range(4):
        await batcher.submit(_request(MIB // 8), MIB // 8)  # 1 MiB each, 0.05 s apart: never quiet for 0.15 s
        await asyncio.sleep(0.05)
    assert calls == []
    await asyncio.sleep(0.4)
    assert len(calls) == 1 and batcher.trims == 1
    await asyncio.sleep(0.3)
    assert len(calls) == 1  # nothing came since: nothing more to give back
    await batcher.close()


def test_plan_cost_prices_ids_on_the_host_and_items_on_the_cards() -> None:
    from sixfold.partitioner.compile import partition_builtin

    _, partitioned = partition_builtin("rm2", max_rows=200, seed=0, cards=6)
    cost = PlanCost.from_plan(partitioned.plan)
    assert cost.per_id_s > 0 and cost.per_row_s > 0
    one, thousand = cost.seconds(1, 3840), cost.seconds(1000, 3_840_000)
    assert 100 < thousand / one < 1000  # the fixed per-request part keeps small queries from being free
    inputs = {"sparse_indices": np.zeros(3840, dtype=np.int64)}
    assert cost(inputs, 1) == pytest.approx(one)


def test_config_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="max_queue_work_ms"):
        BatchingConfig(max_queue_work_ms=-1)
    with pytest.raises(ValueError, match="max_queue_bytes"):
        BatchingConfig(max_queue_bytes=-1)


# --- real: large requests over gRPC, the server's RSS --------------------------------------------------


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc for RSS")
@pytest.mark.timeout(240)
async def test_rss_comes_back_down_after_a_burst_of_large_requests() -> None:
    """Eight concurrent ~48 MiB requests (tiny model: 1 item, 2M ids per table) to a server in its own
    process; once they are answered or refused, its RSS returns to near where it was."""
    import tritonclient.grpc.aio as tritonaio
    from tritonclient.utils import InferenceServerException

    from bench.overload import ServerProcess

    ids = 2_000_000
    request = {"dense_features": np.ones((1, 4), dtype=np.float32),
               "sparse_lengths": np.full((1, 3), ids, dtype=np.int32),
               "sparse_indices": np.arange(3 * ids, dtype=np.int64) % 100}
    with ServerProcess("tiny", cards=2, batching={"max_batch_rows": 1, "max_queue_bytes": 100 * MIB}) as server:
        async with tritonaio.InferenceServerClient(server.url) as client:
            async def infer() -> str:
                inputs = []
                for name, array in request.items():
                    tensor = tritonaio.InferInput(name, list(array.shape), {"float32": "FP32", "int32": "INT32",
                                                                          "int64": "INT64"}[str(array.dtype)])
                    tensor.set_data_from_numpy(array)
                    inputs.append(tensor)
                try:
                    await client.infer("tiny", inputs, client_timeout=120)
                except InferenceServerException as exc:
                    return str(exc.status())
                return "ok"

            assert await infer() == "ok"  # warm: the steady state's buffers exist
            await asyncio.sleep(1.5)
            before = _rss_mib(server.pid)
            results = await asyncio.gather(*(infer() for _ in range(8)))
            peak = _rss_mib(server.pid)
            assert "ok" in results and set(results) <= {"ok", "StatusCode.RESOURCE_EXHAUSTED"}, results
            after = peak
            for _ in range(30):  # bounded: 6 s at most
                await asyncio.sleep(0.2)
                after = _rss_mib(server.pid)
                if after < before + 150:
                    break
        summary = f"RSS before {before:.0f} MiB, after the burst {peak:.0f}, then {after:.0f}; results {results}"
        assert after < before + 150, summary


def test_config_pbtxt_sets_the_admission_bounds() -> None:
    from sixfold.server.loading.model_config import parse_model_config

    settings = parse_model_config('parameters { key: "sixfold.max_queue_work_ms" value { string_value: "45" } }\n'
                                  'parameters { key: "sixfold.max_queue_bytes_mb" value { string_value: "128" } }')
    assert settings.batching.max_queue_work_ms == 45 and settings.batching.max_queue_bytes == 128 * MIB
    with pytest.raises(ValueError, match="sixfold.max_queue_work_ms"):
        parse_model_config('parameters { key: "sixfold.max_queue_work_ms" value { string_value: "-1" } }')
