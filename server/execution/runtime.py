"""Runs one batch through a plan: host (sparse) stage, then the dense stage on a routed card.

Card health (``sixfold.server.execution.card_health``): each card batch gets a hang deadline from
the cost model's expected time for it on that card (a multiple of it, at least
a floor). A batch still running at its hedge point is copied to an idle
healthy card, first answer wins. A card that fails, or passes the deadline, is
taken out of rotation, its batch is retried once on another healthy card, and
the card is restarted in the background (closed, loaded again, and probed with
a one-item batch) before it rejoins; repeated failures back off. When no card
can answer in time (every card hung or restarting), the batch's dense part
runs on the host CPU if a host dense executable exists, else it fails at once
with UNAVAILABLE naming each card's state. A card's error is judged once a second path (a card,
or the host fallback) has run the batch: failed the same way there, it is the batch's own (its
shape; INVALID_ARGUMENT, every card stays in rotation), else the card's. With no second path (one card,
no host fallback) the card runs a batch it answered before: answered, the error is the batch's. Texts name a lane by
its plan card (``cardK``), or a pipeline's as ``replica R (cards a,b,c)``.

Small batches may run their dense part on the host CPU instead (DeepRecSys:
for a few items a card's transfers and queue cost more than the host's
compute). ``HostDenseTuner`` decides per batch, from a fixed row threshold or
one it tunes from measured latencies.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from sixfold.backends.api import Arrays, DeviceLost, Executable
from sixfold.models import DENSE, INDICES, LENGTHS

from sixfold.server.scheduling.batcher import BatchInfo
from sixfold.server.scheduling.card_gate import CARD_SCHEDULING, CardGate
from sixfold.server.execution.card_health import (BatchRefusedByEveryPath, CardDeadlines, CardError, CardHang,
                          HostFallbackError, NoHealthyCardLeft, expected_card_seconds, lane_card_ids, lane_name,
                          same_failure)
from sixfold.server.execution.card_split import CardSplit
from sixfold.server.errors import InternalError, ServingError, Unavailable
from sixfold.server.scheduling.router import LeastLoadedRouter, NoHealthyCard

__all__ = ["PlanRuntime", "DEFAULT_MIN_SPLIT_ROWS", "CARD_SCHEDULING", "DEFAULT_CARD_SCHEDULING", "HostDenseTuner",
           "StageRunner", "single_threaded_ops_here"]

log = logging.getLogger(__name__)

ReloadCard = Callable[[int], Executable]
CardFault = Callable[[int, str], None]
"""Told (card index, kind) of every card fault: "late" (hedge point passed), "hang", "error"."""
DEFAULT_MIN_SPLIT_ROWS = 64
"""A batch of at least twice this many rows is split over cards (``PlanRuntime``)."""
DEFAULT_CARD_SCHEDULING = "fifo"
MAX_EXPLORE_SPREAD = 16.0
"""``HostDenseTuner`` explores a side at most this many times less often than ``explore_every`` (see ``_every``)."""
"""``--card-scheduling``'s default (see ``sixfold.server.scheduling.card_gate``)."""
T = TypeVar("T")


@dataclass
class _Ewma:
    value: float = 0.0
    count: int = 0
    at: float = float("-inf")
    """When the last sample came (the tuner's clock)."""

    def add(self, sample: float, alpha: float, at: float = 0.0, decay_s: float = 0.0) -> None:
        """Move ``alpha`` of the way to ``sample``, or more after a gap: a sample ``decay_s`` after the
        last one moves it 63% of the way (time-decayed, as a load balancer's peak EWMA), so a rarely
        sampled average does not lag behind a change of load by many samples."""
        if self.count and decay_s > 0:
            alpha = max(alpha, 1.0 - math.exp(-max(0.0, at - self.at) / decay_s))
        self.value = sample if self.count == 0 else self.value + alpha * (sample - self.value)
        self.count += 1
        self.at = at


def _ewma(table: dict[int, _Ewma], bucket: int) -> _Ewma:
    """The bucket's EWMA, made on first use (not ``setdefault``, which builds one on every call)."""
    ewma = table.get(bucket)
    if ewma is None:
        ewma = table[bucket] = _Ewma()
    return ewma


