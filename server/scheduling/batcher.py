"""Dynamic batcher: merges queued requests into batches measured in rows (items).

Every canonical input concatenates on dim 0 (docs/architecture.md, "The tensor convention"), so
merging needs no model knowledge. Hygiene after MLServer's adaptive batcher and
Ray Serve's batching: one future per request, asyncio objects created on the
running loop, the wait recomputed after each arrival, a failed batch fails every
waiting future, results set only on futures not yet done, and the batch size a
model returns is checked, never assumed.

Scheduling follows Triton's dynamic batcher, in rows instead of requests:

* Priority levels (``priority_levels``; 1 is the highest). Each level has its own
  FIFO queue and queue policy (size bound, default timeout, timeout action). A
  batch is filled in priority order: level 1 first, then level 2, and so on,
  and stops at the first request that does not fit (no reordering past it).
* A batch leaves when it is full (``max_batch_rows``, or the next request does
  not fit), when it holds at least ``no_wait_rows`` rows, when it reaches a
  preferred size (``preferred_batch_rows``: it is cut
  just after the largest preferred size it crosses), when its oldest request
  has waited ``max_queue_delay_microseconds``, or (``all_in_dispatch``) when every
  request the clients keep outstanding is queued or running. It is formed only when a batch
  slot is free (``max_inflight``), so late arrivals of higher priority still
  get in.
* A queued request whose timeout passes is failed at once with DEADLINE_EXCEEDED
  (``timeout_action`` REJECT) or kept and moved behind every request of its
  level that has not timed out (DELAY). Requests whose client went away are
  dropped before compute.

Admission (``docs/admission.md``): besides its count bound, a level refuses a
request at once with RESOURCE_EXHAUSTED when the work queued ahead of it would take
longer than ``max_queue_work_ms`` to serve (its own service is not counted: the
budget is the SLA less a large query's service; nor is work that is running or that
free batch slots would take at once: only what waits for a slot is a wait), or when queued
requests would hold more than ``max_queue_bytes``. A request's work is the
model's cost estimate (``cost``, e.g. ``sixfold.server.scheduling.admission.PlanCost``) rescaled by
the service rate measured on finished batches (Little's law: a batch that ran
with k batches in flight for t seconds drained k x its estimate in t), so the
bound is in real seconds whatever the cost model's scale. A request alone in the
queue is always admitted: a query larger than the bound can still run. When a
burst of large requests (>= 1 MiB each, ``trim_after_bytes`` queued and running at one time) has
drained and no batch runs, freed heap pages are given back to the kernel
(``sixfold.server.memory.allocator.give_back_freed_memory``), off the event loop, at most once a second; large
requests that reach that many bytes one after another, only after a second with no request (steady
traffic keeps its buffers).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

import numpy as np

from sixfold.server.scheduling.admission import RequestCost
from sixfold.server.memory.allocator import give_back_freed_memory
from sixfold.server.errors import DeadlineExceeded, InternalError, InvalidInput, Overloaded, ServingError, Unavailable

__all__ = ["BatchingConfig", "QueuePolicy", "DynamicBatcher", "BatchInfo", "Queued", "TIMEOUT_ACTIONS",
           "SLA_P99_MS", "DEFAULT_QUEUE_WORK_MS", "DEFAULT_TIMEOUT_US", "DEFAULT_QUEUE_BYTES", "TRIM_AFTER_BYTES",
           "DEFAULT_NO_WAIT_ROWS"]

log = logging.getLogger(__name__)

Arrays = dict[str, np.ndarray]
TimeoutAction = Literal["REJECT", "DELAY"]
TIMEOUT_ACTIONS: tuple[str, ...] = ("REJECT", "DELAY")
_MIB = 1 << 20

SLA_P99_MS = 60.0
"""The latency target the defaults are derived from: MLPerf DLRM Server, p99 <= 60 ms."""
DEFAULT_QUEUE_WORK_MS = 30.0
"""Queue-delay budget: the SLA (60 ms) less the batching window (2 ms) and a large query's own
service at load (~28 ms: rm2's host stage takes ~31 ms for 700 items on a 2-core host)."""
DEFAULT_TIMEOUT_US = 1_000_000
"""Backstop for when admission's estimate is wrong (a card stalls): a request queued this long
has missed a 60 ms SLA 16 times over, and nobody waits for its answer. Loose on purpose, so a
loaded machine's pauses are not turned into errors; a deployment sets its SLA."""
DEFAULT_QUEUE_BYTES = 512 * _MIB
"""Bytes of inputs queued at most: ~16 of the largest sensible query (a 1000-item rm2 query is
~32 MB, nearly all ids); the host keeps a bounded share of its memory for requests in wait."""
TRIM_AFTER_BYTES = 128 * _MIB
"""A burst whose queued bytes reached this at one time is given back to the kernel once drained.

NOTE: the peak held at once, not a running total: steady traffic of large queries (rm2's 700-item
query is 21 MB) would otherwise trim after every few of them, and each batch after a trim faults
its buffers in again and waits on the trim's arena lock (measured on rm2 at 3 q/s of MLPerf-sized
queries: host stage of a 700-item query 33.5 -> 21.6 ms median, client p99 171 -> 60 ms). Twice a
few of the largest queries queued, so a server near its rate keeps its buffers."""
ALL_IN_HORIZON_S = 0.1
"""How far back ``all_in_dispatch`` looks for the most requests held at once (many closed-loop cycles)."""
DEFAULT_NO_WAIT_ROWS = 256
"""A batch this large leaves without waiting out the window: it fills a card (256 rows, the
default ``max_card_batch_rows``), so a partner would only wait for it."""


@dataclass(frozen=True)
class QueuePolicy:
    """One priority level's queue policy (Triton's ModelQueuePolicy)."""

    max_queue_size: int = 256
    """Requests waiting at this level at most; one more is refused at once with RESOURCE_EXHAUSTED (0: unbounded)."""
    default_timeout_microseconds: int = 0
    """A request still queued after this long times out (0: no default timeout, Triton's default)."""
    timeout_action: TimeoutAction = "REJECT"
    """REJECT: a timed-out request fails with DEADLINE_EXCEEDED before compute.
    DELAY: it stays queued, behind every request of its level that has not timed out."""
    allow_timeout_override: bool = True
    """Whether a client's timeout (gRPC deadline or ``timeout`` parameter) applies; it can
    only shorten the default timeout, never lengthen it."""

    def __post_init__(self) -> None:
        if self.max_queue_size < 0:
            raise ValueError(f"max_queue_size must be >= 0, got {self.max_queue_size}")
        if self.default_timeout_microseconds < 0:
            raise ValueError(f"default_timeout_microseconds must be >= 0, got {self.default_timeout_microseconds}")
        if self.timeout_action not in TIMEOUT_ACTIONS:
            raise ValueError(f"timeout_action must be one of {', '.join(TIMEOUT_ACTIONS)}, "
                             f"got {self.timeout_action!r}")

    def timeout_s(self, client_timeout_s: float | None) -> float | None:
        """The timeout a request gets at this level: the default, shortened by the client's if allowed."""
        default = self.default_timeout_microseconds / 1e6 if self.default_timeout_microseconds else None
        if client_timeout_s is None or not self.allow_timeout_override:
            return default
        return client_timeout_s if default is None else min(default, client_timeout_s)


@dataclass(frozen=True)
class BatchingConfig:
    """Dynamic batching knobs (Triton's names where they mean the same; sizes are rows).

    The top-level ``max_queue_size``, ``default_timeout_microseconds``,
    ``timeout_action`` and ``allow_timeout_override`` are the default queue
    policy; ``priority_queue_policy`` overrides it for single levels.
    """

    max_batch_rows: int = 1024
    """A batch holds at most this many items; a larger query runs alone."""
    max_queue_delay_microseconds: int = 2000
    """How long the oldest request of a batch may wait for others to join."""
    max_inflight_batches: int = 0
    """Batches between host and cards at once (0: number of cards + 1, so stages overlap)."""
    max_queue_size: int = 256
    """Requests waiting per level at most; one more is refused at once with RESOURCE_EXHAUSTED (0: unbounded)."""
    default_timeout_microseconds: int = 0
    """A request still queued after this long times out (0: no default timeout, Triton's default; ``sixfold-serve``
    defaults it to DEFAULT_TIMEOUT_US, 1 s)."""
    timeout_action: TimeoutAction = "REJECT"
    """What a timeout does (see QueuePolicy.timeout_action)."""
    allow_timeout_override: bool = True
    """Whether client timeouts apply (they can only shorten the default timeout)."""
    preferred_batch_rows: tuple[int, ...] = ()
    """Batch sizes (rows) worth sending at once: a batch that reaches one leaves without waiting out the delay."""
    no_wait_rows: int = DEFAULT_NO_WAIT_ROWS
    """A batch of at least this many rows leaves at once, without waiting out the delay, and
    uncut (0: every batch waits for a full size, a preferred one or the delay). Merging saves a
    batch's fixed costs, which a batch this large dwarfs: MLPerf-sized queries (100..700 items)
    ran one to a batch anyway, each waiting the whole window (2 ms of every request's p50 on
    dlrm-mlperf, bench/latency_breakdown.py)."""
    all_in_dispatch: bool = False
    """A batch also leaves, without waiting out the delay, once every request the clients keep
    outstanding is in it or running: once the requests queued and running reach the most that were
    in this batcher at once over the last ``ALL_IN_HORIZON_S``. Clients that wait for an answer before
    they send again (perf_analyzer, a closed loop) then send nothing more until answers go out, and
    the window would only be latency. Under open-loop traffic the count seldom reaches its recent
    peak, and batches wait as before. Off here (Triton's semantics); ``sixfold-serve`` turns it on."""
    priority_levels: int = 0
    """Priority levels, 1 the highest (0: priorities off, one queue)."""
    default_priority_level: int = 0
    """The level of a request that gives no priority (or priority 0); 1..priority_levels when levels are on."""
    priority_queue_policy: Mapping[int, QueuePolicy] = field(default_factory=dict)
    """Queue policy per level, overriding the default policy above."""
    max_queue_work_ms: float = 0.0
    """A request is refused with RESOURCE_EXHAUSTED when the work queued ahead of it (its level
    and higher ones) would take longer than this to serve, at the measured rate (its own work not counted,
    nor the requests that free batch slots would take at once: they wait no more than running ones)
    (0: no work bound). Off here, so a library user opts in; ``sixfold-serve`` defaults it to
    DEFAULT_QUEUE_WORK_MS (30 ms: a 60 ms p99 SLA's queue-delay budget)."""
    max_queue_bytes: int = DEFAULT_QUEUE_BYTES
    """Bytes of inputs queued requests may hold, all levels; one more is refused with
    RESOURCE_EXHAUSTED (0: unbounded). A request alone in the queue is always admitted."""
    deadline_work_share: float = 0.0
    """The SLA a client states for itself: a request that carries a deadline (gRPC deadline or ``timeout``
    parameter) is admitted against this share of it instead of ``max_queue_work_ms`` (0: off, every request
    against ``max_queue_work_ms``). A 250 ms deadline then queues up to 125 ms of work at 0.5, where a
    30 ms bound refused work the client would have waited for; a 20 ms one is refused early instead of
    timing out late. ``sixfold-serve`` sets 0.5 (the share its default bound takes of a 60 ms SLA) when no
    SLA is given (``--p99-ms``, ``--max-queue-work-ms``); with one given, it stays 0. Needs the work bound
    on (``max_queue_work_ms`` > 0), which prices requests."""

    def __post_init__(self) -> None:
        if self.max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {self.max_batch_rows}")
        if self.max_queue_delay_microseconds < 0:
            raise ValueError(f"max_queue_delay_microseconds must be >= 0, got {self.max_queue_delay_microseconds}")
        if self.max_inflight_batches < 0:
            raise ValueError(f"max_inflight_batches must be >= 0, got {self.max_inflight_batches}")
        if not (self.max_queue_work_ms >= 0 and math.isfinite(self.max_queue_work_ms)):
            raise ValueError(f"max_queue_work_ms must be >= 0 (0: no work bound), got {self.max_queue_work_ms}")
        if self.max_queue_bytes < 0:
            raise ValueError(f"max_queue_bytes must be >= 0 (0: unbounded), got {self.max_queue_bytes}")
        if self.no_wait_rows < 0:
            raise ValueError(f"no_wait_rows must be >= 0 (0: off), got {self.no_wait_rows}")
        if not (0 <= self.deadline_work_share <= 1):
            raise ValueError(f"deadline_work_share must be in 0..1 (0: off), got {self.deadline_work_share}")
        _ = self.default_policy  # building it checks the default policy's fields
        preferred = tuple(sorted(set(int(p) for p in self.preferred_batch_rows)))
        bad = [p for p in preferred if not 1 <= p <= self.max_batch_rows]
        if bad:
            raise ValueError(f"preferred_batch_rows {bad} out of range: each must be in 1..max_batch_rows "
                             f"({self.max_batch_rows})")
        object.__setattr__(self, "preferred_batch_rows", preferred)
        if self.priority_levels < 0:
            raise ValueError(f"priority_levels must be >= 0, got {self.priority_levels}")
        if self.priority_levels == 0:
            if self.default_priority_level != 0:
                raise ValueError(f"default_priority_level is {self.default_priority_level} but priority_levels "
                                 "is 0 (priorities off); set priority_levels too")
        elif not 1 <= self.default_priority_level <= self.priority_levels:
            raise ValueError(f"default_priority_level must be in 1..priority_levels ({self.priority_levels}), "
                             f"got {self.default_priority_level}")
        policies = dict(self.priority_queue_policy)
        for level, policy in policies.items():
            if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= self.priority_levels:
                raise ValueError(f"priority_queue_policy has level {level}, outside 1..priority_levels "
                                 f"({self.priority_levels})")
            if not isinstance(policy, QueuePolicy):
                raise ValueError(f"priority_queue_policy[{level}] must be a QueuePolicy, got {type(policy).__name__}")
        object.__setattr__(self, "priority_queue_policy", MappingProxyType(policies))

    @property
    def default_policy(self) -> QueuePolicy:
        return QueuePolicy(self.max_queue_size, self.default_timeout_microseconds, self.timeout_action,
                           self.allow_timeout_override)

    @property
    def levels(self) -> range:
        """The priority levels, highest first (one level when priorities are off)."""
        return range(1, max(self.priority_levels, 1) + 1)

    def policy(self, level: int) -> QueuePolicy:
        return self.priority_queue_policy.get(level) or self.default_policy

    def level_of(self, priority: int) -> int:
        """The queue a request with ``priority`` joins (0: the default level).

        With priorities off every request joins the one queue (Triton ignores
        the priority then too); with them on, a priority above
        ``priority_levels`` is refused rather than silently demoted.
        """
        if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
            raise InvalidInput(f"parameter 'priority' must be a non-negative integer, got {priority!r}")
        if self.priority_levels == 0:
            return 1
        if priority == 0:
            return self.default_priority_level
        if priority > self.priority_levels:
            raise InvalidInput(f"parameter 'priority' is {priority} but the model has priority_levels "
                               f"{self.priority_levels} (1 = highest; 0 = default level "
                               f"{self.default_priority_level})")
        return priority


@dataclass
class BatchInfo:
    """What the runtime learns about the batch a request rode in (for statistics)."""

    rows: int = 0
    requests: int = 0
    queue_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(eq=False)
class Queued:
    """One request in the queue (``DynamicBatcher.enqueue``): await ``future`` for its outputs;
    ``info`` then describes the batch it rode in."""

    inputs: Arrays
    rows: int
    future: asyncio.Future
    enqueued: float
    level: int
    cost: float = 0.0
    """Estimated work (the cost model's seconds, before the measured rescaling)."""
    nbytes: int = 0
    info: BatchInfo | None = None
    """Set when its batch has run."""
    timer: asyncio.TimerHandle | None = None
    taken: bool = False
    delayed: bool = False


class _Level:
    """One priority level's queue: requests in arrival order, and those whose DELAY timeout passed.

    Requests leave lazily: a taken, failed or cancelled request stays in its
    deque as a tombstone until it reaches the head (or the deque is compacted).
    """

    def __init__(self, policy: QueuePolicy) -> None:
        self.policy = policy
        self.default_timeout = policy.default_timeout_microseconds > 0
        self.timeout_s = policy.default_timeout_microseconds / 1e6
        # NOTE: a REJECT default timeout is checked at the head of the queue by one timer per
        # batcher (FIFO: the head expires first), not by a timer per request (~1.5 us each).
        self.lazy_expiry = self.default_timeout and policy.timeout_action == "REJECT"
        self.waiting: deque[Queued] = deque()
        self.delayed: deque[Queued] = deque()
        self.live = 0
        self.work = 0.0
        """Estimated work of the requests waiting at this level."""

    @staticmethod
    def _gone(p: Queued) -> bool:
        return p.taken or p.future.done()

    def _tidy(self, queue: deque[Queued], moved: bool) -> None:
        while queue and (self._gone(queue[0]) or (moved and queue[0].delayed)):
            queue.popleft()
        if len(queue) > 2 * self.live + 64:  # NOTE: bounds memory under churn; amortized O(1)
            kept = [p for p in queue if not (self._gone(p) or (moved and p.delayed))]
            queue.clear()
            queue.extend(kept)

    def in_order(self) -> Iterator[Queued]:
        """Live requests in service order: those not timed out, then the DELAYed ones."""
        self._tidy(self.waiting, moved=True)
        self._tidy(self.delayed, moved=False)
        for p in self.waiting:
            if not (self._gone(p) or p.delayed):
                yield p
        for p in self.delayed:
            if not self._gone(p):
                yield p


RunBatch = Callable[[Arrays, BatchInfo], Awaitable[Arrays]]


class DynamicBatcher:
    """Priority queues + batching loop for one model; ``submit`` returns that request's outputs."""

    def __init__(self, run_batch: RunBatch, config: BatchingConfig, *, max_inflight: int,
                 clock: Callable[[], float] = time.monotonic, cost: RequestCost | None = None,
                 trim: Callable[[], object] | None = give_back_freed_memory,
                 trim_after_bytes: int = TRIM_AFTER_BYTES, trim_every_s: float = 1.0,
                 trim_quiet_s: float = 1.0) -> None:
        """``cost(inputs, rows) -> seconds``: a request's estimated work (None: the work bound is off).
        ``trim``: gives freed memory back once a burst has drained (None: never), at most once every
        ``trim_every_s``; a burst is requests holding ``trim_after_bytes`` (or half of ``max_queue_bytes``,
        if less) queued and running at one time, counted as large ones (>= 1 MiB) arrive. Large requests
        that add up to the mark one after another are given back after ``trim_quiet_s`` with no request."""
        self._run_batch = run_batch
        self.config = config
        self._max_inflight = max_inflight
        self._clock = clock
        self._levels = {level: _Level(config.policy(level)) for level in config.levels}
        self._default_level = config.level_of(0)
        self._loop_task: asyncio.Task | None = None
        self._inflight: asyncio.Semaphore | None = None
        self._waiter: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_deadline: float | None = None
        self._tasks: set[asyncio.Task] = set()
        self._closing = False
        self._rows = 0
        """Rows of the requests waiting, all levels."""
        self._lazy_wake = not config.preferred_batch_rows and config.priority_levels <= 1
        self._wake_rows = min(config.max_batch_rows, config.no_wait_rows or config.max_batch_rows)
        """Queued rows at which an arrival must wake the batching loop while its timer runs."""
        self._one_level = config.priority_levels <= 1
        self._cost = cost if config.max_queue_work_ms > 0 else None
        self._work = 0.0
        """Estimated work waiting, all levels (cost model seconds)."""
        self._mean_cost = 0.0
        """Running mean of admitted requests' estimated cost: what a request still being read will likely add."""
        self._scale = 1.0
        """Measured seconds per estimated second (EWMA over finished batches)."""
        self._unmeasured = True
        self._work_limit = config.max_queue_work_ms / 1e3
        """max_queue_work_ms in estimated seconds: the bound over the measured scale."""
        self._deadline_share = config.deadline_work_share
        self._bytes = 0
        self._burst = 0
        """Most bytes of requests queued and running at one time (counted when a large one, >= 1 MiB,
        arrives; refused ones included) since the queue last drained."""
        self._running_bytes = 0
        self._since_trim = 0
        """Bytes of large requests since memory was last given back (given back after ``trim_quiet_s`` of quiet)."""
        self._arrivals = 0
        self._trim_quiet_s = trim_quiet_s
        self._running = 0
        self._running_requests = 0
        self._waiting = 0
        """Requests queued, all levels."""
        self._peak, self._peak_at = 0, -math.inf
        """The most requests queued and running at once, and when that was last reached (all_in_dispatch)."""
        self._all_in = config.all_in_dispatch
        if config.max_queue_bytes:  # NOTE: a queue bounded below the mark could never reach it
            trim_after_bytes = min(trim_after_bytes, config.max_queue_bytes // 2)
        self._trim, self._trim_after, self._trim_every = trim, trim_after_bytes, trim_every_s
        self._last_trim = -math.inf
        self._trims = 0
        self._expiry: asyncio.TimerHandle | None = None

    def _ensure_started(self) -> None:
        if self._loop_task is None:
            self._inflight = asyncio.Semaphore(self._max_inflight)
            self._loop_task = asyncio.get_running_loop().create_task(self._batching_loop())

    @property
    def queued(self) -> int:
        """Requests waiting, all levels."""
        return self._waiting

    def queued_by_level(self) -> dict[int, int]:
        return {n: level.live for n, level in self._levels.items()}

    @property
    def queued_work_s(self) -> float:
        """Work waiting, all levels, in measured seconds (what admission compares with max_queue_work_ms,
        less what free batch slots would take at once)."""
        return self._work * self._scale

    @property
    def queued_bytes(self) -> int:
        """Bytes of inputs held by waiting requests, all levels."""
        return self._bytes

    @property
    def seconds_per_estimate(self) -> float:
        """The measured rescaling of the cost model (1.0 until a batch has finished)."""
        return self._scale

    @property
    def trims(self) -> int:
        """How many times freed memory was given back after a burst."""
        return self._trims

    async def submit(self, inputs: Arrays, rows: int, timeout_s: float | None = None,
                     priority: int = 0) -> tuple[Arrays, BatchInfo]:
        """Queue one request and wait for its outputs: ``enqueue``, ``await`` its future, ``abandon`` on failure."""
        item = self.enqueue(inputs, rows, timeout_s, priority)
        try:
            outputs = await item.future
        except BaseException:  # timed out, failed, or cancelled (the client went away)
            self.abandon(item)
            raise
        return outputs, item.info

    def enqueue(self, inputs: Arrays, rows: int, timeout_s: float | None = None, priority: int = 0) -> Queued:
        """Queue one request at ``priority`` (0: the default level); ``timeout_s`` is the client's.

        The caller awaits the returned ``future`` and calls ``abandon`` if that raises (the
        request timed out, its batch failed, or its client went away). ``submit`` does both.
        NOTE: apart, so the serving path awaits the future itself: every coroutine frame between
        the RPC's task and the future is passed through twice per request, to suspend and resume.

        Raises Overloaded at once when the level's queue is full, InvalidInput
        for a priority the model does not have; the future raises DeadlineExceeded when a
        REJECT timeout passes while queued.
        """
        if self._closing:
            raise Unavailable("server is shutting down; not accepting new requests")
        # NOTE: nearly every request gives no priority: its level is looked up once, not per request.
        level_no = self._default_level if priority == 0 and type(priority) is int else self.config.level_of(priority)
        level = self._levels[level_no]
        limit = level.policy.max_queue_size
        if limit and level.live >= limit:
            where = f" at priority level {level_no}" if self.config.priority_levels else ""
            raise Overloaded(f"queue full{where}: {level.live} requests waiting (max_queue_size {limit}); "
                             "retry later")
        nbytes = 0
        for array in inputs.values():
            nbytes += array.nbytes
        self._arrivals += 1
        if nbytes >= _MIB:
            self._since_trim += nbytes
        if nbytes >= _MIB and self._bytes + self._running_bytes + nbytes > self._burst:
            # NOTE: small requests reuse the heap's buffers; large ones held together (queued or
            # running) are a burst (a refused one too: its bytes were decoded)
            self._burst = self._bytes + self._running_bytes + nbytes
        if self._bytes:  # NOTE: a request alone is always admitted (the message size limit bounds it)
            self._admit_bytes(nbytes)
        cost = 0.0
        if self._cost is not None:
            cost = self._cost(inputs, rows)
            ahead = self._work if self._one_level else self._work_ahead(level_no)
            # NOTE: the wait ahead, not the wait plus this request's own service: the budget already
            # leaves a large query's service out of the SLA, and counting it again refused every
            # large query whenever anything was queued (5% of MLPerf-sized queries at a third of
            # the rate the SLA allows, bench/latency_breakdown.py).
            by_deadline = timeout_s is not None and self._deadline_share > 0
            work_limit = self._deadline_share * timeout_s / self._scale if by_deadline else self._work_limit
            if ahead > work_limit and self._running < self._max_inflight:
                # NOTE: queued work that free batch slots take at once is no wait, as running work is
                # none: counting it refused a 300-item query behind a 700-item one that arrived in the
                # same turn of the loop, with every card idle (make demo, 3 runs in 8 at 5 q/s).
                # Walked only here, on a refusal with a slot free: under overload no slot is.
                ahead = self._work_waiting_for_a_slot(level_no)
            if ahead > work_limit:
                self._refuse_work(level_no, ahead, cost, timeout_s if by_deadline else None)
        if self._loop_task is None:
            self._ensure_started()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        item = Queued(inputs, rows, future, self._clock(), level_no, cost, nbytes)
        if timeout_s is not None or (level.default_timeout and not level.lazy_expiry):
            timeout = level.policy.timeout_s(timeout_s)
            if timeout is not None:
                item.timer = loop.call_later(max(0.0, timeout), self._timed_out, item)
        if level.lazy_expiry and self._expiry is None:
            self._expiry = loop.call_later(level.timeout_s, self._expire)
        level.waiting.append(item)
        level.live += 1
        level.work += cost
        self._rows += rows
        self._work += cost
        self._mean_cost += (0.1 if self._mean_cost else 1.0) * (cost - self._mean_cost)  # the first sets it
        self._bytes += nbytes
        self._waiting += 1
        all_in = False
        if self._all_in:
            held, now = self._waiting + self._running_requests, item.enqueued
            if held >= self._peak or now - self._peak_at > ALL_IN_HORIZON_S:
                self._peak, self._peak_at = held, now
                all_in = True
        # NOTE: while the batch timer runs, an arrival that cannot fill the batch changes nothing
        # (the oldest request sets the deadline): the loop is not woken to recount the queue,
        # which saves a wake-up and a walk over the queue per request.
        if all_in or not (self._lazy_wake and self._timer is not None and self._rows < self._wake_rows):
            self._wake()
        return item

    def refusal_before_read(self, timeout_s: float | None = None, reading: int = 0) -> str | None:
        """Why ``enqueue`` would refuse any request now, whatever its inputs; None: one might be admitted.

        For a transport that has not read the message yet (``sixfold.server.scheduling.unread_admission``):
        under overload most requests are refused, and a refused 8.6 MB rm2 query that is read and decoded
        first costs the server about what serving it would (measured at 3x on one core: goodput 0.58 of
        capacity). The checks are ``enqueue``'s that do not depend on the request: its level full, or
        more work waiting ahead than the bound with no batch slot free (its own work is never counted),
        or the queued bytes at their bound. ``timeout_s``: the client's deadline (admission by deadline).
        ``reading``: requests that passed this check and are being read: each is counted as a mean
        request's work that takes a batch slot, or every handler that starts in the same turn of the loop
        passes, and most are read only to be refused (measured at 10x: 501 read and refused, 577 unread).
        None with priorities on: an unread message may ask for a higher level.
        """
        if self._closing or not self._one_level:
            return None
        level = self._levels[self._default_level]
        limit = level.policy.max_queue_size
        if limit and level.live >= limit:
            return (f"queue full: {level.live} requests waiting (max_queue_size {limit}); refused before its "
                    "message was read; retry later")
        if self._cost is not None and self._running + reading >= self._max_inflight:
            by_deadline = timeout_s is not None and self._deadline_share > 0
            work_limit = self._deadline_share * timeout_s / self._scale if by_deadline else self._work_limit
            ahead = self._work + reading * self._mean_cost
            if ahead > work_limit:
                bound = (f"max_queue_work_ms {self.config.max_queue_work_ms:g}" if not by_deadline else
                         f"{self._deadline_share:g} of this request's {timeout_s * 1e3:.0f} ms deadline")
                return (f"queue full of work: {ahead * self._scale * 1e3:.1f} ms of work waiting ahead "
                        f"exceeds {bound} (estimated at the measured service rate); refused before its "
                        "message was read; retry later")
        byte_limit = self.config.max_queue_bytes
        if byte_limit and self._bytes and self._bytes >= byte_limit:
            return (f"queue full of bytes: queued requests hold {self._bytes / _MIB:.1f} MiB, max_queue_bytes "
                    f"{byte_limit / _MIB:.1f} MiB; refused before its message was read; retry later")
        return None

    def _work_ahead(self, level_no: int) -> float:
        """Work that is served before a request of ``level_no``: its level's and the higher ones'."""
        return sum(level.work for n, level in self._levels.items() if n <= level_no)

    def _work_waiting_for_a_slot(self, level_no: int) -> float:
        """Work ahead of a request of ``level_no`` that the free batch slots would not take at once.

        The requests ahead, in service order, are packed into batches as the batching loop packs
        them (up to ``max_batch_rows``; with preferred sizes, cut at the smallest one reached,
        which never puts more in a batch than the loop does); the first ``max_inflight - running``
        batches start now, and the work of the rest waits for a slot.
        """
        free = self._max_inflight - self._running
        limit = self.config.max_batch_rows
        preferred = self.config.preferred_batch_rows
        full = preferred[0] if preferred else limit
        rows, waiting = 0, 0.0
        for n, level in self._levels.items():
            if n > level_no:
                break
            for item in level.in_order():
                if free and rows and rows + item.rows > limit:  # it starts the next batch
                    free, rows = free - 1, 0
                if not free:
                    waiting += item.cost
                    continue
                rows += item.rows
                if rows >= full:
                    free, rows = free - 1, 0
        return waiting

    def _admit_bytes(self, nbytes: int) -> None:
        limit = self.config.max_queue_bytes
        if limit and self._bytes + nbytes > limit:
            raise Overloaded(f"queue full of bytes: queued requests hold {self._bytes / _MIB:.1f} MiB and this "
                             f"one {nbytes / _MIB:.1f} MiB, over max_queue_bytes {limit / _MIB:.1f} MiB; "
                             "retry later")

    def _refuse_work(self, level_no: int, ahead: float, cost: float, deadline_s: float | None = None) -> None:
        where = f" at priority level {level_no}" if self.config.priority_levels else ""
        scale = self._scale * 1e3
        bound = (f"max_queue_work_ms {self.config.max_queue_work_ms:g}" if deadline_s is None else
                 f"{self._deadline_share:g} of this request's {deadline_s * 1e3:.0f} ms deadline")
        raise Overloaded(f"queue full of work{where}: {ahead * scale:.1f} ms of work waiting ahead exceeds "
                         f"{bound} (estimated at the measured service "
                         f"rate; this request's own {cost * scale:.1f} ms not counted); retry later")

    def _release(self, item: Queued) -> None:
        """``item`` leaves the queue (taken into a batch, or abandoned): it holds no slot, work or bytes."""
        item.taken = True  # a tombstone from now on, if not taken into a batch
        level = self._levels[item.level]
        level.live -= 1
        self._waiting -= 1
        level.work -= item.cost
        self._rows -= item.rows
        self._work -= item.cost
        self._bytes -= item.nbytes
        if item.timer is not None:
            item.timer.cancel()
        if not level.live:
            level.work = 0.0  # NOTE: no float drift left behind by the sums
            if not self._rows:
                self._work = 0.0

    def abandon(self, item: Queued) -> None:
        """The caller stopped waiting for ``item`` (it timed out, its batch failed, or its client went
        away): it no longer holds a queue slot."""
        if not item.taken:
            self._release(item)
            if not self._bytes and not self._running:
                self._maybe_trim()

    def _expire(self) -> None:
        """Fail the REJECT-timeout requests at the heads of the queues whose timeout passed; re-arm."""
        self._expiry = None
        now = self._clock()
        nearest = math.inf
        for level in self._levels.values():
            if not level.lazy_expiry:
                continue
            for p in level.waiting:
                if p.taken or p.future.done() or p.delayed:
                    continue
                if p.enqueued + level.timeout_s > now:
                    nearest = min(nearest, p.enqueued + level.timeout_s)
                    break
                self._timed_out(p)
        if nearest < math.inf and not self._closing:
            self._expiry = asyncio.get_running_loop().call_later(max(0.0, nearest - now), self._expire)

    def _timed_out(self, item: Queued) -> None:
        if item.taken or item.future.done():
            return
        level = self._levels[item.level]
        if level.policy.timeout_action == "DELAY":
            item.delayed = True
            level.delayed.append(item)
            self._wake()
            return
        waited = (self._clock() - item.enqueued) * 1e3
        item.future.set_exception(DeadlineExceeded(
            f"request timed out after {waited:.1f} ms in the queue, before compute"))

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _candidates(self) -> tuple[list[Queued], bool]:
        """The batch that would leave now, in priority order; and whether it is full."""
        chosen: list[Queued] = []
        rows, limit = 0, self.config.max_batch_rows
        for level in self._levels.values():
            for item in level.in_order():
                if chosen and rows + item.rows > limit:
                    return chosen, True  # the next request starts the next batch; never reorder past it
                chosen.append(item)
                rows += item.rows
                if rows >= limit:
                    return chosen, True
        return chosen, False

    def _preferred_cut(self, chosen: list[Queued]) -> int:
        """How many of ``chosen`` to send now for a preferred size (0: none reached)."""
        cut, rows, preferred = 0, 0, self.config.preferred_batch_rows
        k = 0  # the next preferred size not yet crossed
        for i, item in enumerate(chosen):
            rows += item.rows
            while k < len(preferred) and rows >= preferred[k]:
                cut, k = i + 1, k + 1
        return cut

    def _take(self, batch: list[Queued]) -> list[Queued]:
        self._disarm()
        for item in batch:
            self._release(item)
        return batch

    async def _next_batch(self) -> list[Queued]:
        loop = asyncio.get_running_loop()
        delay = self.config.max_queue_delay_microseconds / 1e6
        no_wait = self.config.no_wait_rows
        while True:
            chosen, full = self._candidates()
            deadline = timeout = None
            if chosen:
                if full:
                    return self._take(chosen)
                cut = self._preferred_cut(chosen)
                if cut:
                    return self._take(chosen[:cut])
                if no_wait and sum(p.rows for p in chosen) >= no_wait:
                    return self._take(chosen)
                if self._all_in and len(chosen) == self._waiting and \
                        self._waiting + self._running_requests >= self._peak:
                    return self._take(chosen)  # everyone the clients keep outstanding is in: no one else is coming
                deadline = min(p.enqueued for p in chosen) + delay
                timeout = deadline - self._clock()
                if timeout <= 0:
                    return self._take(chosen)
            self._waiter = waiter = loop.create_future()
            self._arm_timer(loop, deadline, timeout)
            try:
                await waiter
            finally:
                self._waiter = None

    def _arm_timer(self, loop: asyncio.AbstractEventLoop, deadline: float | None, timeout: float | None) -> None:
        """Wake the batching loop at ``deadline`` (batcher clock), ``timeout`` seconds from now (None: never).

        NOTE: every arrival wakes the loop while the oldest request's deadline stays put, so
        a pending timer for the same deadline is kept (one timer per batch, not per arrival).
        """
        if self._timer is not None:
            if deadline == self._timer_deadline:
                return
            self._disarm()
        if deadline is not None:
            self._timer, self._timer_deadline = loop.call_later(timeout, self._timer_fired), deadline

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timer_fired(self) -> None:
        self._timer = None
        self._wake()

    async def _batching_loop(self) -> None:
        assert self._inflight is not None
        while True:
            await self._inflight.acquire()
            try:
                batch = await self._next_batch()
            except asyncio.CancelledError:
                self._inflight.release()
                raise
            self._running += 1
            self._running_requests += len(batch)
            task = asyncio.get_running_loop().create_task(self._execute(batch, self._running))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _measured(self, batch: list[Queued], concurrency: int, seconds: float) -> None:
        """Rescale estimates by a finished batch: with ``concurrency`` batches in flight, the
        server drained ``concurrency`` x its estimate in ``seconds`` (Little's law)."""
        estimate = 0.0
        for p in batch:
            estimate += p.cost
        if estimate > 0.0 and seconds > 0.0:
            sample = seconds / (concurrency * estimate)
            # NOTE: the first sample replaces the cost model's scale (it may be off 1000x: a throttled card)
            self._scale = sample if self._unmeasured else self._scale + 0.2 * (sample - self._scale)
            self._unmeasured = False
            self._work_limit = self.config.max_queue_work_ms / 1e3 / self._scale

    def _maybe_trim(self) -> None:
        """Give freed memory back once a burst of large requests has drained and no batch runs: off the
        loop, at most once every ``trim_every_s``."""
        if self._trim is None:
            return
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        if self._burst >= self._trim_after and now - self._last_trim >= self._trim_every:
            self._last_trim, self._burst = now, 0
            # NOTE: a little later, so the last batch's responses are sent and their buffers freed first
            loop.call_later(0.05, lambda: loop.run_in_executor(None, self._run_trim))
            return
        # NOTE: a burst within trim_every_s of the last trim, or large requests one after another: give
        # back once nothing has come for trim_quiet_s (a later arrival cancels it; steady traffic never waits)
        if self._burst >= self._trim_after or self._since_trim >= self._trim_after:
            loop.call_later(self._trim_quiet_s, self._trim_if_quiet, self._arrivals)
        self._burst = 0  # drained: the next burst is measured afresh

    def _trim_if_quiet(self, arrivals: int) -> None:
        """``trim_quiet_s`` after a drain: give memory back if no request came since (off the loop)."""
        if arrivals == self._arrivals and not self._bytes and not self._running:
            self._last_trim = time.monotonic()
            asyncio.get_running_loop().run_in_executor(None, self._run_trim)

    def _run_trim(self) -> None:
        if self._bytes or self._running:  # a new burst arrived meanwhile: its buffers are in use
            self._burst = max(self._burst, self._trim_after)
            self._last_trim = -math.inf
            return
        self._since_trim = 0
        self._trim()  # type: ignore[misc]
        self._trims += 1

    async def _execute(self, batch: list[Queued], concurrency: int = 1) -> None:
        assert self._inflight is not None
        started = self._clock()
        held = sum(p.nbytes for p in batch)
        self._running_bytes += held
        try:
            rows = sum(p.rows for p in batch)
            info = BatchInfo(rows=rows, requests=len(batch))
            merged = batch[0].inputs if len(batch) == 1 else {
                name: np.concatenate([p.inputs[name] for p in batch]) for name in batch[0].inputs}
            outputs = await self._run_batch(merged, info)
            for name, array in outputs.items():
                if array.shape[0] != rows:
                    raise InternalError(f"model did not preserve batch size: output '{name}' has "
                                        f"{array.shape[0]} rows for a batch of {rows}")
            start = 0
            for p in batch:
                end = start + p.rows
                # NOTE: timings are the batch's, shared and read only from here on
                p.info = BatchInfo(rows, len(batch), started - p.enqueued, info.timings)
                if not p.future.done():
                    p.future.set_result({name: a[start:end] for name, a in outputs.items()})
                start = end
        except Exception as exc:  # a failed batch fails every request in it
            error = exc if isinstance(exc, ServingError) else InternalError(f"batch failed: {exc}")
            if not isinstance(exc, ServingError):
                log.exception("batch of %d requests failed", len(batch))
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(error)
        else:
            if self._cost is not None:
                self._measured(batch, concurrency, self._clock() - started)
        finally:
            self._running -= 1
            self._running_requests -= len(batch)
            self._running_bytes -= held
            self._inflight.release()
            if not self._bytes and not self._running:
                self._maybe_trim()

    async def close(self, drain: bool = True) -> None:
        """Stop taking requests; answer (drain) or fail what is queued; wait for running batches."""
        self._closing = True
        if self._loop_task is None:
            return
        if drain:
            while self.queued:
                await asyncio.sleep(0.005)
        self._loop_task.cancel()
        try:
            await self._loop_task
        except asyncio.CancelledError:
            pass
        self._disarm()
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        for level in self._levels.values():
            for p in list(level.in_order()):
                if not p.future.done():
                    p.future.set_exception(Unavailable("server shut down before this request ran"))
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
