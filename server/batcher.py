"""Dynamic batcher: merges queued requests into batches measured in rows (items).

Every canonical input concatenates on dim 0 (DESIGN.md, tensor convention), so
merging needs no model knowledge. Hygiene after MLServer's adaptive batcher and
Ray Serve's batching: one future per request, asyncio objects created on the
running loop, the remaining wait recomputed after each arrival, a failed batch
fails every waiting future, results set only on futures not yet done, and the
batch size a model returns is checked, never assumed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from .errors import DeadlineExceeded, InternalError, Overloaded, ServingError, Unavailable

__all__ = ["BatchingConfig", "DynamicBatcher", "BatchInfo"]

log = logging.getLogger(__name__)

Arrays = dict[str, np.ndarray]


@dataclass(frozen=True)
class BatchingConfig:
    """Dynamic batching knobs (Triton's names where they mean the same)."""

    max_batch_rows: int = 1024
    """A batch holds at most this many items; a larger query runs alone."""
    max_queue_delay_microseconds: int = 2000
    """How long the first request of a batch may wait for others to join."""
    max_inflight_batches: int = 0
    """Batches between host and cards at once (0: number of cards + 1, so stages overlap)."""
    max_queue_size: int = 256
    """Requests waiting at most; one more is refused at once with RESOURCE_EXHAUSTED (0: unbounded)."""
    default_timeout_microseconds: int = 0
    """A request still queued after this long is dropped before compute (0: no default timeout)."""

    def __post_init__(self) -> None:
        if self.max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {self.max_batch_rows}")
        if self.max_queue_delay_microseconds < 0:
            raise ValueError(f"max_queue_delay_microseconds must be >= 0, got {self.max_queue_delay_microseconds}")
        if self.max_inflight_batches < 0:
            raise ValueError(f"max_inflight_batches must be >= 0, got {self.max_inflight_batches}")
        if self.max_queue_size < 0:
            raise ValueError(f"max_queue_size must be >= 0, got {self.max_queue_size}")
        if self.default_timeout_microseconds < 0:
            raise ValueError(f"default_timeout_microseconds must be >= 0, got {self.default_timeout_microseconds}")


@dataclass
class BatchInfo:
    """What the runtime learns about the batch a request rode in (for statistics)."""

    rows: int = 0
    requests: int = 0
    queue_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class _Pending:
    inputs: Arrays
    rows: int
    future: asyncio.Future
    enqueued: float
    info: BatchInfo
    deadline: float | None = None


RunBatch = Callable[[Arrays, BatchInfo], Awaitable[Arrays]]


class DynamicBatcher:
    """Queue + batching loop for one model; ``submit`` returns that request's outputs."""

    def __init__(self, run_batch: RunBatch, config: BatchingConfig, *, max_inflight: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._run_batch = run_batch
        self.config = config
        self._max_inflight = max_inflight
        self._clock = clock
        self._queue: asyncio.Queue[_Pending] | None = None
        self._loop_task: asyncio.Task | None = None
        self._inflight: asyncio.Semaphore | None = None
        self._tasks: set[asyncio.Task] = set()
        self._closing = False
        self._carry: _Pending | None = None

    def _ensure_started(self) -> None:
        if self._loop_task is None:
            self._queue = asyncio.Queue()
            self._inflight = asyncio.Semaphore(self._max_inflight)
            self._loop_task = asyncio.get_running_loop().create_task(self._batching_loop())

    @property
    def queued(self) -> int:
        return (self._queue.qsize() if self._queue else 0) + (1 if self._carry else 0)

    async def submit(self, inputs: Arrays, rows: int, timeout_s: float | None = None) -> tuple[Arrays, BatchInfo]:
        """Queue one request; ``timeout_s`` (or the default timeout) drops it if still queued then."""
        if self._closing:
            raise Unavailable("server is shutting down; not accepting new requests")
        self._ensure_started()
        assert self._queue is not None
        limit = self.config.max_queue_size
        if limit and self.queued >= limit:
            raise Overloaded(f"queue full: {self.queued} requests waiting (max_queue_size {limit}); retry later")
        if timeout_s is None and self.config.default_timeout_microseconds:
            timeout_s = self.config.default_timeout_microseconds / 1e6
        now = self._clock()
        future = asyncio.get_running_loop().create_future()
        info = BatchInfo()
        deadline = None if timeout_s is None else now + timeout_s
        self._queue.put_nowait(_Pending(inputs, rows, future, now, info, deadline))
        return await future, info

    def _expired(self, item: _Pending) -> bool:
        """Fail a request whose deadline passed while it waited: it never reaches a card."""
        if item.deadline is None or self._clock() < item.deadline:
            return False
        if not item.future.done():
            waited = (self._clock() - item.enqueued) * 1e3
            item.future.set_exception(DeadlineExceeded(
                f"request timed out after {waited:.1f} ms in the queue, before compute"))
        return True

    async def _first_live(self) -> _Pending:
        assert self._queue is not None
        while True:
            first = self._carry or await self._queue.get()
            self._carry = None
            if not self._expired(first):
                return first

    async def _next_batch(self) -> list[_Pending]:
        assert self._queue is not None
        first = await self._first_live()
        batch, rows = [first], first.rows
        deadline = first.enqueued + self.config.max_queue_delay_microseconds / 1e6
        while rows < self.config.max_batch_rows:
            remaining = deadline - self._clock()
            try:
                item = self._queue.get_nowait() if remaining <= 0 else await asyncio.wait_for(self._queue.get(), remaining)
            except (asyncio.QueueEmpty, asyncio.TimeoutError):
                break
            if self._expired(item):
                continue
            if rows + item.rows > self.config.max_batch_rows:
                self._carry = item  # starts the next batch; never reorder requests
                break
            batch.append(item)
            rows += item.rows
        return batch

    async def _batching_loop(self) -> None:
        assert self._inflight is not None
        while True:
            await self._inflight.acquire()
            try:
                batch = await self._next_batch()
            except asyncio.CancelledError:
                self._inflight.release()
                raise
            task = asyncio.get_running_loop().create_task(self._execute(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _execute(self, batch: list[_Pending]) -> None:
        assert self._inflight is not None
        try:
            started = self._clock()
            rows = sum(p.rows for p in batch)
            info = BatchInfo(rows=rows, requests=len(batch))
            merged = batch[0].inputs if len(batch) == 1 else {
                name: np.concatenate([p.inputs[name] for p in batch]) for name in batch[0].inputs}
            outputs = await self._run_batch(merged, info)
            for name, array in outputs.items():
                if array.shape[0] != rows:
                    raise InternalError(f"model did not preserve batch size: output '{name}' has "
                                        f"{array.shape[0]} rows for a batch of {rows}")
            offsets = np.cumsum([0] + [p.rows for p in batch])
            for p, start, end in zip(batch, offsets[:-1], offsets[1:]):
                p.info.rows, p.info.requests = rows, len(batch)
                p.info.queue_s = started - p.enqueued
                p.info.timings = dict(info.timings)
                if not p.future.done():
                    p.future.set_result({name: a[start:end] for name, a in outputs.items()})
        except Exception as exc:  # a failed batch fails every request in it
            error = exc if isinstance(exc, ServingError) else InternalError(f"batch failed: {exc}")
            if not isinstance(exc, ServingError):
                log.exception("batch of %d requests failed", len(batch))
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(error)
        finally:
            self._inflight.release()

    async def close(self, drain: bool = True) -> None:
        """Stop taking requests; answer (drain) or fail what is queued; wait for running batches."""
        self._closing = True
        if self._loop_task is None:
            return
        assert self._queue is not None
        if drain:
            while self._queue.qsize() or self._carry:
                await asyncio.sleep(0.005)
        self._loop_task.cancel()
        try:
            await self._loop_task
        except asyncio.CancelledError:
            pass
        leftovers = [self._carry] if self._carry else []
        while not self._queue.empty():
            leftovers.append(self._queue.get_nowait())
        for p in leftovers:
            if not p.future.done():
                p.future.set_exception(Unavailable("server shut down before this request ran"))
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