class HostDenseTuner:
    """Which batches run their dense part on the host: those of at most ``threshold`` rows.

    ``max_rows`` >= 0 fixes the threshold (0: never). ``max_rows`` = -1 tunes it:
    the dense-stage latency of each path is kept as an EWMA per rows bucket
    (powers of two: 1, 2, 3-4, 5-8, ...), and the threshold becomes the top of
    the largest bucket up to which the host was faster in every bucket measured
    on both sides, capped at ``limit``. To keep measuring both sides, every
    ``explore_every``-th batch of a bucket (every 2nd until a side has
    ``min_samples``) takes the other path; batches over ``limit`` rows never
    run on the host. The latencies include each path's queueing, so a busy card
    or a busy host pushes work to the other one.

    Both sides are compared as they are now: a side not measured for ``stale_after_s`` is
    explored with the next batch of its bucket, and the averages decay with time as well as with
    samples (a sample ``decay_s`` after the previous one moves its side 63% of the way). Without
    that, a burst inflated the cards' figure (many samples, each with a queue), moved every small
    batch onto the single host thread, and the cards' figure then came back down a fifth of the way
    per exploring batch, one batch in 20: after 5 s of 16 queries outstanding on dlrm-mlperf, 170 of
    the next 275 batches at 25 q/s still ran on the host, and 66 of the 275 after those.
    """

    def __init__(self, max_rows: int = -1, *, limit: int = 256, explore_every: int = 20,
                 alpha: float = 0.2, min_samples: int = 3, stale_after_s: float = 1.0, decay_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_rows < -1:
            raise ValueError(f"host_dense_max_rows must be -1 (auto), 0 (off) or a row count, got {max_rows}")
        if limit < 1 or explore_every < 2 or not 0 < alpha <= 1 or min_samples < 1:
            raise ValueError(f"bad host-dense tuner settings: limit {limit} (>= 1), explore_every "
                             f"{explore_every} (>= 2), alpha {alpha} (in (0, 1]), min_samples {min_samples} (>= 1)")
        if not stale_after_s > 0 or not decay_s > 0:
            raise ValueError(f"bad host-dense tuner settings: stale_after_s {stale_after_s} (> 0), "
                             f"decay_s {decay_s} (> 0)")
        self.auto = max_rows == -1
        self.threshold = 0 if self.auto else max_rows
        self.stale_after_s, self.decay_s, self._clock = stale_after_s, decay_s, clock
        self.limit = limit
        self.explore_every, self.alpha, self.min_samples = explore_every, alpha, min_samples
        self._host: dict[int, _Ewma] = {}
        self._card: dict[int, _Ewma] = {}
        self._seen: dict[int, int] = {}
        self._explored: dict[tuple[bool, int], float] = {}  # (on host, bucket) -> when a stale side was tried

    @staticmethod
    def bucket(rows: int) -> int:
        """Bucket b holds batches of 2**(b-1) + 1 .. 2**b rows (bucket 0: one row)."""
        return max(0, (rows - 1).bit_length())

    def on_host(self, rows: int) -> bool:
        """Whether this batch's dense part should run on the host."""
        host = rows <= self.threshold
        if not self.auto or rows > self.limit:
            return host
        b = self.bucket(rows)
        n = self._seen[b] = self._seen.get(b, 0) + 1
        other = (self._card if host else self._host).get(b)
        if other is not None and other.count >= self.min_samples:
            now = self._clock()
            key = (not host, b)
            if now - other.at > self.stale_after_s and now - self._explored.get(key, -math.inf) > self.stale_after_s:
                self._explored[key] = now  # once, not with every batch until its answer is in
                return not host
        every = self._every(host, b) if other is not None and other.count >= self.min_samples else 2
        return (not host) if n % every == 0 else host

    def _every(self, host: bool, bucket: int) -> int:
        """One batch in how many of ``bucket`` explores the other side: ``explore_every`` x how many times slower
        it is (1..``MAX_EXPLORE_SPREAD``), so exploring costs about the same share of the time however far apart
        the sides are. Only while the other side was measured within a tenth of ``stale_after_s``: at a few
        batches a second exploring stays one in ``explore_every`` (a burst's inflated figure comes back as fast
        as before); at thousands it is explored about ten times a second instead of a hundred.

        NOTE: the tiny model's cards (a thread hand-off, a modelled sleep, ~0.3 ms of CPU) against its host
        dense (~10 us) made the one-in-20 exploring batch cost the loop more than the other 19 together.
        """
        mine = (self._host if host else self._card).get(bucket)
        other = (self._card if host else self._host)[bucket]
        if mine is None or mine.count < self.min_samples or mine.value <= 0 or other.value <= mine.value:
            return self.explore_every
        if self._clock() - other.at > self.stale_after_s / 10:
            return self.explore_every
        spread = min(max(other.value / mine.value, 1.0), MAX_EXPLORE_SPREAD)
        return max(self.explore_every, int(self.explore_every * spread))

    def record(self, rows: int, seconds: float, on_host: bool) -> None:
        """One measured dense stage; retunes the threshold in auto mode."""
        if not self.auto or rows > self.limit:
            return
        side = self._host if on_host else self._card
        _ewma(side, self.bucket(rows)).add(seconds, self.alpha, self._clock(), self.decay_s)
        threshold = 0
        for b in sorted(self._host):
            host, card = self._host[b], self._card.get(b)
            if card is None or min(host.count, card.count) < self.min_samples:
                continue
            if host.value >= card.value:
                break
            threshold = min(1 << b, self.limit)
        self.threshold = threshold

    def snapshot(self) -> dict[str, object]:
        """Threshold and per-bucket EWMA latencies (ms), for stats and debugging."""
        def table(side: dict[int, _Ewma]) -> dict[int, float]:
            return {1 << b: round(e.value * 1e3, 3) for b, e in sorted(side.items())}
        return {"mode": "auto" if self.auto else "fixed", "max_rows": self.threshold, "limit": self.limit,
                "host_ms": table(self._host), "card_ms": table(self._card)}


async def _within(awaitable: Awaitable[T], seconds: float) -> T:
    """``await`` with a time limit (raises TimeoutError).

    NOTE: ``asyncio.timeout`` (3.11+) arms one timer on the current task; ``wait_for``
    wraps the awaitable in a new task, per card call.
    """
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await awaitable
    return await asyncio.wait_for(awaitable, seconds)  # pragma: no cover - Python 3.10


def single_threaded_ops_here() -> int:
    """Make torch ops called from this thread (the event loop's) use one intra-op thread; others keep theirs.

    Returns the intra-op thread count other threads keep.

    NOTE: a cheap stage run inline on the loop (``StageRunner``) calls an op or two that fan out
    to the OpenMP pool even for a few rows (``embedding_bag`` splits its bags over every
    thread). Between batches that pool's threads go to sleep, so each call waits for one to
    wake and be scheduled on a busy CPU: measured in the server, a tiny batch's
    ``embedding_bag`` took ~110 us with two threads against ~17 us with one. Batches big enough
    to gain from the pool run on their stage's worker thread, which keeps the process default.
    OpenMP's thread count is per thread, but torch also keeps a process default that a thread
    reads on its first parallel op: a helper thread puts that back.
    """
    import torch

    workers = torch.get_num_threads()  # also settles this thread's own count, so it is not re-read later
    torch.set_num_threads(1)
    if workers != 1:
        helper = threading.Thread(target=torch.set_num_threads, args=(workers,), name="intra-op-default")
        helper.start()
        helper.join()
    return workers


def _timed_run(executable: Executable, inputs: Arrays) -> tuple[Arrays, float, float]:
    """On the worker: the outputs, the CPU time this thread spent (GIL waits excluded) and when it started."""
    started = time.perf_counter()
    t0 = time.thread_time()
    outputs = executable.run(inputs)
    return outputs, time.thread_time() - t0, started


class StageRunner:
    """Runs one host-side executable's batches inline on the event loop when that is cheap, else on its worker.

    A hop to the worker thread costs the loop a submit, a wake-up and a callback, and the
    worker then trades the GIL with the busy loop at every op (each handoff a futex wake, and
    a wait of up to the interpreter's 5 ms switch interval): for a stage that holds the GIL
    for well under a millisecond anyway (a small torch-fx host graph, a small dense MLP) that
    is most of its latency and costs the loop more than running it. So run times are kept per
    rows bucket (powers of two, as ``HostDenseTuner``): a bucket whose CPU time on the worker is
    at most ``probe_factor`` x ``max_inline_s`` tries inline runs, and keeps running inline while
    their wall time (what the loop pays; an EWMA of samples capped at twice the limit) stays at
    most ``max_inline_s``. When it goes over (the stage blocks on I/O or a device, or grew), the
    bucket goes back to the worker for a number of batches that doubles at each failed try (up
    to 4096), then tries again.

    Only executables that keep the default ``Executable.infer`` (``run`` on their own worker)
    run inline, and, unless they are ``thread_safe``, only while none of their batches is on
    the worker (one batch at a time, as the Executable contract says).
    """

    def __init__(self, executable: Executable, max_inline_s: float, *, probe_factor: float = 3.0,
                 alpha: float = 0.2) -> None:
        self.executable = executable
        self.max_inline_s = max_inline_s
        self.probe_s = probe_factor * max_inline_s
        self.alpha = alpha
        self.inlinable = max_inline_s > 0 and type(executable).infer is Executable.infer
        self._worker_cpu: dict[int, _Ewma] = {}
        self._inline_wall: dict[int, _Ewma] = {}
        self._hold: dict[int, tuple[int, int]] = {}  # bucket -> (batches left on the worker, next hold)
        self._on_worker = 0

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.executable.input_names

    def runs_inline(self, rows: int) -> bool:
        """Whether a batch of ``rows`` rows would run on the event loop now."""
        return self.inlinable and self._decide(HostDenseTuner.bucket(rows), consume=False)

    def _decide(self, bucket: int, consume: bool = True) -> bool:
        # NOTE: a thread-safe stage need not wait out its worker: one slow batch there would
        # otherwise send every batch behind it to the worker too.
        if self._on_worker and not self.executable.thread_safe:
            return False
        inline = self._inline_wall.get(bucket)
        if inline is not None:
            return True  # over the limit it was dropped in _record_inline
        left, hold = self._hold.get(bucket, (0, 1))
        if left:
            if consume:
                self._hold[bucket] = (left - 1, hold)
            return False
        worker = self._worker_cpu.get(bucket)
        return worker is not None and worker.value <= self.probe_s

    async def infer(self, inputs: Arrays, rows: int, timings: dict[str, float] | None = None) -> Arrays:
        """The stage's outputs; ``timings["wait_s"]`` (if given) gets the seconds the batch waited for the
        worker (behind other batches of this stage), 0 when it ran inline."""
        if not self.inlinable:
            return await self.executable.infer(inputs)
        bucket = HostDenseTuner.bucket(rows)
        if self._decide(bucket):
            t0 = time.perf_counter()
            outputs = self.executable.run(inputs)
            self._record_inline(bucket, time.perf_counter() - t0)
            return outputs
        self._on_worker += 1
        try:
            loop = asyncio.get_running_loop()
            submitted = time.perf_counter()
            outputs, cpu_s, started = await loop.run_in_executor(self.executable._worker(), _timed_run,
                                                                 self.executable, inputs)
            if timings is not None:
                timings["wait_s"] = started - submitted
        finally:
            self._on_worker -= 1
        _ewma(self._worker_cpu, bucket).add(cpu_s, self.alpha)
        return outputs

    def _record_inline(self, bucket: int, seconds: float) -> None:
        inline = _ewma(self._inline_wall, bucket)
        first = inline.count == 0
        # NOTE: a sample counts at most twice the limit: on a shared machine one preemption (a few
        # ms of wall time) would otherwise lift a 40 us stage's average over the limit and send it
        # to the worker for a doubling number of batches; a stage that is really slow still crosses
        # it within a few runs.
        inline.add(min(seconds, 2 * self.max_inline_s), self.alpha)
        if inline.value <= self.max_inline_s:
            if first:
                self._hold.pop(bucket, None)  # a try that worked: start the back-off afresh
            return
        del self._inline_wall[bucket]
        _, hold = self._hold.get(bucket, (0, 1))
        self._hold[bucket] = (hold, min(2 * hold, 4096))
        log.debug("%s: inline runs of bucket %d take %.3f ms; the next %d batches of that size run on its worker",
                  self.executable.artifact.name, bucket, inline.value * 1e3, hold)


def _batch_items(inputs: Arrays, info: BatchInfo) -> int:
    """Items (candidates) in a batch: the batcher's count, else ``dense_features``' rows.

    NOTE: never just the first input's length: inputs come in the client's order, and
    ``sparse_indices`` has one row per id, not per item.
    """
    if info.rows:
        return info.rows
    return (inputs[DENSE] if DENSE in inputs else next(iter(inputs.values()))).shape[0]


@dataclass(eq=False)
class _Attempt:
    """One card running (a copy of) a batch's dense part."""

    index: int
    rows: int
    expected_s: float
    """This batch's own expected card seconds (given back to the router when it ends)."""
    hang_after: float
    deadline: float
    """Loop time at which the card counts as hung."""
    hedge_at: float | None
    task: asyncio.Future = field(repr=False)
    expected_total_s: float = 0.0
    """Expected seconds until this batch is done: the card's queued work ahead of it plus its own."""

    @property
    def started(self) -> float:
        return self.deadline - self.hang_after


def _cancel(tasks: Sequence[asyncio.Future]) -> None:
    """Cancel tasks from their loop's thread or any other (``close`` may run in a worker thread)."""
    for task in tasks:
        loop = task.get_loop()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            task.cancel()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(task.cancel)


class PlanRuntime:
    """Host executable + one dense executable per card, joined by the router.

    ``reload_card(i)`` loads card ``i`` afresh (used to restart a failed card). A card batch's
    hang deadline is ``max(card_timeout_floor_s, card_timeout_multiple x expected)`` capped at
    ``card_timeout_s``, where ``expected`` is the cost model's time for the batch (and the work
    queued ahead of it) on that card's ``DeviceSpec``; at ``hedge_fraction`` of it a copy goes to
    an idle card (0: never). ``on_card_fault(card, kind)`` hears every fault ("late", "hang",
    "error"). ``host_dense`` is the dense partition loaded on the host
    CPU (e.g. the dense ONNX on onnxruntime with the host spec); batches of at
    most ``host_dense_max_rows`` rows run there (-1: tuned from measured
    latencies up to ``host_dense_auto_limit`` rows; 0: never). If it fails, the
    batch goes to a card. When the cards cannot answer a batch (every card unhealthy, or its
    first card hung), it runs there too (``dense_fallback``). Host and host-dense batches whose
    measured run time is at most ``max_inline_s`` run on the event loop itself (``StageRunner``; 0: never).

    Pipelining (``host_chunk_rows`` > 0): a batch of at least twice that many items, in the
    canonical signature, runs its host stage in chunks of about that many items, and each chunk
    goes on to the cards as soon as its host stage is done, while the next chunk's host stage
    runs: the card stage of chunk k overlaps the host stage of chunk k+1, and the batch's
    latency is its host stage plus the last chunk's card stage rather than the whole batch's.

    A batch is split only as the card partition's layouts allow (``CardSplit``): a model whose
    card inputs are ragged, or have no recorded layout, sends every batch to one card whole.
    Otherwise a batch of more than ``max_card_rows`` rows is split across cards. So is a batch of at
    least 2 x ``min_split_rows`` rows: into equal parts of at least ``min_split_rows`` rows
    (0: split only what a card cannot take), as many as there are cards for it.
    ``card_scheduling`` says which cards those are. "fifo": a ``CardGate`` hands the cards to
    batches in arrival order, each batch split over as many as it can use, waiting for them
    while earlier batches hold them; each part gives its card back as it finishes. "greedy":
    the cards idle when the batch arrives, without waiting; with none idle the batch stays
    whole (see the gate's docstring for why that loses to FIFO once batches overlap).
    """

    def __init__(self, host: Executable, cards: Sequence[Executable], *, reload_card: ReloadCard | None = None,
                 card_timeout_s: float = 30.0, card_timeout_multiple: float = 10.0,
                 card_timeout_floor_s: float = 0.5, hedge_fraction: float = 0.25, max_card_attempts: int = 2,
                 restart_backoff_s: float = 0.5, dense_fallback: bool = True,
                 on_card_fault: CardFault | None = None, max_card_rows: int | None = None,
                 min_split_rows: int = DEFAULT_MIN_SPLIT_ROWS,
                 host_dense: Executable | None = None, host_dense_max_rows: int = -1,
                 host_dense_auto_limit: int = 256, host_dense_explore_every: int = 20,
                 max_inline_s: float = 1e-3, host_chunk_rows: int = 0,
                 card_scheduling: str = DEFAULT_CARD_SCHEDULING,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.host = host
        self._host_runner = StageRunner(host, max_inline_s)
        self.cards = list(cards)
        self.router = LeastLoadedRouter(len(self.cards))
        self.card_split = CardSplit(self.cards[0].artifact) if self.cards else None
        if self.card_split is not None and not self.card_split.splittable:
            log.warning("%s: %s", self.card_split.name, self.card_split.why_not)
        self.reload_card = reload_card
        self.deadlines = CardDeadlines(card_timeout_multiple, card_timeout_floor_s, card_timeout_s, hedge_fraction)
        if max_card_attempts < 1 or restart_backoff_s < 0:
            raise ValueError(f"max_card_attempts must be >= 1 (got {max_card_attempts}) and restart_backoff_s "
                             f">= 0 (got {restart_backoff_s})")
        self.max_card_attempts = max_card_attempts
        self.restart_backoff_s = restart_backoff_s
        self.dense_fallback = dense_fallback
        self.on_card_fault = on_card_fault
        self.closed = False
        """Set by ``close``: a closed runtime answers nothing (``can_answer`` is False)."""
        self.on_close: list[Callable[[], None]] = []
        """Called by ``close`` once the executables are closed (``sixfold.server.loading.card_memory``)."""
        self.card_state = ["healthy"] * len(self.cards)
        """What each card is doing, in words (named in UNAVAILABLE errors and logs)."""
        self.fault_counts: dict[tuple[int, str], int] = {}
        """(card, kind) -> faults seen; kinds as ``on_card_fault``'s."""
        self.hedges = self.hedge_wins = self.host_fallbacks = 0
        self.slowest_card_ratio = self.slowest_card_s = 0.0
        """Largest observed / expected time, and largest time, of an answered card batch (how close
        healthy cards come to their hang deadline)."""
        self._strikes = [0] * len(self.cards)
        self._pace = [_Ewma() for _ in self.cards]  # observed / expected time of each card's answered batches
        self._probe: tuple[Arrays, int] | None = None
        self._watchers: set[asyncio.Future] = set()
        if max_card_rows is not None and max_card_rows < 1:
            raise ValueError(f"max_card_rows must be >= 1, got {max_card_rows}")
        self.max_card_rows = max_card_rows
        if min_split_rows < 0:
            raise ValueError(f"min_split_rows must be >= 0 (0: split only batches over max_card_rows), got {min_split_rows}")
        self.min_split_rows = min_split_rows
        if host_chunk_rows < 0:
            raise ValueError(f"host_chunk_rows must be >= 0 (0: whole batches), got {host_chunk_rows}")
        self.host_chunk_rows = host_chunk_rows
        if card_scheduling not in CARD_SCHEDULING:
            raise ValueError(f"card_scheduling must be one of {', '.join(CARD_SCHEDULING)}, got {card_scheduling!r}")
        self.card_scheduling = card_scheduling
        self.card_gate = CardGate(lambda: len(self.router.healthy), clock) if card_scheduling == "fifo" else None
        self._clock = clock
        self._restarts: set[asyncio.Task] = set()
        self._host_active = 0  # batches in the host stage now
        self._host_hold: asyncio.Future | None = None  # set while between_batches runs a change
        self._host_idle: asyncio.Event | None = None
        if host_dense is None and host_dense_max_rows > 0:
            raise ValueError(f"host_dense_max_rows={host_dense_max_rows} needs a host dense executable "
                             "(host_dense); pass one, or -1/0")
        self.host_dense = host_dense
        self._host_dense_runner = None if host_dense is None else StageRunner(host_dense, max_inline_s)
        self.host_dense_tuner = None if host_dense is None or host_dense_max_rows == 0 else HostDenseTuner(
            host_dense_max_rows, limit=host_dense_auto_limit, explore_every=host_dense_explore_every, clock=clock)

    @property
    def card_timeout_s(self) -> float:
        """The longest a card may take on one batch, whatever its expected time."""
        return self.deadlines.cap_s

    @property
    def host_dense_max_rows(self) -> int:
        """Batches of at most this many rows run their dense part on the host now (0: none)."""
        return self.host_dense_tuner.threshold if self.host_dense_tuner is not None else 0

    @property
    def _can_fall_back(self) -> bool:
        return self.dense_fallback and self._host_dense_runner is not None

    @property
    def can_answer(self) -> bool:
        """Whether a batch has a complete path now: a card (lane) in rotation, or the host's dense fallback.

        Readiness follows it (``ServedModel.ready``): with every card out and no fallback, each batch
        would fail UNAVAILABLE, so the model must not report ready to a load balancer.
        """
        return not self.closed and (bool(self.router.healthy) or self._can_fall_back)

    def lane_cards(self, index: int) -> tuple[str, ...]:
        """The plan's ids of the physical cards lane ``index`` runs on (one, or a pipeline replica's)."""
        return lane_card_ids(self.cards[index], index)

    def lane_name(self, index: int) -> str:
        """Lane ``index`` in texts: ``cardK`` (the plan's card), or ``replica R (cards a,b,c)`` for a pipeline."""
        return lane_name(self.cards[index], index)

    def _states(self) -> str:
        return "; ".join(f"{self.lane_name(i)} {state}" for i, state in enumerate(self.card_state))

    def _lanes_word(self) -> str:
        return "replicas" if any(getattr(c, "stages", None) is not None for c in self.cards) else "cards"

    def paths(self) -> str:
        """The paths a batch could take now, in words: each card's state, and the host fallback."""
        cards = self._states()
        host = "host fallback ready" if self._can_fall_back else "no host fallback"
        return f"{cards}; {host}"

    async def between_batches(self, change: Callable[[], Any]) -> Any:
        """Run ``change()`` (awaited if it returns an awaitable, e.g. work sent to a thread) while no batch
        is in the host stage; batches arriving meanwhile wait.

        For changes to what the host stage reads (table deltas): every batch's host stage sees the
        rows before ``change`` or after it, never both. Batches already past the host stage go on.
        """
        while self._host_hold is not None:
            await asyncio.shield(self._host_hold)
        hold = self._host_hold = asyncio.get_running_loop().create_future()
        try:
            while self._host_active:
                self._host_idle = asyncio.Event()
                await self._host_idle.wait()
            result = change()
            return await result if inspect.isawaitable(result) else result
        finally:
            self._host_hold = None
            hold.set_result(None)

    async def run(self, inputs: Arrays, info: BatchInfo) -> Arrays:
        rows = _batch_items(inputs, info)
        while self._host_hold is not None:  # rows are changing (between_batches): wait for it
            await asyncio.shield(self._host_hold)
        chunks = self._chunks(inputs, rows)
        if chunks is not None:
            return await self._run_pipelined(inputs, chunks, info)
        t0 = self._clock()
        self._host_active += 1
        stage: dict[str, float] = {}
        try:
            host_out = await self._host_runner.infer({n: inputs[n] for n in self.host.input_names}, rows, stage)
        except ServingError:
            raise
        except OSError as exc:  # e.g. a tiered table's read failed: this batch fails, the next may not
            raise Unavailable(f"host stage: {exc}") from exc
        except Exception as exc:
            raise InternalError(f"host stage failed: {exc}") from exc
        finally:
            self._host_active -= 1
            if not self._host_active and self._host_idle is not None:
                self._host_idle.set()
        t1 = self._clock()
        card_inputs = {**inputs, **host_out}
        tuner = self.host_dense_tuner
        outputs = None
        if tuner is not None and tuner.on_host(rows):
            outputs = await self._host_dense_stage(card_inputs, rows)
        if outputs is not None:
            index = -1  # the host
        else:
            t_card = self._clock()
            index, outputs = await self._dense_on_cards(card_inputs, rows, stage)
            if tuner is not None and index >= 0:  # split or not: what the cards' path gave this batch
                tuner.record(rows, self._clock() - t_card, on_host=False)
        t2 = self._clock()
        info.timings.update(host_s=t1 - t0, host_wait_s=stage.get("wait_s", 0.0), card_s=t2 - t1, card=float(index))
        if "card_wait_s" in stage:
            info.timings["card_wait_s"] = stage["card_wait_s"]
        if index < 0:
            info.timings["dense_on_host"] = 1.0
        return outputs

    def _chunks(self, inputs: Arrays, rows: int) -> list[tuple[int, int, int, int]] | None:
        """Item and id bounds ``(a, b, ids_a, ids_b)`` of the host-stage chunks of a batch (None: run it whole).

        Only the canonical signature splits (ids are sample-major, so a run of items is a run of ids).
        """
        size = self.host_chunk_rows
        if not size or rows < 2 * size or not {DENSE, LENGTHS, INDICES} >= set(self.host.input_names):
            return None
        lengths, ids = inputs.get(LENGTHS), inputs.get(INDICES)
        if lengths is None or ids is None or lengths.ndim != 2 or lengths.shape[0] != rows:
            return None
        parts = rows // size
        base, extra = divmod(rows, parts)
        ends = np.cumsum([base + 1] * extra + [base] * (parts - extra))
        id_ends = np.cumsum(lengths.sum(axis=1, dtype=np.int64))[ends - 1]
        if int(id_ends[-1]) != ids.shape[0]:
            return None  # let the host stage report the mismatch
        bounds = zip([0, *ends[:-1].tolist()], ends.tolist(), [0, *id_ends[:-1].tolist()], id_ends.tolist())
        return [(int(a), int(b), int(c), int(d)) for a, b, c, d in bounds]

    async def _run_pipelined(self, inputs: Arrays, chunks: list[tuple[int, int, int, int]], info: BatchInfo) -> Arrays:
        """The batch in host-stage chunks, each chunk's card stage started as soon as its host stage is done."""
        t0 = self._clock()
        host_s = 0.0
        stage: dict[str, float] = {}
        cards: list[asyncio.Future] = []
        self._host_active += 1
        try:
            for a, b, c, d in chunks:
                part = {name: (array[c:d] if name == INDICES else array[a:b]) for name, array in inputs.items()}
                h0 = self._clock()
                try:
                    host_out = await self._host_runner.infer({n: part[n] for n in self.host.input_names}, b - a)
                except ServingError:
                    raise
                except OSError as exc:
                    raise Unavailable(f"host stage: {exc}") from exc
                except Exception as exc:
                    raise InternalError(f"host stage failed: {exc}") from exc
                host_s += self._clock() - h0
                cards.append(asyncio.ensure_future(self._dense_on_cards({**part, **host_out}, b - a, stage)))
        except BaseException:
            for task in cards:
                task.cancel()
            await asyncio.gather(*cards, return_exceptions=True)
            raise
        finally:
            self._host_active -= 1
            if not self._host_active and self._host_idle is not None:
                self._host_idle.set()
        results = await asyncio.gather(*cards)
        outputs = {name: np.concatenate([r[1][name] for r in results]) for name in results[0][1]}
        index = results[-1][0]
        info.timings.update(host_s=host_s, card_s=self._clock() - t0 - host_s, card=float(index),
                            host_chunks=float(len(chunks)), **stage)
        if index < 0:
            info.timings["dense_on_host"] = 1.0
        return outputs

    async def _dense_on_cards(self, card_inputs: Arrays, rows: int,
                                timings: dict[str, float] | None = None) -> tuple[int, Arrays]:
        """A batch's (or a chunk's) dense part on the cards, split as ``card_scheduling`` says.

        With the card gate, the time spent waiting for cards adds to ``timings["card_wait_s"]``.
        """
        gate = self.card_gate
        if gate is None:
            return await self._split_across_cards(card_inputs, rows, self.parts(rows))
        w0 = self._clock()
        grant = await gate.acquire(self._parts(rows, len(self.router.healthy)),
                                   lambda parts: self._split_seconds(card_inputs, rows, parts))
        if timings is not None:
            timings["card_wait_s"] = timings.get("card_wait_s", 0.0) + self._clock() - w0
        try:
            # each part gives its card back as it finishes: the next batch in line may start there
            return await self._split_across_cards(card_inputs, rows, max(grant.slots, self._parts(rows, 0)),
                                                  lambda: gate.release(grant, 1))
        finally:
            gate.release(grant)

    def _split_seconds(self, card_inputs: Arrays, rows: int, parts: int) -> float:
        """Expected seconds of a batch split in ``parts``: its largest part's, on a card at the cards' mean pace."""
        healthy = self.router.healthy
        if not healthy:
            return 0.0
        card = self.cards[healthy[0]]
        part = -(-rows // max(1, parts))
        # NOTE: views of the first part's rows: the cost model reads shapes and byte counts only
        inputs = self._card_split().head({n: card_inputs[n] for n in card.input_names}, rows, part)
        pace = sum(self.pace(i) for i in healthy) / len(healthy)
        return expected_card_seconds(card, part, inputs) * pace

    async def _host_dense_stage(self, card_inputs: Arrays, rows: int) -> Arrays | None:
        """The dense part on the host CPU; None (the caller uses a card) if it fails."""
        runner = self._host_dense_runner
        assert runner is not None and self.host_dense_tuner is not None
        t0 = self._clock()
        try:
            outputs = await runner.infer({n: card_inputs[n] for n in runner.input_names}, rows)
        except Exception:  # noqa: BLE001 - the cards can still answer this batch
            log.exception("host dense stage failed on a %d-row batch; running it on a card", rows)
            return None
        self.host_dense_tuner.record(rows, self._clock() - t0, on_host=True)
        return outputs

    def parts(self, rows: int) -> int:
        """Into how many sub-batches a batch of ``rows`` rows goes now, without the card gate (see the class docstring)."""
        return self._parts(rows, sum(1 for load in self.router.loads if load.healthy and not load.outstanding_rows))

    def _parts(self, rows: int, free: int) -> int:
        """Sub-batches for a batch of ``rows`` rows when ``free`` cards are its to use."""
        if self.card_split is not None and not self.card_split.splittable:
            return 1  # its layouts say it cannot be cut between items (CardSplit.why_not)
        need = 1 if self.max_card_rows is None else -(-rows // self.max_card_rows)
        if self._can_fall_back and not any(load.healthy for load in self.router.loads):
            return 1  # every card is out: the whole batch goes to the host at once
        if not self.min_split_rows or rows < 2 * self.min_split_rows:
            return need
        return max(need, min(free, rows // self.min_split_rows))

    async def _split_across_cards(self, card_inputs: Arrays, rows: int, parts: int,
                                  part_done: Callable[[], None] | None = None) -> tuple[int, Arrays]:
        """Sub-batches of (nearly) equal size run on several cards at once, then rejoin in order (one part: the batch).

        ``part_done()`` is called as each part finishes (answered or failed).

        Each card input splits at its rows per item as the plan's layouts say (1 for dense
        features, T for pooled embeddings laid out [N * T, D]; ``CardSplit``), never by
        divisibility; outputs concatenate. Equal parts, not full ones and a remainder: the batch is done when its largest part is.
        """
        async def part(piece: Arrays, count: int) -> tuple[int, Arrays]:
            try:
                return await self._card_stage(piece, count)
            finally:
                if part_done is not None:
                    part_done()

        if parts == 1:
            return await part(card_inputs, rows)
        base, extra = divmod(rows, parts)
        ends = np.cumsum([base + 1] * extra + [base] * (parts - extra)).tolist()
        bounds = list(zip([0, *ends[:-1]], ends))
        pieces = self._card_split().pieces({n: card_inputs[n] for n in self.cards[0].input_names}, rows, bounds)
        results = await asyncio.gather(*(part(piece, b - a) for piece, (a, b) in zip(pieces, bounds)))
        outputs = {name: np.concatenate([r[1][name] for r in results]) for name in results[0][1]}
        return results[0][0], outputs

    def _card_split(self) -> CardSplit:
        assert self.card_split is not None, "a runtime without cards splits nothing"
        return self.card_split

    async def _card_stage(self, card_inputs: Arrays, rows: int) -> tuple[int, Arrays]:
        """The batch's dense part on a card, hedged, retried, or on the host: -> (card index or -1, outputs).

        At most ``max_card_attempts`` cards run it (the first, a hedged copy or a retry). Once the
        first card is past its hang deadline, a host fallback (when there is one) answers instead
        of waiting on a second card; a copy still running is left to finish (or hang) on its own.
        """
        loop = asyncio.get_running_loop()
        running: list[_Attempt] = []
        tried: set[int] = set()
        failures: list[tuple[str, str]] = []  # (kind, what happened)
        suspects: list[tuple[int, str, BaseException]] = []  # (lane, text, error): failed it, no verdict yet
        first: _Attempt | None = None
        hedge_at: float | None = None
        try:
            while True:
                if not running:
                    if len(tried) >= self.max_card_attempts or (first is not None and self._can_fall_back
                                                                 and loop.time() >= first.deadline):
                        break
                    attempt = self._start(card_inputs, rows, tried, idle_only=False)
                    if attempt is None:
                        break
                    running.append(attempt)
                    if first is None:
                        first, hedge_at = attempt, attempt.hedge_at
                assert first is not None
                wake = min(a.deadline for a in running)
                if hedge_at is not None:
                    wake = min(wake, hedge_at)
                if self._can_fall_back:
                    wake = min(wake, first.deadline)
                done, _ = await asyncio.wait([a.task for a in running], timeout=max(0.0, wake - loop.time()),
                                             return_when=asyncio.FIRST_COMPLETED)
                for attempt in [a for a in running if a.task in done]:
                    running.remove(attempt)
                    self.router.release(attempt.index, rows, attempt.expected_s)
                    exc = attempt.task.exception()
                    if exc is None:
                        self._served(attempt, card_inputs, rows, hedged=attempt is not first)
                        if suspects:  # another path answered: their failures were their cards'
                            self._convict(suspects)
                        for other in running:  # the slower copy: its answer is dropped, its card still watched
                            self._watch(other)
                        running.clear()
                        return attempt.index, attempt.task.result()
                    text = f"{self.lane_name(attempt.index)} failed ({type(exc).__name__}: {exc})"
                    failures.append(("error", text))
                    if isinstance(exc, DeviceLost):
                        self._fault(attempt.index, "error", text, lost=True)
                        continue
                    same = [s for s in suspects if same_failure(s[2], exc)]
                    if same:  # a second path failed it the same way: the batch's error, not the cards'
                        self._refuse(running, card_inputs, rows, [t for _, t, _ in same] + [text], exc)
                    # NOTE: no verdict yet: a card is taken out only once another path answers this batch
                    # or fails it differently (see _convict), never for an error every path would raise
                    self._convict(suspects)
                    suspects.append((attempt.index, text, exc))
                now = loop.time()
                for attempt in [a for a in running if now >= a.deadline]:
                    running.remove(attempt)
                    attempt.task.cancel()
                    self.router.release(attempt.index, rows, attempt.expected_s)
                    text = f"{self.lane_name(attempt.index)} hung (> {attempt.hang_after:.2f} s)"
                    failures.append(("hang", text))
                    self._fault(attempt.index, "hang", text)
                if hedge_at is not None and now >= hedge_at:
                    hedge_at = None
                    if running:
                        self._fault(running[0].index, "late", "")
                        if len(tried) < self.max_card_attempts:
                            hedge = self._start(card_inputs, rows, tried, idle_only=True)
                            if hedge is not None:
                                self.hedges += 1
                                running.append(hedge)
                if running and self._can_fall_back and now >= first.deadline:
                    for attempt in running:
                        self._watch(attempt)
                    running.clear()
                    break
        except BatchRefusedByEveryPath:
            raise
        except BaseException:  # cancelled (server closing) or a bug: no card keeps this batch's load
            for attempt in running:
                attempt.task.cancel()
                self.router.release(attempt.index, rows, attempt.expected_s)
            raise
        return -1, await self._fall_back(card_inputs, rows, failures, suspects)

    async def _judge_by_probe(self, card_inputs: Arrays, rows: int,
                              suspects: list[tuple[int, str, BaseException]]) -> None:
        """With no second path (one card, no host fallback): the one card that failed this batch runs an item of a
        batch it answered before; if it answers, the error is the batch's own (INVALID_ARGUMENT) and the card stays.

        Without this a request the model cannot take (a static export's batch size) took the only card out, and the
        model with it, until a restart. No batch answered yet, or the probe failing too: the card's fault, as before.
        """
        probe = self._probe
        if len(suspects) != 1 or probe is None or isinstance(suspects[0][2], DeviceLost):
            return
        if probe[1] == rows and all(card_inputs.get(n) is a for n, a in probe[0].items()):
            return  # the only batch at hand is this one: nothing known to be good to judge the card by
        index, text, exc = suspects[0]
        suspects.clear()
        why = await self._probe_card(index, whole=True)  # as answered: a static export takes no other size
        if why is not None:  # the probe counted the fault: out, not counted twice
            self._take_out(index, text, lost=why.startswith("lost"))
            return
        lane = self.lane_name(index)
        log.warning("a %d-row batch failed on %s, which then answered a batch it had answered before: the request's "
                    "error; the card stays in rotation (%s)", rows, lane, text)
        raise BatchRefusedByEveryPath(f"this batch failed on {lane}, the only path, which then answered a batch it had "
                                      f"answered before, so its inputs do not fit the model: {type(exc).__name__}: "
                                      f"{exc}") from exc

    def _convict(self, suspects: list[tuple[int, str, BaseException]]) -> None:
        """The lanes that failed a batch another path answered (or failed differently): a card fault each."""
        for index, text, _ in suspects:
            self._fault(index, "error", text)
        suspects.clear()

    def _refuse(self, running: list[_Attempt], card_inputs: Arrays, rows: int, texts: list[str],
                exc: BaseException) -> None:
        """Answer INVALID_ARGUMENT: every path failed the batch the same way (its shape), so no card is at fault."""
        for attempt in running:  # a hedged copy would fail the same way: stop it, no verdict on its card
            attempt.task.cancel()
            self.router.release(attempt.index, rows, attempt.expected_s)
        running.clear()
        probe = self._probe
        if probe is not None and probe[1] == rows and all(card_inputs.get(n) is a for n, a in probe[0].items()):
            self._probe = None  # never probe a restarted card with a batch no card can take
        log.warning("a %d-row batch failed the same way on %d paths (%s): the request's error; every card stays "
                    "in rotation", rows, len(texts), "; ".join(texts))
        raise BatchRefusedByEveryPath(f"this batch fails the same way on every path it was run on "
                                      f"({', '.join(t.split(' failed', 1)[0] for t in texts)}), so its inputs do not "
                                      f"fit the model: {type(exc).__name__}: {exc}") from exc

    def _start(self, card_inputs: Arrays, rows: int, tried: set[int], *, idle_only: bool) -> _Attempt | None:
        """Send the batch to a healthy card not yet tried (None: there is none)."""
        try:
            index = self.router.acquire(rows, exclude=tried, idle_only=idle_only)
        except NoHealthyCard:
            return None
        tried.add(index)
        card = self.cards[index]
        inputs = {n: card_inputs[n] for n in card.input_names}
        own = expected_card_seconds(card, rows, inputs)
        total = self.router.charge(index, own) + own
        hang_after = self.deadlines.hang_after(total * self.pace(index))
        hedge_after = self.deadlines.hedge_after(total * self.pace(index))
        now = asyncio.get_running_loop().time()
        if self._probe is None:
            self._probe = (inputs, rows)
        return _Attempt(index, rows, own, hang_after, now + hang_after,
                        None if hedge_after is None else now + hedge_after, asyncio.ensure_future(card.infer(inputs)),
                        total)

    def pace(self, index: int) -> float:
        """How much slower than its spec card ``index`` answers (an EWMA of observed / expected, at least 1).

        NOTE: deadlines scale by it, so a card that is slow but answering (throttled, or a simulated
        card whose host lags) is not taken for hung; a hung card answers nothing, so its pace stays.
        """
        ewma = self._pace[index]
        return max(1.0, ewma.value) if ewma.count else 1.0

    def _served(self, attempt: _Attempt, card_inputs: Arrays, rows: int, hedged: bool) -> None:
        self._strikes[attempt.index] = 0
        if attempt.expected_total_s > 0:
            took = asyncio.get_running_loop().time() - attempt.started
            self.slowest_card_ratio = max(self.slowest_card_ratio, took / attempt.expected_total_s)
            self.slowest_card_s = max(self.slowest_card_s, took)
            self._pace[attempt.index].add(took / attempt.expected_total_s, 0.2)
        self._probe = (card_inputs, rows)
        self.hedge_wins += hedged

    def _watch(self, attempt: _Attempt) -> None:
        """Let a copy no batch waits for run out: its card is released when it ends, taken out if it hangs."""
        async def watch() -> None:
            loop = asyncio.get_running_loop()
            try:
                await asyncio.wait([attempt.task], timeout=max(0.0, attempt.deadline - loop.time()))
            except asyncio.CancelledError:  # the runtime is closing: no verdict on the card
                attempt.task.cancel()
                self.router.release(attempt.index, attempt.rows, attempt.expected_s)
                raise
            self.router.release(attempt.index, attempt.rows, attempt.expected_s)
            if not attempt.task.done():
                attempt.task.cancel()
                self._fault(attempt.index, "hang", f"{self.lane_name(attempt.index)} hung (> {attempt.hang_after:.2f} s)")
            elif not attempt.task.cancelled() and attempt.task.exception() is not None:
                exc = attempt.task.exception()
                self._fault(attempt.index, "error", f"{self.lane_name(attempt.index)} failed ({type(exc).__name__}: {exc})",
                            lost=isinstance(exc, DeviceLost))
            else:
                self._strikes[attempt.index] = 0

        task = asyncio.ensure_future(watch())
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _fall_back(self, card_inputs: Arrays, rows: int, failures: list[tuple[str, str]],
                         suspects: list[tuple[int, str, BaseException]] | None = None) -> Arrays:
        """No card answered: the dense part on the host CPU, else UNAVAILABLE naming what happened.

        ``suspects``: lanes that failed the batch with no verdict yet; the host fallback failing it the
        same way makes it the request's error (INVALID_ARGUMENT), else they are card faults.
        """
        suspects = suspects if suspects is not None else []
        if not self._can_fall_back:
            await self._judge_by_probe(card_inputs, rows, suspects)
            self._convict(suspects)
            states = self._states()
            word = self._lanes_word()
            if not failures:
                raise NoHealthyCardLeft(f"all {len(self.cards)} {word} unhealthy: {states}")
            kind = CardHang if any(k == "hang" for k, _ in failures) else CardError
            raise kind(f"batch failed on {len(failures)} {word.removesuffix('s')}(s): "
                       f"{'; '.join(t for _, t in failures)} ({word} now: {states})")
        states = self._states()
        runner = self._host_dense_runner
        assert runner is not None
        try:
            outputs = await runner.infer({n: card_inputs[n] for n in runner.input_names}, rows)
        except Exception as exc:  # noqa: BLE001 - named in the client's error
            same = [s for s in suspects if same_failure(s[2], exc)]
            if same:
                self._refuse([], card_inputs, rows, [t for _, t, _ in same] + [f"host failed ({type(exc).__name__}: {exc})"],
                             exc)
            self._convict(suspects)
            raise HostFallbackError(f"no card could answer ({states}) and the host dense fallback failed: "
                                    f"{type(exc).__name__}: {exc}") from exc
        self._convict(suspects)
        self.host_fallbacks += 1
        if self.host_fallbacks == 1 or failures:
            log.warning("a %d-row batch's dense part ran on the host: %s", rows,
                        "; ".join(t for _, t in failures) or f"no healthy card ({states})")
        return outputs

    def _fault(self, index: int, kind: str, why: str, *, lost: bool = False) -> None:
        """Count a card fault; a hang or an error takes the card out (and restarts it, unless the backend said
        the device is lost for good: ``DeviceLost``)."""
        self._count(index, kind)
        if kind in ("hang", "error"):
            self._take_out(index, why, lost=lost)

    def _take_out(self, index: int, why: str, *, lost: bool = False) -> None:
        if not self.router.loads[index].healthy:
            return
        self.router.mark_down(index)
        if self.card_gate is not None:
            self.card_gate.changed()
        self._strikes[index] += 1
        name = self.lane_name(index)
        if lost:
            self.card_state[index] = f"lost for good: {why.removeprefix(f'{name} ')}"
            log.error("%s lost for good (its backend raised DeviceLost): %s; it is not restarted", name, why)
            return
        restarting = self.reload_card is not None
        self.card_state[index] = f"{why.removeprefix(f'{name} ')}{', restarting' if restarting else ''}"
        log.warning("%s out of rotation: %s", name, why)
        if restarting:
            task = asyncio.ensure_future(self._restart(index))
            self._restarts.add(task)
            task.add_done_callback(self._restarts.discard)

    async def _restart(self, index: int) -> None:
        """Close, reload and probe the card until it answers; waits double after each failed try."""
        while True:
            strikes = self._strikes[index]
            delay = 0.0 if strikes <= 1 else min(self.deadlines.cap_s, self.restart_backoff_s * 2 ** (strikes - 2))
            if delay:
                self.card_state[index] += f" (try {strikes} in {delay:.1f} s)"
                await asyncio.sleep(delay)
            old = self.cards[index]
            try:
                await asyncio.to_thread(old.close)
                assert self.reload_card is not None
                self.cards[index] = await asyncio.to_thread(self.reload_card, index)
            except Exception as exc:  # noqa: BLE001 - stays out of rotation; the others keep serving
                log.exception("%s could not be restarted; it stays out of rotation", self.lane_name(index))
                lost = "lost for good: " if isinstance(exc, DeviceLost) else ""
                self.card_state[index] = f"{lost}restart failed ({type(exc).__name__}: {exc})"
                return
            why = await self._probe_card(index)
            if why is None:
                break
            if why.startswith("lost"):
                self.card_state[index] = f"{why} after a restart"
                log.error("%s lost for good after a restart: %s; it is not restarted again", self.lane_name(index), why)
                return
            self._strikes[index] += 1
            self.card_state[index] = f"{why} after a restart, restarting"
            log.warning("%s failed its probe after a restart: %s", self.lane_name(index), why)
        self.card_state[index] = "healthy"
        self.router.mark_up(index)
        if self.card_gate is not None:
            self.card_gate.changed()
        log.warning("%s restarted and back in rotation", self.lane_name(index))

    async def _probe_card(self, index: int, *, whole: bool = False) -> str | None:
        """Run one item of a recent batch (``whole``: all of it) on a card within its deadline; None if it answered."""
        if self._probe is None:
            return None
        inputs, rows = self._probe
        card = self.cards[index]
        # NOTE: one item when the layouts say where it ends, else the whole batch (never a guessed slice)
        items = 1 if self._card_split().splittable and not whole else rows
        sample = {n: np.ascontiguousarray(a) for n, a in
                  self._card_split().head({n: inputs[n] for n in card.input_names}, rows, items).items()}
        limit = self.deadlines.hang_after(expected_card_seconds(card, items, sample))
        try:
            await _within(card.infer(sample), limit)
        except asyncio.TimeoutError:
            self._count(index, "hang")
            return f"hung (> {limit:.2f} s)"
        except Exception as exc:  # noqa: BLE001 - the card stays out
            self._count(index, "error")
            lost = "lost for good, " if isinstance(exc, DeviceLost) else ""
            return f"{lost}failed ({type(exc).__name__}: {exc})"
        return None

    def _count(self, index: int, kind: str) -> None:
        """Count a card fault and tell ``on_card_fault``."""
        key = (index, kind)
        self.fault_counts[key] = self.fault_counts.get(key, 0) + 1
        if self.on_card_fault is not None:
            self.on_card_fault(index, kind)

    def close(self) -> None:
        """Close every executable, then run ``on_close`` (e.g. give the cards' memory back to the ledger)."""
        _cancel([*self._restarts, *self._watchers])
        self.closed = True
        try:
            self.host.close()
            if self.host_dense is not None:
                self.host_dense.close()
            for card in self.cards:
                card.close()
        finally:
            for done in self.on_close:
                done()
